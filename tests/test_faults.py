"""Fault injection at every device call the model makes, through the emulated CUDA driver.

A representative lifecycle (construction, every device-touching method, teardown) is run once to
count its driver calls; then, for every call index N, a fresh device and model run it again with
call N failing: once (a transient fault: the emulator's sticky fault is lifted as soon as the
device layer turns it into a ``CudaError``), or from N on (a sticky error: the GPU is gone). Each
time the fault must surface as a ``CudaError``, every block, slot and adapter reference must come
back, and the model must either stay usable (transient) or tear down without hanging, leaving the
device able to free everything once the driver recovers (sticky). Then: allocation budgets, named
failing copies, and a seeded random soak with faults at random calls.

Every test here needs the emulator (the ``emu`` fixture skips them elsewhere); they run in CI
through ``tests/test_device_emulated.py``.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
import pytest

from lifecycle.device.base import Device
from lifecycle.errors import CudaError
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from devices import (  # noqa: F401  (fixtures)
    CUDA_ERROR_ILLEGAL_ADDRESS,
    CUDA_ERROR_LAUNCH_FAILED,
    CUDA_ERROR_OUT_OF_MEMORY,
    Emulator,
    device,
    emu,
    make_device,
)
from reliability_driver import (
    CONFIGS,
    FAULT_PROMPT,
    count_lifecycle_calls,
    fault_sweep,
    one_shot_faults,
    release_everything,
    soak,
)

CONFIG = CONFIGS["hybrid"]
PROMPT = FAULT_PROMPT


def batch_copy_entry_point(dev: Device) -> str:
    """The driver call a batched copy reaches: cuMemcpyBatchAsync, or the first cuMemcpyAsync of
    the loop on a driver without it (before CUDA 12.8)."""
    return "cuMemcpyBatchAsync" if getattr(dev, "batch_copies") else "cuMemcpyAsync"


@pytest.fixture
def one_shot(emu: Emulator) -> Iterator[Emulator]:
    """Faults injected through this emulator fail exactly one driver call."""
    with one_shot_faults(emu):
        yield emu


# ----------------------------------------------------------------------------- enumeration


def test_the_lifecycle_makes_the_same_driver_calls_every_run(emu: Emulator) -> None:
    first, steps = count_lifecycle_calls(emu, make_device, CONFIG)
    second, _ = count_lifecycle_calls(emu, make_device, CONFIG)
    assert first == second and first > 0
    touched = {step for step, _ in steps}
    # every device-touching step made at least one call: none is silently skipped
    assert {"HybridModel() (pool allocations)", "teardown (frees)", "cache_sequence (snapshot save)",
            "save_snapshot", "attach_prefix (snapshot restore)", "compact_sequence (free slot)",
            "compact_sequence (retired slot)", "save_sequence_state", "restore_sequence_state",
            "alloc_sequence (zero slot)", "bind_gpu_to_thread"} <= touched


def test_a_transient_fault_at_every_driver_call_surfaces_cleanly_and_the_model_stays_usable(
    one_shot: Emulator,
) -> None:
    result = fault_sweep(one_shot, make_device, sticky=False, code=CUDA_ERROR_LAUNCH_FAILED)
    assert result.never_surfaced == [] and result.surfaced == result.calls
    assert not result.broken, f"invariants broken after a fault in: {dict(result.broken)}"
    assert result.survived == result.calls
    assert result.leaks == 0
    print(f"{result.calls} driver calls, {len(result.sites)} (step, entry point) sites: {dict(result.sites)}")


def test_a_sticky_error_from_every_driver_call_surfaces_and_teardown_finishes(emu: Emulator) -> None:
    result = fault_sweep(emu, make_device, sticky=True, code=CUDA_ERROR_ILLEGAL_ADDRESS)
    assert result.never_surfaced == [] and result.surfaced == result.calls
    # host-side bookkeeping needs no driver: every reference still comes back
    assert not result.broken, f"invariants broken after a fault in: {dict(result.broken)}"
    assert result.survived == result.calls
    assert result.leaks == 0
    # the driver is dead: teardown raises its error (after trying every release) instead of hanging
    assert result.teardown_raised > 0


# ----------------------------------------------------------------------------- named faults


def test_construction_past_the_allocation_budget_leaks_nothing(device: Device, emu: Emulator) -> None:
    baseline_bytes, baseline = emu.live_bytes, emu.live_allocations
    m = HybridModel(CONFIG, device)
    need = emu.live_bytes - baseline_bytes
    m.teardown()
    for budget in (0, 1, need // 3, need // 2, need - 1):
        emu.set_alloc_budget(baseline_bytes + budget)
        with pytest.raises(CudaError) as failure:
            HybridModel(CONFIG, device)
        assert failure.value.code == CUDA_ERROR_OUT_OF_MEMORY
        assert emu.live_allocations == baseline
    emu.set_alloc_budget(baseline_bytes + need)
    fits = HybridModel(CONFIG, device)
    fits.teardown()
    assert emu.live_allocations == baseline


def _two_sequences(m: HybridModel) -> tuple[SequenceState, SequenceState]:
    a = m.alloc_sequence()
    m.attach_prefix(a, PROMPT)
    m.grow(a, 16)
    b = m.alloc_sequence()
    m.check_invariants()
    return a, b


@pytest.mark.parametrize("entry_point", ["batch copy", "cuStreamSynchronize"])
def test_a_failing_compaction_copy_moves_nothing(device: Device, emu: Emulator, entry_point: str) -> None:
    if entry_point == "batch copy":
        entry_point = batch_copy_entry_point(device)
    m = HybridModel(CONFIG, device)
    a, b = _two_sequences(m)
    slot, addrs = a.slot_idx, a.ssm_addrs
    target = next(s for s in range(CONFIG.max_seqs) if m.slots.is_free(s))
    emu.fail_call(entry_point, CUDA_ERROR_ILLEGAL_ADDRESS, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.compact_sequence(a, target)
    m.check_invariants()
    assert (a.slot_idx, a.ssm_addrs) == (slot, addrs) and m.slots.is_free(target)
    m.compact_sequence(a, target)  # the retry works
    assert a.slot_idx == target and m.slots.is_free(slot)
    for seq in (a, b):
        m.free_sequence(seq)
    release_everything(m, [])
    m.teardown()


def test_a_failing_slot_zeroing_gives_the_slot_back(device: Device, emu: Emulator) -> None:
    m = HybridModel(CONFIG, device)
    emu.fail_call("cuMemsetD8Async", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match="cuMemsetD8Async"):
        m.alloc_sequence()
    assert m.slots.num_free == CONFIG.max_seqs and m.num_live_sequences == 0
    m.check_invariants()
    m.free_sequence(m.alloc_sequence())
    m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0


@pytest.mark.parametrize("entry_point", ["cuMemHostAlloc", "cuMemcpyDtoHAsync", "cuStreamSynchronize"])
def test_a_failing_swap_out_copy_frees_nothing_and_the_next_save_works(
    device: Device, emu: Emulator, entry_point: str
) -> None:
    m = HybridModel(CONFIG, device)
    a, b = _two_sequences(m)
    refs = m.pool.refcounts()
    emu.fail_call(entry_point, CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.save_sequence_state(a, io.BytesIO())
    m.check_invariants()
    assert np.array_equal(refs, m.pool.refcounts()) and not a.is_freed
    out = io.BytesIO()
    m.save_sequence_state(a, out)
    m.restore_sequence_state(b, a.num_blocks, io.BytesIO(out.getvalue()))
    assert np.array_equal(b.tokens, a.tokens)
    for seq in (a, b):
        m.free_sequence(seq)
    release_everything(m, [])
    m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0


@pytest.mark.parametrize("entry_point", ["cuMemcpyHtoDAsync", "cuStreamSynchronize"])
def test_a_failing_swap_in_copy_leaves_the_target_fresh(device: Device, emu: Emulator, entry_point: str) -> None:
    m = HybridModel(CONFIG, device)
    a, b = _two_sequences(m)
    out = io.BytesIO()
    m.save_sequence_state(a, out)
    refs = m.pool.refcounts()
    emu.fail_call(entry_point, CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.restore_sequence_state(b, a.num_blocks, io.BytesIO(out.getvalue()))
    m.check_invariants()
    assert b.num_blocks == 0 and b.num_tokens == 0 and np.array_equal(refs, m.pool.refcounts())
    m.restore_sequence_state(b, a.num_blocks, io.BytesIO(out.getvalue()))
    assert np.array_equal(b.tokens, a.tokens)
    for seq in (a, b):
        m.free_sequence(seq)
    release_everything(m, [])
    m.teardown()


def test_a_failing_snapshot_restore_during_attach_is_a_failed_prefill(device: Device, emu: Emulator) -> None:
    m = HybridModel(CONFIG, device)
    a = m.alloc_sequence()
    m.attach_prefix(a, PROMPT)
    m.grow(a, 16)
    m.save_snapshot(a, 8)
    b = m.alloc_sequence()
    emu.fail_call(batch_copy_entry_point(device), CUDA_ERROR_LAUNCH_FAILED, 1)
    refs = m.pool.refcounts()
    with pytest.raises(CudaError):
        m.attach_prefix(b, PROMPT)
    m.check_invariants()
    # the snapshot is restored before any reference is taken: nothing to undo
    assert b.num_blocks == 0 and b.num_tokens == 0 and np.array_equal(refs, m.pool.refcounts())
    assert m.attach_prefix(b, PROMPT) == 8  # the retried prefill reuses the prefix
    m.free_sequence(b)
    m.free_sequence(a)
    release_everything(m, [])
    m.teardown()


def test_a_failing_snapshot_copy_gives_the_snapshot_back(device: Device, emu: Emulator) -> None:
    m = HybridModel(CONFIG, device)
    a = m.alloc_sequence()
    m.attach_prefix(a, PROMPT)
    m.grow(a, 16)
    emu.fail_call(batch_copy_entry_point(device), CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError):
        m.save_snapshot(a, 8)
    m.check_invariants()
    assert m.save_snapshot(a, 8)  # the retry finds the snapshot pool whole
    m.check_invariants()
    m.free_sequence(a)
    release_everything(m, [])
    m.teardown()


def test_teardown_closes_its_own_device_even_when_a_free_fails(emu: Emulator) -> None:
    m = HybridModel(CONFIG, "cuda")
    emu.fail_call("cuMemFree", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError):
        m.teardown()
    emu.reset()
    m.teardown()
    assert m.device.closed  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- random soak


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_random_operations_survive_random_faults(device: Device, one_shot: Emulator, config_name: str) -> None:
    driver = soak(device, one_shot, CONFIGS[config_name], 1200, seed=11)
    counts = driver.counts
    assert counts.faults_injected > 0 and counts.faults_survived == counts.faults_injected
    assert counts.leaks == 0
    print(f"{config_name}: {counts.faults_injected} faults survived over {counts.operations} ops: "
          f"{dict(counts.faults_by_call)}")
