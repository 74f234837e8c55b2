"""How a record's bytes leave and reach device memory: the bounded staging buffer, the device
ranges of a sequence's blocks, and the mover that copies them through the buffer's two halves (or,
on the host device, straight from the pools)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from lifecycle.errors import SwapError

if TYPE_CHECKING:
    from lifecycle.device.base import Device
    from lifecycle.swap.context import KVLayout, SwapContext
    from lifecycle.swap.format import _Layout
    from lifecycle.swap.streams import _In, _Out

__all__ = ["DEFAULT_STAGING_BYTES", "StagingBuffer"]

DEFAULT_STAGING_BYTES: Final = 4 << 20
_HOST_PIECE = 256 << 10  # copied, then hashed while still in the core's L2


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



class _Held(NamedTuple):
    """The blocks a sequence holds in one KV cache group: their ids in table order, and (past
    group 0 of a 2.x record) their positions in the table."""

    ids: npt.NDArray[np.int32]
    positions: npt.NDArray[np.uint32] | None


def _kv_pools(ctx: SwapContext, layout: _Layout) -> tuple[KVLayout, ...]:
    """The KV pool of each group of the layout, group 0 first."""
    if layout.grouped:
        return ctx.kv_groups
    return (ctx.kv,) if ctx.kv is not None and layout.group_layer_bytes else ()


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



def _quiet_synchronize(device: Device) -> None:
    """Let in-flight copies finish before the caller frees or reuses their memory (best effort:
    the error being raised is the one the caller must see)."""
    try:
        device.synchronize()
    except Exception:  # noqa: S110 - a sticky device error is already being reported
        pass
