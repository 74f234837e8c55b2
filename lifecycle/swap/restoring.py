"""Restore: a record streamed back into a sequence, all or nothing for the sequence's state."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

from lifecycle.errors import SequenceStateError, SwapError, SwapFormatError, SwapModelMismatch
from lifecycle.swap.format import (
    _CHECKSUM,
    _META_SECTION,
    _TOKEN,
    _U32,
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
from lifecycle.swap.staging import _block_runs, _Held, _kv_pools, _kv_ranges, _Mover, _quiet_synchronize
from lifecycle.swap.streams import _In

if TYPE_CHECKING:
    from lifecycle.sequence import SequenceState
    from lifecycle.swap.context import SwapContext

__all__ = ["AllocateGroups", "read_header", "restore"]

#: (2.x) gives a fresh sequence every group's blocks: (positions per group past 0, kv_tokens).
AllocateGroups: TypeAlias = Callable[[list["npt.NDArray[np.uint32]"], int], None]


def read_header(reader: BinaryIO) -> SwapHeader:
    """Read and check the header at the reader's position (consumes ``HEADER_BYTES`` bytes)."""
    inp = _In(reader)
    return parse_header(inp.read(HEADER_BYTES).data)


def _check_header(header: SwapHeader, layout: _Layout, num_blocks: int) -> None:
    """Everything the header says that the model can contradict, before anything is touched."""
    if header.major != layout.major:
        what = "of KV cache groups" if layout.grouped else "of one group of attention layers"
        raise SwapFormatError(
            f"swap record format version {header.major}.{header.minor} is not supported by this model: a model "
            f"{what} reads major version {layout.major}"
        )
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
        len(layout.group_layer_bytes) if layout.grouped else 0,
    )
    found = (
        header.block_size,
        header.num_attention_layers,
        header.kv_block_bytes,
        header.num_ssm_ranges,
        header.ssm_bytes,
        header.num_groups,
    )
    if found != expected:
        raise SwapModelMismatch(
            "record layout (block_size, KV layers, kv bytes per block, ssm ranges, ssm bytes, KV cache groups) = "
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
    if layout.grouped:
        _check_grouped_sizes(header, layout)
        return
    meta = layout.meta_bytes(header.adapter_name_bytes, header.num_tokens)
    record = layout.record_bytes(header.num_blocks, header.adapter_name_bytes, header.num_tokens)
    if header.meta_bytes != meta or header.record_bytes != record:
        raise SwapFormatError(
            f"header sizes meta_bytes={header.meta_bytes}, record_bytes={header.record_bytes} disagree with its "
            f"own fields (expected {meta}, {record})"
        )


def _check_grouped_sizes(header: SwapHeader, layout: _Layout) -> None:
    """(2.x) The sizes a header can be checked for before its meta section says what each group
    holds: ``kv_tokens`` within the tokens, and the meta and record sizes within those of a
    record whose groups hold no block past group 0's and one whose groups hold every block."""
    if header.kv_tokens > header.num_tokens:
        raise SwapFormatError(f"record header: kv_tokens={header.kv_tokens} exceeds num_tokens={header.num_tokens}")
    groups = len(layout.group_layer_bytes)
    least = [header.num_blocks] + [0] * (groups - 1)
    most = [header.num_blocks] * groups
    name, tokens = header.adapter_name_bytes, header.num_tokens
    low, high = layout.meta_bytes(name, tokens, least), layout.meta_bytes(name, tokens, most)
    if not low <= header.meta_bytes <= high or (header.meta_bytes - low) % 4:
        raise SwapFormatError(
            f"header meta_bytes={header.meta_bytes} disagrees with its own fields (a multiple of 4 past {low}, at "
            f"most {high})"
        )
    record = layout.record_bytes(header.num_blocks, name, tokens, most)
    if header.record_bytes > record:
        raise SwapFormatError(f"header record_bytes={header.record_bytes} exceeds {record}, its fields' largest")


def _group_positions(
    header: SwapHeader, layout: _Layout, meta: npt.NDArray[np.uint8], at: int
) -> tuple[list[int], list[npt.NDArray[np.uint32]], int]:
    """(2.x) From the meta section at byte ``at``: the group table (each group's layers, checked
    against the model's, and blocks held) and where the groups past 0 hold their blocks (checked
    ascending and within the table). Returns (held per group, positions per group past 0, the
    offset of the adapter name)."""
    groups = len(layout.group_layer_bytes)
    table = meta[at : at + 8 * groups].view(_U32).reshape(groups, 2)
    layers = tuple(table[:, 0].tolist())
    if layers != tuple(len(group) for group in layout.group_layer_bytes):
        raise SwapModelMismatch(
            f"record's layers per KV cache group {layers} != this model's "
            f"{tuple(len(group) for group in layout.group_layer_bytes)}"
        )
    held = [int(count) for count in table[:, 1]]
    if held[0] != header.num_blocks or max(held) > header.num_blocks:
        raise SwapFormatError(
            f"record's blocks per KV cache group {held}: group 0 holds num_blocks={header.num_blocks}, the others "
            "at most as many"
        )
    name_at = at + 8 * groups
    meta_bytes = layout.meta_bytes(header.adapter_name_bytes, header.num_tokens, held)
    record_bytes = layout.record_bytes(header.num_blocks, header.adapter_name_bytes, header.num_tokens, held)
    if (header.meta_bytes, header.record_bytes) != (meta_bytes, record_bytes):
        raise SwapFormatError(
            f"header sizes meta_bytes={header.meta_bytes}, record_bytes={header.record_bytes} disagree with the "
            f"blocks its groups hold {held} (expected {meta_bytes}, {record_bytes})"
        )
    offset = name_at + header.adapter_name_bytes + 4 * header.num_tokens
    positions = []
    for group, count in enumerate(held[1:], start=1):
        column = meta[offset : offset + 4 * count].view(_U32)
        offset += 4 * count
        ascending = count < 2 or bool((np.diff(column.astype(np.int64)) > 0).all())
        if count and (int(column[-1]) >= header.num_blocks or not ascending):
            raise SwapFormatError(
                f"record's positions of KV cache group {group} must ascend within the table of "
                f"{header.num_blocks} blocks"
            )
        positions.append(column)
    return held, positions, name_at


def _fresh_blocks(
    ctx: SwapContext, seq: SequenceState, layout: _Layout, positions: list[npt.NDArray[np.uint32]], kv_tokens: int,
    allocate_groups: AllocateGroups | None,
) -> list[_Held]:
    """The blocks the record's KV streams into, per group of the layout: the sequence's table (1.x,
    allocated before), or (2.x) every group's blocks ``allocate_groups`` gives it now."""
    if not layout.group_layer_bytes:
        return []
    if not layout.grouped:
        return [_Held(seq.block_table, None)]
    if allocate_groups is None or ctx.core is None:
        raise SwapError("a record of KV cache groups is restored with allocate_groups and the core's tables")
    allocate_groups(positions, kv_tokens)
    held = [_Held(seq.block_table, None)]
    for group, where in enumerate(positions, start=1):
        held.append(_Held(ctx.core.block_table(seq.handle, group)[where], where))
    return held


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
    allocate_groups: AllocateGroups | None = None,
) -> int:
    """Stream a record into ``seq``; returns the bytes read. The header is read and checked against
    the model first; then ``allocate()`` (if given) gives the sequence its ``num_blocks`` fresh
    blocks, so a record refused by its header costs no allocation (nor any eviction). The layer
    table, adapter and tokens are checked before any memory is written; KV is written into the
    fresh blocks as it streams (the caller frees them on failure); the SSM state, tokens and prompt
    length are set only after every checksum verified. Reads exactly the record's bytes from
    ``reader``, never beyond.

    A 2.x record (a model of KV cache groups) says where each group holds blocks in its meta
    section: once that verified, ``allocate_groups(positions, kv_tokens)`` gives the sequence
    every group's blocks (``positions``: per group past 0, where it holds one) and its window
    state."""
    layout = ctx.layout()
    slot = _slot_of(ctx, seq, "restore")
    inp = _In(reader)
    header = parse_header(inp.read(HEADER_BYTES).data)
    _check_header(header, layout, num_blocks)
    inp.record_bytes = header.record_bytes
    if allocate is not None:
        allocate()
    if not layout.grouped and seq.block_table.shape[0] != num_blocks:
        raise SequenceStateError(
            f"restore: sequence {seq.seq_id} holds {seq.block_table.shape[0]} blocks, expected {num_blocks}"
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
    name_at, positions = table_bytes, list[npt.NDArray[np.uint32]]()
    if layout.grouped:
        _, positions, name_at = _group_positions(header, layout, meta, table_bytes)
    name = meta[name_at : name_at + header.adapter_name_bytes].tobytes()
    _check_adapter(ctx, seq, name, header.adapter_generation)
    tokens_at = name_at + header.adapter_name_bytes
    tokens = meta[tokens_at : tokens_at + 4 * header.num_tokens].view(_TOKEN)
    if tokens.shape[0] and int(tokens.min()) < 0:
        raise SwapFormatError(f"record holds a negative token id {int(tokens.min())}")
    groups = _fresh_blocks(ctx, seq, layout, positions, header.kv_tokens, allocate_groups)

    mover = _Mover(ctx)
    try:
        # Copies queued earlier (into blocks this sequence now owns) must not land after ours.
        ctx.device.synchronize()
        section = _META_SECTION + 1
        for pool, group, layers in zip(_kv_pools(ctx, layout), groups, layout.group_layer_bytes, strict=True):
            runs = _block_runs(group.ids)
            for layer, block_bytes in enumerate(layers):
                inp.section = layout.section_name(section)
                hasher = xxhash.xxh3_64(seed=section)
                mover.restore(_kv_ranges(pool, layer, block_bytes, runs), hasher, inp)
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
