"""The record's layout: its constants, the fixed header, the per-section sizes of a model, and the
bounds a record of that model may not exceed (``docs/swap-format.md`` has the byte layout)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, cast

import numpy as np
import xxhash

from lifecycle.errors import SwapChecksumError, SwapError, SwapFormatError

if TYPE_CHECKING:
    from lifecycle.swap.context import SwapContext

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "GROUPED_MAJOR",
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
#: The major version of a model whose KV layers are not one group of attention layers (several
#: KV cache groups, MLA or indexer layers): every group's held blocks, and where each group has them.
GROUPED_MAJOR: Final = 2
HEADER_BYTES: Final = 128
MAX_ADAPTER_NAME_BYTES: Final = 4096
#: Token ids are int32 in a record and in a sequence's buffer: no record holds more tokens than this.
MAX_RECORD_TOKENS: Final = 0x7FFFFFFF

FLAG_FAILED: Final = 1  # the sequence was marked failed: its KV must never be cached

# Everything but the trailing header checksum; see docs/swap-format.md for the field table.
_HEADER = struct.Struct("<8sHHIQQIIQQIIQQIIQqII8x")
_CHECKSUM = struct.Struct("<Q")
# (2.x) num_groups and kv_tokens, in what 1.x reserves (bytes 112..120)
_GROUP_FIELDS = struct.Struct("<II")
_GROUP_FIELDS_AT: Final = 112
_U64 = np.dtype("<u8")
_U32 = np.dtype("<u4")
_TOKEN = np.dtype("<i4")
assert _HEADER.size + _CHECKSUM.size == HEADER_BYTES
_META_SECTION: Final = 1


class _SSMLayerSpec(Protocol):
    @property
    def h_state_bytes(self) -> int: ...
    @property
    def conv_state_bytes(self) -> int: ...


class _KVLayerSpec(Protocol):
    def block_bytes(self, block_size: int) -> int: ...


class _GroupSpec(Protocol):
    @property
    def layer_indices(self) -> tuple[int, ...]: ...
    @property
    def block_bytes(self) -> int: ...


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
    @property
    def layers(self) -> Sequence[object]: ...
    @property
    def kv_groups(self) -> Sequence[_GroupSpec]: ...
    @property
    def is_single_attention_group(self) -> bool: ...
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
    """Per-section sizes of the model, derived once per context. ``group_layer_bytes``: per KV
    cache group, the bytes of one block of each of its layers (a 1.x layout: one group, the
    attention layers); ``major``: the format version a record of this layout has."""

    fingerprint: int
    block_size: int
    group_layer_bytes: tuple[tuple[int, ...], ...]
    ssm_range_bytes: tuple[int, ...]  # bytes of each per-slot SSM range
    num_ssm_layers: int
    limits: _Limits
    major: int = FORMAT_MAJOR

    @staticmethod
    def of(ctx: SwapContext) -> _Layout:
        config = ctx.config
        if ctx.grouped:
            groups = tuple(
                tuple(pool.layer_block_bytes(i) for i in range(pool.num_layers)) for pool in ctx.kv_groups
            )
            return _Layout.with_groups(config, groups, _ssm_ranges(config))
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
            (kv_bytes,) if kv_bytes else (),
            ssm_bytes,
            len(config.ssm_layers),
            _Limits.of(config),
        )

    @staticmethod
    def with_groups(
        config: ConfigLike, groups: tuple[tuple[int, ...], ...], ssm_ranges: tuple[int, ...]
    ) -> _Layout:
        """A 2.x layout: these groups' layers, these SSM ranges."""
        return _Layout(
            config.fingerprint() & 0xFFFFFFFFFFFFFFFF,
            config.block_size,
            groups,
            ssm_ranges,
            len(config.ssm_layers),
            _Limits.of(config),
            GROUPED_MAJOR,
        )

    @property
    def grouped(self) -> bool:
        return self.major == GROUPED_MAJOR

    @property
    def kv_layer_bytes(self) -> tuple[int, ...]:
        """One block of each KV layer, group by group."""
        return tuple(n for group in self.group_layer_bytes for n in group)

    @property
    def kv_block_bytes(self) -> int:
        """One block position over every group's layers."""
        return sum(self.kv_layer_bytes)

    @property
    def ssm_bytes(self) -> int:
        return sum(self.ssm_range_bytes)

    def meta_bytes(self, adapter_name_bytes: int, num_tokens: int, held: Sequence[int] = ()) -> int:
        """``held``: (2.x) the blocks each group holds, group 0 first."""
        table = 8 * (len(self.kv_layer_bytes) + len(self.ssm_range_bytes))
        groups = 8 * len(self.group_layer_bytes) + 4 * sum(held[1:]) if self.grouped else 0
        return table + groups + adapter_name_bytes + 4 * num_tokens

    def record_bytes(
        self, num_blocks: int, adapter_name_bytes: int, num_tokens: int, held: Sequence[int] | None = None
    ) -> int:
        """``held``: (2.x) the blocks each group holds, group 0's ``num_blocks`` first (None: every
        group holds ``num_blocks``)."""
        counts = [num_blocks] * len(self.group_layer_bytes) if held is None else list(held)
        sections = 1 + len(self.kv_layer_bytes) + len(self.ssm_range_bytes)
        kv = sum(count * sum(group) for count, group in zip(counts, self.group_layer_bytes, strict=True))
        payload = self.meta_bytes(adapter_name_bytes, num_tokens, counts) + kv + self.ssm_bytes
        return HEADER_BYTES + payload + 8 * sections

    def section_name(self, index: int) -> str:
        if index == _META_SECTION:
            return "meta"
        index -= 2
        if index < len(self.kv_layer_bytes):
            if not self.grouped:
                return f"kv attention-layer {index}"
            for group, layers in enumerate(self.group_layer_bytes):
                if index < len(layers):
                    return f"kv group {group} layer {index}"
                index -= len(layers)
        index -= len(self.kv_layer_bytes)
        if len(self.ssm_range_bytes) == 2 * self.num_ssm_layers:
            return f"ssm layer {index // 2} {'h' if index % 2 == 0 else 'conv'}-state"
        return f"ssm range {index}"


