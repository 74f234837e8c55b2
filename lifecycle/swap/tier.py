"""A swap tier for preemption: a scheduler swaps a sequence out to host memory (or to a spill file
when the host budget is spent) and later swaps it back in.

``swap_out`` writes the sequence's record (:mod:`lifecycle.swap`) into a bounded host pool, or into
a file in ``spill_dir`` when the pool cannot take it, then frees the sequence. ``swap_in`` allocates
a new sequence (bound to the same adapter), restores the record into it and releases the record.

Failure rules (SPEC §8 scenario 15):

- ``swap_out`` refused for lack of room (no host room and no spill directory, or host memory that
  cannot be had) raises :class:`~lifecycle.errors.PoolExhausted` before anything happens: the
  sequence stays live, so the scheduler can cache and free it (recompute later) or pick another
  victim. So does a sequence whose record could not be restored (a ``prompt_len`` or
  ``ssm_tokens`` out of range, a negative token id, more tokens than the model's per-sequence
  limit: :func:`~lifecycle.swap.check_saveable`), with ``SequenceStateError``.
- Any other failure of ``swap_out`` (the save itself, the spill file) releases the partial record
  and still frees the sequence: no block is lost.
- ``swap_in`` first makes room: it evicts cached prefix blocks until the record's blocks are free
  (the restore itself never evicts). Refused for lack of room (blocks, or an SSM slot), it raises
  ``PoolExhausted`` with the handle still live, to be swapped in later. Any other failure
  consumes the handle: the new sequence is freed, the record (host memory or spill file) is
  released too, and the error is raised.

A handle is bound to the tier that issued it and is only accepted as that very object: a copy,
a handle of another tier or one built by hand is refused with ``SwapError``.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Final, Literal, cast, final

import numpy as np
import numpy.typing as npt

from lifecycle.errors import InvalidId, OutOfBlocks, PoolExhausted, SwapError, SwapModelMismatch, TornDown
from lifecycle.sequence import NO_ADAPTER
from lifecycle.swap import check_saveable, record_nbytes

if TYPE_CHECKING:
    from lifecycle.model import HybridModel
    from lifecycle.sequence import SequenceState

__all__ = ["DEFAULT_HOST_BYTES", "SwapHandle", "SwapTier"]

DEFAULT_HOST_BYTES: Final = 1 << 30
_ALIGN: Final = 64
# Process-wide, so that no two tiers (nor two handles) ever share an id.
_tier_ids = itertools.count(1)
_handle_ids = itertools.count(1)


@final
@dataclass(frozen=True, slots=True, eq=False)
class SwapHandle:
    """A swapped-out sequence. Consumed by exactly one ``swap_in`` or ``discard`` of the tier that
    issued it (``tier_id``), which accepts only this very object (equality is identity)."""

    tier_id: int
    handle_id: int
    nbytes: int
    num_blocks: int
    num_tokens: int
    budget_tokens: int
    adapter: tuple[str, int] | None  # (name, generation) the KV was computed with
    location: Literal["host", "file"]
    path: Path | None  # the spill file, for location == "file"
    held: tuple[int, ...] = ()  # blocks each KV cache group past 0 holds (a model of several groups)


class _HostPool:
    """First-fit extents of one host buffer (allocated on first use, reused afterwards, so its
    pages are faulted in once rather than on every swap)."""

    def __init__(self, nbytes: int) -> None:
        self.capacity = nbytes
        self.used = 0
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, size) by offset

    def reserve(self, nbytes: int) -> int | None:
        """Offset of a free extent of ``nbytes`` (rounded up to the alignment), or None. The
        buffer is allocated by the first reserve that finds room; ``PoolExhausted`` when the
        host cannot give it."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        if self._buffer is None and size <= self.capacity:
            try:
                self._buffer = np.empty(self.capacity, dtype=np.uint8)
            except MemoryError:
                raise PoolExhausted(
                    f"swap_out: the swap tier's host buffer of host_bytes={self.capacity} cannot be allocated "
                    "(not enough host memory); give the tier fewer host_bytes"
                ) from None
        for index, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, free - size)
                self.used += size
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // _ALIGN) * _ALIGN
        free = self._free
        index = next((i for i, (start, _) in enumerate(free) if start > offset), len(free))
        free.insert(index, (offset, size))
        # Coalesce with the neighbours so large records keep fitting.
        if index + 1 < len(free) and offset + size == free[index + 1][0]:
            free[index] = (offset, size + free.pop(index + 1)[1])
        if index > 0 and free[index - 1][0] + free[index - 1][1] == offset:
            free[index - 1] = (free[index - 1][0], free[index - 1][1] + free.pop(index)[1])
        self.used -= size

    def view(self, offset: int, nbytes: int) -> memoryview:
        assert self._buffer is not None  # allocated by the reserve that handed out the extent
        return self._buffer.data[offset : offset + nbytes]

    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)


