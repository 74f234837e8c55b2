"""A model's sequence saved to and restored from a swap record: :func:`save` and :func:`restore`
around the model's accounting (its swap counters and device time) and, for a restore, the blocks
taken from the core first and given back on any failure. ``HybridModel.save_sequence_state`` and
``restore_sequence_state`` call these under the model's lock."""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import numpy.typing as npt

from lifecycle.errors import SequenceStateError
from lifecycle.swap.context import SwapContext
from lifecycle.swap.restoring import restore
from lifecycle.swap.saving import save

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState
    from lifecycle.stats import DeviceClock, ModelCounters

__all__ = ["restore_sequence", "save_sequence"]


def save_sequence(
    ctx: SwapContext, seq: SequenceState, writer: BinaryIO, counters: ModelCounters, clock: DeviceClock
) -> None:
    """Write the open sequence ``seq`` to ``writer``, counted in ``counters``."""
    if not seq.is_open:
        raise SequenceStateError(f"save_sequence_state: sequence {seq.seq_id} was freed")
    try:
        with clock:
            written = save(ctx, seq, writer)
    except BaseException:
        counters.swap_failures += 1
        raise
    counters.swaps_out += 1
    counters.bytes_swapped_out += written


def restore_sequence(
    ctx: SwapContext, core: KVCacheCore, seq: SequenceState, num_blocks: int, reader: BinaryIO,
    counters: ModelCounters, clock: DeviceClock,
) -> None:
    """Take ``num_blocks`` free blocks for the fresh sequence ``seq`` (all or nothing, never
    evicting), then stream the record from ``reader`` into them and its slot; on any failure the
    blocks go back and the sequence is as it was. A model of KV cache groups takes every group's
    blocks in one core call once the record's meta section said where each group holds them."""
    handle = core.handle_of(seq)
    call = "restore_sequence_state"

    def allocate_groups(positions: list[npt.NDArray[np.uint32]], kv_tokens: int) -> None:
        if positions:
            core.allocate(handle, num_blocks, call, positions, kv_tokens)
        else:  # one group (of MLA or indexer layers): no window
            core.allocate(handle, num_blocks, call)

    if not ctx.grouped:
        core.allocate(handle, num_blocks, call)
    try:
        with clock:
            read = restore(ctx, seq, num_blocks, reader, allocate_groups=allocate_groups if ctx.grouped else None)
    except BaseException:
        core.clear(handle)
        counters.swap_failures += 1
        raise
    counters.swaps_in += 1
    counters.bytes_swapped_in += read
