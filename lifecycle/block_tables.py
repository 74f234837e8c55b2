"""Sequences' block ids written into a 2-D int32 block table the engine owns.

A table in host memory (a numpy array, anything with the buffer protocol, a CPU tensor through
DLPack) is written in place, row by row, by the core. A table in CUDA memory (anything with
``__cuda_array_interface__``: torch, CuPy, Numba) is written through :class:`TableStaging`: the
rows are filled in pinned host memory, then sent with ONE host-to-device copy of the span of rows
written, on the calling thread's copy stream (the engine's stream inside ``use_stream``, so the copy
is ordered with its kernels). The staging is refilled only once that copy is done: the copy is
followed by an event of the device's own, which the next call waits for. Waiting for the event
rather than for the stream matters under ``use_stream``: the stream also holds the engine's kernels
queued after the copy, which the next call has no reason to wait for.

Everything is checked before anything is written (host) or copied (CUDA); errors are
:class:`~lifecycle.errors.InvalidId` naming the value and its limit (:class:`InvalidType` for an
object that is no table at all). :func:`step_cuda_table` is the same staging for a decode step
(``HybridModel.step(table=)``) into a CUDA table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from lifecycle._kvcache import KVCacheCore, SequenceState
from lifecycle.device.base import Device
from lifecycle.device.dlpack import KDL_CPU, KDL_CUDA
from lifecycle.errors import InvalidId, InvalidType, SequenceStateError

__all__ = ["CudaTable", "TableStaging", "raise_if_wrong_type", "step_cuda_table", "write_block_tables"]

_CALL: Final = "write_block_tables"
_ID_BYTES: Final = 4
_IDLE, _UNFENCED, _FENCED = 0, 1, 2  # no copy in flight / one without its event / one followed by its event


@dataclass(frozen=True, slots=True)
class CudaTable:
    """A C-contiguous int32 table in CUDA memory, from its ``__cuda_array_interface__``:
    ``stream`` is the engine's stream the interface names (None: none), which the copy waits for."""

    ptr: int
    num_rows: int
    width: int
    stream: int | None

    @classmethod
    def of(cls, table: object, call: str = _CALL) -> CudaTable:
        """The table behind an object's ``__cuda_array_interface__`` (version 2 or 3), named
        ``call`` in errors."""
        interface: Any = getattr(table, "__cuda_array_interface__")
        if not isinstance(interface, dict):
            raise InvalidId(f"{call}: __cuda_array_interface__ of {type(table).__name__} is not a dict")
        version, typestr, shape = interface.get("version"), interface.get("typestr"), tuple(interface.get("shape", ()))
        if version not in (2, 3):
            raise InvalidId(f"{call}: __cuda_array_interface__ version {version!r}, expected 2 or 3")
        if typestr != "<i4":
            raise InvalidId(f"{call}: the table holds {typestr!r}, expected '<i4' (int32)")
        if len(shape) != 2:
            raise InvalidId(f"{call}: the table has shape {shape}, expected 2-D (rows, blocks)")
        num_rows, width = int(shape[0]), int(shape[1])
        strides = interface.get("strides")
        if strides is not None and num_rows * width:
            row_stride, id_stride = (int(stride) for stride in strides)
            if (num_rows > 1 and row_stride != width * _ID_BYTES) or (width > 1 and id_stride != _ID_BYTES):
                raise InvalidId(f"{call}: the table has strides {tuple(strides)}, expected C-contiguous "
                                f"{(width * _ID_BYTES, _ID_BYTES)}")
        if interface.get("mask") is not None:
            raise InvalidId(f"{call}: a masked table cannot be written")
        data = interface.get("data")
        if not isinstance(data, tuple) or len(data) != 2:
            raise InvalidId(f"{call}: __cuda_array_interface__ data {data!r} is not a (pointer, read-only) pair")
        ptr, read_only = data
        if read_only:
            raise InvalidId(f"{call}: the table at {int(ptr):#x} is read-only")
        stream = interface.get("stream")
        return cls(int(ptr), num_rows, width, None if stream is None else int(stream))


def host_table(table: object, call: str = _CALL) -> npt.NDArray[np.int32] | None:
    """``table`` as a writable 2-D int32 numpy view of host memory with contiguous rows, or None
    when it is a CUDA table (``__cuda_array_interface__``); errors name the call ``call``."""
    if hasattr(table, "__cuda_array_interface__"):
        return None
    if hasattr(table, "__dlpack_device__"):
        device_type = table.__dlpack_device__()[0]
        if device_type != KDL_CPU:
            detail = ("a CUDA tensor is taken through __cuda_array_interface__ (as torch, CuPy and Numba give "
                      "it)" if device_type == KDL_CUDA else "it is not host memory")
            raise InvalidId(f"{call}: {type(table).__name__} lives on DLPack device type {device_type}: {detail}")
    try:
        array = np.asarray(memoryview(table))  # type: ignore[arg-type]
    except TypeError:
        if not hasattr(table, "__dlpack__"):
            raise InvalidType(f"{call}: {type(table).__name__} has neither the buffer protocol, __dlpack__ nor "
                              "__cuda_array_interface__") from None
        array = np.from_dlpack(table)
    if array.dtype != np.int32:
        raise InvalidType(f"{call}: the table holds {array.dtype}, expected int32")
    if array.ndim != 2:
        raise InvalidId(f"{call}: the table is {array.ndim}-D, expected 2-D (rows, blocks)")
    if array.shape[1] > 1 and array.strides[1] != _ID_BYTES:
        raise InvalidId(f"{call}: the table's rows are not contiguous (strides {array.strides})")
    if not array.flags.writeable:
        raise InvalidId(f"{call}: the table is read-only")
    return array


