"""Batched copy kernels of the device layer (pyx/hostcopy.pyx)."""

import numpy as np
import numpy.typing as npt

def first_bad_row(rows: npt.NDArray[np.int64], starts: npt.NDArray[np.int64], ends: npt.NDArray[np.int64]) -> int: ...
def memmove_rows(rows: npt.NDArray[np.int64]) -> None: ...
