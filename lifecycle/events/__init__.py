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
msgspec) sends batches over ZeroMQ the way vLLM's publisher does. The package's modules: ``types``
(the events), ``translate`` (the core's log into events; one model's stream), ``zmq`` (the wire
encoding and the publisher).
"""

from __future__ import annotations

from lifecycle.events.translate import KVEventLog, KVEventTranslator, raw_entries
from lifecycle.events.types import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AdapterLookup,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    RawEvent,
    SaltLookup,
)
from lifecycle.events.zmq import END_OF_REPLAY, ZmqEventPublisher, encode_batch

# The encoding's struct cache, for a caller that must rebuild it (after msgspec is swapped out).
from lifecycle.events.zmq import _wire_structs as _wire_structs

__all__ = [
    "END_OF_REPLAY",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AdapterLookup",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventLog",
    "KVEventTranslator",
    "RawEvent",
    "SaltLookup",
    "ZmqEventPublisher",
    "encode_batch",
    "raw_entries",
]
