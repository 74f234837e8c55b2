"""The record's layout: its constants, the fixed header, the per-section sizes of a model, and the
bounds a record of that model may not exceed (``docs/swap-format.md`` has the byte layout)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

import numpy as np
import xxhash

from lifecycle.errors import SwapChecksumError, SwapError, SwapFormatError

if TYPE_CHECKING:
    from lifecycle.swap.context import SwapContext

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_RECORD_TOKENS",
    "ConfigLike",
    "SwapHeader",
    "parse_header",
    "record_nbytes",
]

MAGIC: Final = b"\x89LCSWAP\n"  # high bit and newline catch 7-bit and text-mode mangling
FORMAT_MAJOR: Final = 1
FORMAT_MINOR: Final = 0
HEADER_BYTES: Final = 128
MAX_ADAPTER_NAME_BYTES: Final = 4096
#: Token ids are int32 in a record and in a sequence's buffer: no record holds more tokens than this.
MAX_RECORD_TOKENS: Final = 0x7FFFFFFF

FLAG_FAILED: Final = 1  # the sequence was marked failed: its KV must never be cached

# Everything but the trailing header checksum; see docs/swap-format.md for the field table.
_HEADER = struct.Struct("<8sHHIQQIIQQIIQQIIQqII8x")
_CHECKSUM = struct.Struct("<Q")
_U64 = np.dtype("<u8")
_TOKEN = np.dtype("<i4")
assert _HEADER.size + _CHECKSUM.size == HEADER_BYTES
_META_SECTION: Final = 1


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


def _check_section(name: str, stored: int, computed: int, offset: int) -> None:
    if stored != computed:
        raise SwapChecksumError(
            f"section {name!r} (ending at byte {offset}) does not match its checksum: "
            f"stored {stored:#018x}, computed {computed:#018x}"
        )
