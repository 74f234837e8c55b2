"""DLPack capsules over memory the library owns (pyx/dlpack.pyx)."""

from typing_extensions import CapsuleType

DLPACK_VERSION: tuple[int, int]
FLAG_READ_ONLY: int
FLAG_IS_COPIED: int

def to_capsule(
    owner: object,
    *,
    data: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    code: int,
    bits: int,
    device_type: int,
    device_id: int,
    versioned: bool,
    flags: int,
) -> CapsuleType:
    """A DLPack capsule (``"dltensor_versioned"`` when ``versioned``, else ``"dltensor"``) over
    ``data``, shaped ``shape`` with ``strides`` counted in elements, of DLPack type ``(code,
    bits)`` on device ``(device_type, device_id)``, holding a reference on ``owner`` until the
    consumer deletes the tensor. ``flags`` applies to a versioned capsule only."""
