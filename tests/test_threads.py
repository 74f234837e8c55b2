"""Threads hammering one model: a scheduler thread (compaction into free slots, reclaim, swap round
trips, invariant checks) and worker threads (alloc, attach, grow, decode, cache, snapshot, free,
drop without free, reclaim, compact their own sequences), with a checker thread recounting every
reference concurrently. The run must end with no error, every reference back and a clean
teardown.

Free-threaded CPython: see docs/reliability.md (no 3.13t/3.14t interpreter can be installed on
this machine); under one, the same tests run unchanged with the GIL disabled.
"""

from __future__ import annotations

import io
import random
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pytest

from lifecycle.config import ModelConfig
from lifecycle.errors import PoolExhausted, SlotInUse
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState
from devices import make_device
from reliability_driver import CONFIGS, SYSTEM_PROMPTS

CONFIG: ModelConfig = CONFIGS["hybrid"].__class__(
    layers=CONFIGS["hybrid"].layers,
    block_size=4,
    num_blocks=160,
    max_seqs=12,
    num_adapter_slots=2,
    num_snapshots=8,
    max_blocks_per_seq=16,
    name="threads",
)
WORKERS = 4
ROUNDS = 250


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    # Switch the GIL often so that the threads interleave inside the model's calls on 2 cores.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


@dataclass
class Tally:
    """What the threads did, and what went wrong (must stay empty)."""

    errors: list[BaseException] = field(default_factory=list)
    ops: int = 0
    invariant_checks: int = 0
    refusals: int = 0
    slot_races: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def guarded(tally: Tally, body: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            body()
        except BaseException as exc:  # reported by the test
            tally.errors.append(exc)

    return run


def free_slot(m: HybridModel) -> int | None:
    free = [s for s in range(CONFIG.max_seqs) if m.slots.is_free(s)]
    return random.choice(free) if free else None


def compact_somewhere(m: HybridModel, seq: SequenceState, tally: Tally) -> None:
    """Compact into a slot that was free a moment ago; another thread may take it first."""
    slot = free_slot(m)
    if slot is None:
        return
    try:
        m.compact_sequence(seq, slot)
    except SlotInUse:
        tally.add(slot_races=1)


def worker(m: HybridModel, seed: int, tally: Tally, drop_sequences: bool) -> None:
    rng = random.Random(seed)
    m.bind_gpu_to_thread()
    for _ in range(ROUNDS):
        try:
            seq = m.alloc_sequence()
        except PoolExhausted:
            tally.add(ops=1, refusals=1)
            m.reclaim_prefix_blocks(4)
            continue
        try:
            prompt = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
            m.attach_prefix(seq, np.concatenate((prompt, [9000 + rng.randrange(3)])).astype(np.int32))
            m.grow(seq, seq.num_tokens + 4)
            for _ in range(rng.randrange(4)):
                m.grow(seq, seq.num_tokens + 2)
                seq.append_tokens([7, 8])
            if rng.random() < 0.3:
                compact_somewhere(m, seq, tally)
            if seq.num_tokens >= 8 and rng.random() < 0.3:
                m.save_snapshot(seq, 8)
            m.cache_sequence(seq)
        except PoolExhausted:
            tally.add(refusals=1)
        if drop_sequences and rng.random() < 0.2:
            del seq  # dropped without free: the guard releases the slot, the model reaps the rest
        else:
            m.free_sequence(seq)
        if rng.random() < 0.2:
            m.reclaim_prefix_blocks(rng.randrange(1, 6))
        tally.add(ops=1)


def scheduler(m: HybridModel, stop: threading.Event, tally: Tally, check: bool) -> None:
    rng = random.Random(99)
    m.bind_gpu_to_thread()
    parked: list[SequenceState] = []
    while not stop.is_set():
        try:
            if len(parked) < 2:
                seq = m.alloc_sequence()
                parked.append(seq)
                m.attach_prefix(seq, SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))])
                m.grow(seq, seq.num_tokens)
            seq = parked[rng.randrange(len(parked))]
            compact_somewhere(m, seq, tally)
            if rng.random() < 0.2:  # preempt: swap out, free, swap back into a new sequence
                out = io.BytesIO()
                m.save_sequence_state(seq, out)
                num_blocks, tokens = seq.num_blocks, seq.tokens.copy()
                parked.remove(seq)
                m.free_sequence(seq)
                back = m.alloc_sequence()
                parked.append(back)
                m.restore_sequence_state(back, num_blocks, io.BytesIO(out.getvalue()))
                assert np.array_equal(back.tokens, tokens)
            m.reclaim_prefix_blocks_for(SYSTEM_PROMPTS[0], -1, rng.randrange(8))
            if check:
                m.check_invariants()
                tally.add(invariant_checks=1)
            tally.add(ops=1)
        except PoolExhausted:
            tally.add(refusals=1)
    for seq in parked:
        m.free_sequence(seq)