@final
class TableStaging:
    """The pinned host rows a CUDA table's copy is sent from: allocated on first use, grown as
    needed, and refilled only once the copy from it is done (see the module docstring). Not
    thread-safe: the model's lock serialises its users."""

    def __init__(self, device: Device) -> None:
        self._device = device
        self._ptr = 0
        self._nbytes = 0
        self._view: npt.NDArray[np.uint8] | None = None
        self._event = 0
        self._in_flight = _IDLE

    def rows(self, num_rows: int, width: int) -> npt.NDArray[np.int32]:
        """``num_rows`` x ``width`` int32 rows to fill, once the previous copy from them is done."""
        nbytes = num_rows * width * _ID_BYTES
        self._settle()
        if nbytes > self._nbytes:
            self._grow(nbytes)
        assert self._view is not None
        return self._view[:nbytes].view(np.int32).reshape(num_rows, width)

    def send(self, dst: int, nbytes: int) -> None:
        """One host-to-device copy of the first ``nbytes`` of the rows to ``dst``, followed by the
        event the next :meth:`rows` waits for."""
        self._device.copy_htod_to(dst, self._ptr, nbytes)
        self._in_flight = _UNFENCED
        self._device.record_event(self._event)
        self._in_flight = _FENCED

    def release(self) -> None:
        """Wait for the copy in flight, then free the memory and the event; idempotent."""
        try:
            self._settle()
        finally:
            ptr, event = self._ptr, self._event
            self._ptr, self._nbytes, self._view, self._event, self._in_flight = 0, 0, None, 0, _IDLE
            try:
                if ptr:
                    self._device.free_pinned(ptr)
            finally:
                if event:
                    self._device.destroy_event(event)

    def _settle(self) -> None:
        if self._in_flight == _FENCED:
            self._device.synchronize_event(self._event)
        elif self._in_flight == _UNFENCED:  # the event could not be recorded: wait for every stream
            self._device.synchronize()
        self._in_flight = _IDLE

    def _grow(self, nbytes: int) -> None:
        size = max(nbytes, 2 * self._nbytes, 4096)
        if self._ptr:
            ptr, self._ptr, self._nbytes, self._view = self._ptr, 0, 0, None
            self._device.free_pinned(ptr)
        if not self._event:
            self._event = self._device.create_event()
        ptr = self._device.alloc_pinned(size)
        try:
            self._view = self._device.host_array(ptr, size)
        except BaseException:
            self._device.free_pinned(ptr)
            raise
        self._ptr, self._nbytes = ptr, size


def _rows_of(rows: Sequence[int] | npt.NDArray[np.integer] | None, count: int,
             num_rows: int, call: str = _CALL) -> npt.NDArray[np.int64]:
    """The table row of each sequence: distinct, each in ``[0, num_rows)``."""
    if rows is None:
        positions = np.arange(count, dtype=np.int64)
    else:
        given = np.asarray(rows)
        if given.ndim != 1 or (given.size and given.dtype.kind not in "iu") or given.size != count:
            raise InvalidId(f"{call}: rows must be {count} ints (one per sequence), got {given.dtype} of shape "
                            f"{given.shape}")
        positions = given.astype(np.int64)
    bad = np.flatnonzero((positions < 0) | (positions >= num_rows))
    if bad.size:
        i = int(bad[0])
        raise InvalidId(f"{call}: row {int(positions[i])} (sequence {i}) out of range [0, {num_rows})")
    if np.unique(positions).size != count:
        values, counts = np.unique(positions, return_counts=True)
        raise InvalidId(f"{call}: row {int(values[counts > 1][0])} is given to more than one sequence")
    return positions


def write_block_tables(core: KVCacheCore, device: Device, staging: TableStaging, seqs: Sequence[SequenceState],
                       handles: Sequence[int], table: object, rows: Sequence[int] | npt.NDArray[np.integer] | None,
                       pad: int | None, group: int = 0) -> None:
    """Write ``seqs[i]`` (core ``handles[i]``) into row ``rows[i]`` of ``table`` (its table in KV
    cache group ``group``), a CUDA table through ``staging`` on ``device``; see
    :meth:`lifecycle.model.HybridModel.write_block_tables`."""
    host = host_table(table)
    if host is None:
        if device.kind != "cuda":
            raise InvalidId(f"{_CALL}: a CUDA table needs a model on a CUDA device, this one is on {device.name!r}")
        target = CudaTable.of(table)
        num_rows, width = target.num_rows, target.width
    else:
        num_rows, width = host.shape
    positions = _rows_of(rows, len(handles), num_rows)
    for seq in seqs:
        if not seq.is_open:
            raise SequenceStateError(f"{_CALL}: sequence {seq.seq_id} was freed")
        if seq.num_blocks > width:
            raise InvalidId(f"{_CALL}: sequence {seq.seq_id} holds {seq.num_blocks} blocks, the table has {width} "
                            "columns")
    if host is not None:
        for handle, row in zip(handles, positions.tolist()):
            core.write_table(handle, host[row], pad, group)
        return
    if not handles or width == 0:
        return
    first = _span(positions, pad)
    staged = staging.rows(len(handles), width)
    for handle, row in zip(handles, positions.tolist()):
        core.write_table(handle, staged[row - first], pad, group)
    _send(device, staging, target, first, staged)


