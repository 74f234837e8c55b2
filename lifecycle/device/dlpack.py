"""DLPack export of the device layer's array views, with the element type the memory really holds.

numpy has no bfloat16 or float8 type, so a view's numpy dtype is an unsigned integer of the same
width (:func:`lifecycle.config.storage_dtype`). Its ``__dlpack__`` names the true type instead, so
``torch.from_dlpack(view)`` is a zero-copy tensor of ``torch.bfloat16`` / ``torch.float8_e4m3fn``
... over the pool's memory. A view knows its element type when it was made from a
:data:`~lifecycle.config.DType` name (``device.device_array(ptr, shape, "bfloat16")``, which pools
do); made from a numpy dtype, it exports that dtype.

The arguments follow the array API standard's ``__dlpack__``: ``max_version`` below ``(1, 0)``
(or None) gets a ``"dltensor"`` capsule, else a ``"dltensor_versioned"`` one (DLPack 1.1);
``copy=True`` copies on host and is refused on CUDA; ``dl_device`` must be the view's own device.
On CUDA, ``stream`` is the consumer's stream (None: the legacy default stream; -1: no ordering),
which is made to wait, on the GPU, for the copies issued on the device's stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from lifecycle._dlpack import FLAG_IS_COPIED, FLAG_READ_ONLY, to_capsule
from lifecycle.config import DTYPE_SIZES, DType, storage_dtype

if TYPE_CHECKING:
    from typing_extensions import CapsuleType

#: ``DLDeviceType`` of host memory and of CUDA device memory.
KDL_CPU: Final = 1
KDL_CUDA: Final = 2

#: ``(DLDataTypeCode, bits)`` of every element type a layer may store (dlpack.h's codes).
DLPACK_DTYPES: Final[dict[DType, tuple[int, int]]] = {
    "float16": (2, 16),  # kDLFloat
    "bfloat16": (4, 16),  # kDLBfloat
    "float32": (2, 32),
    "float8_e4m3fn": (10, 8),  # kDLFloat8_e4m3fn
    "float8_e5m2": (12, 8),  # kDLFloat8_e5m2
    "int8": (0, 8),  # kDLInt
    "uint8": (1, 8),  # kDLUInt
}

# numpy dtype kinds DLPack has a code for: signed, unsigned, float, bool
_KIND_CODES: Final = {"i": 0, "u": 1, "f": 2, "b": 6}


def element_of(dtype: npt.DTypeLike) -> tuple[np.dtype[Any], DType | None]:
    """``(numpy dtype of the view, element type name)``: a :data:`DType` name gives its storage
    dtype and itself; anything else is a numpy dtype, with no name of its own."""
    if isinstance(dtype, str) and dtype in DTYPE_SIZES:
        element: DType = dtype
        return storage_dtype(element), element
    return np.dtype(dtype), None


def dlpack_dtype(storage: np.dtype[Any], element: DType | None) -> tuple[int, int]:
    """The ``(code, bits)`` a view of ``storage`` holding ``element`` exports."""
    if element is not None:
        return DLPACK_DTYPES[element]
    code = _KIND_CODES.get(storage.kind)
    if code is None or storage.itemsize > 32 or storage.byteorder == ">":
        raise BufferError(f"__dlpack__: numpy dtype {storage} has no DLPack type")
    return code, storage.itemsize * 8


def wants_versioned(max_version: tuple[int, int] | None) -> bool:
    """Whether the consumer takes a ``"dltensor_versioned"`` capsule."""
    if max_version is None:
        return False
    try:
        major = int(max_version[0])
    except (TypeError, ValueError, IndexError):
        raise BufferError(f"__dlpack__: max_version={max_version!r} must be a (major, minor) pair") from None
    return major >= 1


def check_device(dl_device: tuple[int, int] | None, own: tuple[int, int]) -> None:
    """Refuse a ``dl_device`` other than the view's own (moving memory is not an export)."""
    if dl_device is not None and tuple(dl_device) != own:
        raise BufferError(f"__dlpack__: dl_device={tuple(dl_device)} but the view lives on {own}; copy it instead")


def element_strides(call: str, byte_strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides as element counts (DLPack's unit); a stride that is not a whole number of
    elements cannot be exported."""
    if any(stride % itemsize for stride in byte_strides):
        raise BufferError(f"{call}: strides {byte_strides} are not whole elements of {itemsize} bytes")
    return tuple(stride // itemsize for stride in byte_strides)


def capsule(owner: object, *, data: int, shape: tuple[int, ...], strides: tuple[int, ...], storage: np.dtype[Any],
            element: DType | None, device: tuple[int, int], max_version: tuple[int, int] | None,
            read_only: bool = False, copied: bool = False) -> CapsuleType:
    """The capsule of a view (``strides`` in elements), as the consumer's ``max_version`` wants it.
    A read-only view needs a versioned capsule to say so (BufferError otherwise)."""
    code, bits = dlpack_dtype(storage, element)
    versioned = wants_versioned(max_version)
    if read_only and not versioned:
        raise BufferError("__dlpack__: a read-only view needs a versioned capsule (max_version >= (1, 0)) to say so")
    flags = (FLAG_READ_ONLY if read_only else 0) | (FLAG_IS_COPIED if copied else 0)
    return to_capsule(owner, data=data, shape=shape, strides=strides, code=code, bits=bits, device_type=device[0],
                      device_id=device[1], versioned=versioned, flags=flags)