class _ViewWriter:
    """A binary writer over a fixed memoryview (the record's host extent)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def write(self, data: memoryview | bytes) -> int:
        view = data if isinstance(data, memoryview) else memoryview(data)
        end = self._pos + view.nbytes
        if end > self._view.nbytes:
            raise SwapError(f"record overflows its host extent: {end} > {self._view.nbytes} bytes")
        self._view[self._pos : end] = view.cast("B")
        self._pos = end
        return view.nbytes

    def reserve(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` bytes of the extent, to be filled by the caller (counted as written)."""
        end = self._pos + nbytes
        if nbytes < 0 or end > self._view.nbytes:
            raise SwapError(f"record overflows its host extent: {end} > {self._view.nbytes} bytes")
        view = self._view[self._pos : end]
        self._pos = end
        return view


class _ViewReader:
    """A binary reader over a fixed memoryview."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def readinto(self, buffer: memoryview) -> int:
        n = min(buffer.nbytes, self._view.nbytes - self._pos)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def claim(self, nbytes: int) -> memoryview:
        """The next ``nbytes`` bytes (fewer at the end of the extent), counted as read."""
        end = min(self._pos + max(nbytes, 0), self._view.nbytes)
        view = self._view[self._pos : end]
        self._pos = end
        return view

    def read(self, nbytes: int = -1) -> bytes:
        end = self._view.nbytes if nbytes < 0 else min(self._pos + nbytes, self._view.nbytes)
        data = self._view[self._pos : end].tobytes()
        self._pos = end
        return data


@dataclass(slots=True)
class _Record:
    handle: SwapHandle
    offset: int  # in the host pool; -1 for a spill file


@final
class SwapTier:
    """Swap space for ``model``'s sequences: ``host_bytes`` of host memory, then spill files in
    ``spill_dir`` (none: swap-outs that do not fit in host memory are refused). Thread-safe."""

    def __init__(
        self, model: HybridModel, host_bytes: int = DEFAULT_HOST_BYTES, spill_dir: str | Path | None = None
    ) -> None:
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0:
            raise InvalidId(f"SwapTier: host_bytes={host_bytes!r} must be an int >= 0")
        self._model = model
        self._host = _HostPool(host_bytes)
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        if self._spill_dir is not None and not self._spill_dir.is_dir():
            raise InvalidId(f"SwapTier: spill_dir={str(self._spill_dir)!r} is not a directory")
        self._lock = threading.Lock()
        self._records: dict[int, _Record] = {}
        self._tier_id = next(_tier_ids)
        self._closed = False

    # ------------------------------------------------------------------ state

    @property
    def host_bytes(self) -> int:
        """The host budget."""
        return self._host.capacity

    @property
    def host_bytes_used(self) -> int:
        """Host bytes held by swapped-out records (extents are 64-byte aligned)."""
        with self._lock:
            return self._host.used

    @property
    def num_swapped_out(self) -> int:
        """Records not yet swapped in or discarded."""
        with self._lock:
            return len(self._records)

    @property
    def spill_files(self) -> list[Path]:
        """Spill files of the live records."""
        with self._lock:
            return [r.handle.path for r in self._records.values() if r.handle.path is not None]

    # ------------------------------------------------------------------ swap out

    def swap_out(self, seq: SequenceState) -> SwapHandle:
        """Save ``seq`` to host memory (or a spill file) and free it; returns the handle to swap it
        back in with. Raises ``PoolExhausted`` with the sequence untouched when no room is left,
        and ``SequenceStateError`` likewise for a sequence whose record could not be restored; on
        any other failure the partial record is dropped and the sequence is freed all the same."""
        model = self._model
        model.block_table(seq)  # refuses a foreign sequence before anything happens
        check_saveable(model.config, seq)
        adapter: tuple[str, int] | None = None
        if seq.adapter_slot != NO_ADAPTER:
            info = model.adapter_info(seq.adapter_slot)
            adapter = (info.name, info.generation)
        held = tuple(
            int(np.count_nonzero(model.block_table(seq, group) >= 0)) for group in range(1, len(model.config.kv_groups))
        )
        nbytes = record_nbytes(
            model.config, seq.num_blocks, seq.num_tokens, adapter[0] if adapter else None, held if held else None
        )
        record = self._reserve(nbytes, seq, adapter, held)
        try:
            if record.offset >= 0:
                writer = _ViewWriter(self._host.view(record.offset, nbytes))
                model.save_sequence_state(seq, cast(BinaryIO, writer))
            else:
                assert record.handle.path is not None
                with open(record.handle.path, "xb") as file:
                    model.save_sequence_state(seq, file)
        except BaseException as error:
            self._drop(record)
            try:
                model.free_sequence(seq)
            except BaseException as free_error:
                error.add_note(f"freeing the sequence after the failed swap-out also failed: {free_error!r}")
            raise
        try:
            model.free_sequence(seq)
        except BaseException:
            self._drop(record)
            raise
        return record.handle

    def _reserve(
        self, nbytes: int, seq: SequenceState, adapter: tuple[str, int] | None, held: tuple[int, ...]
    ) -> _Record:
        with self._lock:
            if self._closed:
                raise TornDown("swap_out: the swap tier was closed")
            handle_id = next(_handle_ids)
            offset = self._host.reserve(nbytes)
            path: Path | None = None
            if offset is None:
                if self._spill_dir is None:
                    raise PoolExhausted(
                        f"swap_out: record of sequence {seq.seq_id} needs {nbytes} bytes; host swap has "
                        f"{self._host.capacity - self._host.used} of {self._host.capacity} bytes free "
                        f"(largest extent {self._host.largest_free()}) and no spill_dir"
                    )
                path = self._spill_dir / f"lifecycle-swap-{os.getpid()}-{id(self)}-{handle_id}.rec"
            handle = SwapHandle(
                tier_id=self._tier_id,
                handle_id=handle_id,
                nbytes=nbytes,
                num_blocks=seq.num_blocks,
                num_tokens=seq.num_tokens,
                budget_tokens=seq.budget_tokens,
                adapter=adapter,
                location="host" if path is None else "file",
                path=path,
                held=held,
            )
            record = _Record(handle, -1 if offset is None else offset)
            self._records[handle_id] = record
            return record

    # ------------------------------------------------------------------ swap in

    def swap_in(self, handle: SwapHandle) -> SequenceState:
        """A new sequence holding the swapped-out state (tokens, KV, SSM state, adapter binding).
        Evicts cached prefix blocks first until the record's blocks are free. Refused for lack of
        room (``PoolExhausted``: blocks or an SSM slot), the handle stays live; otherwise the
        record is released whether this succeeds or fails, and on failure the new sequence is
        freed and the error raised."""
        record = self._take(handle, "swap_in")
        model = self._model
        try:
            self._make_room(handle)
            adapter_slot = self._adapter_slot(handle)
            seq = model.alloc_sequence_for(handle.budget_tokens)
            try:
                if adapter_slot != NO_ADAPTER:
                    model.bind_adapter(seq, adapter_slot)
                # A restore never evicts (so that a failed one gives back exactly what it took):
                # make the room here first.
                self._make_room(handle)
                if record.offset >= 0:
                    reader = _ViewReader(self._host.view(record.offset, handle.nbytes))
                    model.restore_sequence_state(seq, handle.num_blocks, cast(BinaryIO, reader))
                else:
                    assert handle.path is not None
                    with open(handle.path, "rb") as file:
                        model.restore_sequence_state(seq, handle.num_blocks, file)
            except BaseException as error:
                try:
                    model.free_sequence(seq)
                except BaseException as free_error:
                    error.add_note(f"freeing the new sequence after the failed swap-in also failed: {free_error!r}")
                raise
        except PoolExhausted:
            self._put_back(record)  # nothing was lost for want of room: the handle stays live
            raise
        except BaseException:
            self._release(record)
            raise
        self._release(record)
        return seq

    def _make_room(self, handle: SwapHandle) -> None:
        """Evict cached prefix blocks until the record's blocks are free in every KV cache group
        (group 0's eviction trims cached runs in every group at once), or ``OutOfBlocks`` naming
        the group."""
        model = self._model
        pools = model.core.group_pools
        for group, needed in enumerate((handle.num_blocks, *handle.held)):
            free = model.num_free_blocks() if group == 0 else pools[group].num_free  # (group 0: reaps drops first)
            while free < needed:
                if model.reclaim_prefix_blocks(max(needed - free, 1)) == 0:
                    where = f" of KV cache group {group}" if len(pools) > 1 else ""
                    raise OutOfBlocks(
                        f"swap_in: the record needs {needed} blocks{where}, {free} of {pools[group].num_total} are "
                        "free after evicting every evictable cached block (the handle stays live)"
                    )
                free = pools[group].num_free

    def _adapter_slot(self, handle: SwapHandle) -> int:
        """The slot where the handle's adapter generation is loaded now."""
        if handle.adapter is None:
            return NO_ADAPTER
        name, generation = handle.adapter
        model = self._model
        for slot in range(model.config.num_adapter_slots):
            info = model.adapter_info(slot)
            if info.loaded and info.name == name and info.generation == generation:
                return slot
        raise SwapModelMismatch(
            f"swap_in: the record was computed with adapter {name!r} generation {generation}, "
            "which is no longer loaded (unloaded or reloaded since)"
        )

    def discard(self, handle: SwapHandle) -> None:
        """Drop a swapped-out record without swapping it in (the request was cancelled)."""
        self._release(self._take(handle, "discard"))

    # ------------------------------------------------------------------ records

    def _take(self, handle: SwapHandle, what: str) -> _Record:
        """The live record of ``handle``, taken out of the table: only the very handle object
        this tier issued is accepted."""
        with self._lock:
            if not isinstance(handle, SwapHandle):
                raise SwapError(f"{what}: expected a SwapHandle, got {type(handle).__name__}")
            if handle.tier_id != self._tier_id:
                raise SwapError(
                    f"{what}: handle {handle.handle_id} was issued by swap tier #{handle.tier_id}, not by this "
                    f"tier (#{self._tier_id})"
                )
            record = self._records.get(handle.handle_id)
            if record is None:
                raise SwapError(
                    f"{what}: handle {handle.handle_id} is not live in this tier (already swapped in or discarded?)"
                )
            if record.handle is not handle:
                raise SwapError(
                    f"{what}: handle {handle.handle_id} is a copy or a forgery of a live handle of this tier; only "
                    "the handle object swap_out returned is accepted"
                )
            del self._records[handle.handle_id]
            return record

    def _put_back(self, record: _Record) -> None:
        """Make a taken record live again (a swap-in refused for lack of room), unless the tier
        was closed meanwhile."""
        with self._lock:
            if not self._closed:
                self._records[record.handle.handle_id] = record
                return
        self._release(record)

    def _drop(self, record: _Record) -> None:
        with self._lock:
            self._records.pop(record.handle.handle_id, None)
        self._release(record)

    def _release(self, record: _Record) -> None:
        if record.offset >= 0:
            with self._lock:
                self._host.release(record.offset, record.handle.nbytes)
        elif record.handle.path is not None:
            record.handle.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drop every live record (spill files removed). Later swap-outs raise; idempotent."""
        with self._lock:
            self._closed = True
            records, self._records = list(self._records.values()), {}
        for record in records:
            self._release(record)

    def __enter__(self) -> SwapTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
