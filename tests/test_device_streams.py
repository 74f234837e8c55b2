"""The library's copies on the engine's stream (``Device.use_stream``) and ordered with the engine's
events (``Device.record_event`` / ``Device.wait_event``), without a device-wide synchronize.

The ordering tests need the emulated driver, whose streams run their work only when drained (a
copy not ordered after a write reads the state from before it); each shows both sides. They run in
CI through tests/test_device_emulated.py. The argument checks run on every device.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from devices import (  # noqa: F401  (fixtures)
    Emulator,
    EngineStream,
    device,
    emu,
    engine,
    read_device,
    write_device,
)
from lifecycle.device.base import Device, event_handle
from lifecycle.errors import InvalidId

NBYTES = 512


def pattern(seed: int) -> npt.NDArray[np.uint8]:
    """Bytes never found in fresh memory by chance."""
    return np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8)


def zeroed(dev: Device, count: int) -> list[int]:
    """``count`` fresh allocations of NBYTES zero bytes, the zeros in place."""
    ptrs = [dev.alloc(NBYTES) for _ in range(count)]
    for ptr in ptrs:
        write_device(dev, ptr, np.zeros(NBYTES, dtype=np.uint8))
    return ptrs


def copy_in(dev: Device, ptr: int, data: npt.NDArray[np.uint8]) -> None:
    """An asynchronous host-to-device copy of ``data`` (kept alive by the caller until synchronize)."""
    dev.copy_htod(ptr, data.ctypes.data, data.nbytes)


class FakeTorchEvent:
    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


class FakeCudaCoreEvent:
    def __init__(self, handle: int) -> None:
        self.handle = handle


# === arguments, on every device ==========================================================================


@pytest.mark.parametrize("stream", [None, "stream", 1.5, -1, 2**64], ids=repr)
def test_use_stream_refuses_what_is_not_a_stream(device: Device, stream: object) -> None:
    with pytest.raises(InvalidId, match="use_stream"):
        with device.use_stream(stream):
            pass


@pytest.mark.parametrize("call", ["record_event", "wait_event"])
@pytest.mark.parametrize("event", [0, None, "event", FakeTorchEvent(0)], ids=["0", "None", "str", "unrecorded torch"])
def test_event_calls_refuse_what_is_not_an_event(device: Device, call: str, event: object) -> None:
    with pytest.raises(InvalidId, match=call):
        getattr(device, call)(event)


@pytest.mark.parametrize("event", [0x5000, FakeTorchEvent(0x5000), FakeCudaCoreEvent(0x5000)], ids=repr)
def test_event_handle_reads_a_handle_a_torch_event_and_a_cuda_core_event(event: object) -> None:
    assert event_handle(event) == 0x5000


def test_copies_issued_inside_use_stream_are_in_place_after_synchronize(device: Device) -> None:
    (ptr,) = zeroed(device, 1)
    data = pattern(1)
    with device.use_stream(0):  # the legacy default stream, as torch's default stream is
        copy_in(device, ptr, data)
        device.synchronize()
        assert np.array_equal(read_device(device, ptr, NBYTES), data)
    device.free(ptr)


# === ordering, on the emulated driver ====================================================================

WHERE = pytest.mark.parametrize("inside", [False, True], ids=["device stream", "use_stream"])
WAITS = pytest.mark.parametrize("waits", [False, True], ids=["no wait", "waits"])


@WHERE
def test_copies_inside_use_stream_run_after_the_engines_earlier_kernels_without_a_wait(
    device: Device, engine: EngineStream, inside: bool
) -> None:
    src, dst = zeroed(device, 2)
    written = pattern(3)
    engine.write(src, written)  # a kernel still in flight
    if inside:
        with device.use_stream(engine):
            device.copy_dtod(dst, src, NBYTES)
    else:
        device.copy_dtod(dst, src, NBYTES)
    assert np.array_equal(read_device(device, dst, NBYTES), written) == inside
    device.free(src)
    device.free(dst)


def test_entering_use_stream_orders_the_engines_stream_after_the_devices_earlier_copies(
    device: Device, engine: EngineStream
) -> None:
    a, b = zeroed(device, 2)
    data = pattern(4)
    copy_in(device, a, data)  # on the device's stream, in flight
    with device.use_stream(engine):
        device.copy_dtod(b, a, NBYTES)
    engine.synchronize()  # runs the engine's stream alone: its copy must wait for the device's
    assert np.array_equal(read_device(device, b, NBYTES), data)
    device.free(a)
    device.free(b)


def test_copies_after_the_block_run_after_the_copies_issued_inside(device: Device, engine: EngineStream) -> None:
    a, b = zeroed(device, 2)
    data = pattern(5)
    with device.use_stream(engine):
        copy_in(device, a, data)  # on the engine's stream, in flight
    device.copy_dtod(b, a, NBYTES)  # on the device's stream again
    assert np.array_equal(read_device(device, b, NBYTES), data)
    device.free(a)
    device.free(b)


def test_synchronize_after_the_block_runs_the_copies_issued_inside(device: Device, emu: Emulator,
                                                                   engine: EngineStream) -> None:
    (ptr,) = zeroed(device, 1)
    data = pattern(2)
    with device.use_stream(engine):
        copy_in(device, ptr, data)
    assert emu.pending_ops > 0
    device.synchronize()
    assert emu.pending_ops == 0
    device.free(ptr)


def test_synchronize_inside_the_block_runs_the_engines_stream(device: Device, emu: Emulator,
                                                               engine: EngineStream) -> None:
    (ptr,) = zeroed(device, 1)
    data = pattern(6)
    with device.use_stream(engine):
        copy_in(device, ptr, data)
        assert emu.pending_ops > 0
        device.synchronize()
        assert emu.pending_ops == 0
    device.free(ptr)


def test_copies_leave_the_engines_stream_when_the_block_ends_by_an_exception(
    device: Device, engine: EngineStream
) -> None:
    src, dst = zeroed(device, 2)
    engine.write(src, pattern(7))
    with pytest.raises(RuntimeError, match="engine failed"):
        with device.use_stream(engine):
            raise RuntimeError("engine failed")
    device.copy_dtod(dst, src, NBYTES)  # on the device's stream: not ordered after the engine's write
    assert not read_device(device, dst, NBYTES).any()
    device.free(src)
    device.free(dst)


def test_an_inner_block_returns_the_copies_to_the_outer_blocks_stream(device: Device, engine: EngineStream) -> None:
    src, dst = zeroed(device, 2)
    written = pattern(8)
    engine.write(src, written)
    with device.use_stream(engine):
        with device.use_stream(0):
            pass
        device.copy_dtod(dst, src, NBYTES)  # on the engine's stream again: after its write
    assert np.array_equal(read_device(device, dst, NBYTES), written)
    device.free(src)
    device.free(dst)


@WAITS
def test_an_engine_waiting_for_record_event_runs_its_kernels_after_the_devices_copies(
    device: Device, engine: EngineStream, waits: bool
) -> None:
    (ptr,) = zeroed(device, 1)
    ours, theirs = pattern(9), pattern(10)
    copy_in(device, ptr, ours)
    event = engine.new_event()
    device.record_event(event)
    if waits:
        engine.wait(event)
    engine.write(ptr, theirs)
    engine.synchronize()
    device.synchronize()
    final = read_device(device, ptr, NBYTES)
    assert np.array_equal(final, theirs if waits else ours)
    device.free(ptr)


@WAITS
def test_copies_after_wait_event_see_what_the_engine_wrote_before_recording_it(
    device: Device, engine: EngineStream, waits: bool
) -> None:
    src, dst = zeroed(device, 2)
    written = pattern(11)
    engine.write(src, written)
    event = engine.new_event()
    engine.record(event)
    if waits:
        device.wait_event(FakeTorchEvent(event))
    device.copy_dtod(dst, src, NBYTES)
    assert np.array_equal(read_device(device, dst, NBYTES), written) == waits
    device.free(src)
    device.free(dst)


def test_record_event_inside_use_stream_covers_the_blocks_copies(device: Device, emu: Emulator,
                                                                 engine: EngineStream) -> None:
    (ptr,) = zeroed(device, 1)
    ours, theirs = pattern(12), pattern(13)
    other = EngineStream(emu)
    try:
        event = other.new_event()
        with device.use_stream(engine):
            copy_in(device, ptr, ours)
            device.record_event(event)
        other.wait(event)
        other.write(ptr, theirs)
        other.synchronize()  # runs the block's copy first, then the write
        assert np.array_equal(read_device(device, ptr, NBYTES), theirs)
    finally:
        other.close()
    device.free(ptr)

