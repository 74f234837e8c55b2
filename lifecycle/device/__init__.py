"""Device layer: raw memory and copies on the host or on a CUDA GPU, behind one interface.

``open_device("auto")`` picks CUDA only when a driver loads and a GPU is present, else the host,
and logs which it picked.
"""

from __future__ import annotations

import logging
from typing import Literal

from lifecycle.device.base import Copy, Device, DeviceKind, event_handle, stream_handle
from lifecycle.device.host import HostDevice
from lifecycle.errors import ConfigError, DriverNotFound, ForkedAfterCudaInit

__all__ = ["Copy", "Device", "DeviceKind", "HostDevice", "event_handle", "open_device", "stream_handle"]

_log = logging.getLogger("lifecycle.device")


def open_device(kind: Literal["auto", "host", "cuda"] = "auto", ordinal: int = 0) -> Device:
    """Open a device. ``"cuda"`` raises :class:`DriverNotFound` without a driver or GPU (or in a
    process forked after CUDA was initialised); ``"auto"`` falls back to :class:`HostDevice` then,
    and logs its choice (at INFO level, at WARNING for a forked process, which has a GPU it cannot
    use)."""
    if kind == "host":
        return HostDevice()
    if kind == "cuda":
        from lifecycle.device.cuda import CudaDevice

        return CudaDevice(ordinal)
    if kind == "auto":
        try:
            from lifecycle.device.cuda import CudaDevice

            device: Device = CudaDevice(ordinal)
        except DriverNotFound as exc:
            level = logging.WARNING if isinstance(exc, ForkedAfterCudaInit) else logging.INFO
            _log.log(level, "open_device('auto'): using the host device (%s)", exc)
            return HostDevice()
        _log.info("open_device('auto'): using %s", device.name)
        return device
    raise ConfigError(f"open_device: kind={kind!r} must be one of 'auto', 'host', 'cuda'")
