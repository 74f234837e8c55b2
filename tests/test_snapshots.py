"""Hybrid prefix caching: SSM state snapshots at cached prefix ends (issue 6).

The SSM state of a slot is simulated the way a model produces it: a deterministic function of the
tokens the slot has consumed (``state_of``), random and never zero, so a restore of the wrong
snapshot, of a recycled one, or of none at all shows as a byte mismatch. Every test runs on the
``device`` fixture (host, host-deferred, and CudaDevice over the emulated driver), calls
``check_invariants()`` after each mutating step and ends with every block and slot back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer
from lifecycle.device.base import Device
from lifecycle.errors import LifecycleError, OutOfBlocks
from lifecycle.model import HybridModel
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.stats import Stats
from devices import copies_are_deferred, device, loaded_emulator, make_device  # noqa: F401

BS = 4
TAIL = 9000  # tokens no cached block ever contains: a lookup's match stops where they start
ATTENTION = (AttentionLayer(num_kv_heads=2, head_dim=8), AttentionLayer(num_kv_heads=2, head_dim=8))
SSM = (SSMLayer(h_state_bytes=256, conv_state_bytes=64), SSMLayer(h_state_bytes=128, conv_state_bytes=32))

State = list[bytes]  # one entry per slot range: layer 0's h, layer 0's conv, layer 1's h, ...
Build = Callable[..., HybridModel]


def hybrid_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        layers=(ATTENTION[0], SSM[0], ATTENTION[1], SSM[1]),
        block_size=BS,
        num_blocks=32,
        max_seqs=4,
        num_snapshots=8,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def build(device: Device) -> Iterator[Build]:  # noqa: F811
    """``build(**config overrides)``: a hybrid model on the device under test (``attention=True``:
    the same attention layers without SSM), torn down after the test."""
    models: list[HybridModel] = []

    def make(attention: bool = False, **overrides: Any) -> HybridModel:
        if attention:
            overrides = dict(layers=ATTENTION, num_snapshots=0, **overrides)
        model = HybridModel(hybrid_config(**overrides), device)
        models.append(model)
        return model

    yield make
    for model in models:
        model.teardown()


# ----------------------------------------------------------------------------- helpers


def path(*blocks: int, extra: int = 0) -> npt.NDArray[np.int32]:
    """Whole blocks of tokens (block ``b`` is ``100*b+1 .. 100*b+BS``) then ``extra`` tail tokens."""
    tokens = [100 * b + i + 1 for b in blocks for i in range(BS)] + [TAIL + i for i in range(extra)]
    return np.array(tokens, dtype=np.int32)


def range_sizes(m: HybridModel) -> list[int]:
    ssm = m.ssm_pool
    assert ssm is not None
    return [nbytes for _, nbytes in ssm.slot_ranges(0)]


def state_of(m: HybridModel, tokens: npt.NDArray[np.int32]) -> State:
    """The simulated SSM state after consuming ``tokens``: random, never-zero bytes seeded by them."""
    seed = int.from_bytes(hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=8).digest())
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, n, dtype=np.uint8).tobytes() for n in range_sizes(m)]


def write_slot(m: HybridModel, slot: int, state: State) -> None:
    """Write ``state`` into ``slot`` on the device's stream and wait for it."""
    ssm = m.ssm_pool
    assert ssm is not None
    keep = []  # sources stay alive until synchronize
    for (addr, nbytes), data in zip(ssm.slot_ranges(slot), state, strict=True):
        src = np.frombuffer(data, dtype=np.uint8).copy()
        keep.append(src)
        m.device.copy_htod(addr, src.ctypes.data, nbytes)
    m.device.synchronize()


def read_slot(m: HybridModel, slot: int) -> State:
    ssm = m.ssm_pool
    assert ssm is not None
    bufs = [np.empty(nbytes, dtype=np.uint8) for _, nbytes in ssm.slot_ranges(slot)]
    for (addr, nbytes), buf in zip(ssm.slot_ranges(slot), bufs):
        m.device.copy_dtoh(buf.ctypes.data, addr, nbytes)
    m.device.synchronize()
    return [buf.tobytes() for buf in bufs]


