"""Restore: a record streamed back into a sequence, all or nothing for the sequence's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import xxhash

from lifecycle.errors import SequenceStateError, SwapFormatError, SwapModelMismatch
from lifecycle.swap.format import (
    _CHECKSUM,
    _META_SECTION,
    _TOKEN,
    _U64,
    FLAG_FAILED,
    HEADER_BYTES,
    MAX_ADAPTER_NAME_BYTES,
    SwapHeader,
    _check_section,
    _Layout,
    parse_header,
)
from lifecycle.swap.saving import _adapter_of, _slot_of
from lifecycle.swap.staging import _block_runs, _kv_ranges, _Mover, _quiet_synchronize
from lifecycle.swap.streams import _In

if TYPE_CHECKING:
    from lifecycle.sequence import SequenceState
    from lifecycle.swap.context import SwapContext

__all__ = ["read_header", "restore"]


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
