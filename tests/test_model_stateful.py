"""Long-run stateful testing of the whole model API.

- A hypothesis ``RuleBasedStateMachine`` with one rule per operation of the shared driver
  (``tests/reliability_driver.py``): admission (alloc, alloc_for, adapter binding, prefix attach), growth
  and decode, caching and SSM snapshots, retirement, compaction into free, retired and detached
  slots (and refused into active ones), detach, free, drop without free, reclaim, swap round
  trips, adapter load/reload/unload, and bad input of every kind. ``check_invariants()`` runs after
  every step; the teardown frees everything and requires zero leaks. Hypothesis shrinks a failure
  to a short program.
- The seeded random driver over every model configuration, with a count: a short mode in CI, and
  ``LIFECYCLE_LONG=1`` for 1,000,000 operations (``bench/reliability.py`` prints the counts).
"""

from __future__ import annotations

import gc
import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from lifecycle.device.host import HostDevice
from lifecycle.errors import InvalidId, InvariantViolation
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from devices import make_device
from reliability_driver import _BAD_INPUTS, CONFIGS, Counts, Driver, DriverFailure, RandomChooser, run_random

LONG = os.environ.get("LIFECYCLE_LONG") == "1"
#: Operations of the random-driver test: a few seconds in CI, 1,000,000 in the long mode.
RANDOM_OPS = 1_000_000 if LONG else 6_000


