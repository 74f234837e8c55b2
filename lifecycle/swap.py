"""The swap record: a versioned, checksummed image of one sequence's memory, and the streaming
save and restore that write and read it.

The byte layout and the versioning policy are in ``docs/swap-format.md``; in short: a 128-byte
little-endian header with its own xxh3-64 checksum, then sections (meta: layer table, adapter name,
tokens; one per attention layer: the KV of the sequence's blocks in block-table order; one per SSM
slot range: h / conv state), each followed by the xxh3-64 of its payload seeded with the section's
index, so two equal-sized sections swapped in the stream do not verify.

Data moves through a bounded staging buffer (pinned host memory on CUDA, double-buffered so the
copy of one half overlaps the hashing and I/O of the other), so memory use does not grow with the
sequence. On the host device, whose "device" memory is host memory, the bytes are hashed and
written straight from the pools (``SwapContext.zero_copy_host``), which saves one copy.

Writers and readers over memory can skip their own ``write`` / ``readinto`` copy: a writer with
``reserve(nbytes) -> memoryview`` (the next ``nbytes`` of its destination, counted as written) and
a reader with ``claim(nbytes) -> memoryview`` (its next bytes, at most ``nbytes``, counted as read)
get the payload copied in and out with streaming stores, each piece hashed while it is still in
the cache. The swap tier's host pool works this way.

``restore`` is all-or-nothing for the sequence: KV streams into the freshly allocated blocks (the
caller frees them on failure), but the SSM sections (one slot's worth, whatever the sequence's
length) and the token ids are buffered on the host and only written into the sequence's slot and
token list once every checksum verified.

What a record may hold is bounded by the model: at most its per-sequence block limit, and as many
tokens as those blocks cover; ``prompt_len`` and ``ssm_tokens`` within the tokens; token ids in
int32's non-negative range. ``save`` refuses a sequence outside these bounds before writing a byte
(``SequenceStateError``; :func:`check_saveable` is the same rule for a caller that must decide
before anything else, such as a swap tier about to free the sequence), and ``restore`` refuses a
header announcing more before reading past it, so a forged size costs no memory.

Errors: a malformed or truncated record raises :class:`SwapFormatError`, a record of another model
(or block count, or adapter) :class:`SwapModelMismatch`, a corrupted section
:class:`SwapChecksumError`. A reader or writer that breaks the stream contract (a count that is
negative, past what was asked, or not an int; None from a non-blocking stream) raises
:class:`SwapStreamError` at its first such answer. An exception raised by the reader or writer
itself is re-raised as :class:`SwapError` chained from the original (``__cause__``) and naming the
section and offset; a ``LifecycleError`` or a ``BaseException`` that is not an ``Exception``
(``KeyboardInterrupt``) propagates unchanged.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Final, Protocol

import numpy as np
import numpy.typing as npt
import xxhash

from lifecycle._hostcopy import stream_copy
from lifecycle.errors import (
    LifecycleError,
    SequenceStateError,
    SwapChecksumError,
    SwapError,
    SwapFormatError,
    SwapModelMismatch,
    SwapStreamError,
)
from lifecycle.sequence import NO_ADAPTER

if TYPE_CHECKING:
    from lifecycle.adapters import AdapterInfo
    from lifecycle.device.base import Device
    from lifecycle.sequence import SequenceState

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "MAX_RECORD_TOKENS",
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "HEADER_BYTES",
    "MAGIC",
    "StagingBuffer",
    "SwapContext",
    "SwapHeader",
    "check_saveable",
    "parse_header",
    "read_header",
    "record_nbytes",
    "restore",
    "save",
]

MAGIC: Final = b"\x89LCSWAP\n"  # high bit and newline catch 7-bit and text-mode mangling
FORMAT_MAJOR: Final = 1
FORMAT_MINOR: Final = 0
HEADER_BYTES: Final = 128
DEFAULT_STAGING_BYTES: Final = 4 << 20
MAX_ADAPTER_NAME_BYTES: Final = 4096
#: Token ids are int32 in a record and in a sequence's buffer: no record holds more tokens than this.
MAX_RECORD_TOKENS: Final = 0x7FFFFFFF

FLAG_FAILED: Final = 1  # the sequence was marked failed: its KV must never be cached

# Everything but the trailing header checksum; see docs/swap-format.md for the field table.
_HEADER = struct.Struct("<8sHHIQQIIQQIIQQIIQqII8x")
_CHECKSUM = struct.Struct("<Q")
_U64 = np.dtype("<u8")
_TOKEN = np.dtype("<i4")
_HOST_PIECE = 256 << 10  # copied, then hashed while still in the core's L2
assert _HEADER.size + _CHECKSUM.size == HEADER_BYTES
_META_SECTION: Final = 1


# ---------------------------------------------------------------------------- what swap needs


class _SSMLayerSpec(Protocol):
    @property
    def h_state_bytes(self) -> int: ...
    @property
    def conv_state_bytes(self) -> int: ...


class ConfigLike(Protocol):
    """The part of :class:`~lifecycle.config.ModelConfig` swap reads."""

    @property
    def block_size(self) -> int: ...
    @property
    def attention_layers(self) -> Sequence[object]: ...
    @property
    def ssm_layers(self) -> Sequence[_SSMLayerSpec]: ...
    @property
    def max_blocks_per_seq_resolved(self) -> int: ...
    def kv_block_bytes(self) -> int: ...
    def fingerprint(self) -> int: ...


class KVLayout(Protocol):
    """The part of :class:`~lifecycle.pools.KVPool` swap reads: ``layer`` counts attention layers."""

    def layer_block_bytes(self, layer: int) -> int: ...
    def block_addr(self, layer: int, block_id: int) -> int: ...


class SSMLayout(Protocol):
    """The part of :class:`~lifecycle.pools.SSMPool` swap reads."""

    def slot_ranges(self, slot: int) -> list[tuple[int, int]]: ...


class AdapterLookup(Protocol):
    """The part of :class:`~lifecycle.adapters.AdapterTable` swap reads."""

    def info(self, slot: int) -> AdapterInfo: ...


class StagingBuffer:
    """Bounded host memory that swap copies pass through: pinned (``device.alloc_pinned``),
    allocated on first use, reused by every later save and restore, freed by :meth:`release`.
    Not thread-safe: one save or restore uses it at a time (the model's lock)."""

    def __init__(self, device: Device, nbytes: int = DEFAULT_STAGING_BYTES) -> None:
        if not isinstance(nbytes, int) or nbytes < 2 * 4096:
            raise SwapError(f"staging buffer nbytes={nbytes!r} must be an int >= 8192")
        self._device = device
        self.nbytes = nbytes - nbytes % 2
        self._ptr = 0
        self._view: npt.NDArray[np.uint8] | None = None

    @property
    def allocated(self) -> bool:
        return self._ptr != 0

    def acquire(self) -> tuple[int, npt.NDArray[np.uint8]]:
        """(address, uint8 view) of the buffer, allocating it on first use."""
        if self._view is None:
            ptr = self._device.alloc_pinned(self.nbytes)
            try:
                self._view = self._device.host_array(ptr, self.nbytes)
            except BaseException:
                self._device.free_pinned(ptr)
                raise
            self._ptr = ptr
        return self._ptr, self._view

    def release(self) -> None:
        """Free the pinned memory if it was allocated; idempotent."""
        if self._ptr:
            ptr, self._ptr, self._view = self._ptr, 0, None
            self._device.free_pinned(ptr)


@dataclass(slots=True)
class SwapContext:
    """What save and restore work on: the model's configuration, device and pools.

    ``staging``: the model's reusable staging buffer; None allocates one per call (and frees it).
    ``adapters``: resolves a sequence's ``adapter_slot`` to (name, generation) for the record;
    needed only for sequences bound to an adapter. ``zero_copy_host``: on the host device, hash and
    copy straight between the stream and the pools instead of through the staging buffer."""

    config: ConfigLike
    device: Device
    kv: KVLayout | None
    ssm: SSMLayout | None
    staging: StagingBuffer | None = None
    adapters: AdapterLookup | None = None
    zero_copy_host: bool = True
    _layout: _Layout | None = field(default=None, repr=False)

    def layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout.of(self)
        return self._layout


@dataclass(frozen=True, slots=True)
class _Limits:
    """What one record of a model may hold: the per-sequence block limit, and as many tokens as
    those blocks cover (a model without attention layers: the format's limit). ``save`` refuses a
    sequence outside them before writing a byte, and ``restore`` refuses a header announcing more
    before reading past it, by the same rule (:meth:`problem`)."""

    max_blocks: int
    max_tokens: int
    block_size: int

    @staticmethod
    def of(config: ConfigLike) -> _Limits:
        max_blocks = config.max_blocks_per_seq_resolved
        covered = max_blocks * config.block_size if config.kv_block_bytes() else MAX_RECORD_TOKENS
        return _Limits(max_blocks, min(covered, MAX_RECORD_TOKENS), config.block_size)

    def problem(self, num_blocks: int, num_tokens: int, prompt_len: object, ssm_tokens: object) -> str | None:
        """The first count outside what a record may hold, naming its value and the limit; None
        when every count is fine. ``ssm_tokens`` None means "as many as the tokens"."""
        if num_blocks > self.max_blocks:
            return f"num_blocks={num_blocks} exceeds the per-sequence limit of {self.max_blocks} blocks"
        if num_tokens > self.max_tokens:
            what = (
                f"{self.max_blocks} blocks of {self.block_size} tokens"
                if self.max_tokens < MAX_RECORD_TOKENS
                else "the format's int32 token count"
            )
            return f"num_tokens={num_tokens} exceeds the per-sequence limit of {self.max_tokens} tokens ({what})"
        for name, value in (("prompt_len", prompt_len), ("ssm_tokens", ssm_tokens)):
            if value is None and name == "ssm_tokens":
                continue
            count = _exact_int(value)
            if count is None or not 0 <= count <= num_tokens:
                return f"{name}={value!r} must be an int in [0, num_tokens={num_tokens}]"
        return None


def _exact_int(value: object) -> int | None:
    """``value`` as an int when it is one (a numpy integer too; never a bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, int | np.integer):
        return int(value)
    return None


@dataclass(frozen=True, slots=True)
class _Layout:
    """Per-section sizes of the model, derived once per context."""

    fingerprint: int
    block_size: int
    kv_layer_bytes: tuple[int, ...]  # bytes of one block of each attention layer
    ssm_range_bytes: tuple[int, ...]  # bytes of each per-slot SSM range
    num_ssm_layers: int
    limits: _Limits

    @staticmethod
    def of(ctx: SwapContext) -> _Layout:
        config = ctx.config
        num_attention = len(config.attention_layers)
        if num_attention and ctx.kv is None:
            raise SwapError(f"model has {num_attention} attention layers but no KV pool")
        kv = ctx.kv
        kv_bytes = tuple(kv.layer_block_bytes(i) for i in range(num_attention)) if kv is not None else ()
        ssm = ctx.ssm
        ssm_bytes = tuple(n for _, n in ssm.slot_ranges(0)) if ssm is not None else ()
        return _Layout(
            config.fingerprint() & 0xFFFFFFFFFFFFFFFF,
            config.block_size,
            kv_bytes,
            ssm_bytes,
            len(config.ssm_layers),
            _Limits.of(config),
        )

    @property
    def kv_block_bytes(self) -> int:
        return sum(self.kv_layer_bytes)

    @property
    def ssm_bytes(self) -> int:
        return sum(self.ssm_range_bytes)

    def meta_bytes(self, adapter_name_bytes: int, num_tokens: int) -> int:
        return 8 * (len(self.kv_layer_bytes) + len(self.ssm_range_bytes)) + adapter_name_bytes + 4 * num_tokens

    def record_bytes(self, num_blocks: int, adapter_name_bytes: int, num_tokens: int) -> int:
        sections = 1 + len(self.kv_layer_bytes) + len(self.ssm_range_bytes)
        payload = self.meta_bytes(adapter_name_bytes, num_tokens) + num_blocks * self.kv_block_bytes + self.ssm_bytes
        return HEADER_BYTES + payload + 8 * sections

    def section_name(self, index: int) -> str:
        if index == _META_SECTION:
            return "meta"
        index -= 2
        if index < len(self.kv_layer_bytes):
            return f"kv attention-layer {index}"
        index -= len(self.kv_layer_bytes)
        if len(self.ssm_range_bytes) == 2 * self.num_ssm_layers:
            return f"ssm layer {index // 2} {'h' if index % 2 == 0 else 'conv'}-state"
        return f"ssm range {index}"


def record_nbytes(config: ConfigLike, num_blocks: int, num_tokens: int, adapter_name: str | None = None) -> int:
    """Size in bytes of the record ``save`` writes for a sequence of ``num_blocks`` blocks and
    ``num_tokens`` tokens (a swap tier sizes its host memory with it before saving)."""
    num_attention = len(config.attention_layers)
    ssm_layers = config.ssm_layers
    name_bytes = len(adapter_name.encode()) if adapter_name else 0
    sections = 1 + num_attention + 2 * len(ssm_layers)
    ssm_bytes = sum(layer.h_state_bytes + layer.conv_state_bytes for layer in ssm_layers)
    meta = 8 * (num_attention + 2 * len(ssm_layers)) + name_bytes + 4 * num_tokens
    return HEADER_BYTES + meta + num_blocks * config.kv_block_bytes() + ssm_bytes + 8 * sections


# ---------------------------------------------------------------------------- header


@dataclass(frozen=True, slots=True)
class SwapHeader:
    """The fixed header of a record (see docs/swap-format.md)."""

    major: int
    minor: int
    fingerprint: int
    record_bytes: int
    block_size: int
    num_blocks: int
    num_tokens: int
    prompt_len: int
    num_attention_layers: int
    num_ssm_layers: int
    kv_block_bytes: int
    ssm_bytes: int
    adapter_name_bytes: int
    adapter_generation: int
    meta_bytes: int
    ssm_tokens: int  # -1: None
    flags: int
    num_ssm_ranges: int

    def pack(self) -> bytes:
        body = _HEADER.pack(
            MAGIC, self.major, self.minor, HEADER_BYTES, self.fingerprint, self.record_bytes,
            self.block_size, self.num_blocks, self.num_tokens, self.prompt_len,
            self.num_attention_layers, self.num_ssm_layers, self.kv_block_bytes, self.ssm_bytes,
            self.adapter_name_bytes, self.adapter_generation, self.meta_bytes, self.ssm_tokens,
            self.flags, self.num_ssm_ranges,
        )  # fmt: skip
        return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body, 0))


def parse_header(data: bytes | bytearray | memoryview) -> SwapHeader:
    """Decode and check a record's first ``HEADER_BYTES`` bytes: magic, then the major version
    (a reader refuses any major version but its own), then the header checksum."""
    buf = bytes(data)
    if len(buf) < HEADER_BYTES:
        raise SwapFormatError(f"record truncated: header needs {HEADER_BYTES} bytes, got {len(buf)}")
    if buf[:8] != MAGIC:
        raise SwapFormatError(f"not a lifecycle swap record: magic {buf[:8]!r} != {MAGIC!r}")
    fields = _HEADER.unpack_from(buf)
    major, minor, header_bytes = fields[1], fields[2], fields[3]
    if major != FORMAT_MAJOR:
        raise SwapFormatError(
            f"swap record format version {major}.{minor} is not supported: this reader reads major version "
            f"{FORMAT_MAJOR} (any {FORMAT_MAJOR}.x)"
        )
    (stored,) = _CHECKSUM.unpack_from(buf, _HEADER.size)
    actual = xxhash.xxh3_64_intdigest(buf[: _HEADER.size], 0)
    if stored != actual:
        raise SwapChecksumError(
            f"section 'header' (bytes 0..{HEADER_BYTES}) does not match its checksum: "
            f"stored {stored:#018x}, computed {actual:#018x}"
        )
    if header_bytes != HEADER_BYTES:
        raise SwapFormatError(f"header_bytes={header_bytes} but format {major}.x has {HEADER_BYTES}-byte headers")
    return SwapHeader(major, minor, *fields[4:])


# ---------------------------------------------------------------------------- streams


class _Out:
    """The writer, counting bytes; wraps the writer's own exceptions in SwapError.

    A writer with a ``reserve(nbytes)`` method returning a writable memoryview of the next
    ``nbytes`` bytes of its destination (the swap tier's host pool has one) gets the large
    sections copied straight in with streaming stores, instead of through ``write``."""

    __slots__ = ("writer", "offset", "section", "reserve")

    def __init__(self, writer: BinaryIO) -> None:
        self.writer = writer
        self.offset = 0
        self.section = "header"
        reserve = getattr(writer, "reserve", None)
        self.reserve: Callable[[int], memoryview] | None = reserve if callable(reserve) else None

    def write(self, data: bytes | memoryview) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        total = view.nbytes
        done = 0
        try:
            while done < total:
                done += self._accepted(self.writer.write(view[done:] if done else view), total - done)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(
                f"writing section {self.section!r} at byte {self.offset + done} failed: {exc!r}"
            ) from exc
        self.offset += total

    def _accepted(self, n: object, offered: int) -> int:
        """How many of the ``offered`` bytes one ``write`` took: 1..offered, or SwapStreamError."""
        if n is None:
            if isinstance(self.writer, io.RawIOBase):
                raise SwapStreamError(
                    f"writer {self.writer!r} returned None for {offered} bytes: a non-blocking stream that "
                    "cannot take them now (swap needs a blocking writer)"
                )
            return offered  # a hand-written writer that, like file.write in Python 2, returns nothing
        count = _stream_count(n)
        if count is None or not 0 < count <= offered:
            raise SwapStreamError(
                f"writer {self.writer!r} returned {n!r} for {offered} bytes offered; a write returns how "
                f"many it took, 1..{offered}"
            )
        return count

    def write_bulk(self, view: memoryview) -> None:
        """``write`` for a large piece of payload (a flat byte view)."""
        if self.reserve is None:
            self.write(view)
            return
        total = view.nbytes
        try:
            dest = self.reserve(total)
            if not isinstance(dest, memoryview) or dest.nbytes != total:
                raise SwapStreamError(f"writer.reserve({total}) returned {dest!r}, not a memoryview of {total} bytes")
            stream_copy(dest.cast("B"), view)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"writing section {self.section!r} at byte {self.offset} failed: {exc!r}") from exc
        self.offset += total


_READ_CHUNK: Final = 1 << 20


class _In:
    """The reader, counting bytes; a short stream raises SwapFormatError naming the offset."""

    __slots__ = ("reader", "offset", "section", "record_bytes", "_readinto", "_claim")

    def __init__(self, reader: BinaryIO) -> None:
        self.reader = reader
        self.offset = 0
        self.section = "header"
        self.record_bytes: int | None = None
        self._readinto = getattr(reader, "readinto", None)
        # A reader with claim(nbytes) -> memoryview of its next (at most) nbytes bytes, counted
        # as read (the swap tier's host pool has one): large pieces are copied straight out of it.
        claim = getattr(reader, "claim", None)
        self._claim: Callable[[int], memoryview] | None = claim if callable(claim) else None

    def _truncated(self, got: int, total: int) -> SwapFormatError:
        size = f" of a {self.record_bytes}-byte record" if self.record_bytes is not None else ""
        return SwapFormatError(
            f"record truncated: stream ended at byte {self.offset + got}{size}, inside section "
            f"{self.section!r} ({total - got} more bytes expected)"
        )

    def readinto_bulk(self, view: memoryview) -> memoryview:
        """``readinto`` for a large piece of payload (a flat byte view); returns a view of the
        same bytes that is still in the cache, for the checksum."""
        if self._claim is None:
            self.readinto(view)
            return view
        total = view.nbytes
        try:
            source = self._claim(total)
            if not isinstance(source, memoryview) or source.nbytes > total:
                raise SwapStreamError(
                    f"reader.claim({total}) returned {source!r}, not a memoryview of at most {total} bytes"
                )
            source = source.cast("B")
            got = source.nbytes
            if got:
                stream_copy(view[:got] if got < total else view, source)
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"reading section {self.section!r} at byte {self.offset} failed: {exc!r}") from exc
        if got < total:
            raise self._truncated(got, total)
        self.offset += total
        return source

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` exactly (it is a byte view)."""
        total = view.nbytes
        got = 0
        try:
            while got < total:
                if self._readinto is not None:
                    n = self._delivered(self._readinto(view[got:] if got else view), total - got, "readinto")
                else:
                    chunk = self.reader.read(total - got)
                    n = self._delivered(None if chunk is None else len(chunk), total - got, "read")
                    view[got : got + n] = chunk
                if not n:
                    break
                got += n
        except LifecycleError:
            raise
        except Exception as exc:
            raise SwapError(f"reading section {self.section!r} at byte {self.offset + got} failed: {exc!r}") from exc
        if got < total:
            raise self._truncated(got, total)
        self.offset += total

    def _delivered(self, n: object, asked: int, call: str) -> int:
        """How many bytes one ``readinto`` / ``read`` delivered: 0 (end of stream) .. asked, or
        SwapStreamError (a count that is not an int, negative, or more than asked; None)."""
        if n is None:
            raise SwapStreamError(
                f"reader {self.reader!r}: {call} returned None for {asked} bytes: a non-blocking stream with no "
                f"data ready (swap needs a blocking reader); section {self.section!r}"
            )
        count = _stream_count(n)
        if count is None or not 0 <= count <= asked:
            raise SwapStreamError(
                f"reader {self.reader!r}: {call} of {asked} bytes returned {n!r}; it must deliver 0..{asked} "
                f"(section {self.section!r})"
            )
        return count

    def read(self, nbytes: int) -> npt.NDArray[np.uint8]:
        """Read exactly ``nbytes``. Memory grows with the bytes that actually arrive (chunks of at
        most ``_READ_CHUNK``), so a forged size on a short stream fails as truncated before it can
        allocate what it announced."""
        if nbytes <= _READ_CHUNK:
            out = np.empty(nbytes, dtype=np.uint8)
            self.readinto(out.data)
            return out
        parts = []
        left = nbytes
        while left:
            part = np.empty(min(left, _READ_CHUNK), dtype=np.uint8)
            self.readinto(part.data)
            parts.append(part)
            left -= part.shape[0]
        return np.concatenate(parts)


def _stream_count(n: object) -> int | None:
    """A byte count a stream returned, as an int (None: not an int, or a bool)."""
    if isinstance(n, bool):
        return None
    if isinstance(n, int):
        return n
    if isinstance(n, np.integer):
        return int(n)
    return None


def _check_section(name: str, stored: int, computed: int, offset: int) -> None:
    if stored != computed:
        raise SwapChecksumError(
            f"section {name!r} (ending at byte {offset}) does not match its checksum: "
            f"stored {stored:#018x}, computed {computed:#018x}"
        )


# ---------------------------------------------------------------------------- device ranges


def _block_runs(block_ids: npt.NDArray[np.int32]) -> list[tuple[int, int]]:
    """(first block id, count) of each run of consecutive ids, in block-table order."""
    if block_ids.shape[0] == 0:
        return []
    ids = block_ids.astype(np.int64, copy=False)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.shape[0]]))
    return list(zip(ids[starts].tolist(), (ends - starts).tolist(), strict=True))


