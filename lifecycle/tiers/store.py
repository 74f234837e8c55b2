"""The shared store tier: cached blocks in Redis or Valkey, so engines on many machines reuse each
other's prefixes.

A :class:`StoreTier` talks to one Redis / Valkey server or cluster through redis-py (the ``store``
extra: ``pip install 'kv-lifecycle[store]'``). A block is one key::

    {key_prefix}:kv2:{tier key, high word:016x}{tier key, low word:016x}

whose value is a :mod:`record <lifecycle.tiers.records>` (header with the namespace, the key and
the parent's key; tokens, every layer's KV, checksum). Tier keys are keyed chain keys
(:mod:`lifecycle.tiers.keys`): engines with the same namespace (model name, weights fingerprint,
byte format), cache key (adapter, salt) and secret compute the same keys for the same prefix and
share blocks; any other engine's keys never meet theirs, and a record is served only when its
namespace, key, parent and tokens are the ones asked for.

- **Keys expire**: every write sets ``ttl_s`` (24 hours by default; None: never, the server's
  eviction policy makes room).
- **Prefetch**: :meth:`StoreTier.prefetch` reads a queued request's blocks on a background
  thread; :meth:`StoreTier.get_many` serves what has arrived without a round trip, and reads
  only what no prefetch covers.
- **Writes go behind the host tier.** :meth:`StoreTier.write_behind` queues content hashes (a
  bounded queue: past ``queue_blocks`` a block is dropped and counted, never waited for); one
  background thread reads each block from its ``source`` (the :class:`~lifecycle.tiers.host.HostTier`)
  and writes ``batch_blocks`` records per pipelined round trip.
- **Reads are one round trip per request**: :meth:`StoreTier.get_many` sends its reads in one
  pipeline (on a cluster, one per node, sent together), never one round trip per block.
- **Faults cost a miss.** A store that is down or slow (every call is bounded by ``timeout_s``), full
  (out-of-memory refusals of writes) or that returns corrupt or foreign bytes makes the blocks
  concerned misses (and drops the writes concerned); nothing raises on the request path. Each
  kind of fault is counted (:class:`StoreStats`) and logged once (the logger
  ``lifecycle.tiers.store``); after an outage the tier skips the store for ``retry_after_s``, then
  tries again, and logs once when it answers again.
- **Bad configuration fails at construction**: a malformed URL, a missing redis-py or a store that
  does not answer ``PING`` within ``timeout_s`` raise :class:`~lifecycle.errors.ConfigError` or
  :class:`StoreUnavailable`.

URLs: ``redis://``, ``rediss://`` (TLS), ``unix://``, and ``valkey://`` / ``valkeys://`` as
synonyms; a ``+cluster`` suffix on the scheme (``redis+cluster://host:port``) connects to a cluster
through any of its nodes (``redis.cluster.RedisCluster``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import numpy.typing as npt

from lifecycle.config import ModelConfig
from lifecycle.errors import ConfigError, InvalidId, InvariantViolation, LifecycleError, TornDown
from lifecycle.tiers._args import (
    HashesLike, KeyLike, KeysLike, chained_parents, content_hashes, tier_key, tier_key_rows,
)
from lifecycle.tiers._args import token_blocks
from lifecycle.tiers.records import VERSION, BlockRecord, RecordCorrupt, RecordForeign, RecordLayout

if TYPE_CHECKING:
    from redis import Redis
    from redis.cluster import RedisCluster

__all__ = ["BlockSource", "StoreStats", "StoreTier", "StoreUnavailable", "redact_url"]

_log = logging.getLogger("lifecycle.tiers.store")

_SCHEMES: Final = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
_MAX_TIMEOUT_S: Final = 60.0
#: The outcomes of a queued write, each counted in :class:`StoreStats`.
_WRITE_OUTCOMES: Final = ("written", "refused_full", "dropped_unavailable", "dropped_gone", "dropped_closed")


class StoreUnavailable(LifecycleError):
    """The store did not answer at construction (refused, unreachable, timed out, or refused the
    credentials); the message names the URL (without its password) and the timeout."""


class SourceBlock(Protocol):
    """One block a source gives: its key and its parent's (high, low), tokens and KV bytes."""

    @property
    def key(self) -> tuple[int, int]: ...
    @property
    def parent(self) -> tuple[int, int]: ...
    @property
    def tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def kv(self) -> bytes: ...


