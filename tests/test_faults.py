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
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import lifecycle.device.cuda as cuda_module
from lifecycle.config import ModelConfig
from lifecycle.device.base import Device
from lifecycle.errors import CudaError, InvariantViolation, TornDown
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
from reliability import CONFIGS, Driver, RandomChooser

CONFIG = CONFIGS["hybrid"]
PROMPT = np.arange(1, 15, dtype=np.int32)  # 14 tokens: 3 full blocks of 4, so a lookup reuses up to 3


@dataclass
class Lifecycle:
    """One run of the representative lifecycle; what a test inspects after a fault."""

    model: HybridModel | None = None
    held: list[SequenceState] = field(default_factory=list)
    step: str = "start"
    #: (step, driver calls it made), filled by the counting run
    calls: list[tuple[str, int]] = field(default_factory=list)


def workload(life: Lifecycle, emulator: Emulator | None = None) -> None:
    """Every model method that touches the device, in the order a serving engine calls them."""
    m = life.model
    assert m is not None
    last = emulator.call_count if emulator is not None else 0

    def at(step: str) -> None:
        nonlocal last
        if emulator is not None:
            now = emulator.call_count
            life.calls.append((life.step, now - last))
            last = now
        life.step = step

    at("bind_gpu_to_thread")
    m.bind_gpu_to_thread()
    at("alloc_sequence (zero slot)")
    a = m.alloc_sequence()
    life.held.append(a)
    at("attach_prefix (miss)")
    m.attach_prefix(a, PROMPT)
    m.grow(a, 16)
    a.append_tokens([7, 7])
    at("cache_sequence (snapshot save)")
    m.cache_sequence(a)
    at("save_snapshot")
    m.save_snapshot(a, 8)
    at("alloc_sequence (zero slot) 2")
    b = m.alloc_sequence()
    life.held.append(b)
    at("attach_prefix (snapshot restore)")
    m.attach_prefix(b, PROMPT)
    m.grow(b, 20)
    b.append_tokens(range(100, 106))
    at("compact_sequence (free slot)")
    free_slot = next(s for s in range(CONFIG.max_seqs) if m._slots.is_free(s))
    m.compact_sequence(b, free_slot)
    at("compact_sequence (retired slot)")
    m.retire_sequence(a)
    m.compact_sequence(b, a.slot_idx)
    at("save_sequence_state")
    record = io.BytesIO()
    m.save_sequence_state(b, record)
    at("alloc_sequence (zero slot) 3")
    c = m.alloc_sequence()
    life.held.append(c)
    at("restore_sequence_state")
    m.restore_sequence_state(c, b.num_blocks, io.BytesIO(record.getvalue()))
    at("save_sequence_state (staging reused)")
    m.save_sequence_state(c, io.BytesIO())
    at("free")
    for seq in life.held:
        m.free_sequence(seq)
    life.held.clear()
    at("done")


def run_lifecycle(life: Lifecycle, dev: Device, emulator: Emulator | None = None) -> None:
    """Construct, run the workload, tear down."""
    life.step = "HybridModel() (pool allocations)"
    start = emulator.call_count if emulator is not None else 0
    life.model = HybridModel(CONFIG, dev)
    if emulator is not None:
        life.calls.append((life.step, emulator.call_count - start))
    workload(life, emulator)
    life.step = "teardown (frees)"
    start = emulator.call_count if emulator is not None else 0
    life.model.teardown()
    if emulator is not None:
        life.calls.append((life.step, emulator.call_count - start))
    life.step = "after teardown"


def release_everything(m: HybridModel, held: list[SequenceState]) -> None:
    """Free what the lifecycle still holds and require every reference back."""
    m.check_invariants()
    for seq in held:
        m.free_sequence(seq)
    held.clear()
    m.check_invariants()
    while m.reclaim_prefix_blocks(m.num_total_blocks()):
        pass
    assert m.num_free_blocks() == m.num_total_blocks()
    assert m._slots.num_free == CONFIG.max_seqs
    assert sum(m._adapters.refcounts()) == 0
    assert m.num_live_sequences == 0


@pytest.fixture
def one_shot(monkeypatch: pytest.MonkeyPatch, emu: Emulator) -> Emulator:
    """Make the emulator's sticky fault one-shot: lifted the moment the device layer builds the
    CudaError for it (every failing call goes through ``_error``), so exactly one call fails."""
    original = cuda_module._error

    def lift_then_report(driver: Any, call: str, err: Any) -> CudaError:
        emu.reset()
        return original(driver, call, err)

    monkeypatch.setattr(cuda_module, "_error", lift_then_report)
    return emu


def count_calls(emulator: Emulator) -> tuple[int, list[tuple[str, int]]]:
    dev = make_device()
    try:
        life = Lifecycle()
        before = emulator.call_count
        run_lifecycle(life, dev, emulator)
        return emulator.call_count - before, [(s, n) for s, n in life.calls if n]
    finally:
        dev.close()


# ----------------------------------------------------------------------------- enumeration


