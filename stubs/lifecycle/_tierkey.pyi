"""Keyed chain keys of the tiers below the device (compiled from pyx/tierkey.pyx)."""

from typing import Any

import numpy as np
import numpy.typing as npt

def chain_keys(
    tokens: npt.NDArray[np.int32], block_size: int, k0: int, k1: int, parent_hi: int, parent_lo: int
) -> npt.NDArray[np.uint64]: ...
def siphash128(data: bytes | bytearray | memoryview | npt.NDArray[Any], k0: int, k1: int) -> tuple[int, int]: ...
