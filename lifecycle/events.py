"""KV events: which blocks the prefix cache stored and dropped, in the layout vLLM publishes.

A KV-aware router (NVIDIA Dynamo, llm-d) keeps an index of what every engine has cached from the
events the engine publishes. These classes carry the same fields, in the same order, as vLLM's
``vllm.distributed.kv_events`` structs, and :func:`encode_batch` writes the bytes vLLM's msgspec
encoder writes for them, so a router built for vLLM's events reads ours unchanged
(:doc:`kv-events` gives the format byte by byte).

- A block is named by its *content hash* (:doc:`content-hashes`): an unsigned 64-bit integer, sent as
  a msgpack integer, as vLLM sends its hashes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set
  (the form Dynamo's router decodes).
- ``medium`` names the tier the block is stored in, with vLLM's names: :data:`MEDIUM_GPU` for the
  model's KV pool (the tier a request computes into, whatever memory holds it, as vLLM's own block
  pool reports), :data:`MEDIUM_CPU` for a host-memory tier, :data:`MEDIUM_STORAGE` for files or a
  shared store.
- Fields lifecycle has no value for stay ``None`` and, like vLLM's optional fields, are left out
  of the encoding.

The C core keeps a raw log only while events are enabled; :class:`KVEventTranslator` turns that log
into a :class:`KVEventBatch`, and :class:`ZmqEventPublisher` (the ``events`` extra: pyzmq and
msgspec) sends batches over ZeroMQ the way vLLM's publisher does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, Final, TypeAlias

import numpy as np

from lifecycle._kvcache import REMOVED, STORED, RawEvents
from lifecycle.errors import ConfigError, MalformedEvent, TornDown

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AdapterLookup",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventTranslator",
    "RawEvent",
    "SaltLookup",
    "ZmqEventPublisher",
    "encode_batch",
    "raw_entries",
]

_log = logging.getLogger("lifecycle.events")

#: The model's KV pool: blocks a request computes into and reads from.
MEDIUM_GPU: Final = "GPU"
#: A tier in host memory below the KV pool.
MEDIUM_CPU: Final = "CPU"
#: A tier in files or a shared store.
MEDIUM_STORAGE: Final = "STORAGE"

_UINT64_LIMIT = 1 << 64

#: The extras that the wire encoding and the publisher need.
_EXTRA_HINT = "pip install 'kv-lifecycle[events]' (pyzmq and msgspec)"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered a tier: ``block_hashes[i]`` names the block holding
    ``token_ids[i * block_size:(i + 1) * block_size]``; ``parent_block_hash`` names the block before
    the first (None at the start of a sequence). ``lora_id`` / ``lora_name`` name the adapter the
    blocks were computed with (None without one). The fields after ``lora_name`` are vLLM's optional
    ones; lifecycle fills ``extra_keys`` only where vLLM puts a cache salt, in the first block of a
    salted sequence (``((salt,), None, ...)``, one entry a block), and leaves the rest None."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a tier (evicted or dropped); the fields after ``medium`` stay None."""

    block_hashes: tuple[int, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached block is gone (the prefix cache was reset)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """Events in the order they happened, stamped with ``ts`` (seconds since the epoch, as
    ``time.time()``). A publisher fills ``data_parallel_rank`` with its own when it is None."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


#: One entry of the core's raw log (``KVCacheCore.take_events()``), oldest first:
#: ``("stored", hashes, parent_hash, tokens, adapter_key)``, ``("removed", hashes)``, ``("cleared",)``.
RawEvent: TypeAlias = tuple[Any, ...]

#: ``adapter_of(adapter_key)``: ``(lora_id, lora_name)`` of an adapter key, or None for none.
AdapterLookup: TypeAlias = Callable[[int], tuple[int, str] | None]

#: ``salt_of(adapter_key)``: the cache salt a key was salted with (``HybridModel.attach_prefix``'s
#: ``cache_salt``), or None for an unsalted key.
SaltLookup: TypeAlias = Callable[[int], bytes | str | int | None]


def _no_adapter(adapter_key: int) -> tuple[int, str] | None:
    return None


def _no_salt(adapter_key: int) -> bytes | str | int | None:
    return None


def raw_entries(raw: RawEvents) -> list[RawEvent]:
    """The core's drained log as tuple entries: ``("stored", hashes, parent_hash | None, tokens,
    adapter_key)``, ``("removed", hashes)``, ``("cleared",)`` (slices of its arrays, no copy)."""
    entries = raw.entries
    if not len(entries):
        return []
    hashes, tokens = raw.hashes, raw.tokens
    hash_ends = np.cumsum(entries["count"], dtype=np.int64).tolist()
    token_ends = np.cumsum(entries["num_tokens"], dtype=np.int64).tolist()
    out: list[RawEvent] = []
    h = t = 0
    for row, h_end, t_end in zip(entries.tolist(), hash_ends, token_ends):
        adapter, parent, _, _, kind, has_parent, _ = row
        if kind == STORED:
            out.append(("stored", hashes[h:h_end], parent if has_parent else None, tokens[t:t_end], adapter))
        elif kind == REMOVED:
            out.append(("removed", hashes[h:h_end]))
        else:
            out.append(("cleared",))
        h, t = h_end, t_end
    return out


def _hashes(what: str, values: object) -> tuple[int, ...]:
    """Content hashes as Python ints in ``[0, 2**64)``, from a uint64 array or any int sequence."""
    if isinstance(values, np.ndarray) and values.dtype == np.uint64:
        hashes: list[int] = values.ravel().tolist()
        return tuple(hashes)
    if not isinstance(values, Sequence) and not isinstance(values, np.ndarray):
        raise MalformedEvent(f"{what}: hashes must be a uint64 array or a sequence of ints, got {values!r}")
    checked = []
    for value in values:
        number = int(value) if isinstance(value, np.integer) else value
        if type(number) is not int or not 0 <= number < _UINT64_LIMIT:
            raise MalformedEvent(f"{what}: hash {value!r} is not an int in [0, 2**64)")
        checked.append(number)
    return tuple(checked)


def _tokens(what: str, values: object) -> tuple[int, ...]:
    try:
        tokens: list[int] = np.asarray(values, dtype=np.int64).ravel().tolist()
    except (TypeError, ValueError, OverflowError):
        raise MalformedEvent(f"{what}: tokens must be an int32 array or a sequence of ints, got {values!r}") from None
    return tuple(tokens)


class KVEventTranslator:
    """Turns the core's raw event log into batches (:class:`KVEventBatch`).

    ``block_size`` is the model's; ``adapter_of`` maps a non-zero adapter key to ``(lora_id,
    lora_name)`` (key 0 is "no adapter" and is never looked up) and ``salt_of`` to the cache salt
    it was salted with (vLLM puts a request's ``cache_salt`` in the ``extra_keys`` of its first
    block, and so does this translator, for a store that starts a sequence); ``medium`` is the tier
    the core's blocks live in (:data:`MEDIUM_GPU`: the KV pool); ``clock`` stamps each batch.
    """

    __slots__ = ("_adapter_of", "_block_size", "_clock", "_medium", "_salt_of")

    def __init__(
        self,
        block_size: int,
        *,
        adapter_of: AdapterLookup | None = None,
        salt_of: SaltLookup | None = None,
        medium: str | None = MEDIUM_GPU,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"KVEventTranslator: block_size={block_size!r} must be an int >= 1")
        self._block_size = block_size
        self._adapter_of = adapter_of or _no_adapter
        self._salt_of = salt_of or _no_salt
        self._medium = medium
        self._clock = clock

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def medium(self) -> str | None:
        """The tier named in every event."""
        return self._medium

    def events(self, raw_log: Iterable[RawEvent] | RawEvents) -> list[KVEvent]:
        """The events of ``raw_log`` (the core's :class:`~lifecycle._kvcache.RawEvents`, or
        entries as tuples), one per entry, in its order. A malformed entry raises
        :class:`~lifecycle.errors.MalformedEvent` naming it, and nothing is returned."""
        if isinstance(raw_log, RawEvents):
            raw_log = raw_entries(raw_log)
        return [self._event(index, entry) for index, entry in enumerate(raw_log)]

    def stored(
        self, block_hashes: object, parent_block_hash: int | None, token_ids: object, adapter_key: int = 0
    ) -> BlockStored:
        """The ``BlockStored`` of blocks ``block_hashes`` holding ``token_ids`` (a chain: each
        block's parent is the one before it, the first's ``parent_block_hash``, None at the start
        of a sequence), computed under cache key ``adapter_key``, in this translator's tier. A
        malformed argument raises :class:`~lifecycle.errors.MalformedEvent`."""
        return self._stored("stored", block_hashes, parent_block_hash, token_ids, adapter_key)

    def _stored(
        self, what: str, raw_hashes: object, parent: object, raw_tokens: object, adapter_key: object
    ) -> BlockStored:
        hashes = _hashes(what, raw_hashes)
        tokens = _tokens(what, raw_tokens)
        if len(tokens) != len(hashes) * self._block_size:
            raise MalformedEvent(
                f"{what}: {len(tokens)} tokens for {len(hashes)} blocks of {self._block_size}; "
                f"expected {len(hashes) * self._block_size}"
            )
        parent_hash = None if parent is None else _hashes(what, (parent,))[0]
        if isinstance(adapter_key, np.integer):
            adapter_key = int(adapter_key)
        if type(adapter_key) is not int:
            raise MalformedEvent(f"{what}: adapter key {adapter_key!r} is not an int")
        adapter = self._adapter_of(adapter_key) if adapter_key else None
        lora_id, lora_name = adapter if adapter is not None else (None, None)
        salt = self._salt_of(adapter_key) if adapter_key and parent_hash is None and hashes else None
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent_hash,
            token_ids=tokens,
            block_size=self._block_size,
            lora_id=lora_id,
            medium=self._medium,
            lora_name=lora_name,
            extra_keys=None if salt is None else ((salt,), *(None,) * (len(hashes) - 1)),
        )

    def batch(self, raw_log: Iterable[RawEvent], *, data_parallel_rank: int | None = None) -> KVEventBatch:
        """The events of ``raw_log`` as one batch stamped now (possibly with no events)."""
        events = tuple(self.events(raw_log))
        return KVEventBatch(ts=self._clock(), events=events, data_parallel_rank=data_parallel_rank)

    def _event(self, index: int, entry: RawEvent) -> KVEvent:
        kind = entry[0] if isinstance(entry, tuple) and entry else None
        what = f"raw event {index} ({kind!r})"
        if kind == "stored" and len(entry) == 5:
            _, raw_hashes, parent, raw_tokens, adapter_key = entry
            return self._stored(what, raw_hashes, parent, raw_tokens, adapter_key)
        if kind == "removed" and len(entry) == 2:
            return BlockRemoved(block_hashes=_hashes(what, entry[1]), medium=self._medium)
        if kind == "cleared" and len(entry) == 1:
            return AllBlocksCleared()
        raise MalformedEvent(
            f"raw event {index} is {entry!r}; expected ('stored', hashes, parent_hash, tokens, adapter_key), "
            "('removed', hashes) or ('cleared',)"
        )

    def __repr__(self) -> str:
        return f"KVEventTranslator(block_size={self._block_size}, medium={self._medium!r})"


# --- the wire encoding -------------------------------------------------------------------------------


@functools.cache
def _wire_structs() -> tuple[Any, dict[type, tuple[Any, tuple[str, ...]]]]:
    """msgspec structs declared as vLLM declares its own (tagged by class name, ``omit_defaults``;
    the batch ``array_like``), so that msgspec writes the very bytes it writes for vLLM's, map
    headers included. Returns the batch struct and, per event class, its struct and field names."""
    msgspec = _import_extra("msgspec")
    events: dict[type, tuple[Any, tuple[str, ...]]] = {}
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared):
        fields = dataclasses.fields(cls)
        spec = [(f.name, Any) if f.default is dataclasses.MISSING else (f.name, Any, f.default) for f in fields]
        struct = msgspec.defstruct(cls.__name__, spec, tag=True, omit_defaults=True, gc=False)
        events[cls] = (struct, tuple(f.name for f in fields))
    batch = msgspec.defstruct(
        "KVEventBatch",
        [("ts", float), ("events", list), ("data_parallel_rank", Any, None)],
        array_like=True, omit_defaults=True, gc=False,
    )
    return batch, events


def _wire_batch(batch: KVEventBatch) -> Any:
    batch_struct, event_structs = _wire_structs()
    wire_events = []
    for event in batch.events:
        struct, names = event_structs[type(event)]
        wire_events.append(struct(*[getattr(event, name) for name in names]))
    return batch_struct(float(batch.ts), wire_events, batch.data_parallel_rank)


def _import_extra(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"lifecycle.events needs {name} for this: {_EXTRA_HINT}") from error


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch``: the same bytes vLLM's ``msgspec.msgpack.Encoder`` writes for
    its ``KVEventBatch`` with the same values. Needs msgspec (the ``events`` extra)."""
    msgspec = _import_extra("msgspec")
    payload: bytes = msgspec.msgpack.encode(_wire_batch(batch))
    return payload