class BlockSource(Protocol):
    """Where the writer thread reads the blocks it writes, by the high word of their keys (None
    for a block no longer held). :class:`~lifecycle.tiers.host.HostTier` is one."""

    def read_blocks(self, hashes: Sequence[int]) -> Sequence[SourceBlock | None]: ...


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters of a :class:`StoreTier` since it was built (blocks, unless named otherwise).

    Reads: ``get_requests`` calls of ``get_many`` asked for ``get_blocks`` blocks, of which
    ``hits`` came back as valid records; ``misses`` were absent, ``corrupt`` failed their checksum,
    ``foreign`` were no record of this block, ``token_mismatch`` held other tokens, and
    ``unavailable`` were not asked for (the store was down, slow or failing).

    Writes: ``queued`` blocks entered the queue (``dropped_queue_full`` did not); each ends as
    ``written``, ``refused_full`` (the store was out of memory), ``dropped_unavailable`` (down,
    slow or failing), ``dropped_gone`` (the source no longer held it) or ``dropped_closed``.
    ``outages`` counts the times the store stopped answering."""

    get_requests: int
    get_blocks: int
    hits: int
    prefetched: int
    prefetch_blocks: int
    misses: int
    corrupt: int
    foreign: int
    token_mismatch: int
    unavailable: int
    queued: int
    dropped_queue_full: int
    written: int
    refused_full: int
    dropped_unavailable: int
    dropped_gone: int
    dropped_closed: int
    write_batches: int
    outages: int
    bytes_read: int
    bytes_written: int
    queue_depth: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def redact_url(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<malformed URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def _parse_url(url: object) -> tuple[str, bool]:
    """(the URL redis-py reads, whether it names a cluster); ConfigError for a malformed one."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"StoreTier: url must be a non-empty str such as 'redis://host:6379', got {url!r}")
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ConfigError(f"StoreTier: url {shown!r} is malformed ({error})") from None
    scheme, _, suffix = parts.scheme.partition("+")
    if scheme not in _SCHEMES or suffix not in ("", "cluster"):
        raise ConfigError(
            f"StoreTier: url {shown!r} has scheme {parts.scheme!r}; expected one of "
            f"{sorted(_SCHEMES)}, optionally with '+cluster' (e.g. 'redis+cluster://host:6379')"
        )
    cluster = suffix == "cluster"
    if scheme == "unix":
        if cluster:
            raise ConfigError(f"StoreTier: url {shown!r}: a cluster is reached over TCP, not a unix socket")
        if not parts.path:
            raise ConfigError(f"StoreTier: url {shown!r} names no socket path (unix:///path/to/socket)")
    elif not parts.hostname:
        raise ConfigError(f"StoreTier: url {shown!r} names no host (e.g. 'redis://127.0.0.1:6379')")
    if port == 0:
        raise ConfigError(f"StoreTier: url {shown!r} has port 0; ports are 1..65535")
    return urlunsplit(parts._replace(scheme=_SCHEMES[scheme])), cluster


def _check_number(field: str, value: object, low: float, high: float | None, *, integer: bool) -> None:
    kinds: tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"StoreTier: {field} must be {'an int' if integer else 'a number'}, got {value!r}")
    assert isinstance(value, (int, float))
    if value < low or (high is not None and value > high):
        limit = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"StoreTier: {field}={value!r} must be {limit}")