def _kv_ranges(kv: KVLayout, layer: int, block_bytes: int, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Device (address, nbytes) ranges holding ``runs`` of one layer, one per run of consecutive
    blocks when the pool lays them out back to back (it does; checked at both ends of the run)."""
    ranges: list[tuple[int, int]] = []
    addr_of = kv.block_addr
    for first, count in runs:
        addr = addr_of(layer, first)
        if count == 1 or addr_of(layer, first + count - 1) == addr + (count - 1) * block_bytes:
            ranges.append((addr, count * block_bytes))
        else:
            ranges.extend((addr_of(layer, b), block_bytes) for b in range(first, first + count))
    return ranges


class _Mover:
    """Moves device ranges to/from the stream, hashing every byte: straight from host-device memory,
    or through the double-buffered staging buffer."""

    def __init__(self, ctx: SwapContext) -> None:
        self.device = ctx.device
        self.direct = ctx.zero_copy_host and ctx.device.kind == "host"
        self._own_staging: StagingBuffer | None = None
        self.staging_ptr = 0
        self.halves: tuple[memoryview, memoryview] | None = None
        self.half_bytes = 0
        if not self.direct:
            staging = ctx.staging
            if staging is None:
                staging = self._own_staging = StagingBuffer(ctx.device)
            ptr, view = staging.acquire()
            self.half_bytes = staging.nbytes // 2
            self.staging_ptr = ptr
            whole = view.data
            self.halves = (whole[: self.half_bytes], whole[self.half_bytes : 2 * self.half_bytes])

    def close(self) -> None:
        if self._own_staging is not None:
            self._own_staging.release()

    def _device_view(self, addr: int, nbytes: int) -> memoryview:
        array: npt.NDArray[np.uint8] = self.device.device_array(addr, (nbytes,), np.uint8)
        return array.data

    def save(self, ranges: list[tuple[int, int]], hasher: xxhash.xxh3_64, out: _Out) -> None:
        if self.direct:
            for addr, nbytes in ranges:
                view = self._device_view(addr, nbytes)
                for start in range(0, nbytes, _HOST_PIECE):
                    piece = view[start : start + _HOST_PIECE]
                    out.write_bulk(piece)
                    hasher.update(piece)  # after the copy: the piece is still in cache
            return
        assert self.halves is not None
        device, half_bytes = self.device, self.half_bytes
        current, fill, ready = 0, 0, -1  # ready: the half whose copies completed, not yet written
        ready_fill = 0
        for addr, nbytes in ranges:
            while nbytes:
                take = min(nbytes, half_bytes - fill)
                device.copy_dtoh(self.staging_ptr + current * half_bytes + fill, addr, take)
                fill += take
                addr += take
                nbytes -= take
                if fill == half_bytes:
                    # Write the previous half while this one's copies run, then wait for them.
                    if ready >= 0:
                        self._emit(self.halves[ready][:ready_fill], hasher, out)
                    device.synchronize()
                    ready, ready_fill, current, fill = current, fill, current ^ 1, 0
        if ready >= 0:
            self._emit(self.halves[ready][:ready_fill], hasher, out)
        if fill:
            device.synchronize()
            self._emit(self.halves[current][:fill], hasher, out)

    @staticmethod
    def _emit(view: memoryview, hasher: xxhash.xxh3_64, out: _Out) -> None:
        out.write_bulk(view)
        hasher.update(view)  # after the copy: the view is still in cache

    def restore(self, ranges: list[tuple[int, int]], hasher: xxhash.xxh3_64, inp: _In) -> None:
        if self.direct:
            for addr, nbytes in ranges:
                view = self._device_view(addr, nbytes)
                for start in range(0, nbytes, _HOST_PIECE):
                    hasher.update(inp.readinto_bulk(view[start : start + _HOST_PIECE]))
            return
        assert self.halves is not None
        device, half_bytes = self.device, self.half_bytes
        current, fill = 0, 0
        pending: list[tuple[int, int, int]] = []  # (device address, offset in the half, nbytes)

        def flush() -> None:
            nonlocal current, fill, pending
            view = self.halves[current][:fill]  # type: ignore[index]
            # This half's last copies to the device finished at the previous flush's synchronize.
            inp.readinto(view)
            hasher.update(view)
            device.synchronize()  # the other half's copies, overlapped with the read above
            base = self.staging_ptr + current * half_bytes
            for dst, offset, nbytes in pending:
                device.copy_htod(dst, base + offset, nbytes)
            current, fill, pending = current ^ 1, 0, []

        for addr, nbytes in ranges:
            while nbytes:
                take = min(nbytes, half_bytes - fill)
                pending.append((addr, fill, take))
                fill += take
                addr += take
                nbytes -= take
                if fill == half_bytes:
                    flush()
        if fill:
            flush()
        device.synchronize()


# ---------------------------------------------------------------------------- save


def _adapter_of(ctx: SwapContext, seq: SequenceState) -> tuple[bytes, int]:
    """(UTF-8 name, generation) of the adapter the sequence holds; (b"", 0) for none."""
    slot = seq.adapter_slot
    if slot == NO_ADAPTER:
        return b"", 0
    if ctx.adapters is None:
        raise SwapError(
            f"sequence {seq.seq_id} holds adapter slot {slot} but the swap context has no adapter table "
            "to name it in the record"
        )
    info = ctx.adapters.info(slot)
    name = info.name.encode()
    if not name or len(name) > MAX_ADAPTER_NAME_BYTES:
        raise SwapError(f"adapter slot {slot}: name {info.name!r} must be 1..{MAX_ADAPTER_NAME_BYTES} UTF-8 bytes")
    return name, info.generation


def _slot_of(ctx: SwapContext, seq: SequenceState, what: str) -> int:
    if ctx.ssm is None:
        return -1
    if seq.slot_idx < 0:
        raise SequenceStateError(
            f"{what}: sequence {seq.seq_id} is detached (slot_idx={seq.slot_idx}); it has no SSM state"
        )
    return seq.slot_idx


def check_saveable(config: ConfigLike, seq: SequenceState) -> None:
    """Refuse, with ``SequenceStateError`` naming the field, its value and the limit, a sequence
    whose record ``restore`` would refuse: more blocks or tokens than the model's per-sequence
    limits, ``prompt_len`` or ``ssm_tokens`` not an int in ``[0, num_tokens]``, a negative token
    id. ``save`` applies it before writing a byte; a swap tier applies it before anything else,
    so a sequence is never freed for a record that could not come back."""
    _check_saveable(_Limits.of(config), seq, "save")


def _check_saveable(limits: _Limits, seq: SequenceState, what: str) -> None:
    tokens = seq.tokens
    problem = limits.problem(seq.num_blocks, int(tokens.shape[0]), seq.prompt_len, seq.ssm_tokens)
    if problem is None and tokens.shape[0] and int(tokens.min()) < 0:
        problem = f"it holds a negative token id {int(tokens.min())}; token ids must lie in [0, {MAX_RECORD_TOKENS}]"
    if problem is not None:
        raise SequenceStateError(f"{what}: sequence {seq.seq_id}: {problem}; its record could not be restored")


def save(ctx: SwapContext, seq: SequenceState, writer: BinaryIO) -> int:
    """Write the record of ``seq`` to ``writer``; returns the bytes written. Changes nothing in the
    pools or the sequence; extra memory is the staging buffer (none on the host device). A
    sequence whose record could not be restored (:func:`check_saveable`) is refused before a
    byte is written."""
    layout = ctx.layout()
    slot = _slot_of(ctx, seq, "save")
    _check_saveable(layout.limits, seq, "save")
    name, generation = _adapter_of(ctx, seq)
    block_ids = seq.block_table
    tokens = seq.tokens.astype(_TOKEN, copy=False)
    num_blocks, num_tokens = int(block_ids.shape[0]), int(tokens.shape[0])
    header = SwapHeader(
        major=FORMAT_MAJOR,
        minor=FORMAT_MINOR,
        fingerprint=layout.fingerprint,
        record_bytes=layout.record_bytes(num_blocks, len(name), num_tokens),
        block_size=layout.block_size,
        num_blocks=num_blocks,
        num_tokens=num_tokens,
        prompt_len=int(seq.prompt_len),
        num_attention_layers=len(layout.kv_layer_bytes),
        num_ssm_layers=layout.num_ssm_layers,
        kv_block_bytes=layout.kv_block_bytes,
        ssm_bytes=layout.ssm_bytes,
        adapter_name_bytes=len(name),
        adapter_generation=generation,
        meta_bytes=layout.meta_bytes(len(name), num_tokens),
        ssm_tokens=-1 if seq.ssm_tokens is None else int(seq.ssm_tokens),
        flags=FLAG_FAILED if seq.failed else 0,
        num_ssm_ranges=len(layout.ssm_range_bytes),
    )
    out = _Out(writer)
    mover = _Mover(ctx)
    try:
        ctx.device.synchronize()  # the engine's copies into the pools land before we read them
        out.write(header.pack())
        out.section = layout.section_name(_META_SECTION)
        table = np.array(layout.kv_layer_bytes + layout.ssm_range_bytes, dtype=_U64).tobytes()
        hasher = xxhash.xxh3_64(seed=_META_SECTION)
        for part in (memoryview(table), memoryview(name), tokens.data.cast("B")):
            hasher.update(part)
            out.write(part)
        out.write(_CHECKSUM.pack(hasher.intdigest()))
        section = _META_SECTION + 1
        runs = _block_runs(block_ids)
        for layer, block_bytes in enumerate(layout.kv_layer_bytes):
            out.section = layout.section_name(section)
            hasher = xxhash.xxh3_64(seed=section)
            mover.save(_kv_ranges(ctx.kv, layer, block_bytes, runs), hasher, out)  # type: ignore[arg-type]
            out.write(_CHECKSUM.pack(hasher.intdigest()))
            section += 1
        if ctx.ssm is not None:
            for addr, nbytes in ctx.ssm.slot_ranges(slot):
                out.section = layout.section_name(section)
                hasher = xxhash.xxh3_64(seed=section)
                mover.save([(addr, nbytes)], hasher, out)
                out.write(_CHECKSUM.pack(hasher.intdigest()))
                section += 1
    except BaseException:
        _quiet_synchronize(ctx.device)
        raise
    finally:
        mover.close()
    if out.offset != header.record_bytes:
        raise SwapError(
            f"wrote {out.offset} bytes but the header announced {header.record_bytes} (pool layout changed?)"
        )
    return out.offset


def _quiet_synchronize(device: Device) -> None:
    """Let in-flight copies finish before the caller frees or reuses their memory (best effort:
    the error being raised is the one the caller must see)."""
    try:
        device.synchronize()
    except Exception:  # noqa: S110 - a sticky device error is already being reported
        pass


# ---------------------------------------------------------------------------- restore


def read_header(reader: BinaryIO) -> SwapHeader:
    """Read and check the header at the reader's position (consumes ``HEADER_BYTES`` bytes)."""
    inp = _In(reader)
    return parse_header(inp.read(HEADER_BYTES).data)


def _check_header(header: SwapHeader, layout: _Layout, num_blocks: int) -> None:
    """Everything the header says that the model can contradict, before anything is touched."""
    if header.fingerprint != layout.fingerprint:
        raise SwapModelMismatch(
            f"record was written by a model with fingerprint {header.fingerprint:#018x}; this model's is "
            f"{layout.fingerprint:#018x}"
        )
    if header.num_blocks != num_blocks:
        raise SwapModelMismatch(
            f"record holds {header.num_blocks} blocks but restore was asked for num_blocks={num_blocks}"
        )
    expected = (
        layout.block_size,
        len(layout.kv_layer_bytes),
        layout.kv_block_bytes,
        len(layout.ssm_range_bytes),
        layout.ssm_bytes,
    )
    found = (
        header.block_size,
        header.num_attention_layers,
        header.kv_block_bytes,
        header.num_ssm_ranges,
        header.ssm_bytes,
    )
    if found != expected:
        raise SwapModelMismatch(
            "record layout (block_size, attention layers, kv bytes per block, ssm ranges, ssm bytes) = "
            f"{found}, this model's = {expected}"
        )
    # Before anything past the header is read: the meta section is sized by these counts.
    problem = layout.limits.problem(
        header.num_blocks, header.num_tokens, header.prompt_len, None if header.ssm_tokens == -1 else header.ssm_tokens
    )
    if problem is not None:
        raise SwapFormatError(f"record header: {problem}")
    if header.adapter_name_bytes > MAX_ADAPTER_NAME_BYTES:
        raise SwapFormatError(f"adapter name of {header.adapter_name_bytes} bytes exceeds {MAX_ADAPTER_NAME_BYTES}")
    meta = layout.meta_bytes(header.adapter_name_bytes, header.num_tokens)
    record = layout.record_bytes(header.num_blocks, header.adapter_name_bytes, header.num_tokens)
    if header.meta_bytes != meta or header.record_bytes != record:
        raise SwapFormatError(
            f"header sizes meta_bytes={header.meta_bytes}, record_bytes={header.record_bytes} disagree with its "
            f"own fields (expected {meta}, {record})"
        )


def _check_adapter(ctx: SwapContext, seq: SequenceState, name: bytes, generation: int) -> None:
    held = _adapter_of(ctx, seq)
    if held != (name, generation):

        def show(adapter: tuple[bytes, int]) -> str:
            return (
                f"adapter {adapter[0].decode(errors='replace')!r} generation {adapter[1]}"
                if adapter[0]
                else "no adapter"
            )

        raise SwapModelMismatch(
            f"record was saved with {show((name, generation))}; sequence {seq.seq_id} is bound to {show(held)}"
        )


def restore(
    ctx: SwapContext,
    seq: SequenceState,
    num_blocks: int,
    reader: BinaryIO,
    allocate: Callable[[], None] | None = None,
) -> int:
    """Stream a record into ``seq``; returns the bytes read. The header is read and checked against
    the model first; then ``allocate()`` (if given) gives the sequence its ``num_blocks`` fresh
    blocks, so a record refused by its header costs no allocation (nor any eviction). The layer
    table, adapter and tokens are checked before any memory is written; KV is written into the
    fresh blocks as it streams (the caller frees them on failure); the SSM state, tokens and prompt
    length are set only after every checksum verified. Reads exactly the record's bytes from
    ``reader``, never beyond."""
    layout = ctx.layout()
    slot = _slot_of(ctx, seq, "restore")
    inp = _In(reader)
    header = parse_header(inp.read(HEADER_BYTES).data)
    _check_header(header, layout, num_blocks)
    inp.record_bytes = header.record_bytes
    if allocate is not None:
        allocate()
    block_ids = seq.block_table
    if block_ids.shape[0] != num_blocks:
        raise SequenceStateError(
            f"restore: sequence {seq.seq_id} holds {block_ids.shape[0]} blocks, expected {num_blocks}"
        )

    inp.section = layout.section_name(_META_SECTION)
    meta = inp.read(header.meta_bytes)
    (stored,) = _CHECKSUM.unpack(inp.read(8).tobytes())
    _check_section(inp.section, stored, xxhash.xxh3_64_intdigest(meta.data, _META_SECTION), inp.offset)
    table_bytes = 8 * (len(layout.kv_layer_bytes) + len(layout.ssm_range_bytes))
    table = tuple(meta[:table_bytes].view(_U64).tolist())
    if table != layout.kv_layer_bytes + layout.ssm_range_bytes:
        raise SwapModelMismatch(
            f"record's per-section sizes {table} != this model's {layout.kv_layer_bytes + layout.ssm_range_bytes}"
        )
    name = meta[table_bytes : table_bytes + header.adapter_name_bytes].tobytes()
    _check_adapter(ctx, seq, name, header.adapter_generation)
    tokens = meta[table_bytes + header.adapter_name_bytes :].view(_TOKEN)
    if tokens.shape[0] and int(tokens.min()) < 0:
        raise SwapFormatError(f"record holds a negative token id {int(tokens.min())}")

    mover = _Mover(ctx)
    try:
        # Copies queued earlier (into blocks this sequence now owns) must not land after ours.
        ctx.device.synchronize()
        section = _META_SECTION + 1
        runs = _block_runs(block_ids)
        for layer, block_bytes in enumerate(layout.kv_layer_bytes):
            inp.section = layout.section_name(section)
            hasher = xxhash.xxh3_64(seed=section)
            mover.restore(_kv_ranges(ctx.kv, layer, block_bytes, runs), hasher, inp)  # type: ignore[arg-type]
            (stored,) = _CHECKSUM.unpack(inp.read(8).tobytes())
            _check_section(inp.section, stored, hasher.intdigest(), inp.offset)
            section += 1
        # SSM state is buffered on the host and verified before the slot is written.
        ssm_state = np.empty(layout.ssm_bytes, dtype=np.uint8)
        offset = 0
        for nbytes in layout.ssm_range_bytes:
            inp.section = layout.section_name(section)
            part = ssm_state[offset : offset + nbytes]
            inp.readinto(part.data)
            (stored,) = _CHECKSUM.unpack(inp.read(8).tobytes())
            _check_section(inp.section, stored, xxhash.xxh3_64_intdigest(part.data, section), inp.offset)
            offset += nbytes
            section += 1
        # Verified: commit the slot, then the sequence's fields (which cannot fail past this point).
        if ctx.ssm is not None and layout.ssm_bytes:
            src = ssm_state.ctypes.data
            for addr, nbytes in ctx.ssm.slot_ranges(slot):
                ctx.device.copy_htod(addr, src, nbytes)
                src += nbytes
        ctx.device.synchronize()
    except BaseException:
        _quiet_synchronize(ctx.device)
        raise
    finally:
        mover.close()
    seq.append_tokens(tokens)
    seq.prompt_len = header.prompt_len
    seq.ssm_tokens = None if header.ssm_tokens < 0 else header.ssm_tokens
    if header.flags & FLAG_FAILED:
        seq.mark_failed()
    return inp.offset
