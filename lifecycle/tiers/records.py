"""The block record: one cached block as the shared store keeps it, versioned and checksummed.

A record is an 88-byte header, then the block's tokens (``block_size`` little-endian int32), then
its KV bytes: every attention layer's block (K then V) in layer order, as :class:`~lifecycle.pools.KVPool`
lays one block of a layer out. The header (little-endian)::

    offset  size  field
         0     4  magic b"LCKB"
         4     2  version (2)
         6     2  header bytes (88)
         8     8  model fingerprint (ModelConfig.fingerprint(): the byte format of a block)
        16    16  namespace (lifecycle.tiers.keys.namespace_of: model name, weights, byte format)
        32    16  the block's tier key (high word, low word; lifecycle.tiers.keys)
        48    16  its parent's tier key (the root key for a sequence's first block)
        64     4  block size in tokens
        68     4  reserved (0)
        72     8  KV bytes
        80     8  xxh3-64 of bytes 0..80 and of everything after the header

A value that is not a record of this layout (another magic, version, model, namespace, key,
parent or size) is *foreign*; one whose checksum does not match is *corrupt*. Either raises a
:class:`RecordError` subclass naming the field and both values; the store turns it into a miss.
The tokens are the caller's to compare (:meth:`RecordLayout.decode` returns them).
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
]

MAGIC: Final = b"LCKB"
VERSION: Final = 2
_HEADER: Final = struct.Struct("<4sHHQ16sQQQQIIQQ")
HEADER_BYTES: Final = _HEADER.size
_CHECKSUM_AT: Final = HEADER_BYTES - 8
_TOKEN = np.dtype("<i4")


class RecordError(LifecycleError):
    """A store value is not a valid record for the block asked for."""


class RecordForeign(RecordError):
    """The value is a record of another format, model, namespace or block, or no record at all."""


class RecordCorrupt(RecordError):
    """The value's checksum does not match its bytes."""


@dataclass(frozen=True, slots=True, eq=False)
class BlockRecord:
    """One block read from (or written to) the store: its tier key and its parent's, as (high,
    low) words, its tokens (``block_size`` int32) and the KV bytes of every layer, in layer order."""

    key: tuple[int, int]
    parent: tuple[int, int]
    tokens: npt.NDArray[np.int32]
    kv: bytes | memoryview


@dataclass(frozen=True, slots=True)
class RecordLayout:
    """What every record of one model looks like: its fingerprint, block size and KV bytes per
    block (all attention layers), and its namespace (16 bytes, :func:`~lifecycle.tiers.keys.namespace_of`).
    Build it with :meth:`of`."""

    fingerprint: int
    block_size: int
    kv_bytes: int
    namespace: bytes = bytes(16)

    @classmethod
    def of(cls, config: ModelConfig, namespace: bytes | None = None) -> RecordLayout:
        """The layout of ``config``'s blocks (``namespace``: the model's, by default
        :func:`~lifecycle.tiers.keys.namespace_of` without a weights fingerprint); a model
        without attention layers has none."""
        kv_bytes = config.kv_block_bytes()
        if kv_bytes == 0:
            raise InvalidId(f"model {config.name!r} has no attention layer: it has no KV blocks to store")
        if namespace is None:
            from lifecycle.tiers.keys import namespace_of

            namespace = namespace_of(config)
        if not isinstance(namespace, bytes) or len(namespace) != 16:
            raise InvalidId(f"a namespace is 16 bytes, got {namespace!r}")
        return cls(config.fingerprint(), config.block_size, kv_bytes, namespace)

    @property
    def record_bytes(self) -> int:
        """Bytes of one record: header, tokens and KV."""
        return HEADER_BYTES + self.block_size * 4 + self.kv_bytes

    def encode(
        self, key: tuple[int, int], parent: tuple[int, int], tokens: npt.NDArray[np.int32], kv: bytes | memoryview
    ) -> bytes:
        """The record of one block (``key`` and its ``parent``'s key; ``tokens``: ``block_size``
        token ids; ``kv``: ``kv_bytes``)."""
        token_bytes = np.ascontiguousarray(tokens, dtype=_TOKEN).tobytes()
        if len(token_bytes) != self.block_size * 4:
            raise InvalidId(f"encode: {len(token_bytes) // 4} tokens for a block of block_size={self.block_size}")
        if memoryview(kv).nbytes != self.kv_bytes:
            raise InvalidId(f"encode: {memoryview(kv).nbytes} KV bytes for blocks of kv_bytes={self.kv_bytes}")
        out = bytearray(self.record_bytes)
        _HEADER.pack_into(
            out, 0, MAGIC, VERSION, HEADER_BYTES, self.fingerprint, self.namespace, *key, *parent, self.block_size,
            0, self.kv_bytes, 0,
        )
        tokens_end = HEADER_BYTES + len(token_bytes)
        out[HEADER_BYTES:tokens_end] = token_bytes
        out[tokens_end:] = kv
        view = memoryview(out)
        struct.pack_into("<Q", out, _CHECKSUM_AT, _checksum(view))
        return bytes(out)

    def decode(self, value: bytes | memoryview, key: tuple[int, int], parent: tuple[int, int]) -> BlockRecord:
        """The record in ``value``, which must be the block of tier key ``key`` after the block
        of key ``parent``, of this model's namespace; :class:`RecordForeign` or
        :class:`RecordCorrupt` otherwise. The record's KV is a view of ``value``."""
        view = memoryview(value).cast("B")
        if view.nbytes < HEADER_BYTES:
            raise RecordForeign(f"a record has at least {HEADER_BYTES} bytes, got {view.nbytes}")
        (magic, version, header, fingerprint, namespace, key_high, key_low, parent_high, parent_low, block_size, _,
         kv_bytes, checksum) = _HEADER.unpack_from(view)
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
            raise RecordCorrupt(f"record of key {key[0]:#018x}: checksum {actual:#018x}, header says {checksum:#018x}")
        if namespace != self.namespace:
            raise RecordForeign(
                f"record of key {key[0]:#018x}: namespace {namespace.hex()}, expected {self.namespace.hex()}"
            )
        for field, got, want in (
            ("fingerprint", fingerprint, self.fingerprint),
            ("key high word", key_high, key[0]),
            ("key low word", key_low, key[1]),
            ("parent key high word", parent_high, parent[0]),
            ("parent key low word", parent_low, parent[1]),
            ("block size", block_size, self.block_size),
            ("KV bytes", kv_bytes, self.kv_bytes),
        ):
            if got != want:
                raise RecordForeign(f"record of key {key[0]:#018x}: {field} {got:#x}, expected {want:#x}")
        tokens_end = HEADER_BYTES + self.block_size * 4
        tokens = np.frombuffer(view[HEADER_BYTES:tokens_end], dtype=_TOKEN).astype(np.int32, copy=False)
        return BlockRecord(key, parent, tokens, view[tokens_end:])


def _checksum(record: memoryview) -> int:
    digest = xxhash.xxh3_64()
    digest.update(record[:_CHECKSUM_AT])
    digest.update(record[HEADER_BYTES:])
    return digest.intdigest()
