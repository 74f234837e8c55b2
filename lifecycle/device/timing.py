"""Policy composed around a device: a wrapper that is itself a device and forwards to the one inside.

:class:`CopyTimingDevice` times the copies of any device it wraps, so that the device itself stays
free of policy (as RMM's resource adaptors wrap a memory resource); ``lifecycle.simulate`` uses it
to tell the library's device copies from its bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from lifecycle.device.base import Copy, Device, DeviceKind

__all__ = ["CopyTimingDevice"]


class CopyTimingDevice:
    """A :class:`~lifecycle.device.base.Device` that forwards every call to ``inner`` and adds the
    wall time of each copy, memset and synchronize to ``copy_ns[cause]`` for the ``cause`` set at
    the time (None: not counted). Everything else, implementation-specific attributes included,
    is the inner device's."""

    def __init__(self, inner: Device, *, close_with_simulation: bool = False) -> None:
        self.inner = inner
        self.cause: str | None = None
        self.copy_ns: dict[str, int] = {}
        #: :func:`simulate` closes this device after tearing the model down (the model does not).
        self.close_with_simulation = close_with_simulation

    def _add(self, started: int) -> None:
        if self.cause is not None:
            self.copy_ns[self.cause] = self.copy_ns.get(self.cause, 0) + time.perf_counter_ns() - started

    @property
    def kind(self) -> DeviceKind:
        return self.inner.kind

    @property
    def name(self) -> str:
        return self.inner.name

    def bind_to_thread(self) -> None:
        self.inner.bind_to_thread()

    def alloc(self, nbytes: int) -> int:
        return self.inner.alloc(nbytes)

    def free(self, ptr: int) -> None:
        self.inner.free(ptr)

    def alloc_pinned(self, nbytes: int) -> int:
        return self.inner.alloc_pinned(nbytes)

    def free_pinned(self, ptr: int) -> None:
        self.inner.free_pinned(ptr)

    def _timed(self, operation: Callable[..., None], *args: Any) -> None:
        started = time.perf_counter_ns()
        try:
            operation(*args)
        finally:
            self._add(started)

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        self._timed(self.inner.copy_dtod, dst, src, nbytes)

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        self._timed(self.inner.copy_htod, dst, src_host, nbytes)

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        self._timed(self.inner.copy_dtoh, dst_host, src, nbytes)

    def copy_htod_to(self, dst: int, src_host: int, nbytes: int) -> None:
        self._timed(self.inner.copy_htod_to, dst, src_host, nbytes)

    def copy_batch(self, copies: Sequence[Copy] | npt.NDArray[np.int64]) -> None:
        self._timed(self.inner.copy_batch, copies)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._timed(self.inner.memset, ptr, value, nbytes)

    def synchronize(self) -> None:
        self._timed(self.inner.synchronize)

    def mem_info(self) -> tuple[int, int]:
        return self.inner.mem_info()

    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        return self.inner.host_array(ptr, nbytes)

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Any:
        return self.inner.device_array(ptr, shape, dtype)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"CopyTimingDevice({self.inner!r})"
