"""The block record: one cached block as the shared store keeps it, versioned and checksummed.

A record is a 56-byte header, then the block's tokens (``block_size`` little-endian int32), then
its KV bytes: every attention layer's block (K then V) in layer order, as :class:`~lifecycle.pools.KVPool`
lays one block of a layer out. The header (little-endian)::

    offset  size  field
         0     4  magic b"LCKB"
         4     2  version (1)
         6     2  header bytes (56)
         8     8  model fingerprint (ModelConfig.fingerprint(): the byte format of a block)
        16     8  adapter id (adapter_id(name); 0 without an adapter)
        24     8  content hash of the block (docs/content-hashes.md)
        32     4  block size in tokens
        36     4  reserved (0)
        40     8  KV bytes
        48     8  xxh3-64 of bytes 0..48 and of everything after the header

A value that is not a record of this layout (another magic, version, model, adapter, hash or size)
is *foreign*; one whose checksum does not match is *corrupt*. Either raises a
:class:`RecordError` subclass naming the field and both values; the store turns it into a miss.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from lifecycle.config import ModelConfig
from lifecycle.errors import InvalidId, LifecycleError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "BlockRecord",
    "RecordCorrupt",
    "RecordError",
    "RecordForeign",
    "RecordLayout",
    "adapter_id",
    "model_id",
]

MAGIC: Final = b"LCKB"
VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sHHQQQIIQQ")
HEADER_BYTES: Final = _HEADER.size
_CHECKSUM_AT: Final = HEADER_BYTES - 8
_TOKEN = np.dtype("<i4")


class RecordError(LifecycleError):
    """A store value is not a valid record for the block asked for."""


class RecordForeign(RecordError):
    """The value is a record of another format, model, adapter or block, or no record at all."""


class RecordCorrupt(RecordError):
    """The value's checksum does not match its bytes."""


def adapter_id(adapter: str) -> int:
    """The 64-bit id of an adapter name in keys and headers: 0 for ``""`` (no adapter), else the
    xxh3-64 of its UTF-8 bytes (never 0). Equal in every process, unlike the adapter keys the
    core's content hashes start from."""
    if not isinstance(adapter, str):
        raise InvalidId(f"adapter must be a str (\"\" for none), got {adapter!r}")
    if not adapter:
        return 0
    return xxhash.xxh3_64_intdigest(adapter.encode("utf-8")) or 1


@dataclass(frozen=True, slots=True, eq=False)
class BlockRecord:
    """One block read from (or written to) the store: its content hash, adapter id, tokens
    (``block_size`` int32) and KV bytes of every layer, in layer order."""

    content_hash: int
    adapter_id: int
    tokens: npt.NDArray[np.int32]
    kv: bytes | memoryview


def model_id(name: str) -> int:
    """The 64-bit id of a model name (``ModelConfig.name``) in store keys: the xxh3-64 of its
    UTF-8 bytes. Two models of one byte format but other names compute other KV for the same
    tokens (other weights), so their blocks must never meet."""
    if not isinstance(name, str) or not name:
        raise InvalidId(f"a model name must be a non-empty str, got {name!r}")
    return xxhash.xxh3_64_intdigest(name.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """What every record of one model looks like: its fingerprint, block size and KV bytes per
    block (all attention layers), and the id of the model's name (:func:`model_id`), which the
    store keys its records under. Build it with :meth:`of`."""

    fingerprint: int
    block_size: int
    kv_bytes: int
    model: int = 0

    @classmethod
    def of(cls, config: ModelConfig) -> RecordLayout:
        """The layout of ``config``'s blocks; a model without attention layers has none."""
        kv_bytes = config.kv_block_bytes()
        if kv_bytes == 0:
            raise InvalidId(f"model {config.name!r} has no attention layer: it has no KV blocks to store")
        return cls(config.fingerprint(), config.block_size, kv_bytes, model_id(config.name))

    @property
    def record_bytes(self) -> int:
        """Bytes of one record: header, tokens and KV."""
        return HEADER_BYTES + self.block_size * 4 + self.kv_bytes

    def encode(self, content_hash: int, adapter: int, tokens: npt.NDArray[np.int32], kv: bytes | memoryview) -> bytes:
        """The record of one block (``tokens``: ``block_size`` token ids; ``kv``: ``kv_bytes``)."""
        token_bytes = np.ascontiguousarray(tokens, dtype=_TOKEN).tobytes()
        if len(token_bytes) != self.block_size * 4:
            raise InvalidId(f"encode: {len(token_bytes) // 4} tokens for a block of block_size={self.block_size}")
        if memoryview(kv).nbytes != self.kv_bytes:
            raise InvalidId(f"encode: {memoryview(kv).nbytes} KV bytes for blocks of kv_bytes={self.kv_bytes}")
        out = bytearray(self.record_bytes)
        _HEADER.pack_into(
            out, 0, MAGIC, VERSION, HEADER_BYTES, self.fingerprint, adapter, content_hash, self.block_size, 0,
            self.kv_bytes, 0,
        )
        tokens_end = HEADER_BYTES + len(token_bytes)
        out[HEADER_BYTES:tokens_end] = token_bytes
        out[tokens_end:] = kv
        view = memoryview(out)
        struct.pack_into("<Q", out, _CHECKSUM_AT, _checksum(view))
        return bytes(out)

    def decode(self, value: bytes | memoryview, content_hash: int, adapter: int) -> BlockRecord:
        """The record in ``value``, which must be the block ``content_hash`` of adapter
        ``adapter`` of this model; :class:`RecordForeign` or :class:`RecordCorrupt` otherwise.
        The record's KV is a view of ``value``."""
        view = memoryview(value).cast("B")
        if view.nbytes < HEADER_BYTES:
            raise RecordForeign(f"a record has at least {HEADER_BYTES} bytes, got {view.nbytes}")
        magic, version, header, fingerprint, adapter_got, hash_got, block_size, _, kv_bytes, checksum = (
            _HEADER.unpack_from(view)
        )
        if magic != MAGIC or version != VERSION or header != HEADER_BYTES:
            raise RecordForeign(
                f"not a version {VERSION} block record: magic {magic!r}, version {version}, header {header} bytes "
                f"(expected {MAGIC!r}, {VERSION}, {HEADER_BYTES})"
            )
        if view.nbytes != self.record_bytes:
            raise RecordForeign(
                f"record of {view.nbytes} bytes; a block of this model takes {self.record_bytes} "
                f"(block_size={self.block_size}, kv_bytes={self.kv_bytes})"
            )
        actual = _checksum(view)
        if actual != checksum:
            raise RecordCorrupt(
                f"record of block {content_hash:#018x}: checksum {actual:#018x}, header says {checksum:#018x}"
            )
        for field, got, want in (
            ("fingerprint", fingerprint, self.fingerprint),
            ("adapter id", adapter_got, adapter),
            ("content hash", hash_got, content_hash),
            ("block size", block_size, self.block_size),
            ("KV bytes", kv_bytes, self.kv_bytes),
        ):
            if got != want:
                raise RecordForeign(f"record of block {content_hash:#018x}: {field} {got:#x}, expected {want:#x}")
        tokens_end = HEADER_BYTES + self.block_size * 4
        tokens = np.frombuffer(view[HEADER_BYTES:tokens_end], dtype=_TOKEN).astype(np.int32)
        return BlockRecord(content_hash, adapter, tokens, view[tokens_end:])


def _checksum(record: memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(record[:_CHECKSUM_AT])
    digest.update(record[HEADER_BYTES:])
    return digest.intdigest()
