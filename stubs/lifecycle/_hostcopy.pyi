"""Batched copy kernels of the device layer (pyx/hostcopy.pyx)."""

import numpy as np
import numpy.typing as npt

def first_bad_row(rows: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> int: ...
def first_overlap(rows: npt.NDArray[np.int64]) -> tuple[int, int]: ...
def memmove_rows(rows: npt.NDArray[np.int64]) -> None: ...
def stream_copy(
    dst: memoryview | npt.NDArray[np.uint8] | bytearray, src: memoryview | npt.NDArray[np.uint8] | bytes | bytearray
) -> None: ...
def put_int32(dst: npt.NDArray[np.int32], start: int, src: npt.NDArray[np.int32]) -> bool:
    """False, copying nothing, unless both are 1-D C-contiguous int32 arrays, ``start`` an int and
    the range inside ``dst``."""
