"""SSM state snapshots for hybrid prefix caching: their device memory, their copies, and the rules
that say where a sequence's state is snapshotted.

For a hybrid model a cached KV prefix is only reusable together with the SSM state at the same
token, so the cache keeps copies of a slot's state (h and conv of every SSM layer) at cached prefix
ends. The KV cache core hands out the snapshot ids (one per trie node end, budgeted, least recently
used reused first, freed with their node) and cuts a lookup at the deepest node that has one; this
module owns the memory behind the ids and the copies in and out of slots.

Rules:

- A snapshot is taken where the SSM state has consumed exactly a whole number of blocks: at the end
  of a cached sequence when ``ssm_tokens`` (default: all its tokens) is that end, or at an explicit
  ``save_snapshot`` point.
- A lookup restores the snapshot at the end of the prefix it reuses into the new sequence's slot.
- A snapshot whose copy failed is dropped again, so no node ever points at state that was not
  written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, final

import numpy as np

from lifecycle.device.base import Copy, Device
from lifecycle.errors import ConfigError, InvalidId, SequenceStateError

if TYPE_CHECKING:
    from lifecycle._kvcache import KVCacheCore, SequenceState
    from lifecycle.pools import SSMPool


def snapshot_blocks_at_finish(num_tokens: int, num_blocks: int, ssm_tokens: int | None, block_size: int) -> int:
    """Where a finishing (or cached) sequence's SSM state can be snapshotted: its number of full
    blocks when the state consumed exactly that many tokens, else 0 (no snapshot)."""
    full = min(num_tokens // block_size, num_blocks)
    consumed = num_tokens if ssm_tokens is None else ssm_tokens
    return full if full > 0 and consumed == full * block_size else 0


def snapshot_point(seq: SequenceState, num_tokens: object, block_size: int) -> int:
    """The blocks of an explicit snapshot point: ``num_tokens`` must be a positive multiple of the
    block size within the sequence's tokens and blocks, on a sequence that holds its slot."""
    total = seq.num_tokens
    if type(num_tokens) is not int or num_tokens <= 0 or num_tokens % block_size or num_tokens > total:
        raise InvalidId(
            f"save_snapshot: num_tokens={num_tokens!r} must be a positive multiple of the block size "
            f"{block_size}, at most the sequence's {total} tokens"
        )
    blocks = num_tokens // block_size
    if blocks > seq.num_blocks or seq.is_detached:
        raise SequenceStateError(
            f"save_snapshot: sequence {seq.seq_id} has {seq.num_blocks} blocks "
            f"({'detached' if seq.is_detached else 'attached'}); {blocks} needed"
        )
    return blocks


@final
class SnapshotPool:
    """``capacity`` snapshots of one SSM slot each, in one device allocation; ids from the core."""

    def __init__(self, device: Device, ssm: SSMPool, capacity: int) -> None:
        if capacity <= 0:
            raise ConfigError(f"num_snapshots={capacity} must be > 0 to build a snapshot pool")
        self._device = device
        self._ssm = ssm
        self._capacity = capacity
        sizes = [nbytes for _, nbytes in ssm.slot_ranges(0)]
        self._offsets: list[int] = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64).tolist()
        self.snapshot_bytes = int(sum(sizes))
        self._base = device.alloc(self.snapshot_bytes * capacity)
        self._released = False

    @property
    def capacity(self) -> int:
        return self._capacity

    def _copies(self, snapshot_id: int, slot: int, to_snapshot: bool) -> list[Copy]:
        base = self._base + snapshot_id * self.snapshot_bytes
        copies: list[Copy] = []
        for (slot_addr, nbytes), offset in zip(self._ssm.slot_ranges(slot), self._offsets):
            snap_addr = base + offset
            copies.append((snap_addr, slot_addr, nbytes) if to_snapshot else (slot_addr, snap_addr, nbytes))
        return copies

    def save(self, core: KVCacheCore, snapshot_id: int, slot: int) -> None:
        """Copy ``slot``'s state into snapshot ``snapshot_id`` (fresh from the core) and wait for
        the copy (the engine writes the slot again at its next step). If the copy fails the id
        goes back to the core, its node keeping only its KV."""
        try:
            self._device.copy_batch(self._copies(snapshot_id, slot, to_snapshot=True))
            self._device.synchronize()
        except BaseException:
            core.drop_snapshot(snapshot_id)
            raise

    def restore_into(self, snapshot_id: int, slot: int) -> None:
        """Copy a snapshot into ``slot`` and wait for it, so the snapshot's memory may be reused
        as soon as this returns."""
        self._device.copy_batch(self._copies(snapshot_id, slot, to_snapshot=False))
        self._device.synchronize()

    def release(self) -> None:
        """Free the device memory, exactly once."""
        if not self._released:
            self._released = True
            self._device.free(self._base)

    # -- the rules, applied to a sequence of the core --

    def snapshot(self, core: KVCacheCore, seq: SequenceState, blocks: int, *, rolling: bool = False) -> bool:
        """Cache the sequence's first ``blocks`` blocks with an SSM snapshot at their end: the
        core names the snapshot (a fresh id, or the one already there), a fresh one gets the slot's
        state. False when the core keeps none (snapshots off, a failed sequence)."""
        snapshot_id, fresh = core.snapshot_point(seq.handle, blocks, rolling)
        if fresh:
            self.save(core, snapshot_id, seq.slot_idx)
        return snapshot_id >= 0

    def restore_prefix(self, core: KVCacheCore, seq: SequenceState) -> None:
        """Copy the snapshot at the end of the sequence's attached prefix into its slot; if the
        copy fails, the attach is undone (the sequence is as before it)."""
        snapshot_id = core.prefix_snapshot(seq.handle)
        if snapshot_id >= 0:
            try:
                self.restore_into(snapshot_id, seq.slot_idx)
            except BaseException:
                core.clear(seq.handle)
                raise


def cache_sequence(core: KVCacheCore, snapshots: SnapshotPool | None, seq: SequenceState, block_size: int) -> None:
    """The sequence's full blocks into the prefix cache (pinned while it lives), with an SSM
    snapshot at their end when the state consumed exactly those tokens. A failed sequence is
    never cached."""
    _, _, num_tokens, _, num_blocks, _, ssm_tokens, failed, _ = core.info(seq.handle)
    if failed:
        return
    if snapshots is not None and not seq.is_detached:
        blocks = snapshot_blocks_at_finish(num_tokens, num_blocks, None if ssm_tokens < 0 else ssm_tokens, block_size)
        if blocks:
            snapshots.snapshot(core, seq, blocks)
            return
    core.cache(seq.handle, min(num_tokens // block_size, num_blocks))