def checker(m: HybridModel, stop: threading.Event, tally: Tally) -> None:
    while not stop.is_set():
        m.check_invariants()
        tally.add(invariant_checks=1)


def hammer(*, drop_sequences: bool, concurrent_checks: bool) -> Tally:
    """Run the workers, the scheduler and (optionally) the checker thread on one model; then
    require every reference back and a clean teardown."""
    dev = make_device()
    m = HybridModel(CONFIG, dev)
    tally = Tally()
    stop = threading.Event()
    workers = [threading.Thread(target=guarded(tally, partial(worker, m, k, tally, drop_sequences)))
               for k in range(WORKERS)]
    background = [threading.Thread(target=guarded(tally, lambda: scheduler(m, stop, tally, concurrent_checks)))]
    if concurrent_checks:
        background.append(threading.Thread(target=guarded(tally, lambda: checker(m, stop, tally))))
    for t in workers + background:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in background:
        t.join()
    assert tally.errors == [], tally.errors[:3]
    m.check_invariants()
    while m.reclaim_prefix_blocks(m.num_total_blocks()):
        pass
    assert m.num_live_sequences == 0
    assert m.num_free_blocks() == m.num_total_blocks()
    assert m.slots.num_free == CONFIG.max_seqs
    assert tally.ops >= WORKERS * ROUNDS
    m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0
    dev.close()
    return tally


def test_a_scheduler_and_workers_hammering_one_model_keep_every_invariant() -> None:
    tally = hammer(drop_sequences=False, concurrent_checks=True)
    assert tally.invariant_checks > 0


def test_workers_dropping_sequences_leak_nothing() -> None:
    """Sequences dropped without free on worker threads, while the scheduler compacts and swaps
    and checks invariants concurrently: every slot and block comes back."""
    tally = hammer(drop_sequences=True, concurrent_checks=True)
    assert tally.invariant_checks > 0


def test_sequences_dropped_on_other_threads_are_reaped_once() -> None:
    """Sequences allocated here and dropped on worker threads (their guard released there, their
    blocks reaped by whichever thread calls the model next) come back exactly once."""
    dev = make_device()
    m = HybridModel(CONFIG, dev)
    seqs: list[SequenceState] = []
    for k in range(CONFIG.max_seqs):
        seq = m.alloc_sequence()
        m.attach_prefix(seq, SYSTEM_PROMPTS[k % len(SYSTEM_PROMPTS)])
        m.grow(seq, seq.num_tokens)
        seqs.append(seq)
    del seq
    tally = Tally()
    barrier = threading.Barrier(len(seqs) + 1)

    def drop(box: list[SequenceState]) -> None:
        barrier.wait()
        box.clear()  # the last reference goes on this thread

    boxes = [[s] for s in seqs]
    seqs.clear()
    threads = [threading.Thread(target=guarded(tally, partial(drop, b))) for b in boxes]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    assert tally.errors == []
    m.check_invariants()
    assert m.num_live_sequences == 0 and m.slots.num_free == CONFIG.max_seqs
    assert m.num_free_blocks() + m.core.num_cached_blocks == m.num_total_blocks()
    m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0
    dev.close()


def test_check_invariants_holds_while_a_dropped_sequence_is_being_released() -> None:
    dev = make_device()
    m = HybridModel(CONFIG, dev)
    seq = m.alloc_sequence()
    in_flight = seq.guard  # the guard of a sequence whose weakref died, its release not yet run
    del seq
    try:
        m.check_invariants()
    finally:
        del in_flight
        m.teardown()
        dev.close()
