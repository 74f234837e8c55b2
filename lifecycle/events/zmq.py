"""KV event batches on the wire: :func:`encode_batch` writes the bytes vLLM's msgspec encoder writes
for the same batch, and :class:`ZmqEventPublisher` sends them over ZeroMQ as vLLM's publisher does
(the ``events`` extra: pyzmq and msgspec)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import queue
import threading
from collections import deque
from types import ModuleType, TracebackType
from typing import Any, Final

from lifecycle.errors import ConfigError, MalformedEvent, TornDown
from lifecycle.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["END_OF_REPLAY", "ZmqEventPublisher", "encode_batch"]

_log = logging.getLogger("lifecycle.events")

#: The extras that the wire encoding and the publisher need.
_EXTRA_HINT = "pip install 'kv-lifecycle[events]' (pyzmq and msgspec)"


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