def out_of_stream(dev: Device, addr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """A view of device memory that bypasses the device's stream, the way the engine's kernels on
    their own stream do: reads see only what already ran, writes land at once."""
    if dev.kind == "cuda" and loaded_emulator() is None:
        pytest.skip("a real GPU's memory has no host view")
    return dev.host_array(addr, nbytes)


def snapshots_used(m: HybridModel) -> int:
    assert m.core.num_snapshots > 0
    return m.core.num_snapshots_used


def admit(m: HybridModel, tokens: npt.NDArray[np.int32]) -> tuple[SequenceState, int]:
    """A new sequence with the cached prefix of ``tokens`` attached: (sequence, reused tokens)."""
    seq = m.alloc_sequence()
    m.check_invariants()
    reused = m.attach_prefix(seq, tokens)
    m.check_invariants()
    return seq, reused


def compute(m: HybridModel, seq: SequenceState) -> None:
    """Prefill or decode up to the sequence's tokens: blocks for all of them, the slot's state after them."""
    m.grow(seq, seq.num_tokens)
    m.check_invariants()
    if m.ssm_pool is not None:
        write_slot(m, seq.slot_idx, state_of(m, seq.tokens))


def decode(m: HybridModel, seq: SequenceState, tokens: npt.NDArray[np.int32]) -> None:
    seq.append_tokens(tokens)
    compute(m, seq)


def cache_path(m: HybridModel, tokens: npt.NDArray[np.int32]) -> None:
    """Run a whole request for ``tokens``, cache it (a snapshot at its end when that is a block
    boundary) and free it."""
    seq, _ = admit(m, tokens)
    compute(m, seq)
    m.cache_sequence(seq)
    m.check_invariants()
    m.free_sequence(seq)
    m.check_invariants()


def lookup(m: HybridModel, tokens: npt.NDArray[np.int32]) -> tuple[int, State | None]:
    """Attach ``tokens`` in a throwaway sequence: (reused tokens, the slot's state right after)."""
    seq, reused = admit(m, tokens)
    state = read_slot(m, seq.slot_idx) if m.ssm_pool is not None else None
    m.free_sequence(seq)
    m.check_invariants()
    return reused, state


def delta(before: Stats, after: Stats, *fields: str) -> dict[str, int]:
    return {f: getattr(after, f) - getattr(before, f) for f in fields}


def assert_clean(m: HybridModel) -> None:
    m.check_invariants()
    assert m.num_live_sequences == 0
    m.reclaim_prefix_blocks(m.num_total_blocks())
    m.check_invariants()
    assert m.num_free_blocks() == m.num_total_blocks()
    if m.core.num_snapshots > 0:
        assert snapshots_used(m) == 0  # no node left, so no snapshot left


# ----------------------------------------------------------------------------- restore is bit-exact


def test_a_restored_slot_holds_the_saved_h_and_conv_of_every_ssm_layer(build: Build) -> None:
    m = build()
    tokens = path(1, 2)
    source, _ = admit(m, tokens)
    compute(m, source)
    source_slot = source.slot_idx
    ssm = m.ssm_pool
    assert ssm is not None
    saved = [
        (read_slot_range(m, ssm.h_addr(layer, source_slot), spec.h_state_bytes),
         read_slot_range(m, ssm.conv_addr(layer, source_slot), spec.conv_state_bytes))
        for layer, spec in enumerate(SSM)
    ]
    m.cache_sequence(source)
    m.check_invariants()
    m.free_sequence(source)
    m.check_invariants()
    # The source slot is handed to another sequence, which overwrites it, before the lookup.
    squatter = m.alloc_sequence()
    if squatter.slot_idx != source_slot:
        m.compact_sequence(squatter, source_slot)
        m.check_invariants()
    write_slot(m, source_slot, [np.full(n, 0xA5, np.uint8).tobytes() for n in range_sizes(m)])

    seq, reused = admit(m, path(1, 2, extra=3))
    assert reused == 8
    assert seq.slot_idx != source_slot
    for layer, spec in enumerate(SSM):
        h = read_slot_range(m, ssm.h_addr(layer, seq.slot_idx), spec.h_state_bytes)
        conv = read_slot_range(m, ssm.conv_addr(layer, seq.slot_idx), spec.conv_state_bytes)
        assert (h, conv) == saved[layer], f"SSM layer {layer}"
    m.free_sequence(seq)
    m.free_sequence(squatter)
    assert_clean(m)


def read_slot_range(m: HybridModel, addr: int, nbytes: int) -> bytes:
    buf = np.empty(nbytes, dtype=np.uint8)
    m.device.copy_dtoh(buf.ctypes.data, addr, nbytes)
    m.device.synchronize()
    assert buf.all(), "simulated states are never zero; a zero byte means nothing was written"
    return buf.tobytes()


def test_a_lookup_restores_the_deepest_snapshot_on_its_path(build: Build) -> None:
    m = build()
    tokens = path(1, 2, 3, 4, extra=1)  # 17 tokens: caching it snapshots nothing at block 4
    seq, _ = admit(m, tokens)
    m.grow(seq, 17)
    for point in (4, 12):  # the engine pauses at these block boundaries
        write_slot(m, seq.slot_idx, state_of(m, tokens[:point]))
        assert m.save_snapshot(seq, point)
        m.check_invariants()
    compute(m, seq)
    m.cache_sequence(seq)
    m.check_invariants()
    m.free_sequence(seq)
    m.check_invariants()

    assert lookup(m, path(1, 2, 3, 4, extra=1)) == (12, state_of(m, tokens[:12]))
    assert lookup(m, path(1, 2, 3, extra=1)) == (12, state_of(m, tokens[:12]))
    assert lookup(m, path(1, 2, extra=2)) == (4, state_of(m, tokens[:4]))
    assert lookup(m, path(1, extra=1)) == (4, state_of(m, tokens[:4]))
    assert_clean(m)


def test_a_snapshot_keeps_the_state_of_its_save_while_the_sequence_decodes_on(build: Build) -> None:
    m = build()
    seq, _ = admit(m, path(1, 2))
    compute(m, seq)
    assert m.save_snapshot(seq, 8)
    m.check_invariants()
    decode(m, seq, path(3))  # the slot moves on to the state after 12 tokens
    decode(m, seq, path(4, extra=1))
    assert lookup(m, path(1, 2, extra=1)) == (8, state_of(m, path(1, 2)))
    m.free_sequence(seq)
    assert_clean(m)


def test_a_snapshot_keeps_the_state_of_its_save_when_the_slot_is_written_right_after(
    build: Build, device: Device  # noqa: F811
) -> None:
    """The engine's next kernel (on its own stream) updates the slot in place as soon as
    ``cache_sequence``/``save_snapshot`` return; the snapshot must already hold the old state."""
    m = build()
    tokens = path(1, 2)
    seq, _ = admit(m, tokens)
    compute(m, seq)
    m.cache_sequence(seq)
    m.check_invariants()
    ssm = m.ssm_pool
    assert ssm is not None
    for addr, nbytes in ssm.slot_ranges(seq.slot_idx):
        out_of_stream(device, addr, nbytes)[:] = 0x5A  # the next decode step's state
    m.free_sequence(seq)
    m.check_invariants()
    assert lookup(m, path(1, 2, extra=1)) == (8, state_of(m, tokens))
    assert_clean(m)


# ----------------------------------------------------------------------------- never outlives its node


def test_evicting_a_node_drops_its_snapshot(build: Build) -> None:
    m = build()
    cache_path(m, path(1, 2))
    assert snapshots_used(m) == 1
    before = m.stats()
    assert m.reclaim_prefix_blocks(2) == 2
    m.check_invariants()
    assert snapshots_used(m) == 0
    assert delta(before, m.stats(), "snapshots_evicted") == {"snapshots_evicted": 1}
    before = m.stats()
    assert lookup(m, path(1, 2, extra=1)) == (0, [bytes(n) for n in range_sizes(m)])
    assert delta(before, m.stats(), "prefix_misses", "snapshot_hits_cut_short") == {
        "prefix_misses": 1, "snapshot_hits_cut_short": 0}  # nothing left to match
    assert_clean(m)


def test_eviction_under_grow_pressure_drops_the_snapshots_of_evicted_nodes(build: Build) -> None:
    m = build(num_blocks=8)
    cache_path(m, path(1, 2))
    cache_path(m, path(3, 4))
    assert snapshots_used(m) == 2
    big, _ = admit(m, path(5, 6, 7, 8, 5, 6, 7, 8))
    compute(m, big)  # needs every block: the whole cache goes
    assert snapshots_used(m) == 0
    assert m.stats().snapshots_evicted == 2
    assert lookup(m, path(1, 2, extra=1))[0] == 0
    assert lookup(m, path(3, 4, extra=1))[0] == 0
    m.free_sequence(big)
    assert_clean(m)


def test_a_snapshot_dropped_by_the_pool_lru_leaves_its_nodes_kv_cached(build: Build) -> None:
    m = build(num_snapshots=1)
    first, _ = admit(m, path(1, 2))
    compute(m, first)
    kv_blocks = m.block_table(first)
    m.cache_sequence(first)
    m.free_sequence(first)
    m.check_invariants()
    cache_path(m, path(3, 4))  # the budget of one: path(1, 2)'s snapshot goes, its KV stays
    assert snapshots_used(m) == 1
    assert m.stats().snapshots_evicted == 1
    assert m.num_total_blocks() - m.num_free_blocks() == 4

    before = m.stats()
    assert lookup(m, path(1, 2, extra=1))[0] == 0
    assert delta(before, m.stats(), "snapshot_hits_cut_short", "prefix_misses") == {
        "snapshot_hits_cut_short": 1, "prefix_misses": 1}
    # Recomputing the prefix takes no new cache block (its nodes kept theirs); the new snapshot at
    # the old node makes the original KV blocks reusable again.
    before = m.stats()
    cache_path(m, path(1, 2))
    assert delta(before, m.stats(), "blocks_cached", "snapshots_saved") == {"blocks_cached": 0, "snapshots_saved": 1}
    seq, reused = admit(m, path(1, 2, extra=1))
    assert reused == 8
    assert np.array_equal(m.block_table(seq)[:2], kv_blocks)
    m.free_sequence(seq)
    assert_clean(m)


def test_an_attention_model_reuses_the_whole_match_without_snapshots(build: Build) -> None:
    m = build(attention=True)
    assert m.core.num_snapshots == 0
    cache_path(m, path(1, 2, 3, extra=1))  # no block boundary at the end: irrelevant without SSM
    assert lookup(m, path(1, 2, 3, extra=1))[0] == 12
    stats = m.stats()
    assert (stats.snapshots_saved, stats.snapshot_hits, stats.snapshot_hits_cut_short) == (0, 0, 0)
    assert_clean(m)


def test_a_hybrid_model_without_a_snapshot_pool_reuses_nothing(build: Build) -> None:
    m = build(num_snapshots=0)
    cache_path(m, path(1, 2))
    assert m.core.num_snapshots == 0
    before = m.stats()
    assert lookup(m, path(1, 2, extra=1))[0] == 0
    assert delta(before, m.stats(), "snapshot_hits_cut_short") == {"snapshot_hits_cut_short": 1}
    assert m.reclaim_prefix_blocks_for(path(1, 2, extra=1), NO_ADAPTER, 3).target == 3
    assert_clean(m)


# ----------------------------------------------------------------------------- restore vs. reuse of the snapshot


def test_a_restore_is_complete_when_attach_prefix_returns(build: Build, device: Device) -> None:  # noqa: F811
    m = build()
    source, _ = admit(m, path(1, 2))
    compute(m, source)
    m.cache_sequence(source)  # the source stays live, so the restore goes to another slot
    seq, reused = admit(m, path(1, 2, extra=1))
    assert reused == 8 and seq.slot_idx != source.slot_idx
    emulator = loaded_emulator() if device.kind == "cuda" else None
    if emulator is not None:
        assert emulator.pending_ops == 0
    ssm = m.ssm_pool
    assert ssm is not None
    now = [out_of_stream(device, addr, n).tobytes() for addr, n in ssm.slot_ranges(seq.slot_idx)]
    assert now == state_of(m, path(1, 2))
    m.free_sequence(seq)
    m.free_sequence(source)
    assert_clean(m)


def test_a_snapshot_reused_right_after_a_restore_never_reaches_the_restored_slot(
    build: Build, device: Device  # noqa: F811
) -> None:
    m = build(num_snapshots=1)
    source, _ = admit(m, path(1, 2))
    compute(m, source)
    m.cache_sequence(source)  # the source stays live, so the restore goes to another slot
    device.synchronize()  # the save has landed: only the restore can still be in flight below
    seq, reused = admit(m, path(1, 2, extra=1))
    assert reused == 8 and seq.slot_idx != source.slot_idx
    # The moment attach_prefix returns, the snapshot's memory is fair game: scribble over all of
    # it behind the stream's back, then have the pool recycle it for other data.
    pool = m._snapshots
    assert pool is not None
    out_of_stream(device, pool._base, pool.snapshot_bytes * pool.capacity)[:] = 0xEE
    cache_path(m, path(3, 4))
    assert m.stats().snapshots_evicted == 1 and snapshots_used(m) == 1
    assert read_slot(m, seq.slot_idx) == state_of(m, path(1, 2))
    assert lookup(m, path(3, 4, extra=1)) == (8, state_of(m, path(3, 4)))
    m.free_sequence(seq)
    m.free_sequence(source)
    assert_clean(m)


# ----------------------------------------------------------------------------- budget and LRU


def test_never_more_snapshots_in_use_than_the_budget(build: Build) -> None:
    m = build(num_snapshots=3)
    for i in range(6):
        cache_path(m, path(i, i + 10))
        stats = m.stats()
        assert snapshots_used(m) == min(i + 1, 3)
        assert (stats.snapshots_saved, stats.snapshots_evicted) == (i + 1, max(i + 1 - 3, 0))
    reused = [lookup(m, path(i, i + 10, extra=1))[0] for i in range(6)]
    assert reused == [0, 0, 0, 8, 8, 8]  # the three newest kept
    assert_clean(m)


def test_the_least_recently_used_snapshot_is_replaced_first(build: Build) -> None:
    m = build(num_snapshots=2)
    cache_path(m, path(1, 1))
    cache_path(m, path(2, 2))
    assert lookup(m, path(1, 1, extra=1))[0] == 8  # a restore makes path(1, 1)'s the most recent
    cache_path(m, path(3, 3))
    assert [lookup(m, path(b, b, extra=1))[0] for b in (1, 2, 3)] == [8, 0, 8]
    assert_clean(m)


def test_saving_again_at_a_node_refreshes_its_snapshot_instead_of_taking_another(build: Build) -> None:
    m = build(num_snapshots=2)
    cache_path(m, path(1, 1))
    cache_path(m, path(2, 2))
    before = m.stats()
    cache_path(m, path(1, 1))  # the same prefix again: its snapshot becomes the most recent
    assert delta(before, m.stats(), "snapshots_saved", "snapshots_evicted") == {
        "snapshots_saved": 0, "snapshots_evicted": 0}
    assert snapshots_used(m) == 2
    cache_path(m, path(3, 3))
    assert [lookup(m, path(b, b, extra=1))[0] for b in (1, 2, 3)] == [8, 0, 8]
    assert_clean(m)


# ----------------------------------------------------------------------------- rolling snapshots


def test_a_rolling_snapshot_replaces_the_previous_rolling_one(build: Build) -> None:
    m = build()
    seq, _ = admit(m, path(1, 2))
    compute(m, seq)
    for block in (3, 4, None):
        assert m.save_snapshot(seq, seq.num_tokens, rolling=True)
        m.check_invariants()
        assert snapshots_used(m) == 1
        if block is not None:
            decode(m, seq, path(block))
    m.free_sequence(seq)
    m.check_invariants()
    assert snapshots_used(m) == 1  # the last rolling snapshot stays cached with its node
    assert lookup(m, path(1, 2, extra=1))[0] == 0
    assert lookup(m, path(1, 2, 3, extra=1))[0] == 0
    assert lookup(m, path(1, 2, 3, 4, extra=1)) == (16, state_of(m, path(1, 2, 3, 4)))
    assert_clean(m)


def test_kept_snapshots_stay_while_a_rolling_one_moves_on(build: Build) -> None:
    m = build()
    seq, _ = admit(m, path(1, 2))
    compute(m, seq)
    assert m.save_snapshot(seq, 8)  # kept (e.g. the prompt's end)
    for block in (3, 4):
        decode(m, seq, path(block))
        assert m.save_snapshot(seq, seq.num_tokens, rolling=True)
        m.check_invariants()
        assert snapshots_used(m) == 2
    m.free_sequence(seq)
    m.check_invariants()
    assert lookup(m, path(1, 2, extra=1)) == (8, state_of(m, path(1, 2)))
    assert lookup(m, path(1, 2, 3, extra=1)) == (8, state_of(m, path(1, 2)))
    assert lookup(m, path(1, 2, 3, 4, extra=1)) == (16, state_of(m, path(1, 2, 3, 4)))
    assert_clean(m)


def test_another_sequences_rolling_snapshots_leave_a_freed_ones_alone(build: Build) -> None:
    m = build()
    first, _ = admit(m, path(1, 2))
    compute(m, first)
    assert m.save_snapshot(first, 8, rolling=True)
    m.free_sequence(first)
    m.check_invariants()
    second, _ = admit(m, path(5, 6))
    compute(m, second)
    for block in (7, None):
        assert m.save_snapshot(second, second.num_tokens, rolling=True)
        m.check_invariants()
        if block is not None:
            decode(m, second, path(block))
    assert snapshots_used(m) == 2
    m.free_sequence(second)
    assert lookup(m, path(1, 2, extra=1)) == (8, state_of(m, path(1, 2)))
    assert_clean(m)


def test_a_rolling_save_at_a_node_that_already_has_a_snapshot_leaves_it_cached(build: Build) -> None:
    m = build()
    cache_path(m, path(1, 2))  # a finished request's snapshot at 8 tokens
    seq, reused = admit(m, path(1, 2))
    assert reused == 0  # the last prompt token is always computed
    compute(m, seq)
    assert m.save_snapshot(seq, 8, rolling=True)  # lands on the existing snapshot
    m.check_invariants()
    decode(m, seq, path(3))
    assert m.save_snapshot(seq, 12, rolling=True)
    m.check_invariants()
    m.free_sequence(seq)
    m.check_invariants()
    assert lookup(m, path(1, 2, extra=1))[0] == 8
    assert_clean(m)


def test_a_sequences_own_kept_snapshot_survives_its_rolling_saves(build: Build) -> None:
    m = build()
    seq, _ = admit(m, path(1, 2))
    compute(m, seq)
    assert m.save_snapshot(seq, 8)  # kept: the prompt's end
    assert m.save_snapshot(seq, 8, rolling=True)  # the first rolling save lands on it
    decode(m, seq, path(3))
    assert m.save_snapshot(seq, 12, rolling=True)
    m.check_invariants()
    assert snapshots_used(m) == 2
    m.free_sequence(seq)
    assert lookup(m, path(1, 2, extra=1)) == (8, state_of(m, path(1, 2)))
    assert_clean(m)


def test_repeating_a_rolling_save_at_the_same_point_keeps_it_rolling(build: Build) -> None:
    m = build()
    seq, _ = admit(m, path(1, 2))
    compute(m, seq)
    assert m.save_snapshot(seq, 8, rolling=True)
    assert m.save_snapshot(seq, 8, rolling=True)  # e.g. the engine saves at every step at the last boundary
    m.check_invariants()
    decode(m, seq, path(3))
    assert m.save_snapshot(seq, 12, rolling=True)
    m.check_invariants()
    assert snapshots_used(m) == 1
    m.free_sequence(seq)
    assert_clean(m)


def test_a_rolling_save_never_drops_a_snapshot_the_lru_handed_to_another_save(build: Build) -> None:
    m = build(num_snapshots=2)
    rolling, _ = admit(m, path(1, 2))
    compute(m, rolling)
    assert m.save_snapshot(rolling, 8, rolling=True)  # id a at node N
    cache_path(m, path(3, 3))  # id b
    cache_path(m, path(4, 4))  # reuses a (N forgotten)
    cache_path(m, path(5, 5))  # reuses b
    kept, _ = admit(m, path(1, 2, extra=1))  # N has no snapshot any more: computed again
    assert kept.num_blocks == 0
    compute(m, kept)
    assert m.save_snapshot(kept, 8)  # reuses a, at N again: a kept snapshot of another sequence
    m.free_sequence(kept)
    m.check_invariants()
    decode(m, rolling, path(6))
    assert m.save_snapshot(rolling, 12, rolling=True)  # the pool is full: path(5, 5)'s is the LRU one
    m.check_invariants()
    assert lookup(m, path(1, 2, extra=1))[0] == 8
    m.free_sequence(rolling)
    assert_clean(m)


# ----------------------------------------------------------------------------- reclaim_prefix_blocks_for


def cached_path_with_snapshot_at_8(m: HybridModel) -> None:
    """Cache path(1, 2, 3, 4) with an SSM snapshot at 8 tokens only."""
    tokens = path(1, 2, 3, 4, extra=1)
    seq, _ = admit(m, tokens)
    m.grow(seq, 17)
    if m.ssm_pool is not None:
        write_slot(m, seq.slot_idx, state_of(m, tokens[:8]))
        assert m.save_snapshot(seq, 8)
    compute(m, seq)
    m.cache_sequence(seq)  # 17 tokens: no snapshot at block 4
    m.free_sequence(seq)
    m.check_invariants()


def test_reclaim_for_counts_only_the_blocks_up_to_the_deepest_snapshot(build: Build) -> None:
    hybrid, attention = build(num_blocks=12), build(attention=True, num_blocks=12)
    for m in (hybrid, attention):
        cached_path_with_snapshot_at_8(m)
        assert m.num_free_blocks() == 8
    prompt = path(1, 2, 3, 4, extra=1)
    result = hybrid.reclaim_prefix_blocks_for(prompt, NO_ADAPTER, 11)
    hybrid.check_invariants()
    assert (result.target, result.free) == (11 - 2, 9)  # one unusable cached block evicted
    result = attention.reclaim_prefix_blocks_for(prompt, NO_ADAPTER, 11)
    attention.check_invariants()
    assert (result.target, result.free) == (11 - 4, 8)  # the whole match counts: nothing to evict
    assert_clean(hybrid)
    assert_clean(attention)


def test_reclaim_for_never_evicts_the_reusable_prefix_of_a_hybrid_model(build: Build) -> None:
    m = build(num_blocks=12)
    cached_path_with_snapshot_at_8(m)
    result = m.reclaim_prefix_blocks_for(path(1, 2, 3, 4, extra=1), NO_ADAPTER, 12)
    m.check_invariants()
    assert (result.target, result.free) == (10, 10)
    assert lookup(m, path(1, 2, 3, 4, extra=1)) == (8, state_of(m, path(1, 2)))
    result = m.reclaim_prefix_blocks_for(path(1, 2, 3, 4, extra=1), NO_ADAPTER, 14)
    assert (result.target, result.free, result.fits) == (12, 10, False)
    assert_clean(m)


def test_reclaim_for_a_hybrid_match_without_any_snapshot_needs_every_block(build: Build) -> None:
    m = build(num_blocks=12)
    cache_path(m, path(1, 2, 3, extra=1))  # cached KV, no snapshot anywhere
    assert m.num_free_blocks() == 9
    result = m.reclaim_prefix_blocks_for(path(1, 2, 3, extra=1), NO_ADAPTER, 11)
    m.check_invariants()
    assert (result.target, result.free) == (11, 11)
    assert_clean(m)


# ----------------------------------------------------------------------------- stats


COUNTERS = ("snapshots_saved", "snapshot_hits", "snapshot_hits_cut_short", "snapshots_evicted",
            "prefix_hits", "prefix_misses", "prefix_hit_tokens")


def test_stats_count_snapshot_hits_cut_short_hits_and_evictions(build: Build) -> None:
    m = build(num_snapshots=2)
    expected = dict.fromkeys(COUNTERS, 0)

    def step(action: Callable[[], object], **changes: int) -> None:
        before = m.stats()
        action()
        want = dict.fromkeys(COUNTERS, 0)
        want.update(changes)
        assert delta(before, m.stats(), *COUNTERS) == want
        for key, value in changes.items():
            expected[key] += value

    step(lambda: cache_path(m, path(1, 2)), snapshots_saved=1, prefix_misses=1)
    step(lambda: lookup(m, path(1, 2, extra=1)), snapshot_hits=1, prefix_hits=1, prefix_hit_tokens=8)
    # A hit short of the match: path(1, 2) reusable, block 3 cached without a snapshot.
    step(lambda: cache_path(m, path(1, 2, 3, extra=2)), snapshot_hits=1, prefix_hits=1, prefix_hit_tokens=8)
    step(lambda: lookup(m, path(1, 2, 3, extra=1)), snapshot_hits=1, snapshot_hits_cut_short=1, prefix_hits=1,
         prefix_hit_tokens=8)
    step(lambda: lookup(m, path(7, extra=1)), prefix_misses=1)  # matched nothing: not cut short
    step(lambda: cache_path(m, path(4, 4)), snapshots_saved=1, prefix_misses=1)
    step(lambda: cache_path(m, path(5, 5)), snapshots_saved=1, snapshots_evicted=1, prefix_misses=1)  # budget
    step(lambda: lookup(m, path(1, 2, extra=1)), snapshot_hits_cut_short=1, prefix_misses=1)
    step(lambda: m.reclaim_prefix_blocks(m.num_total_blocks()), snapshots_evicted=2)
    assert {f: getattr(m.stats(), f) for f in COUNTERS} == expected
    assert_clean(m)


# ----------------------------------------------------------------------------- stateful


MAX_SEQS = 4
MAX_TOKENS = 6 * BS
SNAPSHOTS = 3
PATTERNS = st.lists(st.integers(0, 1), min_size=1, max_size=4)


def pattern_tokens(start: int, count: int, pattern: int) -> list[int]:
    """``count`` tokens from position ``start`` of a sequence made of ``pattern``'s block repeated:
    sequences drawn from few patterns share whole blocks, so their cached paths meet."""
    return [100 * pattern + (pos % BS) + 1 for pos in range(start, start + count)]


class SnapshotMachine(RuleBasedStateMachine):
    """Sequences with and without snapshots (kept, rolling, at the end or inside), caching,
    lookups, eviction under pressure and a small snapshot budget, against a plain-Python model:
    the SSM state is a function of the consumed tokens, and ``ever`` holds every whole-block prefix
    that was ever snapshotted. A lookup never reuses past the deepest such prefix, always restores
    exactly the state of what it reuses, and a fresh snapshot is reusable at once."""

    def __init__(self) -> None:
        super().__init__()
        self.device = make_device()
        self.m = HybridModel(
            hybrid_config(num_blocks=12, max_seqs=MAX_SEQS, num_snapshots=SNAPSHOTS, max_blocks_per_seq=6), self.device
        )
        self.live: list[SequenceState] = []
        self.ever: set[bytes] = set()

    # -- the reference model

    def deepest_ever(self, tokens: npt.NDArray[np.int32]) -> int:
        limit = (len(tokens) - 1) // BS
        return max((k for k in range(1, limit + 1) if tokens[: k * BS].tobytes() in self.ever), default=0)

    def probe(self, prefix: npt.NDArray[np.int32]) -> None:
        """A snapshot just taken at ``prefix`` is reused, restoring exactly its state."""
        reused, state = lookup(self.m, np.concatenate((prefix, [TAIL])).astype(np.int32))
        assert reused == len(prefix)
        assert state == state_of(self.m, prefix)

    def at_boundary(self) -> list[SequenceState]:
        return [seq for seq in self.live if seq.num_tokens % BS == 0]

    # -- rules

    @precondition(lambda self: len(self.live) < MAX_SEQS - 1)  # one slot stays free for probes
    @rule(blocks=PATTERNS, extra=st.integers(0, BS - 1))
    def admit(self, blocks: list[int], extra: int) -> None:
        tokens = np.concatenate((path(*blocks), pattern_tokens(0, extra, 9))).astype(np.int32)
        seq, reused = admit(self.m, tokens)
        assert reused % BS == 0
        assert reused // BS <= self.deepest_ever(tokens)
        restored = read_slot(self.m, seq.slot_idx)
        assert restored == (state_of(self.m, tokens[:reused]) if reused else [bytes(n) for n in range_sizes(self.m)])
        try:
            compute(self.m, seq)
        except OutOfBlocks:
            self.m.check_invariants()
            self.m.free_sequence(seq)
            return
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7), count=st.integers(1, BS), pattern=st.integers(0, 2))
    def decode(self, index: int, count: int, pattern: int) -> None:
        seq = self.live[index % len(self.live)]
        count = min(count, MAX_TOKENS - seq.num_tokens)
        try:
            self.m.grow(seq, seq.num_tokens + count)
        except OutOfBlocks:
            return
        finally:
            self.m.check_invariants()
        decode(self.m, seq, np.array(pattern_tokens(seq.num_tokens, count, pattern), dtype=np.int32))

    @precondition(lambda self: self.at_boundary())
    @rule(index=st.integers(0, 7), rolling=st.booleans())
    def save_at_end(self, index: int, rolling: bool) -> None:
        candidates = self.at_boundary()
        seq = candidates[index % len(candidates)]
        assert self.m.save_snapshot(seq, seq.num_tokens, rolling=rolling)
        self.m.check_invariants()
        self.ever.add(seq.tokens.tobytes())
        self.probe(seq.tokens.copy())

    @precondition(lambda self: any(seq.num_tokens >= BS for seq in self.live))
    @rule(index=st.integers(0, 7), point=st.integers(1, MAX_TOKENS // BS), rolling=st.booleans())
    def save_inside(self, index: int, point: int, rolling: bool) -> None:
        candidates = [seq for seq in self.live if seq.num_tokens >= BS]
        seq = candidates[index % len(candidates)]
        point = min(point, seq.num_tokens // BS)
        prefix = seq.tokens[: point * BS].copy()
        write_slot(self.m, seq.slot_idx, state_of(self.m, prefix))  # the engine paused there
        assert self.m.save_snapshot(seq, point * BS, rolling=rolling)
        self.m.check_invariants()
        write_slot(self.m, seq.slot_idx, state_of(self.m, seq.tokens))
        self.ever.add(prefix.tobytes())
        self.probe(prefix)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7))
    def cache(self, index: int) -> None:
        seq = self.live[index % len(self.live)]
        self.m.cache_sequence(seq)
        self.m.check_invariants()
        if seq.num_tokens % BS == 0:  # the state is at the cached end: a snapshot there
            self.ever.add(seq.tokens.tobytes())
            self.probe(seq.tokens.copy())

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 7))
    def free(self, index: int) -> None:
        seq = self.live.pop(index % len(self.live))
        self.m.free_sequence(seq)

    @rule(count=st.integers(0, 6))
    def reclaim(self, count: int) -> None:
        self.m.reclaim_prefix_blocks(count)

    @rule(blocks=PATTERNS, extra=st.integers(1, BS), needed=st.integers(0, 8))
    def reclaim_for(self, blocks: list[int], extra: int, needed: int) -> None:
        tokens = np.concatenate((path(*blocks), pattern_tokens(0, extra, 9))).astype(np.int32)
        result = self.m.reclaim_prefix_blocks_for(tokens, NO_ADAPTER, needed)
        assert max(needed - self.deepest_ever(tokens), 0) <= result.target <= needed
        assert result.free == self.m.num_free_blocks()

    @invariant()
    def consistent(self) -> None:
        self.m.check_invariants()
        assert snapshots_used(self.m) <= SNAPSHOTS

    def teardown(self) -> None:
        try:
            for seq in self.live:
                self.m.free_sequence(seq)
            assert_clean(self.m)
            self.m.teardown()
            assert self.m.teardown_report is not None and self.m.teardown_report.leaked == 0
        finally:
            self.device.close()


SnapshotMachine.TestCase.settings = settings(stateful_step_count=40)
TestSnapshotsStateful = SnapshotMachine.TestCase


def test_a_refused_attach_leaves_the_slot_state_the_engine_advanced(build: Build) -> None:
    """Only a call that attached (or attached and then ran out of blocks to grow) restores the
    prefix snapshot; a refused call changes nothing, the slot included."""
    m = build()
    cache_path(m, path(1, 2, 3))
    tokens = path(1, 2, 3, extra=1)
    seq, reused = admit(m, tokens)
    assert reused == 3 * BS
    compute(m, seq)
    advanced = read_slot(m, seq.slot_idx)
    for prompt, grow_to in ((tokens, -5), (tokens, 10**9), (path(7, 8, 9, extra=1), None)):
        with pytest.raises(LifecycleError):
            m.attach_prefix(seq, prompt, grow_to=grow_to)
        assert read_slot(m, seq.slot_idx) == advanced
        m.check_invariants()
    m.free_sequence(seq)
    assert_clean(m)