def _span(positions: npt.NDArray[np.int64], pad: int | None, call: str = _CALL) -> int:
    """The first row of the one span of rows a CUDA table's copy covers; refuses rows that leave
    a gap in it, and a missing ``pad`` (the rows are written whole)."""
    first, last = int(positions.min()), int(positions.max())
    if last - first + 1 != len(positions):
        missing = sorted(set(range(first, last + 1)) - set(positions.tolist()))
        raise InvalidId(f"{call}: a CUDA table is written by one copy of rows {first}..{last}, but rows "
                        f"{missing[:8]} of them are not given (give every row of the span, or call once per span)")
    if pad is None:
        raise InvalidId(f"{call}: a CUDA table is written in whole rows: give pad= (the id for the columns past "
                        "a sequence's blocks, e.g. the null block)")
    return first


def _send(device: Device, staging: TableStaging, target: CudaTable, first: int,
          staged: npt.NDArray[np.int32]) -> None:
    if target.stream is not None:
        device.wait_stream(target.stream)  # the interface's stream: the table is written after its work
    staging.send(target.ptr + first * target.width * _ID_BYTES, staged.nbytes)


def step_cuda_table(core: KVCacheCore, device: Device, staging: TableStaging, handles: object, tokens: object,
                    counts: object, table: object, rows: object, pad: int | None, cache: bool) -> npt.NDArray[np.int32]:
    """``core.step`` into a table in CUDA memory: each request's row is filled in the pinned
    staging (its block ids, then ``pad``), the core steps there (checking everything before it
    changes anything, the table's width included), and the span of rows goes in one copy."""
    call = "step"
    if device.kind != "cuda":
        raise InvalidId(f"{call}: a CUDA table needs a model on a CUDA device, this one is on {device.name!r}")
    target = CudaTable.of(table, call)
    wanted = np.asarray(handles, dtype=np.int64)
    if wanted.ndim != 1:
        raise InvalidId(f"{call}: handles must be 1-D, got shape {wanted.shape}")
    positions = _rows_of(rows, wanted.size, target.num_rows, call)  # type: ignore[arg-type]
    if wanted.size == 0 or target.width == 0:
        return core.step(wanted, tokens, counts, None, None, cache)  # type: ignore[arg-type]
    first = _span(positions, pad, call)
    staged = staging.rows(wanted.size, target.width)
    for handle, row in zip(wanted.tolist(), positions.tolist()):
        core.write_table(handle, staged[row - first], pad)
    refused = core.step(wanted, tokens, counts, staged, positions - first, cache)  # type: ignore[arg-type]
    _send(device, staging, target, first, staged)
    return refused


# --- the types of the hot path's arguments, checked after the core refused a call -------------------------

_INTS: Final = "ints (a numpy array, a CPU tensor, a list or tuple)"


def _describe(value: object, array: npt.NDArray[np.generic] | None) -> str:
    if array is None or array.ndim == 0 or array.dtype.kind in "OUS":
        return f"{type(value).__name__} {value!r:.40}"
    return f"{type(value).__name__} of {array.dtype}, shape {array.shape}"


def raise_if_wrong_type(
    error: InvalidId, call: str, inputs: dict[str, object], outputs: dict[str, object] | None = None
) -> None:
    """After the core refused a call (off the fast path): raise :class:`InvalidType`, chained from
    ``error``, for the first argument of a type the call cannot take: ``inputs`` must hold ints
    (converted where they are not int32), ``outputs`` be int32 to be written in place. Returns when
    every argument's type is usable: the refusal was of a value."""
    for name, value in (*inputs.items(), *((k, v) for k, v in (outputs or {}).items() if v is not None)):
        try:
            array = value if isinstance(value, np.ndarray) else np.asarray(value)
        except Exception:  # e.g. a tensor in device memory, which numpy cannot read
            array = None
        if name in (outputs or {}):
            if array is None or array.dtype != np.int32:
                raise InvalidType(
                    f"{call}: {name} must be int32 in host memory, got {_describe(value, array)} ({error})"
                ) from error
        elif array is None or array.ndim == 0 or (array.size and array.dtype.kind not in "iu"):
            expected = f"SequenceStates, or their handles as {_INTS}" if name == "seqs" else _INTS
            got = _describe(value, array)
            raise InvalidType(f"{call}: {name} must be {expected} in host memory, got {got} ({error})") from error