def test_the_lifecycle_makes_the_same_driver_calls_every_run(emu: Emulator) -> None:
    first, steps = count_calls(emu)
    second, _ = count_calls(emu)
    assert first == second and first > 0
    touched = {step for step, _ in steps}
    # every device-touching step made at least one call: none is silently skipped
    assert {"HybridModel() (pool allocations)", "teardown (frees)", "cache_sequence (snapshot save)",
            "attach_prefix (snapshot restore)", "compact_sequence (free slot)", "save_sequence_state",
            "restore_sequence_state", "alloc_sequence (zero slot)", "bind_gpu_to_thread"} <= touched


#: Call sites where a transient fault currently breaks an invariant (bug reported to the model's
#: owner): SnapshotPool.save takes a snapshot id (from the free list, or the LRU victim's) before
#: its copy, and does not give it back when the copy fails. Remove an entry once it is fixed; the
#: test fails while the list is not exactly the set of broken sites.
KNOWN_BROKEN_STEPS: frozenset[str] = frozenset({"cache_sequence (snapshot save)", "save_snapshot"})


def test_a_transient_fault_at_every_driver_call_surfaces_cleanly_and_the_model_stays_usable(
    one_shot: Emulator,
) -> None:
    total, _ = count_calls(one_shot)
    sites: Counter[tuple[str, str]] = Counter()
    broken: set[str] = set()
    for n in range(1, total + 1):
        dev = make_device()
        baseline = one_shot.live_allocations
        life = Lifecycle()
        one_shot.fail_from_call(n, CUDA_ERROR_LAUNCH_FAILED)
        with pytest.raises(CudaError) as failure:
            run_lifecycle(life, dev)
        one_shot.reset()
        sites[(life.step, failure.value.call.split("(", 1)[0])] += 1
        m = life.model
        if m is None:  # construction failed: what it had allocated was freed
            assert one_shot.live_allocations == baseline, f"call {n}: construction leaked device memory"
        elif life.step == "teardown (frees)":
            # one cuMemFree failed: teardown went on with the rest and raised; the sequences were
            # already freed, so nothing was still referenced
            assert m.teardown_report is not None and m.teardown_report.leaked == 0
            with pytest.raises(TornDown):
                m.alloc_sequence()
        else:
            try:
                release_everything(m, life.held)
            except InvariantViolation:
                broken.add(life.step)
                m.teardown()
                dev.close()
                continue
            # still usable: the whole workload runs again, then a clean teardown
            again = Lifecycle(model=m)
            workload(again)
            release_everything(m, again.held)
            m.teardown()
            assert m.teardown_report is not None and m.teardown_report.leaked == 0
        dev.close()  # frees whatever a failed free left behind, now that the driver works
        assert one_shot.live_allocations == baseline, f"call {n}: device memory left after close"
    assert sum(sites.values()) == total
    assert broken == KNOWN_BROKEN_STEPS, f"invariants broken after a fault in: {sorted(broken)}"
    print(f"{total} driver calls, {len(sites)} (step, entry point) sites: {dict(sites)}")


def test_a_sticky_error_from_every_driver_call_surfaces_and_teardown_finishes(emu: Emulator) -> None:
    total, _ = count_calls(emu)
    teardown_raised = 0
    for n in range(1, total + 1):
        dev = make_device()
        baseline = emu.live_allocations
        life = Lifecycle()
        emu.fail_from_call(n, CUDA_ERROR_ILLEGAL_ADDRESS)
        with pytest.raises(CudaError):
            run_lifecycle(life, dev)
        m = life.model
        if m is not None and life.step != "teardown (frees)":
            # host-side bookkeeping needs no driver: every reference still comes back
            try:
                release_everything(m, life.held)
            except InvariantViolation:
                assert life.step in KNOWN_BROKEN_STEPS, f"call {n}: invariants broken at {life.step}"
                life.held.clear()
            try:
                m.teardown()  # the driver is dead: frees fail, teardown still finishes
            except CudaError:
                teardown_raised += 1
            assert m.teardown_report is not None
            m.teardown()  # a no-op, not a retry
            with pytest.raises(TornDown):
                m.num_free_blocks()
        emu.reset()  # the driver recovers: the device frees what the model could not
        dev.close()
        assert emu.live_allocations == baseline, f"call {n}: device memory left after close"
    assert teardown_raised > 0


# ----------------------------------------------------------------------------- named faults