def _ssm_ranges(config: ConfigLike) -> tuple[int, ...]:
    """Bytes of each per-slot SSM range, in ``SSMPool.slot_ranges`` order (h, conv per layer)."""
    return tuple(n for layer in config.ssm_layers for n in (layer.h_state_bytes, layer.conv_state_bytes))


def record_nbytes(
    config: ConfigLike, num_blocks: int, num_tokens: int, adapter_name: str | None = None,
    held: Sequence[int] | None = None,
) -> int:
    """Size in bytes of the record ``save`` writes for a sequence of ``num_blocks`` blocks and
    ``num_tokens`` tokens (a swap tier sizes its host memory with it before saving). ``held``:
    for a model of several KV cache groups, the blocks each group past 0 holds (None: every
    group holds ``num_blocks``)."""
    if not config.is_single_attention_group:
        layers = config.layers
        groups = tuple(
            tuple(cast("_KVLayerSpec", layers[i]).block_bytes(config.block_size) for i in group.layer_indices)
            for group in config.kv_groups
        )
        layout = _Layout.with_groups(config, groups, _ssm_ranges(config))
        name_bytes = len(adapter_name.encode()) if adapter_name else 0
        counts = None if held is None else [num_blocks, *held]
        return layout.record_bytes(num_blocks, name_bytes, num_tokens, counts)
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
    num_groups: int = 0  # (2.x) KV cache groups; 1.x: 0 (its reserved bytes)
    kv_tokens: int = 0  # (2.x) tokens up to which the windowed groups released their blocks

    def pack(self) -> bytes:
        body = bytearray(_HEADER.pack(
            MAGIC, self.major, self.minor, HEADER_BYTES, self.fingerprint, self.record_bytes,
            self.block_size, self.num_blocks, self.num_tokens, self.prompt_len,
            self.num_attention_layers, self.num_ssm_layers, self.kv_block_bytes, self.ssm_bytes,
            self.adapter_name_bytes, self.adapter_generation, self.meta_bytes, self.ssm_tokens,
            self.flags, self.num_ssm_ranges,
        ))  # fmt: skip
        if self.major == GROUPED_MAJOR:
            _GROUP_FIELDS.pack_into(body, _GROUP_FIELDS_AT, self.num_groups, self.kv_tokens)
        return bytes(body) + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body, 0))


def parse_header(data: bytes | bytearray | memoryview) -> SwapHeader:
    """Decode and check a record's first ``HEADER_BYTES`` bytes: magic, then the major version
    (1 or 2: a reader refuses any other), then the header checksum. A 1.x record's reserved bytes
    are ignored (``num_groups`` and ``kv_tokens`` 0)."""
    buf = bytes(data)
    if len(buf) < HEADER_BYTES:
        raise SwapFormatError(f"record truncated: header needs {HEADER_BYTES} bytes, got {len(buf)}")
    if buf[:8] != MAGIC:
        raise SwapFormatError(f"not a lifecycle swap record: magic {buf[:8]!r} != {MAGIC!r}")
    fields = _HEADER.unpack_from(buf)
    major, minor, header_bytes = fields[1], fields[2], fields[3]
    if major not in (FORMAT_MAJOR, GROUPED_MAJOR):
        raise SwapFormatError(
            f"swap record format version {major}.{minor} is not supported: this reader reads major version "
            f"{FORMAT_MAJOR} (any {FORMAT_MAJOR}.x: one group of attention layers) and {GROUPED_MAJOR} (any "
            f"{GROUPED_MAJOR}.x: KV cache groups)"
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
    groups = _GROUP_FIELDS.unpack_from(buf, _GROUP_FIELDS_AT) if major == GROUPED_MAJOR else (0, 0)
    return SwapHeader(major, minor, *fields[4:], *groups)


def _check_section(name: str, stored: int, computed: int, offset: int) -> None:
    if stored != computed:
        raise SwapChecksumError(
            f"section {name!r} (ending at byte {offset}) does not match its checksum: "
            f"stored {stored:#018x}, computed {computed:#018x}"
        )