# --- the ZeroMQ publisher ----------------------------------------------------------------------------

#: The sequence number of the frame that ends a replay.
END_OF_REPLAY: Final = (-1).to_bytes(8, "big", signed=True)

_STOP = object()  # queued by close(): the thread sends what was queued before it, then stops


def _binds(endpoint: str) -> bool:
    """A wildcard address, ipc:// and inproc:// are bound; any other endpoint is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sends batches (:class:`KVEventBatch`) over ZeroMQ as vLLM's ``ZmqEventPublisher`` does.

    Every batch is one multipart message on a PUB socket: ``(topic, seq, payload)``, where ``seq`` is
    the batch's sequence number (0, 1, 2, ... as an 8-byte big-endian integer) and ``payload`` is
    :func:`encode_batch`. With ``replay_endpoint``, a ROUTER socket resends the last
    ``buffer_steps`` batches from a sequence number a subscriber asks for (see :doc:`kv-events`).

    :meth:`publish` only queues the batch (at most ``max_queue_size``; a full queue makes it wait);
    a background thread encodes and sends. A wildcard, ipc:// or inproc:// endpoint is bound here (an
    error raises now), any other is connected to. :meth:`close` sends what was queued, then closes
    the sockets, waiting at most ``linger_ms`` for subscribers to take what is still buffered.
    Needs pyzmq and msgspec (the ``events`` extra).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        linger_ms: int = 1000,
        context: Any = None,
    ) -> None:
        for name, value, minimum in (
            ("buffer_steps", buffer_steps, 1),
            ("hwm", hwm, 0),
            ("max_queue_size", max_queue_size, 1),
            ("data_parallel_rank", data_parallel_rank, 0),
            ("linger_ms", linger_ms, 0),
        ):
            if type(value) is not int or value < minimum:
                raise ConfigError(f"ZmqEventPublisher: {name}={value!r} must be an int >= {minimum}")
        zmq = _import_extra("zmq")
        self._msgspec = _import_extra("msgspec")
        self._zmq = zmq
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._linger_ms = linger_ms
        self._queue: queue.Queue[KVEventBatch | object] = queue.Queue(maxsize=max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closed = False
        self._close_lock = threading.Lock()
        self._failures = 0
        self._unsent = 0  # batches queued and not yet handed to the socket
        self._all_sent = threading.Condition()
        ctx = context if context is not None else zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(hwm)
            self._endpoint = self._attach(self._pub, endpoint)
            self._replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # a whole replay and its end marker fit in the send queue of a slow subscriber
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay_endpoint)
                self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            self._close_sockets(linger_ms=0)
            raise
        self._thread = threading.Thread(target=self._run, name="lifecycle-kv-events", daemon=True)
        self._thread.start()

    def _attach(self, socket: Any, endpoint: str) -> str:
        if _binds(endpoint):
            socket.bind(endpoint)
            bound: str = socket.getsockopt_string(self._zmq.LAST_ENDPOINT)
            return bound
        socket.connect(endpoint)
        return endpoint

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (for a bound wildcard port, the port the system chose)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's bound address, or None without one."""
        return self._replay_endpoint

    @property
    def send_failures(self) -> int:
        """Batches the thread failed to encode or send (each logged)."""
        return self._failures

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch`` for sending; a batch without events is not sent (nor numbered).
        Raises :class:`~lifecycle.errors.TornDown` after :meth:`close`."""
        if self._closed:
            raise TornDown("ZmqEventPublisher.publish: the publisher is closed")
        if not isinstance(batch, KVEventBatch):
            raise MalformedEvent(f"ZmqEventPublisher.publish: expected a KVEventBatch, got {batch!r}")
        if batch.events:
            with self._all_sent:
                self._unsent += 1
            self._queue.put(batch)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every batch published so far was handed to the socket (or failed, see
        :attr:`send_failures`); False if ``timeout_s`` passed first."""
        with self._all_sent:
            return self._all_sent.wait_for(lambda: self._unsent == 0, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what was queued, stop the thread and close the sockets. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            _log.warning("ZmqEventPublisher.close: the queue stayed full for %.1f s", timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.warning("ZmqEventPublisher.close: the sending thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ZmqEventPublisher({self._endpoint!r}, topic={self._topic!r}, closed={self._closed})"

    # --- the sending thread (the only one that touches the sockets after __init__) ----------------

    def _run(self) -> None:
        encoder = self._msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:  # a replay is best effort: the live stream goes on
                        _log.exception("ZmqEventPublisher: answering a replay request failed")
                try:
                    item = self._queue.get(timeout=0.05 if self._replay is not None else None)
                except queue.Empty:
                    continue
                if item is _STOP:
                    return
                assert isinstance(item, KVEventBatch)
                try:
                    if item.data_parallel_rank is None:
                        item = dataclasses.replace(item, data_parallel_rank=self._rank)
                    payload: bytes = encoder.encode(_wire_batch(item))
                    seq_bytes = seq.to_bytes(8, "big")
                    self._pub.send_multipart((self._topic, seq_bytes, payload))
                    self._sent.append((seq, payload))
                    seq += 1
                except Exception:  # a bad batch or a socket error must not stop the batches after it
                    self._failures += 1
                    _log.exception("ZmqEventPublisher: sending batch %d failed", seq)
                with self._all_sent:
                    self._unsent -= 1
                    if not self._unsent:
                        self._all_sent.notify_all()
        finally:
            self._close_sockets(self._linger_ms)

    def _serve_replay(self) -> None:
        """Answer one replay request: every kept batch from the sequence number asked for, then the
        end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            _log.warning("ZmqEventPublisher: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _close_sockets(self, linger_ms: int) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=linger_ms)
