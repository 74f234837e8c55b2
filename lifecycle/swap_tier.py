"""A swap tier for preemption: a scheduler swaps a sequence out to host memory (or to a spill file
when the host budget is spent) and later swaps it back in.

``swap_out`` writes the sequence's record (:mod:`lifecycle.swap`) into a bounded host pool, or into
a file in ``spill_dir`` when the pool cannot take it, then frees the sequence. ``swap_in`` allocates
a new sequence (bound to the same adapter), restores the record into it and releases the record.

Failure rules (SPEC §8 scenario 15):

- ``swap_out`` refused for lack of room (no host room and no spill directory) raises
  :class:`~lifecycle.errors.PoolExhausted` before anything happens: the sequence stays live, so the
  scheduler can cache and free it (recompute later) or pick another victim.
- Any other failure of ``swap_out`` (the save itself, the spill file) releases the partial record
  and still frees the sequence: no block is lost.
- ``swap_in`` consumes the handle whatever happens: on failure the new sequence is freed and the
  record (host memory or spill file) is released too, and the error is raised.
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

from lifecycle.errors import InvalidId, PoolExhausted, SwapError, SwapModelMismatch, TornDown
from lifecycle.sequence import NO_ADAPTER
from lifecycle.swap import record_nbytes

if TYPE_CHECKING:
    from lifecycle.model import HybridModel
    from lifecycle.sequence import SequenceState

__all__ = ["DEFAULT_HOST_BYTES", "SwapHandle", "SwapTier"]

DEFAULT_HOST_BYTES: Final = 1 << 30
_ALIGN: Final = 64


@final
@dataclass(frozen=True, slots=True)
class SwapHandle:
    """A swapped-out sequence. Consumed by exactly one ``swap_in`` or ``discard``."""

    handle_id: int
    nbytes: int
    num_blocks: int
    num_tokens: int
    budget_tokens: int
    adapter: tuple[str, int] | None  # (name, generation) the KV was computed with
    location: Literal["host", "file"]
    path: Path | None  # the spill file, for location == "file"


class _HostPool:
    """First-fit extents of one host buffer (allocated on first use, reused afterwards, so its
    pages are faulted in once rather than on every swap)."""

    def __init__(self, nbytes: int) -> None:
        self.capacity = nbytes
        self.used = 0
        self._buffer: npt.NDArray[np.uint8] | None = None
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, size) by offset

    def reserve(self, nbytes: int) -> int | None:
        """Offset of a free extent of ``nbytes`` (rounded up to the alignment), or None."""
        size = -(-nbytes // _ALIGN) * _ALIGN
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
        if self._buffer is None:
            self._buffer = np.empty(self.capacity, dtype=np.uint8)
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
        if not isinstance(host_bytes, int) or host_bytes < 0:
            raise InvalidId(f"SwapTier: host_bytes={host_bytes!r} must be an int >= 0")
        self._model = model
        self._host = _HostPool(host_bytes)
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        if self._spill_dir is not None and not self._spill_dir.is_dir():
            raise InvalidId(f"SwapTier: spill_dir={str(self._spill_dir)!r} is not a directory")
        self._lock = threading.Lock()
        self._records: dict[int, _Record] = {}
        self._ids = itertools.count(1)
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
        back in with. Raises ``PoolExhausted`` with the sequence untouched when no room is left;
        on any other failure the partial record is dropped and the sequence is freed all the same."""
        model = self._model
        model.block_table(seq)  # refuses a foreign sequence before anything happens
        adapter: tuple[str, int] | None = None
        if seq.adapter_slot != NO_ADAPTER:
            info = model.adapter_info(seq.adapter_slot)
            adapter = (info.name, info.generation)
        nbytes = record_nbytes(model.config, seq.num_blocks, seq.num_tokens, adapter[0] if adapter else None)
        record = self._reserve(nbytes, seq, adapter)
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

    def _reserve(self, nbytes: int, seq: SequenceState, adapter: tuple[str, int] | None) -> _Record:
        with self._lock:
            if self._closed:
                raise TornDown("swap_out: the swap tier was closed")
            handle_id = next(self._ids)
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
                handle_id=handle_id,
                nbytes=nbytes,
                num_blocks=seq.num_blocks,
                num_tokens=seq.num_tokens,
                budget_tokens=seq.budget_tokens,
                adapter=adapter,
                location="host" if path is None else "file",
                path=path,
            )
            record = _Record(handle, -1 if offset is None else offset)
            self._records[handle_id] = record
            return record

    # ------------------------------------------------------------------ swap in

    def swap_in(self, handle: SwapHandle) -> SequenceState:
        """A new sequence holding the swapped-out state (tokens, KV, SSM state, adapter binding).
        The record is released whether this succeeds or fails; on failure the new sequence is
        freed and the error raised."""
        record = self._take(handle, "swap_in")
        model = self._model
        try:
            adapter_slot = self._adapter_slot(handle)
            seq = model.alloc_sequence_for(handle.budget_tokens)
            try:
                if adapter_slot != NO_ADAPTER:
                    model.bind_adapter(seq, adapter_slot)
                # A restore never evicts (so that a failed one gives back exactly what it took):
                # make the room here first.
                short = handle.num_blocks - model.num_free_blocks()
                if short > 0:
                    model.reclaim_prefix_blocks(short)
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
            return seq
        finally:
            self._release(record)

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
        with self._lock:
            record = self._records.pop(handle.handle_id, None) if isinstance(handle, SwapHandle) else None
            if record is None or record.handle != handle:
                if record is not None:
                    self._records[handle.handle_id] = record
                raise SwapError(f"{what}: handle {handle!r} is not live in this tier (already swapped in or discarded?)")
            return record

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
