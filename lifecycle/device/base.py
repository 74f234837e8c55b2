"""The device interface: bytes and addresses, nothing about blocks, tries or sequences.

Two implementations behave identically: :class:`~lifecycle.device.host.HostDevice` (host memory,
the embedded default) and :class:`~lifecycle.device.cuda.CudaDevice` (``cuda.bindings.driver``).
Addresses are plain ``int``. Copies are asynchronous on the device's own stream: their data is only
guaranteed to be in place after :meth:`Device.synchronize`. ``host`` addresses passed to copies are
host pointers (pinned ones from :meth:`Device.alloc_pinned` give full speed on CUDA).

The device's stream is its own: work an engine issues on other streams is not ordered with it
until :meth:`Device.wait_stream` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol, SupportsInt, runtime_checkable

import numpy as np
import numpy.typing as npt

from lifecycle.errors import InvalidId

DeviceKind = Literal["host", "cuda"]

#: A raw CUstream handle is a pointer (0: the legacy default stream; 1 and 2: the special handles
#: CU_STREAM_LEGACY and CU_STREAM_PER_THREAD), so it fits in 64 bits.
_MAX_HANDLE = 1 << 64

#: One copy of a batch: (destination address, source address, byte count).
Copy = tuple[int, int, int]


@runtime_checkable
class Device(Protocol):
    """Raw memory and copies on one device; see the module docstring for the rules."""

    @property
    def kind(self) -> DeviceKind:
        """``"host"`` or ``"cuda"``."""
        ...

    @property
    def name(self) -> str:
        """Human-readable name, e.g. ``"host"`` or ``"cuda:0 (NVIDIA H200)"``."""
        ...

    def bind_to_thread(self) -> None:
        """Make the device's context current on the calling thread (no-op on host)."""
        ...

    def alloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory; returns its address. Raises on failure."""
        ...

    def free(self, ptr: int) -> None:
        """Free memory returned by :meth:`alloc`. Freeing an unknown address raises."""
        ...

    def alloc_pinned(self, nbytes: int) -> int:
        """Allocate page-locked host memory (plain host memory on the host device)."""
        ...

    def free_pinned(self, ptr: int) -> None:
        """Free memory returned by :meth:`alloc_pinned`."""
        ...

    def copy_dtod(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device copy, asynchronous on the device's stream."""
        ...

    def copy_htod(self, dst: int, src_host: int, nbytes: int) -> None:
        """Host to device copy, asynchronous on the device's stream."""
        ...

    def copy_dtoh(self, dst_host: int, src: int, nbytes: int) -> None:
        """Device to host copy, asynchronous on the device's stream."""
        ...

    def copy_batch(self, copies: Sequence[Copy] | npt.NDArray[np.int64]) -> None:
        """Copies in one call; copies within one batch are unordered.

        ``copies`` is a sequence of (dst, src, nbytes) or, cheapest for large batches, an (n, 3)
        int64 array of such rows. Each range lies in device memory from :meth:`alloc` or in pinned
        memory from :meth:`alloc_pinned` (so a swap can gather blocks into a staging buffer in one
        call). Every range is checked before any copy is issued, and so is the order-independence
        of the batch: a destination overlapping another copy's destination or any source (its own
        included) is refused, since the copies may run in any order."""
        ...

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` bytes at ``ptr`` to ``value`` (0..255), asynchronously."""
        ...

    def synchronize(self) -> None:
        """Wait until every copy and memset issued so far on the device's stream is done."""
        ...

    def wait_stream(self, stream: object) -> None:
        """Order the device's later copies and memsets after all work issued so far on another
        stream (an engine's, whose kernels may still be writing the pools), without blocking the
        caller. ``stream`` is a raw ``CUstream`` handle (int) or a stream object: see
        :func:`stream_handle`. A no-op on the host device, whose memory has no streams."""
        ...

    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""
        ...

    def host_array(self, ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """A uint8 numpy view of ``nbytes`` of *host* memory at ``ptr`` (pinned or plain)."""
        ...

    def device_array(self, ptr: int, shape: tuple[int, ...], dtype: npt.DTypeLike) -> Any:
        """A zero-copy array view of device memory: numpy on host; on CUDA an object with
        ``__cuda_array_interface__`` (version 3) that torch, CuPy and Numba accept."""
        ...

    def close(self) -> None:
        """Release what the device itself holds (stream, context reference). Idempotent."""
        ...


def stream_handle(stream: object) -> int:
    """The raw ``CUstream`` handle of ``stream``: an int, an object implementing the CUDA stream
    protocol (``__cuda_stream__()``, e.g. ``cuda.core``), an object with a ``cuda_stream``
    attribute (``torch.cuda.Stream``), or one ``int()`` converts (``cuda.bindings``' ``CUstream``).
    Anything else raises :class:`~lifecycle.errors.InvalidId` naming it."""
    handle: object
    if isinstance(stream, int) and not isinstance(stream, bool):
        handle = stream
    elif hasattr(stream, "__cuda_stream__"):
        protocol = stream.__cuda_stream__()
        handle = protocol[1] if isinstance(protocol, tuple) and len(protocol) == 2 else protocol
    elif hasattr(stream, "cuda_stream"):
        handle = stream.cuda_stream
    elif isinstance(stream, SupportsInt) and not isinstance(stream, (bool, float)):
        handle = int(stream)
    else:
        raise InvalidId(
            f"wait_stream: {stream!r} is not a stream (give a CUstream handle as an int, or an object "
            "with __cuda_stream__ or cuda_stream)"
        )
    if not isinstance(handle, int) or isinstance(handle, bool) or not 0 <= handle < _MAX_HANDLE:
        raise InvalidId(f"wait_stream: stream handle {handle!r} of {stream!r} must be an int in [0, 2**64)")
    return handle