class _Health:
    """Whether the store answers: a failed round trip marks it down for ``retry_after_s``, during
    which calls skip it; the first answer afterwards marks it up again. Logs each change once."""

    def __init__(self, shown_url: str, retry_after_s: float) -> None:
        self._url = shown_url
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._retry_at = 0.0
        self.outages = 0

    def available(self) -> bool:
        with self._lock:
            return self._down_since is None or time.monotonic() >= self._retry_at

    def failed(self, what: str, error: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self._retry_at = now + self._retry_after_s
            if self._down_since is not None:
                return
            self._down_since = now
            self.outages += 1
        _log.warning(
            "store %s: %s failed (%s: %s); its blocks count as misses and writes are dropped until it answers "
            "again (next try in %.3g s)", self._url, what, type(error).__name__, error, self._retry_after_s,
        )

    def answered(self) -> None:
        with self._lock:
            down_since, self._down_since = self._down_since, None
        if down_since is not None:
            _log.warning("store %s answers again after %.3g s", self._url, time.monotonic() - down_since)


#: How long a record lives in the store by default (seconds): a day.
DEFAULT_TTL_S: Final = 86400.0
#: How a block enters the store: ``"reused"``, once the host tier served it (or its prefix was
#: marked to keep); ``"all"``, every block entering the host tier (write-through).
ADMISSIONS: Final = ("reused", "all")
_ARRIVED_MAX: Final = 65536


class StoreTier:
    """Blocks of the model ``config`` in the Redis / Valkey store at ``url``, under the tier keys
    of ``namespace`` (:func:`~lifecycle.tiers.keys.namespace_of`; None: the config's without a
    weights fingerprint).

    ``source`` is where queued writes read their blocks (the host tier); without one,
    :meth:`write_behind` is refused. ``timeout_s`` bounds every connect, read and write;
    ``retry_after_s`` is how long an unavailable store is skipped; ``ttl_s`` is how long a record
    lives (None: until the server's eviction policy makes room). ``admit`` (one of
    :data:`ADMISSIONS`) is for the caller that queues writes (:class:`~lifecycle.tiers.promote.ModelTiers`).
    """

    def __init__(
        self,
        url: str,
        config: ModelConfig,
        *,
        source: BlockSource | None = None,
        namespace: bytes | None = None,
        key_prefix: str = "lifecycle",
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        queue_blocks: int = 4096,
        batch_blocks: int = 64,
        ttl_s: float | None = DEFAULT_TTL_S,
        admit: str = "reused",
    ) -> None:
        redis_url, cluster = _parse_url(url)
        self._shown_url = redact_url(url)
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"StoreTier: config must be a ModelConfig, got {config!r}")
        try:
            self._layout = RecordLayout.of(config, namespace)
        except InvalidId as error:
            raise ConfigError(f"StoreTier: {error}") from None
        if not isinstance(key_prefix, str) or not key_prefix or any(c.isspace() or c == ":" for c in key_prefix):
            raise ConfigError(f"StoreTier: key_prefix={key_prefix!r} must be a non-empty str without spaces or ':'")
        _check_number("timeout_s", timeout_s, 0.001, _MAX_TIMEOUT_S, integer=False)
        _check_number("retry_after_s", retry_after_s, 0.0, None, integer=False)
        _check_number("queue_blocks", queue_blocks, 1, None, integer=True)
        _check_number("batch_blocks", batch_blocks, 1, None, integer=True)
        if ttl_s is not None:
            _check_number("ttl_s", ttl_s, 0.001, None, integer=False)
        if admit not in ADMISSIONS:
            raise ConfigError(f"StoreTier: admit={admit!r} must be one of {ADMISSIONS}")
        self.admit = admit
        self._prefix = f"{key_prefix}:kv{VERSION}:"
        self._source = source
        self._timeout_s = float(timeout_s)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._cluster = cluster
        self._client = self._connect(redis_url, cluster)
        self._health = _Health(self._shown_url, float(retry_after_s))
        self._counts = dict.fromkeys(
            ("get_requests", "get_blocks", "hits", "prefetched", "prefetch_blocks", "misses", "corrupt", "foreign",
             "token_mismatch", "unavailable", "queued", "dropped_queue_full", *_WRITE_OUTCOMES, "write_batches",
             "bytes_read", "bytes_written"), 0,
        )
        self._count_lock = threading.Lock()
        self._logged: set[str] = set()
        self._queue: deque[int] = deque()  # high words of the keys to write
        self._inflight = 0
        self._closing = False
        self._closed = False
        self._wakeup = threading.Condition()
        # prefetches: asked (key rows, parent rows, token rows), pending keys, arrived values
        self._reads: deque[tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int32]]] = deque()
        self._pending: set[tuple[int, int]] = set()
        self._arrived: dict[tuple[int, int], BlockRecord] = {}
        self._reader_wakeup = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="lifecycle-store-writer", daemon=True)
        self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="lifecycle-store-reader", daemon=True)
        self._reader.start()

    def _connect(self, redis_url: str, cluster: bool) -> Redis | RedisCluster:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry
        except ImportError:
            raise ConfigError(
                "StoreTier needs redis-py, which is not installed: pip install 'kv-lifecycle[store]'"
            ) from None
        options: dict[str, Any] = {
            "socket_timeout": self._timeout_s,
            "socket_connect_timeout": self._timeout_s,
            "retry": Retry(NoBackoff(), 0),  # a failure is a miss now, not a wait
        }
        client: Redis | RedisCluster | None = None
        try:
            if cluster:
                client = RedisCluster.from_url(redis_url, **options)
            else:
                client = redis.Redis.from_url(redis_url, **options)
            client.ping()
        except (ValueError, TypeError) as error:  # redis-py refused an option of the URL
            if client is not None:
                client.close()
            raise ConfigError(f"StoreTier: url {self._shown_url!r} is not usable: {error}") from None
        except Exception as error:
            if client is not None:
                client.close()
            raise StoreUnavailable(
                f"StoreTier: the store at {self._shown_url!r} did not answer PING within timeout_s={self._timeout_s} "
                f"({type(error).__name__}: {error})"
            ) from None
        return client

    # -- identity ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The store's URL, without its password."""
        return self._shown_url

    @property
    def layout(self) -> RecordLayout:
        """The record layout of this model's blocks."""
        return self._layout

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def key(self, key: KeyLike) -> str:
        """The store key of the block of tier key ``key`` ((high, low), or a high word)."""
        return self._key(tier_key("StoreTier.key", key))

    def _key(self, key: tuple[int, int]) -> str:
        return f"{self._prefix}{key[0]:016x}{key[1]:016x}"

    def _count(self, **deltas: int) -> None:
        with self._count_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _log_once(self, kind: str, message: str, *args: object) -> None:
        with self._count_lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        _log.warning(message + " (counted; further ones are not logged)", *args)

    # -- reads ------------------------------------------------------------------------------------

    def _asked(
        self, call: str, keys: KeysLike, parent: KeyLike, tokens: npt.ArrayLike | None
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int32] | None]:
        if self._closed:
            raise TornDown(f"StoreTier.{call}: the tier is closed")
        rows = tier_key_rows(f"StoreTier.{call}", keys)
        parents = chained_parents(rows, tier_key(f"StoreTier.{call}", parent))
        block_size = self._layout.block_size
        wanted = None if tokens is None else token_blocks(f"StoreTier.{call}", tokens, len(rows), block_size)
        return rows, parents, wanted

    def get_many(
        self, keys: KeysLike, tokens: npt.ArrayLike | None = None, parent: KeyLike = 0
    ) -> list[BlockRecord | None]:
        """The records of the blocks of tier keys ``keys``, one chain after the block of key
        ``parent`` (None for each block the store does not give back valid), in one round trip;
        what a :meth:`prefetch` brought is served without one, and what a prefetch still reads is
        a miss (admission does not wait for it). With ``tokens`` (``len(keys)`` blocks of them), a
        record holding other tokens is None too. Never raises for a store fault."""
        rows, parents, wanted = self._asked("get_many", keys, parent, tokens)
        count = len(rows)
        self._count(get_requests=1, get_blocks=count)
        if not count:
            return []
        pairs: list[tuple[int, int]] = [(pair[0], pair[1]) for pair in rows.tolist()]
        out: list[BlockRecord | None] = [None] * count
        asked: list[int] = []
        prefetched = pending = 0
        with self._reader_wakeup:
            for position, pair in enumerate(pairs):
                record = self._arrived.pop(pair, None) if self._arrived else None
                if record is not None and record.parent == tuple(parents[position].tolist()):
                    out[position] = record
                    prefetched += 1
                elif pair in self._pending:
                    pending += 1
                else:
                    asked.append(position)
        if wanted is not None and prefetched:
            for position, record in enumerate(out):
                if record is not None and not np.array_equal(record.tokens, wanted[position]):
                    out[position] = None
                    prefetched -= 1
                    self._count(token_mismatch=1)
        self._count(hits=prefetched, prefetched=prefetched, misses=pending)
        if not asked:
            return out
        if not self._health.available():
            self._count(unavailable=len(asked))
            return out
        values = self._read([self._key(pairs[i]) for i in asked])
        if values is None:
            self._count(unavailable=len(asked))
            return out
        counts = dict.fromkeys(("hits", "misses", "corrupt", "foreign", "token_mismatch", "bytes_read"), 0)
        for position, value in zip(asked, values):
            out[position] = self._decode(value, pairs[position], parents[position], wanted, position, counts)
        self._count(**counts)
        return out

    def _read(self, keys: list[str]) -> list[Any] | None:
        """The values of ``keys`` in one pipelined round trip (None: the store failed)."""
        try:
            if self._cluster:
                values: list[Any] = self._client.mget_nonatomic(keys)  # type: ignore[union-attr]
            else:
                values = self._client.mget(keys)
        except Exception as error:  # any failure of the store is a miss
            self._health.failed("a read", error)
            return None
        self._health.answered()
        return values

    def _decode(
        self, value: Any, key: tuple[int, int], parent_row: npt.NDArray[np.uint64],
        wanted: npt.NDArray[np.int32] | None, position: int, counts: dict[str, int],
    ) -> BlockRecord | None:
        if value is None:
            counts["misses"] += 1
            return None
        counts["bytes_read"] += len(value)
        high, low = parent_row.tolist()
        try:
            record = self._layout.decode(value, key, (high, low))
        except RecordCorrupt as error:
            counts["corrupt"] += 1
            self._log_once("corrupt", "store %s: a corrupt record was read: %s", self._shown_url, error)
            return None
        except RecordForeign as error:
            counts["foreign"] += 1
            self._log_once("foreign", "store %s: a foreign value was read: %s", self._shown_url, error)
            return None
        if wanted is not None and not np.array_equal(record.tokens, wanted[position]):
            counts["token_mismatch"] += 1
            self._log_once(
                "token_mismatch", "store %s: key %#018x holds other tokens than asked for", self._shown_url, key[0]
            )
            return None
        counts["hits"] += 1
        return record

    def prefetch(self, keys: KeysLike, tokens: npt.ArrayLike, parent: KeyLike = 0) -> int:
        """Read the blocks of ``keys`` (one chain after ``parent``, holding ``tokens``) on the
        reader thread, for a later :meth:`get_many` to serve without a round trip; returns the
        blocks asked for (those not arrived or pending already). Never waits, never raises for a
        store fault."""
        rows, parents, wanted = self._asked("prefetch", keys, parent, tokens)
        assert wanted is not None
        fresh: list[int] = []
        with self._reader_wakeup:
            for position, pair in enumerate(rows.tolist()):
                key = (pair[0], pair[1])
                if key not in self._pending and key not in self._arrived:
                    self._pending.add(key)
                    fresh.append(position)
            if fresh:
                self._reads.append((rows[fresh], parents[fresh], wanted[fresh]))
                self._reader_wakeup.notify()
        self._count(prefetch_blocks=len(fresh))
        return len(fresh)

    def _read_loop(self) -> None:
        while True:
            with self._reader_wakeup:
                while not self._reads and not self._closing:
                    self._reader_wakeup.wait()
                if self._closing:
                    return
                rows, parents, wanted = self._reads.popleft()
            pairs: list[tuple[int, int]] = [(pair[0], pair[1]) for pair in rows.tolist()]
            values = self._read([self._key(pair) for pair in pairs]) if self._health.available() else None
            counts = dict.fromkeys(("hits", "misses", "corrupt", "foreign", "token_mismatch", "bytes_read"), 0)
            arrived: list[tuple[tuple[int, int], BlockRecord]] = []
            for position, pair in enumerate(pairs):
                value = None if values is None else values[position]
                record = self._decode(value, pair, parents[position], wanted, position, counts)
                if record is not None:
                    arrived.append((pair, BlockRecord(record.key, record.parent, record.tokens, bytes(record.kv))))
            with self._reader_wakeup:
                self._pending.difference_update(pairs)
                if len(self._arrived) + len(arrived) > _ARRIVED_MAX:
                    self._arrived.clear()  # prefetches nobody admitted: the oldest go
                self._arrived.update(arrived)
                self._reader_wakeup.notify_all()
            self._count(bytes_read=counts["bytes_read"])

    def wait_prefetched(self, timeout_s: float = 10.0) -> bool:
        """Wait until every prefetch has arrived (True; False on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._reader_wakeup:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    return False
                self._reader_wakeup.wait(left)
        return True

    # -- writes -----------------------------------------------------------------------------------

    def write_behind(self, hashes: HashesLike) -> int:
        """Queue the blocks of ``hashes`` (high words of their tier keys) for writing, read from
        the source when their turn comes; returns how many were queued (the rest were dropped:
        the queue was full). Never waits."""
        if self._closed:
            raise TornDown("StoreTier.write_behind: the tier is closed")
        if self._source is None:
            raise ConfigError("StoreTier.write_behind: the tier was built without a source to read blocks from")
        keys = content_hashes("StoreTier.write_behind", hashes)
        with self._wakeup:
            room = max(0, self._queue_blocks - len(self._queue))
            taken = keys[:room]
            self._queue.extend(taken)
            self._count(queued=len(taken), dropped_queue_full=len(keys) - len(taken))
            self._wakeup.notify()
        if len(taken) < len(keys):
            self._log_once(
                "queue_full", "store %s: the write queue of queue_blocks=%d is full; blocks were dropped",
                self._shown_url, self._queue_blocks,
            )
        return len(taken)

    def _write_loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._queue and not self._closing:
                    self._wakeup.wait()
                if self._closing:  # close() dropped what was queued
                    return
                batch = [self._queue.popleft() for _ in range(min(self._batch_blocks, len(self._queue)))]
                self._inflight = len(batch)
            try:
                outcomes = self._write(batch)
            except Exception as error:  # a bug in a source must not kill the writer silently
                outcomes = {"dropped_unavailable": len(batch)}
                _log.exception("store %s: writing a batch failed: %s", self._shown_url, error)
            with self._wakeup:  # the outcomes and the end of the flight together, for check_invariants
                self._count(**outcomes)
                self._inflight = 0
                self._wakeup.notify_all()

    def _write(self, batch: list[int]) -> dict[str, int]:
        """Write one batch; returns how many blocks ended how (see :class:`StoreStats`)."""
        if not self._health.available():
            return {"dropped_unavailable": len(batch)}
        assert self._source is not None  # write_behind refuses to queue without one
        try:
            blocks = self._source.read_blocks(batch)
        except TornDown:  # the host tier closed first: nothing left to write
            return {"dropped_gone": len(batch)}
        records: list[tuple[str, bytes]] = []
        for block in blocks:
            if block is not None:
                value = self._layout.encode(block.key, block.parent, block.tokens, block.kv)
                records.append((self._key(block.key), value))
        gone = len(batch) - len(records)
        if not records:
            return {"dropped_gone": gone}
        pipe = self._client.pipeline(transaction=False)
        for key, value in records:
            pipe.set(key, value, px=self._ttl_ms)
        try:
            results = pipe.execute(raise_on_error=False)
        except Exception as error:
            self._health.failed("a write", error)
            return {"dropped_gone": gone, "dropped_unavailable": len(records)}
        finally:
            pipe.reset()
        self._health.answered()
        written = full = failed = nbytes = 0
        for (_, value), result in zip(records, results):
            if not isinstance(result, Exception):
                written += 1
                nbytes += len(value)
            elif "OOM" in str(result) or type(result).__name__ == "OutOfMemoryError":
                full += 1
            else:
                failed += 1
                self._log_once("write_error", "store %s: a write was refused: %s", self._shown_url, result)
        if full:
            self._log_once(
                "full", "store %s is out of memory (maxmemory with a noeviction policy?): writes are refused",
                self._shown_url,
            )
        return {
            "written": written, "refused_full": full, "dropped_unavailable": failed, "dropped_gone": gone,
            "write_batches": 1, "bytes_written": nbytes,
        }

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (written or dropped), at most ``timeout_s``;
        True when the queue is empty."""
        deadline = time.monotonic() + timeout_s
        with self._wakeup:
            while self._queue or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or not self._writer.is_alive():
                    return False
                self._wakeup.wait(left)
        return True

    # -- state ------------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """The counters now."""
        with self._wakeup:
            depth = len(self._queue) + self._inflight
        with self._count_lock:
            return StoreStats(outages=self._health.outages, queue_depth=depth, **self._counts)

    def check_invariants(self) -> None:
        """Every queued block is waiting, being written, or counted in exactly one outcome; the
        queue stays within ``queue_blocks``. :class:`InvariantViolation` names the mismatch."""
        with self._wakeup, self._count_lock:
            waiting = len(self._queue) + self._inflight
            ended = sum(self._counts[name] for name in _WRITE_OUTCOMES)
            if len(self._queue) > self._queue_blocks:
                raise InvariantViolation(f"StoreTier: {len(self._queue)} queued > queue_blocks={self._queue_blocks}")
            if self._counts["queued"] != waiting + ended:
                raise InvariantViolation(
                    f"StoreTier: {self._counts['queued']} queued != {waiting} waiting + {ended} ended "
                    f"({', '.join(f'{name} {self._counts[name]}' for name in _WRITE_OUTCOMES)})"
                )
            asked = self._counts["get_blocks"]
            answered = sum(
                self._counts[name] for name in ("hits", "misses", "corrupt", "foreign", "token_mismatch", "unavailable")
            )
            if asked != answered:
                raise InvariantViolation(f"StoreTier: {asked} blocks asked for != {answered} answered")

    def close(self) -> None:
        """Drop the writes still queued (counted), wait for the one in flight (bounded by
        ``timeout_s``), stop the writer and close the connections. A second call does nothing."""
        if self._closed:
            return
        with self._wakeup:
            self._closing = True
            self._count(dropped_closed=len(self._queue))
            self._queue.clear()
            self._wakeup.notify_all()
        with self._reader_wakeup:
            self._reads.clear()
            self._pending.clear()
            self._reader_wakeup.notify_all()
        self._writer.join()
        self._reader.join()
        self._closed = True
        self._client.close()

    def __enter__(self) -> StoreTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreTier({self._shown_url!r}, cluster={self._cluster}, closed={self._closed})"
