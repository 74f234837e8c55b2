"""HybridModel: the seventeen methods, the companions, and the regression scenarios of SPEC §8.

Every stateful test calls ``check_invariants()`` after each mutating step and ends with the block
and slot counts back where they started.
"""

from __future__ import annotations

import gc
import io
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lifecycle.config import AttentionLayer, ModelConfig, SSMLayer
from lifecycle.device.base import Device
from lifecycle.errors import (
    AdapterError,
    ForeignSequence,
    InvalidId,
    LifecycleError,
    OutOfBlocks,
    OutOfSlots,
    PoolExhausted,
    SequenceStateError,
    SlotInUse,
    SlotOutOfRange,
    TornDown,
)
from lifecycle.model import HybridModel
from lifecycle.protocol import LifecycleDefaults, ModelLifecycle, PrefixReclaim
from lifecycle.sequence import DETACHED_SLOT, NO_ADAPTER, SequenceState
from devices import device  # noqa: F401  (the shared device fixture)

BS = 4


def hybrid_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        layers=(
            AttentionLayer(num_kv_heads=2, head_dim=8),
            SSMLayer(h_state_bytes=256, conv_state_bytes=64),
            AttentionLayer(num_kv_heads=2, head_dim=8),
            SSMLayer(h_state_bytes=128, conv_state_bytes=32),
        ),
        block_size=BS,
        num_blocks=64,
        max_seqs=6,
        num_adapter_slots=3,
        num_snapshots=16,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def attention_config(**overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        layers=(AttentionLayer(num_kv_heads=2, head_dim=8), AttentionLayer(num_kv_heads=2, head_dim=8)),
        block_size=BS,
        num_blocks=64,
        max_seqs=6,
        num_adapter_slots=3,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def model(device: Device) -> Iterator[HybridModel]:
    m = HybridModel(hybrid_config(), device)
    yield m
    m.teardown()


@pytest.fixture
def attn(device: Device) -> Iterator[HybridModel]:
    m = HybridModel(attention_config(), device)
    yield m
    m.teardown()


def prompt(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def run_prefill(m: HybridModel, tokens: np.ndarray, generated: int = 0) -> SequenceState:
    """Admit a request the way a scheduler does: attach the cached prefix, grow, append tokens."""
    seq = m.alloc_sequence()
    m.attach_prefix(seq, tokens)
    m.check_invariants()
    m.grow(seq, len(tokens) + generated)
    m.check_invariants()
    if generated:
        seq.append_tokens(range(10_000, 10_000 + generated))
    return seq


def fill_slot(m: HybridModel, slot: int, seed: int) -> list[bytes]:
    """Write random bytes into every per-slot range of ``slot``; returns them."""
    ssm = m.ssm_pool
    assert ssm is not None
    rng = np.random.default_rng(seed)
    written = []
    for addr, nbytes in ssm.slot_ranges(slot):
        data = rng.integers(1, 256, nbytes, dtype=np.uint8)
        staging = np.ascontiguousarray(data)
        m.device.copy_htod(addr, staging.ctypes.data, nbytes)
        written.append(data.tobytes())
    m.device.synchronize()
    return written


def read_slot(m: HybridModel, slot: int) -> list[bytes]:
    ssm = m.ssm_pool
    assert ssm is not None
    out = []
    for addr, nbytes in ssm.slot_ranges(slot):
        buf = np.empty(nbytes, dtype=np.uint8)
        m.device.copy_dtoh(buf.ctypes.data, addr, nbytes)
        m.device.synchronize()
        out.append(buf.tobytes())
    return out


def assert_clean(m: HybridModel) -> None:
    m.check_invariants()
    assert m.num_live_sequences == 0


# ----------------------------------------------------------------------------- protocol


def test_hybrid_model_satisfies_the_protocol(model: HybridModel) -> None:
    assert isinstance(model, ModelLifecycle)


class _NoPools(LifecycleDefaults):
    """A model without pools: only the seven required methods."""

    def bind_gpu_to_thread(self) -> None:
        pass

    def alloc_sequence(self) -> SequenceState:
        raise OutOfSlots("this model has no slots")

    def cache_sequence(self, seq: SequenceState) -> None:
        pass

    def free_sequence(self, seq: SequenceState) -> None:
        pass

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        pass

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        pass

    def kv_block_bytes(self) -> int:
        return 0


def test_defaults_of_a_model_without_pools() -> None:
    m = _NoPools()
    assert isinstance(m, ModelLifecycle)
    m.teardown()
    m.poll_innerq()
    assert m.high_speed_swap_dims() is None
    assert m.num_free_blocks() == 0 and m.num_total_blocks() == 0
    assert m.reclaim_prefix_blocks(10) == 0
    assert m.reclaim_prefix_blocks_for([1, 2, 3], NO_ADAPTER, 0) == PrefixReclaim(target=0, free=0)
    assert m.reclaim_prefix_blocks_for([1, 2, 3], NO_ADAPTER, 5) == PrefixReclaim(target=5, free=0)
    with pytest.raises(OutOfSlots):
        m.alloc_sequence_for(100)
    with pytest.raises(LifecycleError, match="cannot save"):
        m.save_sequence_state(None, io.BytesIO())  # type: ignore[arg-type]
    with pytest.raises(LifecycleError, match="cannot restore"):
        m.restore_sequence_state(None, 1, io.BytesIO())  # type: ignore[arg-type]


def test_default_reclaim_for_loops_until_enough_is_free() -> None:
    class Reclaiming(_NoPools):
        def __init__(self) -> None:
            self.free = 0
            self.calls = 0

        def num_free_blocks(self) -> int:
            return self.free

        def reclaim_prefix_blocks(self, num_blocks: int) -> int:
            self.calls += 1
            got = min(num_blocks, 2, 7 - self.free)
            self.free += got
            return got

    m = Reclaiming()
    assert m.reclaim_prefix_blocks_for([], NO_ADAPTER, 5) == PrefixReclaim(target=5, free=5)
    m2 = Reclaiming()
    assert m2.reclaim_prefix_blocks_for([], NO_ADAPTER, 9) == PrefixReclaim(target=9, free=7)


# ----------------------------------------------------------------------------- basics


def test_alloc_sequence_claims_a_zeroed_slot(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    fill_slot(model, seq.slot_idx, seed=1)
    model.free_sequence(seq)
    again = model.alloc_sequence()
    assert all(chunk == bytes(len(chunk)) for chunk in read_slot(model, again.slot_idx))
    model.free_sequence(again)
    assert_clean(model)


def test_alloc_sequence_for_sizes_proposer_state_to_the_budget(model: HybridModel) -> None:
    seq = model.alloc_sequence_for(100)
    assert seq.budget_tokens == 100 and seq.draft_tokens.shape == (100,)
    with pytest.raises(InvalidId, match="-1"):
        model.alloc_sequence_for(-1)
    model.free_sequence(seq)
    assert_clean(model)


def test_out_of_slots_is_pool_exhausted_and_changes_nothing(model: HybridModel) -> None:
    seqs = [model.alloc_sequence() for _ in range(model.config.max_seqs)]
    with pytest.raises(PoolExhausted):
        model.alloc_sequence()
    model.check_invariants()
    assert sorted(s.slot_idx for s in seqs) == list(range(model.config.max_seqs))
    for s in seqs:
        model.free_sequence(s)
    assert_clean(model)


def test_grow_is_all_or_nothing(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    assert model.grow(seq, 9) == 3
    model.check_invariants()
    assert model.grow(seq, 12) == 0
    hog = model.alloc_sequence()
    model.grow(hog, (model.num_total_blocks() - 4) * BS)
    free = model.num_free_blocks()
    assert free == 1
    with pytest.raises(OutOfBlocks, match="need 2 blocks, 1 free"):
        model.grow(seq, 5 * BS)
    assert model.num_free_blocks() == free and seq.num_blocks == 3
    with pytest.raises(InvalidId, match="per-sequence limit of 64"):
        model.grow(seq, (model.num_total_blocks() + 1) * BS)
    model.check_invariants()
    model.free_sequence(hog)
    model.free_sequence(seq)
    assert model.num_free_blocks() == model.num_total_blocks()
    assert_clean(model)


def test_block_table_is_an_int32_copy(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    model.grow(seq, 10)
    table = model.block_table(seq)
    assert table.dtype == np.int32 and table.shape == (3,)
    assert np.array_equal(table, seq.block_table)
    table[0] = -5
    assert seq.block_table[0] != -5
    model.free_sequence(seq)
    assert_clean(model)


def test_kv_block_bytes_times_total_is_the_pool_size(model: HybridModel) -> None:
    per_layer = 2 * BS * 2 * 8 * 2  # K and V, block_size tokens, 2 heads, dim 8, float16
    assert model.kv_block_bytes() == 2 * per_layer
    kv = model.kv_pool
    assert kv is not None
    assert model.num_total_blocks() * model.kv_block_bytes() == kv.total_bytes


def test_high_speed_swap_dims_describe_the_model(model: HybridModel) -> None:
    dims = model.high_speed_swap_dims()
    assert dims.block_size == BS and dims.num_kv_heads == 2 and dims.head_dim == 8
    assert dims.fingerprint == model.config.fingerprint()


def test_poll_innerq_runs_the_registered_hook_only(model: HybridModel) -> None:
    calls: list[int] = []
    model.poll_innerq()
    model.set_innerq_hook(lambda: calls.append(1))
    model.poll_innerq()
    model.poll_innerq()
    assert calls == [1, 1]


def test_bind_gpu_to_thread_from_another_thread(model: HybridModel) -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            model.bind_gpu_to_thread()
            seq = model.alloc_sequence()
            model.grow(seq, 5)
            model.free_sequence(seq)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == []
    assert_clean(model)


def test_a_foreign_sequence_is_refused(device: Device) -> None:
    a, b = HybridModel(hybrid_config(), device), HybridModel(hybrid_config(), device)
    seq = a.alloc_sequence()
    for call in (b.free_sequence, b.cache_sequence, b.detach_slot_for_reuse, lambda s: b.grow(s, 4)):
        with pytest.raises(ForeignSequence, match=f"sequence {seq.seq_id}"):
            call(seq)
    b.check_invariants()
    a.free_sequence(seq)
    a.check_invariants()
    a.teardown()
    b.teardown()


def test_bad_tokens_are_refused(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    with pytest.raises(InvalidId, match="-3"):
        model.attach_prefix(seq, [1, -3, 4])
    with pytest.raises(LifecycleError):
        seq.append_tokens([[1, 2]])  # type: ignore[list-item]
    assert seq.num_tokens == 0
    model.free_sequence(seq)
    assert_clean(model)


# ----------------------------------------------------------------------------- teardown


def test_teardown_reports_what_was_still_held_and_is_idempotent(device: Device) -> None:
    m = HybridModel(hybrid_config(), device)
    seq = run_prefill(m, prompt(10))
    m.teardown()
    report = m.teardown_report
    assert report is not None
    assert report.live_sequences == 1 and report.live_blocks == 3 and report.leaked >= 1
    m.teardown()
    with pytest.raises(TornDown):
        m.alloc_sequence()
    with pytest.raises(TornDown):
        m.num_free_blocks()
    with pytest.raises(TornDown):
        m.free_sequence(seq)


def test_clean_teardown_reports_no_leak(device: Device) -> None:
    m = HybridModel(hybrid_config(), device)
    seq = run_prefill(m, prompt(10))
    m.cache_sequence(seq)
    m.free_sequence(seq)
    m.teardown()
    assert m.teardown_report is not None and m.teardown_report.leaked == 0


# ----------------------------------------------------------------------------- prefix cache


def test_second_request_reuses_the_cached_prefix(attn: HybridModel) -> None:
    first = run_prefill(attn, prompt(13))
    attn.cache_sequence(first)
    attn.check_invariants()
    first_blocks = first.block_table.copy()
    attn.free_sequence(first)
    attn.check_invariants()
    assert first.num_blocks == 0
    second = attn.alloc_sequence()
    assert attn.attach_prefix(second, prompt(13)) == 12
    assert np.array_equal(second.block_table, first_blocks[:3])
    attn.check_invariants()
    attn.free_sequence(second)
    stats = attn.stats()
    assert stats.prefix_hits == 1 and stats.prefix_hit_tokens == 12 and stats.prefix_lookup_tokens == 26
    assert_clean(attn)


def test_lookup_never_covers_the_last_prompt_token(attn: HybridModel) -> None:
    first = run_prefill(attn, prompt(12))
    attn.cache_sequence(first)
    attn.free_sequence(first)
    second = attn.alloc_sequence()
    assert attn.attach_prefix(second, prompt(12)) == 8
    attn.free_sequence(second)
    assert_clean(attn)


def test_adapters_have_separate_prefix_roots(attn: HybridModel) -> None:
    slot = attn.load_adapter("math")
    first = attn.alloc_sequence()
    attn.bind_adapter(first, slot)
    attn.attach_prefix(first, prompt(9))
    attn.grow(first, 9)
    attn.cache_sequence(first)
    attn.free_sequence(first)
    plain = attn.alloc_sequence()
    assert attn.attach_prefix(plain, prompt(9)) == 0
    attn.free_sequence(plain)
    same = attn.alloc_sequence()
    attn.bind_adapter(same, slot)
    assert attn.attach_prefix(same, prompt(9)) == 8
    attn.free_sequence(same)
    attn.check_invariants()
    attn.load_adapter("math")  # reload: a new generation never matches the old KV
    reloaded = attn.alloc_sequence()
    attn.bind_adapter(reloaded, _slot_of(attn, "math"))
    assert attn.attach_prefix(reloaded, prompt(9)) == 0
    attn.free_sequence(reloaded)
    assert_clean(attn)


def _slot_of(m: HybridModel, name: str) -> int:
    for slot in range(m.config.num_adapter_slots):
        info = m.adapter_info(slot)
        if info.loaded and info.name == name:
            return slot
    raise AssertionError(name)


def test_reclaim_prefix_blocks_frees_lru_first_and_reports_zero_when_empty(attn: HybridModel) -> None:
    for i in range(3):
        seq = run_prefill(attn, prompt(9, start=100 * i + 1))
        attn.cache_sequence(seq)
        attn.free_sequence(seq)
        attn.check_invariants()
    total = attn.num_total_blocks()
    assert attn.num_free_blocks() == total - 6
    assert attn.reclaim_prefix_blocks(2) == 2
    attn.check_invariants()
    assert attn.num_free_blocks() == total - 4
    assert attn.reclaim_prefix_blocks(100) == 4
    assert attn.reclaim_prefix_blocks(1) == 0
    assert_clean(attn)


# ----------------------------------------------------------------------------- SPEC §8 scenarios


def test_s1_retire_with_compaction_releases_the_slot_once(model: HybridModel) -> None:
    retired = model.alloc_sequence()
    survivor = model.alloc_sequence()
    retired_slot, survivor_slot = retired.slot_idx, survivor.slot_idx
    survivor_state = fill_slot(model, survivor_slot, seed=7)
    model.retire_sequence(retired)
    model.compact_sequence(survivor, retired_slot)
    model.check_invariants()
    model.detach_slot_for_reuse(retired)
    model.check_invariants()
    assert retired.slot_idx == DETACHED_SLOT and survivor.slot_idx == retired_slot
    assert read_slot(model, retired_slot) == survivor_state
    with pytest.raises(SequenceStateError, match="detached"):
        model.save_sequence_state(retired, io.BytesIO())  # the swap-out save fails...
    del retired  # ...and the sequence is dropped
    gc.collect()
    model.check_invariants()
    assert not model.slots.is_free(retired_slot)
    assert model.slots.is_free(survivor_slot)
    model.free_sequence(survivor)
    model.check_invariants()
    assert model.slots.is_free(retired_slot)
    assert model.slots.num_free == model.config.max_seqs
    assert_clean(model)


def test_s1_detach_before_compaction_also_works(model: HybridModel) -> None:
    retired = model.alloc_sequence()
    survivor = model.alloc_sequence()
    slot = retired.slot_idx
    model.detach_slot_for_reuse(retired)
    model.free_sequence(retired)
    model.check_invariants()
    assert not model.slots.is_free(slot)
    model.compact_sequence(survivor, slot)
    model.check_invariants()
    model.free_sequence(survivor)
    assert model.slots.num_free == model.config.max_seqs
    assert_clean(model)


def test_compaction_into_an_active_sequences_slot_is_refused(model: HybridModel) -> None:
    a = model.alloc_sequence()
    b = model.alloc_sequence()
    state_a = fill_slot(model, a.slot_idx, seed=3)
    with pytest.raises(SlotInUse, match=f"slot {a.slot_idx}"):
        model.compact_sequence(b, a.slot_idx)
    assert read_slot(model, a.slot_idx) == state_a
    with pytest.raises(SlotOutOfRange, match="99"):
        model.compact_sequence(b, 99)
    with pytest.raises(SlotOutOfRange, match=str(model.config.max_seqs)):
        model.compact_sequence(b, model.config.max_seqs)  # the padding slot is never handed out
    model.check_invariants()
    model.free_sequence(a)
    model.free_sequence(b)
    assert_clean(model)


def test_compaction_to_the_same_slot_is_a_no_op(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    before = model.stats().compactions
    model.compact_sequence(seq, seq.slot_idx)
    assert model.stats().compactions == before
    model.free_sequence(seq)
    assert_clean(model)


def test_s2_a_free_compaction_target_is_claimed_never_handed_out_twice(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    target = next(s for s in range(model.config.max_seqs) if model.slots.is_free(s) and s != seq.slot_idx)
    model.compact_sequence(seq, target)
    model.check_invariants()
    others = [model.alloc_sequence() for _ in range(model.config.max_seqs - 1)]
    assert target not in {o.slot_idx for o in others}
    assert len({o.slot_idx for o in others} | {seq.slot_idx}) == model.config.max_seqs
    for o in [*others, seq]:
        model.free_sequence(o)
    assert_clean(model)


def test_s3_every_per_slot_address_follows_compaction(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    state = fill_slot(model, seq.slot_idx, seed=11)
    target = (seq.slot_idx + 3) % model.config.max_seqs
    model.compact_sequence(seq, target)
    ssm = model.ssm_pool
    assert ssm is not None
    assert seq.ssm_addrs == tuple((ssm.h_addr(i, target), ssm.conv_addr(i, target)) for i in range(2))
    assert read_slot(model, target) == state
    model.free_sequence(seq)
    assert_clean(model)


def test_s4_a_late_failure_in_free_sequence_still_releases_the_slot(
    model: HybridModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = model.load_adapter("a")
    seq = model.alloc_sequence()
    model.bind_adapter(seq, slot)
    model.grow(seq, 8)
    ssm_slot = seq.slot_idx
    adapters = model._adapters

    class FailingRelease:
        def __getattr__(self, name: str) -> Any:
            return getattr(adapters, name)

        def release(self, adapter_slot: int, uid: int) -> None:
            raise AdapterError("injected failure")

        def release_ref(self, adapter_slot: int) -> None:
            raise AdapterError("injected failure")

    monkeypatch.setattr(model, "_adapters", FailingRelease())
    with pytest.raises(AdapterError, match="injected"):
        model.free_sequence(seq)
    assert model.slots.is_free(ssm_slot)
    assert seq.is_freed and model.num_free_blocks() == model.num_total_blocks()
    monkeypatch.setattr(model, "_adapters", adapters)
    adapters.release(slot, adapters.info(slot).uid)  # settle the injected leak by hand
    model.free_sequence(seq)  # a second call is a no-op
    assert_clean(model)


def test_s5_a_dropped_sequence_releases_its_slot_and_blocks_once(model: HybridModel) -> None:
    seq = run_prefill(model, prompt(10))
    slot = seq.slot_idx
    del seq
    gc.collect()
    assert model.slots.is_free(slot)
    model.check_invariants()
    assert model.num_free_blocks() == model.num_total_blocks()
    assert model.slots.num_free == model.config.max_seqs
    assert_clean(model)


def test_s5_a_dropped_detached_sequence_releases_nothing(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    slot = seq.slot_idx
    model.detach_slot_for_reuse(seq)
    del seq
    gc.collect()
    model.check_invariants()
    assert model.slots.is_detached(slot)
    survivor = model.alloc_sequence()
    model.compact_sequence(survivor, slot)
    model.free_sequence(survivor)
    assert model.slots.num_free == model.config.max_seqs
    assert_clean(model)


def test_s6_lora_release_goes_to_the_acquired_index_once(model: HybridModel) -> None:
    slot = model.load_adapter("chat")
    seq = model.alloc_sequence()
    model.bind_adapter(seq, slot)
    assert model.adapter_info(slot).refcount == 1
    new_slot = model.load_adapter("chat")  # reloaded meanwhile: a new generation elsewhere
    assert new_slot != slot
    model.free_sequence(seq)
    assert seq.adapter_slot == NO_ADAPTER
    assert model.adapter_info(slot).refcount == 0
    assert model.adapter_info(new_slot).refcount == 0
    model.free_sequence(seq)
    assert model.adapter_info(new_slot).refcount == 0
    with pytest.raises(AdapterError, match="no loaded adapter"):
        model.bind_adapter(model.alloc_sequence(), slot)  # the old generation's slot was reaped
    assert_clean(model)


def test_s7_a_failed_prefill_after_attach_unpins_the_prefix(attn: HybridModel) -> None:
    first = run_prefill(attn, prompt(17))
    attn.cache_sequence(first)
    attn.free_sequence(first)
    failing = attn.alloc_sequence()
    assert attn.attach_prefix(failing, prompt(17)) == 16
    failing.mark_failed()
    attn.free_sequence(failing)
    attn.check_invariants()
    assert attn.reclaim_prefix_blocks(100) == 4  # nothing stays pinned
    assert_clean(attn)


def test_s8_a_retried_lookup_takes_no_second_reference(attn: HybridModel) -> None:
    first = run_prefill(attn, prompt(9))
    attn.cache_sequence(first)
    attn.free_sequence(first)
    seq = attn.alloc_sequence()
    attn.attach_prefix(seq, prompt(9))
    refs = attn.pool.refcounts().copy()
    attn.attach_prefix(seq, prompt(9))
    attn.check_invariants()
    assert np.array_equal(attn.pool.refcounts(), refs)
    attn.free_sequence(seq)
    assert attn.reclaim_prefix_blocks(100) == 2
    assert_clean(attn)


def test_s9_caching_over_existing_nodes_keeps_their_blocks(attn: HybridModel) -> None:
    a = run_prefill(attn, prompt(9))
    b = run_prefill(attn, prompt(9))  # computed the same prefix before a was cached
    attn.cache_sequence(a)
    attn.check_invariants()
    attn.cache_sequence(b)  # nodes exist: they keep a's blocks; b's duplicates stay b's
    attn.check_invariants()
    a_blocks, b_blocks = a.block_table[:2].copy(), b.block_table[:2].copy()
    assert all(attn.pool.refcount(int(x)) == 2 for x in a_blocks)
    assert all(attn.pool.refcount(int(x)) == 1 for x in b_blocks)
    assert attn.reclaim_prefix_blocks(100) == 0  # a still holds the cached blocks
    attn.free_sequence(b)
    attn.check_invariants()
    assert all(attn.pool.refcount(int(x)) == 0 for x in b_blocks)
    attn.free_sequence(a)
    assert attn.reclaim_prefix_blocks(100) == 2
    assert_clean(attn)


def test_s10_a_block_released_and_acquired_in_one_step_keeps_a_reference(attn: HybridModel) -> None:
    """A retried attach takes its new references before it drops the old ones (in one core call
    under its lock): the prefix blocks keep their references and never go back to the free list."""
    first = run_prefill(attn, prompt(9))
    attn.cache_sequence(first)
    attn.free_sequence(first)
    attn.reclaim_prefix_blocks(0)
    seq = attn.alloc_sequence()
    attn.attach_prefix(seq, prompt(9))
    refs, free = attn.pool.refcounts(), attn.num_free_blocks()
    attn.attach_prefix(seq, prompt(9))
    assert np.array_equal(attn.pool.refcounts(), refs) and attn.num_free_blocks() == free
    assert all(attn.pool.refcount(int(b)) == 2 for b in seq.block_table)  # the cache's and ours
    attn.check_invariants()
    attn.free_sequence(seq)
    assert_clean(attn)


def test_s11_with_the_prefix_cache_disabled_nothing_takes_a_cache_reference(device: Device) -> None:
    m = HybridModel(attention_config(enable_prefix_cache=False), device)
    for _ in range(5):
        seq = run_prefill(m, prompt(9), generated=3)
        m.cache_sequence(seq)
        m.check_invariants()
        m.free_sequence(seq)
        assert m.num_free_blocks() == m.num_total_blocks()
    assert m.reclaim_prefix_blocks(10) == 0
    assert_clean(m)
    m.teardown()


def test_s12_a_double_free_never_takes_a_refcount_below_zero(attn: HybridModel) -> None:
    seq = run_prefill(attn, prompt(9))
    blocks = seq.block_table.copy()
    attn.free_sequence(seq)
    attn.free_sequence(seq)
    attn.check_invariants()
    with pytest.raises(LifecycleError, match=str(int(blocks[0]))):
        attn.pool.dec_ref(blocks)
    assert all(attn.pool.refcount(int(b)) == 0 for b in blocks)
    assert_clean(attn)


def test_s13_allocation_under_pressure_keeps_evicting(device: Device) -> None:
    m = HybridModel(attention_config(num_blocks=12), device)
    for i in range(4):
        seq = run_prefill(m, prompt(9, start=100 * i + 1))
        m.cache_sequence(seq)
        m.free_sequence(seq)
    assert m.num_free_blocks() == 4
    big = m.alloc_sequence()
    m.grow(big, 11 * BS)  # needs 7 more blocks than are free: evicts several times
    m.check_invariants()
    assert big.num_blocks == 11 and m.stats().blocks_evicted >= 7
    m.free_sequence(big)
    assert_clean(m)
    m.teardown()


def test_s14_reclaim_for_never_evicts_the_prefix_it_makes_room_for(device: Device) -> None:
    m = HybridModel(attention_config(num_blocks=8), device)
    wanted = prompt(13)
    for tokens in (wanted, prompt(9, start=500)):
        seq = run_prefill(m, tokens)
        m.cache_sequence(seq)
        m.free_sequence(seq)
    m.check_invariants()
    assert m.num_free_blocks() == 3
    result = m.reclaim_prefix_blocks_for(wanted, NO_ADAPTER, 8)
    m.check_invariants()
    assert result.target == 5 and result.free == 5 and result.fits
    seq = m.alloc_sequence()
    assert m.attach_prefix(seq, wanted) == 12  # the wanted prefix survived
    m.free_sequence(seq)
    assert m.reclaim_prefix_blocks_for([], NO_ADAPTER, 8) == PrefixReclaim(target=8, free=8)
    assert_clean(m)
    m.teardown()


def test_s16_a_failed_sequence_is_never_cached(attn: HybridModel) -> None:
    seq = run_prefill(attn, prompt(9))
    seq.mark_failed()
    attn.cache_sequence(seq)
    attn.free_sequence(seq)
    assert attn.num_free_blocks() == attn.num_total_blocks()
    fresh = attn.alloc_sequence()
    assert attn.attach_prefix(fresh, prompt(9)) == 0
    attn.free_sequence(fresh)
    assert_clean(attn)


# ----------------------------------------------------------------------------- hybrid snapshots


def test_hybrid_lookup_needs_a_snapshot_and_restores_it(model: HybridModel) -> None:
    first = model.alloc_sequence()
    model.attach_prefix(first, prompt(8))
    model.grow(first, 8)
    state = fill_slot(model, first.slot_idx, seed=5)
    model.cache_sequence(first)  # 8 tokens = 2 whole blocks, SSM state at that point: snapshot
    model.free_sequence(first)
    model.check_invariants()
    assert model.stats().snapshots_saved == 1
    second = model.alloc_sequence()
    assert model.attach_prefix(second, prompt(12)) == 8
    assert read_slot(model, second.slot_idx) == state
    model.free_sequence(second)
    third = model.alloc_sequence()
    assert model.attach_prefix(third, prompt(8)) == 0  # the last token is never covered: no snapshot before it
    model.free_sequence(third)
    assert model.stats().snapshot_hits_cut_short >= 1
    assert_clean(model)


def test_hybrid_without_a_snapshot_reuses_nothing(model: HybridModel) -> None:
    first = run_prefill(model, prompt(9))  # 9 tokens: the SSM state is not at a block boundary
    model.cache_sequence(first)
    model.free_sequence(first)
    second = model.alloc_sequence()
    assert model.attach_prefix(second, prompt(9)) == 0
    model.free_sequence(second)
    assert_clean(model)


def test_sequences_on_a_stream_of_threads_keep_invariants(model: HybridModel) -> None:
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            model.bind_gpu_to_thread()
            for i in range(40):
                seq = model.alloc_sequence()
                model.attach_prefix(seq, prompt(9, start=offset + (i % 3)))
                model.grow(seq, 12)
                model.cache_sequence(seq)
                model.free_sequence(seq)
                model.reclaim_prefix_blocks(1)
        except PoolExhausted:
            pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(100 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_clean(model)


def test_a_rolling_snapshot_replaces_the_previous_one(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    model.attach_prefix(seq, prompt(8))
    model.grow(seq, 16)
    seq.append_tokens(range(100, 108))
    assert model.save_snapshot(seq, 8, rolling=True)
    model.check_invariants()
    assert model.save_snapshot(seq, 12, rolling=True)
    model.check_invariants()
    assert model.core.num_snapshots > 0 and model.core.num_snapshots_used == 1
    assert model.save_snapshot(seq, 16)  # a kept one: the rolling one at 12 stays too
    assert model.core.num_snapshots_used == 2
    model.free_sequence(seq)
    resumed = model.alloc_sequence()
    tokens = np.concatenate((prompt(8), np.arange(100, 108, dtype=np.int32), prompt(3, start=900)))
    assert model.attach_prefix(resumed, tokens) == 16
    model.free_sequence(resumed)
    assert_clean(model)


def test_save_snapshot_refuses_a_point_off_a_block_boundary(model: HybridModel) -> None:
    seq = run_prefill(model, prompt(9))
    with pytest.raises(InvalidId, match="num_tokens=6"):
        model.save_snapshot(seq, 6)
    with pytest.raises(InvalidId, match="num_tokens=12"):
        model.save_snapshot(seq, 12)  # past the sequence's 9 tokens
    model.check_invariants()
    model.free_sequence(seq)
    assert_clean(model)


def test_finish_sequence_caches_then_frees_in_one_step(attn: HybridModel) -> None:
    seq = run_prefill(attn, prompt(13), generated=3)
    attn.finish_sequence(seq)
    attn.check_invariants()
    assert seq.is_freed and attn.num_live_sequences == 0
    assert attn.core.num_cached_blocks == 4  # 16 tokens: prompt and generated, whole blocks
    again = attn.alloc_sequence()
    assert attn.attach_prefix(again, prompt(13)) == 12
    attn.free_sequence(again)
    attn.finish_sequence(again)  # already freed: nothing happens
    assert_clean(attn)


def test_finish_sequence_of_a_failed_sequence_only_frees(attn: HybridModel) -> None:
    seq = run_prefill(attn, prompt(13))
    seq.mark_failed()
    attn.finish_sequence(seq)
    assert attn.core.num_cached_blocks == 0
    assert attn.num_free_blocks() == attn.num_total_blocks()
    assert_clean(attn)


# ------------------------------------------------------------------ attach_prefix(grow_to=...)


def _drive(m: HybridModel, fused: bool, seed: int) -> list[Any]:
    """A random admission workload (shared prefixes, a pool small enough to evict and to run
    out); returns what a scheduler can observe after every step."""
    rng = np.random.default_rng(seed)
    live: list[SequenceState] = []
    seen: list[Any] = []
    for _ in range(120):
        if len(live) == 4 or (live and rng.random() < 0.3):
            seq = live.pop(int(rng.integers(len(live))))
            m.finish_sequence(seq)
        prompt = np.concatenate(
            [np.arange(int(rng.integers(0, 3)) * 4, dtype=np.int32), rng.integers(0, 3, int(rng.integers(1, 14)))]
        )
        total = len(prompt) + int(rng.integers(0, 20))
        seq = m.alloc_sequence()
        try:
            if fused:
                reused = m.attach_prefix(seq, prompt, grow_to=total)
            else:
                reused = m.attach_prefix(seq, prompt)
                m.grow(seq, total)
            outcome: Any = reused
        except OutOfBlocks:
            outcome = "out of blocks"
        m.check_invariants()
        stats = m.stats()
        seen.append((outcome, seq.block_table.tolist(), seq.num_cached_tokens, m.num_free_blocks(),
                     stats.blocks_evicted, stats.blocks_allocated, stats.prefix_hit_tokens))
        live.append(seq)
    for seq in live:
        m.free_sequence(seq)
    m.check_invariants()
    return seen


@pytest.mark.parametrize("make_config", [attention_config, hybrid_config], ids=["attention", "hybrid"])
def test_attach_prefix_with_grow_to_ends_as_attach_then_grow(device: Device, make_config: Any) -> None:
    for seed in range(3):
        one, two = HybridModel(make_config(num_blocks=24), device), HybridModel(make_config(num_blocks=24), device)
        try:
            assert _drive(one, True, seed) == _drive(two, False, seed)
            one.reclaim_prefix_blocks(one.num_total_blocks())  # what is left is cached, nothing leaked
            assert one.num_free_blocks() == one.num_total_blocks()
        finally:
            one.teardown()
            two.teardown()


def test_attach_prefix_out_of_blocks_keeps_the_prefix(attn: HybridModel) -> None:
    prompt = np.arange(10, dtype=np.int32)
    first = attn.alloc_sequence()
    attn.attach_prefix(first, prompt, grow_to=12)
    attn.finish_sequence(first)  # 2 full blocks cached
    hog = attn.alloc_sequence()
    attn.grow(hog, (attn.num_free_blocks() - 1) * BS)
    seq = attn.alloc_sequence()
    with pytest.raises(OutOfBlocks):
        attn.attach_prefix(seq, prompt, grow_to=40)
    assert seq.num_cached_tokens == 8 and seq.num_blocks == 2 and seq.num_tokens == 10
    attn.check_invariants()
    attn.free_sequence(hog)
    attn.grow(seq, 40)  # the prefix is still there to grow from
    assert seq.num_blocks == 10
    attn.free_sequence(seq)
    attn.reclaim_prefix_blocks(attn.num_total_blocks())
    assert attn.num_free_blocks() == attn.num_total_blocks()
    attn.check_invariants()


@pytest.mark.parametrize("bad", [-1, 2.5, "8", 64 * BS * 2])
def test_attach_prefix_refuses_a_bad_grow_to_and_changes_nothing(attn: HybridModel, bad: Any) -> None:
    seq = attn.alloc_sequence()
    free = attn.num_free_blocks()
    message = "attach_prefix: (num_tokens=|512 tokens need 128 blocks, over the per-sequence limit of 64)"
    with pytest.raises(InvalidId, match=message):
        attn.attach_prefix(seq, np.arange(10, dtype=np.int32), grow_to=bad)
    assert (seq.num_blocks, seq.num_tokens, attn.num_free_blocks()) == (0, 0, free)
    attn.free_sequence(seq)
    attn.check_invariants()