def test_construction_past_the_allocation_budget_leaks_nothing(device: Device, emu: Emulator) -> None:
    baseline_bytes, baseline = emu.live_bytes, emu.live_allocations
    m = HybridModel(CONFIG, device)
    need = emu.live_bytes - baseline_bytes
    m.teardown()
    for budget in (0, 1, need // 3, need // 2, need - 1):
        emu.set_alloc_budget(baseline_bytes + budget)
        with pytest.raises(CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            HybridModel(CONFIG, device)
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


@pytest.mark.parametrize("entry_point", ["cuMemcpyBatchAsync", "cuStreamSynchronize"])
def test_a_failing_compaction_copy_moves_nothing(device: Device, emu: Emulator, entry_point: str) -> None:
    m = HybridModel(CONFIG, device)
    a, b = _two_sequences(m)
    slot, addrs = a.slot_idx, a.ssm_addrs
    target = next(s for s in range(CONFIG.max_seqs) if m._slots.is_free(s))
    emu.fail_call(entry_point, CUDA_ERROR_ILLEGAL_ADDRESS, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.compact_sequence(a, target)
    m.check_invariants()
    assert (a.slot_idx, a.ssm_addrs) == (slot, addrs) and m._slots.is_free(target)
    m.compact_sequence(a, target)  # the retry works
    assert a.slot_idx == target and m._slots.is_free(slot)
    for seq in (a, b):
        m.free_sequence(seq)
    release_everything(m, [])
    m.teardown()


def test_a_failing_slot_zeroing_gives_the_slot_back(device: Device, emu: Emulator) -> None:
    m = HybridModel(CONFIG, device)
    emu.fail_call("cuMemsetD8Async", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match="cuMemsetD8Async"):
        m.alloc_sequence()
    assert m._slots.num_free == CONFIG.max_seqs and m.num_live_sequences == 0
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
    refs = m._pool.refcounts()
    emu.fail_call(entry_point, CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.save_sequence_state(a, io.BytesIO())
    m.check_invariants()
    assert np.array_equal(refs, m._pool.refcounts()) and not a.is_freed
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
    refs = m._pool.refcounts()
    emu.fail_call(entry_point, CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError, match=entry_point):
        m.restore_sequence_state(b, a.num_blocks, io.BytesIO(out.getvalue()))
    m.check_invariants()
    assert b.num_blocks == 0 and b.num_tokens == 0 and np.array_equal(refs, m._pool.refcounts())
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
    emu.fail_call("cuMemcpyBatchAsync", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError):
        m.attach_prefix(b, PROMPT)
    assert b.num_blocks == 2  # the matched prefix is recorded, pinned and referenced
    m.check_invariants()  # the prefix it pinned is recorded, so freeing releases it
    b.mark_failed()
    m.free_sequence(b)
    m.free_sequence(a)
    release_everything(m, [])
    m.teardown()


@pytest.mark.xfail(strict=True, reason="SnapshotPool.save keeps the snapshot id it took when its copy fails "
                   "(lifecycle/snapshots.py save(): pop before copy_batch); check_invariants then finds "
                   "'used + free != capacity'")
def test_a_failing_snapshot_copy_leaves_the_snapshot_pool_whole(device: Device, emu: Emulator) -> None:
    m = HybridModel(CONFIG, device)
    a = m.alloc_sequence()
    m.attach_prefix(a, PROMPT)
    m.grow(a, 16)
    emu.fail_call("cuMemcpyBatchAsync", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError):
        m.save_snapshot(a, 8)
    try:
        m.check_invariants()
    finally:
        m.free_sequence(a)
        m.teardown()


@pytest.mark.xfail(strict=True, reason="HybridModel.teardown skips closing a device it opened when a release "
                   "fails (the exception leaves before self._device.close()), and a second teardown() is a no-op, "
                   "so the device (stream, context, the allocation whose free failed) is never released")
def test_teardown_closes_its_own_device_even_when_a_free_fails(emu: Emulator) -> None:
    m = HybridModel(CONFIG, "cuda")
    emu.fail_call("cuMemFree", CUDA_ERROR_LAUNCH_FAILED, 1)
    with pytest.raises(CudaError):
        m.teardown()
    emu.reset()
    m.teardown()
    assert m.device.closed  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- random soak


def soak(dev: Device, emulator: Emulator, config: ModelConfig, ops: int, seed: int) -> Driver:
    """The random driver with a one-shot fault armed at a random upcoming driver call before
    about one operation in eight."""
    rng = random.Random(seed)

    def arm(_: Driver) -> None:
        if rng.random() < 0.125:
            emulator.fail_from_call(rng.randint(1, 6), CUDA_ERROR_LAUNCH_FAILED)

    driver = Driver(config, dev, RandomChooser(seed), expect_faults=True, on_op=arm)
    driver.run(ops)
    emulator.reset()
    driver.finish()
    return driver


@pytest.mark.parametrize("config_name", ["attention", "ssm-only"])
def test_random_operations_survive_random_faults(
    device: Device, one_shot: Emulator, config_name: str
) -> None:
    driver = soak(device, one_shot, CONFIGS[config_name], 1500, seed=11)
    counts = driver.counts
    assert counts.faults_injected > 0 and counts.leaks == 0
    print(f"{config_name}: {counts.faults_injected} faults survived over {counts.operations} ops: "
          f"{dict(counts.faults_by_call)}")


@pytest.mark.xfail(strict=True, raises=InvariantViolation, reason="snapshot copy failures leak a snapshot id "
                   "(see test_a_failing_snapshot_copy_leaves_the_snapshot_pool_whole)")
def test_random_operations_on_a_hybrid_model_survive_random_faults(device: Device, one_shot: Emulator) -> None:
    soak(device, one_shot, CONFIGS["hybrid"], 1500, seed=11)
