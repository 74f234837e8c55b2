"""The engine's kernels run on streams of their own: the library reads what they write only after
being told to wait for their stream (``Device.wait_stream``, ``HybridModel.wait_stream``), or when
they issue their copies on the engine's stream itself (``Device.use_stream``).

An engine kernel still writing the pools is emulated by a write queued on another stream of the
emulated driver (``EngineStream``), which lands only when that stream's work runs. Each test shows
both sides: without the wait the library's copies read the state from before the write, after it
they read the write. They need the emulator and run in CI through tests/test_device_emulated.py.
"""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
import pytest

from devices import (  # noqa: F401  (fixtures)
    EngineStream,
    Emulator,
    device,
    emu,
    engine,
    read_device,
    write_device,
)
from lifecycle.device.base import Device
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from reliability_driver import CONFIGS, FAULT_PROMPT

CONFIG = CONFIGS["hybrid"]
WAITS = pytest.mark.parametrize("waits", [False, True], ids=["no wait", "wait_stream"])


def engine_bytes(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    """What the engine's kernel writes: random bytes, never found in fresh state by chance."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@WAITS
def test_device_copies_read_an_engine_write_only_after_waiting_for_its_stream(
    device: Device, engine: EngineStream, waits: bool
) -> None:
    ptr = device.alloc(1024)
    write_device(device, ptr, np.zeros(1024, dtype=np.uint8))
    written = engine_bytes(1024, seed=1)
    engine.write(ptr, written)
    if waits:
        device.wait_stream(engine.cuda_stream)
    assert np.array_equal(read_device(device, ptr, 1024), written) == waits
    device.free(ptr)


@WAITS
def test_the_legacy_default_stream_can_be_waited_for(device: Device, emu: Emulator, waits: bool) -> None:
    ptr = device.alloc(256)
    write_device(device, ptr, np.zeros(256, dtype=np.uint8))
    written = engine_bytes(256, seed=2)
    emu.engine_write(0, ptr, written)  # torch's default stream is the legacy stream, handle 0
    if waits:
        device.wait_stream(0)
    assert np.array_equal(read_device(device, ptr, 256), written) == waits
    device.free(ptr)


def _model_with_a_sequence(device: Device) -> tuple[HybridModel, SequenceState]:
    m = HybridModel(CONFIG, device)
    seq = m.alloc_sequence()
    m.attach_prefix(seq, FAULT_PROMPT)
    m.grow(seq, 16)
    m.check_invariants()
    return m, seq


def _finish(m: HybridModel, *seqs: SequenceState) -> None:
    for seq in seqs:
        m.free_sequence(seq)
    m.check_invariants()
    m.teardown()


@pytest.mark.parametrize("target", ["kv", "ssm"])
@WAITS
def test_save_sequence_state_reads_engine_writes_only_after_wait_stream(
    device: Device, engine: EngineStream, target: str, waits: bool
) -> None:
    m, seq = _model_with_a_sequence(device)
    if target == "kv":
        assert m.kv_pool is not None
        addr = m.kv_pool.block_addr(0, int(m.block_table(seq)[0]))
    else:
        addr = seq.ssm_addrs[0][0]
    written = engine_bytes(48, seed=3)
    engine.write(addr, written)
    if waits:
        m.wait_stream(engine)
    record = io.BytesIO()
    m.save_sequence_state(seq, record)
    assert (written.tobytes() in record.getvalue()) == waits
    _finish(m, seq)


@WAITS
def test_save_snapshot_reads_engine_writes_only_after_wait_stream(
    device: Device, engine: EngineStream, waits: bool
) -> None:
    m, a = _model_with_a_sequence(device)
    h_addr, _ = a.ssm_addrs[0]
    h_bytes = CONFIG.ssm_layers[0].h_state_bytes
    written = engine_bytes(h_bytes, seed=4)
    engine.write(h_addr, written)  # the state after the 8 tokens the snapshot covers
    if waits:
        m.wait_stream(engine)
    assert m.save_snapshot(a, 8)
    b = m.alloc_sequence()
    assert m.attach_prefix(b, FAULT_PROMPT) == 8  # restores the snapshot into b's slot
    m.check_invariants()
    assert np.array_equal(read_device(device, b.ssm_addrs[0][0], h_bytes), written) == waits
    _finish(m, a, b)


@WAITS
def test_compaction_moves_engine_writes_only_after_wait_stream(
    device: Device, engine: EngineStream, waits: bool
) -> None:
    m, seq = _model_with_a_sequence(device)
    h_bytes = CONFIG.ssm_layers[0].h_state_bytes
    written = engine_bytes(h_bytes, seed=5)
    engine.write(seq.ssm_addrs[0][0], written)
    if waits:
        m.wait_stream(engine)
    target = (seq.slot_idx + 1) % CONFIG.max_seqs
    m.compact_sequence(seq, target)
    m.check_invariants()
    assert seq.slot_idx == target
    assert np.array_equal(read_device(device, seq.ssm_addrs[0][0], h_bytes), written) == waits
    _finish(m, seq)


@pytest.mark.parametrize("inside", [False, True], ids=["device stream", "use_stream"])
def test_compaction_on_the_engines_stream_moves_its_writes_without_a_wait(
    device: Device, engine: EngineStream, inside: bool
) -> None:
    m, seq = _model_with_a_sequence(device)
    h_bytes = CONFIG.ssm_layers[0].h_state_bytes
    written = engine_bytes(h_bytes, seed=6)
    engine.write(seq.ssm_addrs[0][0], written)
    target = (seq.slot_idx + 1) % CONFIG.max_seqs
    if inside:
        with device.use_stream(engine):
            m.compact_sequence(seq, target)
    else:
        m.compact_sequence(seq, target)
    m.check_invariants()
    assert np.array_equal(read_device(device, seq.ssm_addrs[0][0], h_bytes), written) == inside
    _finish(m, seq)


@pytest.mark.parametrize("inside", [False, True], ids=["device stream", "use_stream"])
def test_save_sequence_state_on_the_engines_stream_reads_its_writes_without_a_wait(
    device: Device, engine: EngineStream, inside: bool
) -> None:
    m, seq = _model_with_a_sequence(device)
    written = engine_bytes(48, seed=7)
    engine.write(seq.ssm_addrs[0][0], written)
    record = io.BytesIO()
    if inside:
        with device.use_stream(engine):
            m.save_sequence_state(seq, record)
    else:
        m.save_sequence_state(seq, record)
    assert (written.tobytes() in record.getvalue()) == inside
    _finish(m, seq)