class DataChooser:
    """The driver's choices drawn from hypothesis, so failures shrink."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


class ModelMachine(RuleBasedStateMachine):
    """Every rule is one driver operation on one model; the driver checks the invariants and
    what a refused call must leave alone after each."""

    def __init__(self) -> None:
        super().__init__()
        self.driver: Driver | None = None
        self.device = make_device()

    @initialize(config=st.sampled_from(sorted(CONFIGS)), data=st.data())
    def build(self, config: str, data: st.DataObject) -> None:
        self.driver = Driver(CONFIGS[config], self.device, DataChooser(data))

    def _op(self, name: str, data: st.DataObject) -> None:
        assert self.driver is not None
        self.driver.choose = DataChooser(data)
        self.driver.step(name)

    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        self._op("alloc", data)

    @rule(data=st.data())
    def alloc_for(self, data: st.DataObject) -> None:
        self._op("alloc_for", data)

    @rule(data=st.data())
    def bind_adapter(self, data: st.DataObject) -> None:
        self._op("bind_adapter", data)

    @rule(data=st.data())
    def attach_prefix(self, data: st.DataObject) -> None:
        self._op("attach_prefix", data)

    @rule(data=st.data())
    def grow(self, data: st.DataObject) -> None:
        self._op("grow", data)

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        self._op("decode", data)

    @rule(data=st.data())
    def cache(self, data: st.DataObject) -> None:
        self._op("cache", data)

    @rule(data=st.data())
    def save_snapshot(self, data: st.DataObject) -> None:
        self._op("save_snapshot", data)

    @rule(data=st.data())
    def retire(self, data: st.DataObject) -> None:
        self._op("retire", data)

    @rule(data=st.data())
    def compact_into_free_slot(self, data: st.DataObject) -> None:
        self._op("compact_free", data)

    @rule(data=st.data())
    def compact_into_retired_slot(self, data: st.DataObject) -> None:
        self._op("compact_retired", data)

    @rule(data=st.data())
    def compact_into_detached_slot(self, data: st.DataObject) -> None:
        self._op("compact_detached", data)

    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        self._op("detach", data)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._op("free", data)

    @rule(data=st.data())
    def drop_without_free(self, data: st.DataObject) -> None:
        self._op("drop", data)

    @rule()
    def collect_garbage(self) -> None:
        gc.collect()

    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        self._op("reclaim", data)

    @rule(data=st.data())
    def reclaim_for(self, data: st.DataObject) -> None:
        self._op("reclaim_for", data)

    @rule(data=st.data())
    def swap_round_trip(self, data: st.DataObject) -> None:
        self._op("round_trip", data)

    @rule(data=st.data())
    def load_or_reload_adapter(self, data: st.DataObject) -> None:
        self._op("load_adapter", data)

    @rule(data=st.data())
    def unload_adapter(self, data: st.DataObject) -> None:
        self._op("unload_adapter", data)

    @rule(data=st.data())
    def mark_failed(self, data: st.DataObject) -> None:
        self._op("mark_failed", data)

    @precondition(lambda self: self.driver is not None)
    @rule(kind=st.integers(0, len(_BAD_INPUTS) - 1), data=st.data())
    def bad_input(self, kind: int, data: st.DataObject) -> None:
        assert self.driver is not None
        self.driver.choose = DataChooser(data)
        _BAD_INPUTS[kind](self.driver)
        self.driver.check()

    def teardown(self) -> None:
        try:
            if self.driver is not None:
                assert self.driver.finish() == 0, "leaks at teardown"
        finally:
            self.device.close()


ModelMachine.TestCase.settings = settings(
    max_examples=300 if LONG else 15,
    stateful_step_count=60 if LONG else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestModelMachine = ModelMachine.TestCase


# ----------------------------------------------------------------------------- random driver


@pytest.mark.parametrize("seed", [1, 2])
def test_random_operations_keep_invariants_and_leak_nothing(seed: int) -> None:
    counts = run_random(RANDOM_OPS // 2, seed=seed, device_factory=make_device)
    assert counts.operations == RANDOM_OPS // 2
    assert counts.invariant_checks >= counts.operations
    assert counts.leaks == 0 and counts.leak_checks == counts.episodes > 0
    # the run exercised what it claims: every operation ran, bad input was tried and refused
    assert all(counts.by_op[op] > 0 for op in ("compact_retired", "compact_detached", "round_trip", "drop", "detach"))
    assert counts.bad_inputs > 0 and counts.refusals_under_pressure > 0 and counts.round_trips > 0


def test_every_configuration_gets_a_clean_episode() -> None:
    for name, config in CONFIGS.items():
        dev = HostDevice()
        driver = Driver(config, dev, RandomChooser(7))
        driver.run(400)
        assert driver.finish() == 0, name
        dev.close()


def test_the_driver_catches_a_reference_the_model_forgets() -> None:
    """The driver's checks can fail: a model whose free_sequence releases the slot but forgets
    the sequence's record keeps its pins and blocks, which the driver's checks report."""
    dev = HostDevice()
    driver = Driver(CONFIGS["attention"], dev, RandomChooser(3))

    def forgetful_free(seq: SequenceState) -> None:
        guard = seq.detach_guard()
        if guard is not None:
            guard.release()

    driver.model.free_sequence = forgetful_free  # type: ignore[method-assign]
    driver.model.finish_sequence = forgetful_free  # type: ignore[method-assign]
    try:
        driver.run(1000)
        leaks = driver.finish()
    except DriverFailure:
        leaks = -1
    assert leaks != 0
    dev.close()


def test_check_invariants_finds_a_reference_no_sequence_holds() -> None:
    m = HybridModel(CONFIGS["attention"], HostDevice())
    seq = m.alloc_sequence()
    m.attach_prefix(seq, list(range(1, 10)))
    m.grow(seq, 9)
    m.cache_sequence(seq)
    m.free_sequence(seq)
    cached = next(b for b in range(m.num_total_blocks()) if m.pool.refcount(b) == 1)
    m.pool.inc_ref([cached])  # a leaked reference: neither a sequence nor the cache holds it
    try:
        with pytest.raises(InvariantViolation, match=f"block {cached}: refcount 2"):
            m.check_invariants()
    finally:
        m.pool.dec_ref([cached])
        m.teardown()


def test_counts_merge_adds_every_field() -> None:
    a, b = Counts(operations=2, leaks=0), Counts(operations=3, bad_inputs=4)
    a.by_op["alloc"] += 1
    b.by_op["alloc"] += 2
    a.merge(b)
    assert (a.operations, a.bad_inputs, a.by_op["alloc"]) == (5, 4, 3)


# ----------------------------------------------------------------------------- regressions (bugs these suites found)


def test_an_oversized_python_token_is_refused_by_append_tokens() -> None:
    m = HybridModel(CONFIGS["attention"], HostDevice())
    seq = m.alloc_sequence()
    with pytest.raises(InvalidId, match="1180591620717411303424"):
        seq.append_tokens([2**70])
    m.free_sequence(seq)
    m.teardown()


def test_an_oversized_python_token_is_refused_by_attach_prefix() -> None:
    m = HybridModel(CONFIGS["attention"], HostDevice())
    seq = m.alloc_sequence()
    try:
        with pytest.raises(InvalidId):
            m.attach_prefix(seq, [1, 2**70])
    finally:
        m.free_sequence(seq)
        m.teardown()

