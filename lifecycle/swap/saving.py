"""Save: a sequence's record written to a stream, refused before the first byte when it could not
be restored."""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import xxhash

from lifecycle.errors import SequenceStateError, SwapError
from lifecycle.sequence import NO_ADAPTER
from lifecycle.swap.format import (
    _CHECKSUM,
    _META_SECTION,
    _TOKEN,
    _U64,
    FLAG_FAILED,
    FORMAT_MINOR,
    MAX_ADAPTER_NAME_BYTES,
    MAX_RECORD_TOKENS,
    ConfigLike,
    SwapHeader,
    _Layout,
    _Limits,
    _U32,
)
from lifecycle.swap.staging import _block_runs, _Held, _kv_pools, _kv_ranges, _Mover, _quiet_synchronize
from lifecycle.swap.streams import _Out

if TYPE_CHECKING:
    from lifecycle.sequence import SequenceState
    from lifecycle.swap.context import SwapContext

__all__ = ["check_saveable", "save"]


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


def _held_blocks(ctx: SwapContext, seq: SequenceState, layout: _Layout) -> list[_Held]:
    """Per KV cache group of the layout, group 0 first: the block ids the sequence holds and (past
    group 0) their positions in its table; a 1.x layout: group 0's table alone."""
    if not layout.group_layer_bytes:
        return []
    held = [_Held(seq.block_table, None)]
    if layout.grouped:
        if ctx.core is None:
            raise SwapError("a swap context of KV cache groups needs the core that holds their tables")
        for group in range(1, len(layout.group_layer_bytes)):
            column = ctx.core.block_table(seq.handle, group)
            positions = np.flatnonzero(column >= 0).astype(_U32)
            held.append(_Held(column[positions], positions))
    return held


def save(ctx: SwapContext, seq: SequenceState, writer: BinaryIO) -> int:
    """Write the record of ``seq`` to ``writer``; returns the bytes written. Changes nothing in the
    pools or the sequence; extra memory is the staging buffer (none on the host device). A
    sequence whose record could not be restored (:func:`check_saveable`) is refused before a
    byte is written."""
    layout = ctx.layout()
    slot = _slot_of(ctx, seq, "save")
    _check_saveable(layout.limits, seq, "save")
    name, generation = _adapter_of(ctx, seq)
    groups = _held_blocks(ctx, seq, layout)
    counts = [int(group.ids.shape[0]) for group in groups]
    tokens = seq.tokens.astype(_TOKEN, copy=False)
    num_blocks, num_tokens = int(seq.num_blocks), int(tokens.shape[0])
    header = SwapHeader(
        major=layout.major,
        minor=FORMAT_MINOR,
        fingerprint=layout.fingerprint,
        record_bytes=layout.record_bytes(num_blocks, len(name), num_tokens, counts or None),
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
        meta_bytes=layout.meta_bytes(len(name), num_tokens, counts),
        ssm_tokens=-1 if seq.ssm_tokens is None else int(seq.ssm_tokens),
        flags=FLAG_FAILED if seq.failed else 0,
        num_ssm_ranges=len(layout.ssm_range_bytes),
        num_groups=len(layout.group_layer_bytes) if layout.grouped else 0,
        kv_tokens=ctx.core.kv_tokens(seq.handle) if layout.grouped and ctx.core is not None else 0,
    )
    out = _Out(writer)
    mover = _Mover(ctx)
    try:
        ctx.device.synchronize()  # the engine's copies into the pools land before we read them
        out.write(header.pack())
        out.section = layout.section_name(_META_SECTION)
        table = np.array(layout.kv_layer_bytes + layout.ssm_range_bytes, dtype=_U64).tobytes()
        parts = [memoryview(table)]
        if layout.grouped:
            group_table = [(len(layers), count) for layers, count in zip(layout.group_layer_bytes, counts, strict=True)]
            parts.append(memoryview(np.array(group_table, dtype=_U32).tobytes()))
        parts += [memoryview(name), tokens.data.cast("B")]
        parts += [memoryview(group.positions.tobytes()) for group in groups if group.positions is not None]
        hasher = xxhash.xxh3_64(seed=_META_SECTION)
        for part in parts:
            hasher.update(part)
            out.write(part)
        out.write(_CHECKSUM.pack(hasher.intdigest()))
        section = _META_SECTION + 1
        for pool, group, layers in zip(_kv_pools(ctx, layout), groups, layout.group_layer_bytes, strict=True):
            runs = _block_runs(group.ids)
            for layer, block_bytes in enumerate(layers):
                out.section = layout.section_name(section)
                hasher = xxhash.xxh3_64(seed=section)
                mover.save(_kv_ranges(pool, layer, block_bytes, runs), hasher, out)
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
