"""The shared store tier: cached blocks in Redis or Valkey, so engines on many machines reuse each
other's prefixes.

A :class:`StoreTier` talks to one Redis / Valkey server or cluster through redis-py (the ``store``
extra: ``pip install 'kv-lifecycle[store]'``). A block is one key::

    {key_prefix}:kv1:{model fingerprint:016x}:{model id:016x}:{adapter id:016x}:{content hash:016x}

whose value is a :mod:`record <lifecycle.tiers.records>` (header, tokens, every layer's KV,
checksum). Two engines with the same model byte format (``ModelConfig.fingerprint()``), model name
(``ModelConfig.name``, as :func:`~lifecycle.tiers.records.model_id`) and adapter name share keys;
any other engine's keys never meet theirs.

- **Writes go behind the host tier.** :meth:`StoreTier.write_behind` queues content hashes (a
  bounded queue: past ``queue_blocks`` a block is dropped and counted, never waited for); one
  background thread reads each block from its ``source`` (the :class:`~lifecycle.tiers.host.HostTier`)
  and writes ``batch_blocks`` records per pipelined round trip.
- **Reads are one round trip per request**: :meth:`StoreTier.get_many` sends one ``MGET`` (on a
  cluster, one per node, sent together), never one command per block.
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
from lifecycle.tiers._args import HashesLike, content_hashes, token_blocks
from lifecycle.tiers.records import VERSION, BlockRecord, RecordCorrupt, RecordForeign, RecordLayout, adapter_id

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


class BlockSource(Protocol):
    """Where the writer thread reads the blocks it writes: the tokens and KV bytes of each content
    hash, or None for a block no longer held. :class:`~lifecycle.tiers.host.HostTier` is one."""

    def read_blocks(self, hashes: Sequence[int]) -> list[tuple[npt.NDArray[np.int32], bytes] | None]: ...


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


class StoreTier:
    """Blocks of the model ``config`` (its byte format and name) in the Redis / Valkey store at ``url``.

    ``source`` is where queued writes read their blocks (the host tier); without one,
    :meth:`write_behind` is refused. ``timeout_s`` bounds every connect, read and write;
    ``retry_after_s`` is how long an unavailable store is skipped; ``ttl_s`` (optional) lets the
    store expire records (otherwise its own eviction policy, e.g. ``allkeys-lru``, makes room).
    """

    def __init__(
        self,
        url: str,
        config: ModelConfig,
        *,
        source: BlockSource | None = None,
        key_prefix: str = "lifecycle",
        timeout_s: float = 0.5,
        retry_after_s: float = 1.0,
        queue_blocks: int = 4096,
        batch_blocks: int = 64,
        ttl_s: float | None = None,
    ) -> None:
        redis_url, cluster = _parse_url(url)
        self._shown_url = redact_url(url)
        if not isinstance(config, ModelConfig):
            raise ConfigError(f"StoreTier: config must be a ModelConfig, got {config!r}")
        try:
            self._layout = RecordLayout.of(config)
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
        self._prefix = f"{key_prefix}:kv{VERSION}:{self._layout.fingerprint:016x}:{self._layout.model:016x}:"
        self._source = source
        self._timeout_s = float(timeout_s)
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._cluster = cluster
        self._client = self._connect(redis_url, cluster)
        self._health = _Health(self._shown_url, float(retry_after_s))
        self._counts = dict.fromkeys(
            ("get_requests", "get_blocks", "hits", "misses", "corrupt", "foreign", "token_mismatch", "unavailable",
             "queued", "dropped_queue_full", *_WRITE_OUTCOMES, "write_batches", "bytes_read", "bytes_written"), 0,
        )
        self._count_lock = threading.Lock()
        self._logged: set[str] = set()
        self._queue: deque[tuple[int, int]] = deque()  # (content hash, adapter id)
        self._inflight = 0
        self._closing = False
        self._closed = False
        self._wakeup = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="lifecycle-store-writer", daemon=True)
        self._writer.start()

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

    def key(self, content_hash: int, adapter: str = "") -> str:
        """The store key of block ``content_hash`` of ``adapter`` (``""``: none) for this model."""
        return self._key(content_hash, adapter_id(adapter))

    def _key(self, content_hash: int, adapter: int) -> str:
        return f"{self._prefix}{adapter:016x}:{content_hash:016x}"

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

    def get_many(
        self, hashes: HashesLike, tokens: npt.ArrayLike | None = None, adapter: str = ""
    ) -> list[BlockRecord | None]:
        """The records of blocks ``hashes`` of ``adapter`` (None for each block the store does not
        give back valid), in one round trip. With ``tokens`` (``len(hashes)`` blocks of them), a
        record holding other tokens is None too. Never raises for a store fault."""
        if self._closed:
            raise TornDown("StoreTier.get_many: the tier is closed")
        keys_of = content_hashes("StoreTier.get_many", hashes)
        block_size = self._layout.block_size
        wanted = None if tokens is None else token_blocks("StoreTier.get_many", tokens, len(keys_of), block_size)
        adapter_key = adapter_id(adapter)
        count = len(keys_of)
        self._count(get_requests=1, get_blocks=count)
        if not count:
            return []
        if not self._health.available():
            self._count(unavailable=count)
            return [None] * count
        keys = [self._key(content_hash, adapter_key) for content_hash in keys_of]
        try:
            if self._cluster:
                values: list[Any] = self._client.mget_nonatomic(keys)  # type: ignore[union-attr]
            else:
                values = self._client.mget(keys)
        except Exception as error:  # any failure of the store is a miss
            self._health.failed("a read", error)
            self._count(unavailable=count)
            return [None] * count
        self._health.answered()
        return self._decode(keys_of, values, wanted, adapter_key)

    def _decode(self, hashes: list[int], values: list[Any], wanted: npt.NDArray[np.int32] | None,
                adapter: int) -> list[BlockRecord | None]:
        out: list[BlockRecord | None] = []
        counts = dict.fromkeys(("hits", "misses", "corrupt", "foreign", "token_mismatch", "bytes_read"), 0)
        for position, (content_hash, value) in enumerate(zip(hashes, values)):
            if value is None:
                counts["misses"] += 1
                out.append(None)
                continue
            counts["bytes_read"] += len(value)
            try:
                record = self._layout.decode(value, content_hash, adapter)
            except RecordCorrupt as error:
                counts["corrupt"] += 1
                self._log_once("corrupt", "store %s: a corrupt record was read: %s", self._shown_url, error)
                out.append(None)
                continue
            except RecordForeign as error:
                counts["foreign"] += 1
                self._log_once("foreign", "store %s: a foreign value was read: %s", self._shown_url, error)
                out.append(None)
                continue
            if wanted is not None and not np.array_equal(record.tokens, wanted[position]):
                counts["token_mismatch"] += 1
                self._log_once(
                    "token_mismatch", "store %s: block %#018x holds other tokens than asked for", self._shown_url,
                    content_hash,
                )
                out.append(None)
                continue
            counts["hits"] += 1
            out.append(record)
        self._count(**counts)
        return out

    # -- writes -----------------------------------------------------------------------------------

    def write_behind(self, hashes: HashesLike, adapter: str = "") -> int:
        """Queue blocks ``hashes`` of ``adapter`` for writing, read from the source when their turn
        comes; returns how many were queued (the rest were dropped: the queue was full). Never
        waits."""
        if self._closed:
            raise TornDown("StoreTier.write_behind: the tier is closed")
        if self._source is None:
            raise ConfigError("StoreTier.write_behind: the tier was built without a source to read blocks from")
        keys = content_hashes("StoreTier.write_behind", hashes)
        adapter_key = adapter_id(adapter)
        with self._wakeup:
            room = max(0, self._queue_blocks - len(self._queue))
            taken = keys[:room]
            self._queue.extend((content_hash, adapter_key) for content_hash in taken)
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

    def _write(self, batch: list[tuple[int, int]]) -> dict[str, int]:
        """Write one batch; returns how many blocks ended how (see :class:`StoreStats`)."""
        if not self._health.available():
            return {"dropped_unavailable": len(batch)}
        assert self._source is not None  # write_behind refuses to queue without one
        try:
            blocks = self._source.read_blocks([content_hash for content_hash, _ in batch])
        except TornDown:  # the host tier closed first: nothing left to write
            return {"dropped_gone": len(batch)}
        records: list[tuple[str, bytes]] = []
        for (content_hash, adapter), block in zip(batch, blocks):
            if block is not None:
                tokens, kv = block
                value = self._layout.encode(content_hash, adapter, tokens, kv)
                records.append((self._key(content_hash, adapter), value))
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
        self._writer.join()
        self._closed = True
        self._client.close()

    def __enter__(self) -> StoreTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreTier({self._shown_url!r}, cluster={self._cluster}, closed={self._closed})"
