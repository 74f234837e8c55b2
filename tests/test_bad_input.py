"""Every bad input gets a clear error and loses nothing (issue #14: defects 1-10 of an adversarial
pass over the public API).

Each test throws one class of bad input at one call and requires a ``LifecycleError`` subclass
whose message names the value (and the limit), with the pools exactly as before: free and total
block counts, live sequences, the cache's counters, the sequence's own fields, and a clean
``check_invariants()``. Hypothesis draws the members of a class (dtypes, huge ints, stream return
values) where there is a class.

The defects whose fix came with the core rewrite (token ids, setter validation, restore never
evicting, calls after teardown, the recount under concurrent calls) are tested here like the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import lifecycle.cli
import lifecycle.model
import lifecycle.simulate
from lifecycle._blockpool import BlockPool
from lifecycle._hostcopy import first_bad_row, memmove_rows, put_int32, stream_copy
from lifecycle._kvcache import KVCacheCore
from lifecycle.cli import main
from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.device.base import Device
from lifecycle.errors import (
    ConfigError,
    InvalidId,
    LifecycleError,
    OutOfBlocks,
    PoolExhausted,
    SequenceStateError,
    SwapError,
    SwapFormatError,
    SwapStreamError,
    TornDown,
)
from lifecycle.model import HybridModel
from lifecycle.presets import preset
from lifecycle.sequence import NO_ADAPTER, SequenceState
from lifecycle.swap import HEADER_BYTES, MAX_RECORD_TOKENS, parse_header
from lifecycle.swap.tier import SwapHandle, SwapTier
from devices import device  # noqa: F401  (shared fixture)
from reliability_driver import BrokenReader, BrokenWriter, forged_header
from swap_helpers import BS, model, fill_sequence, swap_config  # noqa: F401  (model: a fixture)

#: Examples for a function-scoped model: every example is refused, so the model stays as it was.
SHARED_MODEL = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])

#: Per-sequence limits of ``swap_config()``: 48 blocks of 4 tokens.
MAX_BLOCKS = 48
MAX_TOKENS = MAX_BLOCKS * BS


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(14)


def filled(model: HybridModel, rng: np.random.Generator, num_tokens: int = 9) -> SequenceState:
    seq = model.alloc_sequence()
    fill_sequence(model, seq, num_tokens, rng)
    model.check_invariants()
    return seq


# ---------------------------------------------------------------------------------- "nothing changed"


def model_state(model: HybridModel) -> tuple[object, ...]:
    """Free and total blocks, live sequences, and what the prefix cache took in and gave up."""
    stats = model.stats()
    return (
        model.num_free_blocks(),
        model.num_total_blocks(),
        model.num_live_sequences,
        stats.blocks_cached,
        stats.blocks_evicted,
    )


def seq_state(seq: SequenceState) -> tuple[object, ...]:
    return (
        seq.status,
        seq.slot_idx,
        seq.block_table.tobytes(),
        seq.tokens.tobytes(),
        seq.prompt_len,
        seq.ssm_tokens,
        seq.adapter_slot,
        seq.failed,
    )


@contextmanager
def unchanged(model: HybridModel, *seqs: SequenceState) -> Iterator[None]:
    """The block inside (a refused call) leaves the pools and the sequences as they were."""
    before, seqs_before = model_state(model), [seq_state(s) for s in seqs]
    yield
    model.check_invariants()
    assert model_state(model) == before
    assert [seq_state(s) for s in seqs] == seqs_before


@contextmanager
def pool_unchanged(pool: BlockPool) -> Iterator[None]:
    refcounts, free, total = pool.refcounts(), pool.num_free, pool.num_total
    yield
    pool.check_invariants()
    assert (pool.num_free, pool.num_total) == (free, total)
    np.testing.assert_array_equal(pool.refcounts(), refcounts)


def record_of(model: HybridModel, seq: SequenceState) -> bytes:
    out = io.BytesIO()
    model.save_sequence_state(seq, out)
    return out.getvalue()


# ---------------------------------------------------------------------------------- 1. token ids

#: Token arrays no rule may take: non-integer dtypes (even integral floats: "+ 0.7" must never get
#: a cache hit), and integers outside [0, 2**31) in integer dtypes that could hold them.
bad_token_arrays = st.one_of(
    hnp.arrays(np.float64, st.integers(1, 20), elements=st.floats(0, 1000, allow_nan=False)),
    hnp.arrays(np.float32, st.integers(1, 20), elements=st.floats(0, 1000, width=32)),
    hnp.arrays(np.complex128, st.integers(1, 20), elements=st.complex_numbers(max_magnitude=1000, allow_nan=False)),
    hnp.arrays(np.bool_, st.integers(1, 20)),
    st.lists(st.text(alphabet="0123456789", min_size=1, max_size=3), min_size=1, max_size=8).map(np.array),
    st.lists(st.integers(1, 1000), min_size=1, max_size=8).map(lambda ids: np.array([*ids, None], dtype=object)),
    hnp.arrays(np.uint32, st.integers(1, 20), elements=st.integers(2**31, 2**32 - 1)),
    hnp.arrays(np.uint64, st.integers(1, 20), elements=st.integers(2**31, 2**64 - 1)),
    hnp.arrays(np.int64, st.integers(1, 20), elements=st.integers(-(2**63), -1)),
)


def test_append_tokens_refuses_a_uint32_id_past_int32(model: HybridModel) -> None:
    seq = model.alloc_sequence()
    with unchanged(model, seq), pytest.raises(InvalidId, match="2147483648"):
        seq.append_tokens(np.array([5, 2**31], dtype=np.uint32))
    model.free_sequence(seq)


@SHARED_MODEL
@given(tokens=bad_token_arrays)
def test_append_tokens_refuses_ids_that_are_not_int32_integers(model: HybridModel, tokens: npt.NDArray[Any]) -> None:
    seq = model.alloc_sequence()
    try:
        with unchanged(model, seq), pytest.raises(InvalidId):
            seq.append_tokens(tokens)
    finally:
        model.free_sequence(seq)


@SHARED_MODEL
@given(tokens=bad_token_arrays)
def test_attach_prefix_refuses_ids_that_are_not_int32_integers(model: HybridModel, tokens: npt.NDArray[Any]) -> None:
    seq = model.alloc_sequence()
    try:
        with unchanged(model, seq), pytest.raises(InvalidId):
            model.attach_prefix(seq, tokens)
    finally:
        model.free_sequence(seq)


@SHARED_MODEL
@given(tokens=bad_token_arrays)
def test_reclaim_prefix_blocks_for_refuses_ids_that_are_not_int32_integers(
    model: HybridModel, tokens: npt.NDArray[Any]
) -> None:
    with unchanged(model), pytest.raises(InvalidId):
        model.reclaim_prefix_blocks_for(tokens, NO_ADAPTER, 1)


def test_a_fractional_prompt_is_refused_not_matched(model: HybridModel) -> None:
    cached = model.alloc_sequence()
    model.attach_prefix(cached, np.arange(1, 18))
    model.grow(cached, 17)
    model.cache_sequence(cached)
    model.free_sequence(cached)
    seq = model.alloc_sequence()
    with unchanged(model, seq), pytest.raises(InvalidId, match="float64"):
        model.attach_prefix(seq, np.arange(1, 18) + 0.7)  # type: ignore[arg-type]
    model.free_sequence(seq)


# ------------------------------------------------------------ 2. swap-out frees what swap-in cannot restore


def out_of_range_counts(num_tokens: int) -> st.SearchStrategy[object]:
    """Values ``prompt_len`` / ``ssm_tokens`` may not hold on a sequence of ``num_tokens`` tokens."""
    return st.one_of(
        st.integers(num_tokens + 1, 2**70),
        st.integers(-(2**70), -1),
        st.floats(0, num_tokens),
        st.text(alphabet="0123456789", min_size=1, max_size=2),
        st.booleans(),
    )


@SHARED_MODEL
@given(data=st.data())
def test_prompt_len_outside_the_tokens_is_refused_on_assignment(
    model: HybridModel, rng: np.random.Generator, data: st.DataObject
) -> None:
    seq = filled(model, rng, 6)
    try:
        value = data.draw(st.one_of(out_of_range_counts(6), st.none()))
        with unchanged(model, seq), pytest.raises(InvalidId, match="prompt_len"):
            seq.prompt_len = value  # type: ignore[assignment]
    finally:
        model.free_sequence(seq)


@SHARED_MODEL
@given(data=st.data())
def test_ssm_tokens_outside_the_tokens_is_refused_on_assignment(
    model: HybridModel, rng: np.random.Generator, data: st.DataObject
) -> None:
    seq = filled(model, rng, 6)
    try:
        value = data.draw(out_of_range_counts(6))
        with unchanged(model, seq), pytest.raises(InvalidId, match="ssm_tokens"):
            seq.ssm_tokens = value  # type: ignore[assignment]
    finally:
        model.free_sequence(seq)


def assign_or_refused(seq: SequenceState, field: str, value: object) -> bool:
    """Give ``seq`` a bad field the way an engine could; False when the sequence refuses it on
    assignment (then no record of it can exist)."""
    try:
        setattr(seq, field, value)
    except LifecycleError:
        return False
    return True


@SHARED_MODEL
@given(data=st.data())
def test_swap_out_never_frees_a_sequence_whose_record_could_not_be_restored(
    model: HybridModel, rng: np.random.Generator, data: st.DataObject
) -> None:
    seq = filled(model, rng, 6)
    tier = SwapTier(model, host_bytes=1 << 20)
    field = data.draw(st.sampled_from(["prompt_len", "ssm_tokens"]))
    value = data.draw(out_of_range_counts(6))
    try:
        if assign_or_refused(seq, field, value):
            with (
                unchanged(model, seq),
                pytest.raises(SequenceStateError, match=f"{field}=.*must be an int in \\[0, num_tokens=6\\]"),
            ):
                tier.swap_out(seq)
            assert not seq.is_freed
            assert (tier.num_swapped_out, tier.host_bytes_used) == (0, 0)
    finally:
        model.free_sequence(seq)


def test_save_refuses_a_bad_prompt_len_before_writing_a_byte(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 6)
    if assign_or_refused(seq, "prompt_len", 10):
        out = io.BytesIO()
        with unchanged(model, seq), pytest.raises(SequenceStateError, match=r"prompt_len=10 .*\[0, num_tokens=6\]"):
            model.save_sequence_state(seq, out)
        assert out.tell() == 0
    model.free_sequence(seq)


def test_swap_out_refuses_more_tokens_than_the_model_can_restore(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 8)
    seq.append_tokens(np.arange(1, MAX_TOKENS - 8 + 2))  # one more than 48 blocks of 4 cover
    tier = SwapTier(model, host_bytes=1 << 20)
    with (
        unchanged(model, seq),
        pytest.raises(
            SequenceStateError,
            match=f"num_tokens={MAX_TOKENS + 1} exceeds the per-sequence limit of {MAX_TOKENS} tokens",
        ),
    ):
        tier.swap_out(seq)
    assert not seq.is_freed and tier.num_swapped_out == 0
    model.free_sequence(seq)


def test_swap_out_refuses_a_sequence_holding_a_negative_token_id(model: HybridModel, rng: np.random.Generator) -> None:
    seq = filled(model, rng, 6)
    try:
        seq.append_tokens(np.array([2**31], dtype=np.uint32))  # stored as -2147483648 unless refused
    except LifecycleError:
        pass  # the sequence refuses the id: no record of it can hold one
    else:
        tier = SwapTier(model, host_bytes=1 << 20)
        with unchanged(model, seq), pytest.raises(SequenceStateError, match="negative token id -2147483648"):
            tier.swap_out(seq)
        assert not seq.is_freed and tier.num_swapped_out == 0
    model.free_sequence(seq)


# ---------------------------------------------------------------------------------- 3. swap handles


def test_a_handle_of_another_tier_is_refused_and_both_records_stay(
    model: HybridModel, rng: np.random.Generator
) -> None:
    first, second = SwapTier(model, host_bytes=1 << 20), SwapTier(model, host_bytes=1 << 20)
    mine = first.swap_out(filled(model, rng))
    theirs = second.swap_out(filled(model, rng, 13))
    with unchanged(model), pytest.raises(SwapError, match=f"issued by swap tier #{mine.tier_id}, not by this tier"):
        second.swap_in(mine)
    assert (first.num_swapped_out, second.num_swapped_out) == (1, 1)
    back = second.swap_in(theirs)
    assert back.num_tokens == 13
    model.free_sequence(back)
    model.free_sequence(first.swap_in(mine))
    model.check_invariants()


@pytest.mark.parametrize(
    "forge",
    [copy.copy, copy.deepcopy, lambda h: dataclasses.replace(h), lambda h: SwapHandle(**dataclasses.asdict(h))],
    ids=["copy", "deepcopy", "replace", "constructed"],
)
def test_a_forged_handle_is_refused_and_the_real_one_still_works(
    model: HybridModel, rng: np.random.Generator, forge: Callable[[SwapHandle], SwapHandle]
) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    handle = tier.swap_out(filled(model, rng))
    forged = forge(handle)
    with unchanged(model), pytest.raises(SwapError, match="a copy or a forgery"):
        tier.swap_in(forged)
    with unchanged(model), pytest.raises(SwapError, match="a copy or a forgery"):
        tier.discard(forged)
    assert tier.num_swapped_out == 1
    model.free_sequence(tier.swap_in(handle))
    model.check_invariants()


@pytest.mark.parametrize("handle", [None, 1, "handle-1", (1, 2)])
def test_something_that_is_not_a_handle_is_refused(model: HybridModel, handle: object) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    with unchanged(model), pytest.raises(SwapError, match="expected a SwapHandle"):
        tier.swap_in(handle)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- 4. broken streams

#: What a broken ``readinto`` / ``write`` may answer when asked for ``asked`` bytes; drawn as a
#: function of ``asked`` since the right answer depends on it.
bad_counts = st.one_of(
    st.integers(-(2**64), -1).map(lambda n: lambda asked: n),
    st.integers(1, 2**64).map(lambda extra: lambda asked: asked + extra),
    st.floats(allow_nan=True).map(lambda n: lambda asked: n),
    st.sampled_from(["1", b"1", True, [1]]).map(lambda n: lambda asked: n),
)


@SHARED_MODEL
@given(answer=bad_counts, bad_call=st.integers(1, 8))
def test_a_reader_answering_nonsense_is_refused_and_the_restore_undone(
    model: HybridModel, rng: np.random.Generator, answer: Callable[[int], object], bad_call: int
) -> None:
    source = filled(model, rng)
    record = record_of(model, source)
    target = model.alloc_sequence()
    try:
        with unchanged(model, target), pytest.raises(SwapStreamError, match="readinto of [0-9]+ bytes returned"):
            model.restore_sequence_state(
                target, source.num_blocks, cast(io.BytesIO, BrokenReader(record, bad_call, answer))
            )
    finally:
        model.free_sequence(target)
        model.free_sequence(source)


@SHARED_MODEL
@given(answer=bad_counts, bad_call=st.integers(1, 8))
def test_a_writer_answering_nonsense_is_refused(
    model: HybridModel, rng: np.random.Generator, answer: Callable[[int], object], bad_call: int
) -> None:
    seq = filled(model, rng)
    try:
        with unchanged(model, seq), pytest.raises(SwapStreamError, match="returned .* bytes offered"):
            model.save_sequence_state(seq, cast(io.BytesIO, BrokenWriter(bad_call, answer)))
    finally:
        model.free_sequence(seq)


def test_a_reader_with_nothing_ready_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    source = filled(model, rng)
    target = model.alloc_sequence()
    reader = BrokenReader(record_of(model, source), 2, lambda asked: None)  # a non-blocking raw stream
    with unchanged(model, target), pytest.raises(SwapStreamError, match="returned None .* non-blocking"):
        model.restore_sequence_state(target, source.num_blocks, cast(io.BytesIO, reader))
    model.free_sequence(target)
    model.free_sequence(source)


@pytest.mark.parametrize("answer", [lambda asked: b"x" * (asked + 1), lambda asked: None], ids=["too-much", "none"])
def test_a_read_only_reader_delivering_more_than_asked_or_none_is_refused(
    model: HybridModel, rng: np.random.Generator, answer: Callable[[int], bytes | None]
) -> None:
    source = filled(model, rng)
    record = io.BytesIO(record_of(model, source))

    class ReadOnly:
        def __init__(self) -> None:
            self.calls = 0

        def read(self, n: int) -> bytes | None:
            self.calls += 1
            return answer(n) if self.calls == 3 else record.read(n)

    target = model.alloc_sequence()
    with unchanged(model, target), pytest.raises(SwapStreamError, match="read"):
        model.restore_sequence_state(target, source.num_blocks, cast(io.BytesIO, ReadOnly()))
    model.free_sequence(target)
    model.free_sequence(source)


def test_a_non_blocking_raw_writer_that_takes_nothing_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    class WouldBlock(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int | None:
            return None  # what a non-blocking raw stream says when it cannot take anything now

    seq = filled(model, rng)
    with unchanged(model, seq), pytest.raises(SwapStreamError, match="non-blocking stream"):
        model.save_sequence_state(seq, cast(io.BytesIO, WouldBlock()))
    model.free_sequence(seq)


# ---------------------------------------------------------------------------------- 5. late restore failures


def cache_the_whole_pool(model: HybridModel) -> None:
    """Leave every block held by the prefix cache alone (evictable, not free)."""
    hog = model.alloc_sequence()
    model.grow(hog, model.num_free_blocks() * BS)
    hog.append_tokens(np.arange(1, hog.num_blocks * BS + 1))
    model.cache_sequence(hog)
    model.free_sequence(hog)
    model.check_invariants()
    assert model.num_free_blocks() == 0


def test_a_restore_short_of_free_blocks_refuses_before_reading_and_evicts_nothing(
    model: HybridModel, rng: np.random.Generator
) -> None:
    source = filled(model, rng)
    record, num_blocks = record_of(model, source), source.num_blocks
    model.free_sequence(source)
    cache_the_whole_pool(model)
    target = model.alloc_sequence()
    reader = io.BytesIO(record)
    with unchanged(model, target), pytest.raises(OutOfBlocks, match=f"{num_blocks}"):
        model.restore_sequence_state(target, num_blocks, reader)
    assert reader.tell() == 0
    model.free_sequence(target)


def test_a_restore_failing_its_last_checksum_leaves_the_cache_as_it_was(
    model: HybridModel, rng: np.random.Generator
) -> None:
    source = filled(model, rng)
    record, num_blocks = bytearray(record_of(model, source)), source.num_blocks
    record[-3] ^= 0x40  # inside the last section's checksum
    model.free_sequence(source)
    cache_the_whole_pool(model)
    target = model.alloc_sequence()
    with unchanged(model, target), pytest.raises(LifecycleError):
        model.restore_sequence_state(target, num_blocks, io.BytesIO(bytes(record)))
    model.free_sequence(target)


def test_swap_in_makes_room_itself_so_the_restore_never_has_to_evict(
    model: HybridModel, rng: np.random.Generator
) -> None:
    tier = SwapTier(model, host_bytes=1 << 20)
    seq = filled(model, rng)
    tokens, handle = seq.tokens.copy(), tier.swap_out(seq)
    cache_the_whole_pool(model)
    evicted = model.stats().blocks_evicted
    back = tier.swap_in(handle)
    model.check_invariants()
    assert np.array_equal(back.tokens, tokens)
    assert model.stats().blocks_evicted - evicted >= handle.num_blocks
    model.free_sequence(back)


# ------------------------------------------------------------ 6. exceptions that are not LifecycleError

#: Anything a count, a start or an id cannot be: ints past 64 bits either way, and non-ints.
not_a_c_index = st.one_of(
    st.integers(2**63, 2**80),
    st.integers(-(2**80), -(2**63) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
    st.booleans(),
    st.just(np.float64(2.0)),
    st.just(np.array([1, 2])),
)


@given(
    value=not_a_c_index,
    call=st.sampled_from(
        ["allocate", "allocate_into start", "allocate_into n", "dec_ref_range start", "dec_ref_range n", "refcount"]
    ),
)
def test_block_pool_counts_starts_and_ids_that_fit_no_c_index_are_invalid_ids(value: object, call: str) -> None:
    pool = BlockPool(16)
    table = pool.allocate(8)
    calls: dict[str, Callable[[], object]] = {
        "allocate": lambda: pool.allocate(value),  # type: ignore[arg-type]
        "allocate_into start": lambda: pool.allocate_into(np.zeros(4, np.int32), value, 1),  # type: ignore[arg-type]
        "allocate_into n": lambda: pool.allocate_into(np.zeros(4, np.int32), 0, value),  # type: ignore[arg-type]
        "dec_ref_range start": lambda: pool.dec_ref_range(table, value, 1),  # type: ignore[arg-type]
        "dec_ref_range n": lambda: pool.dec_ref_range(table, 0, value),  # type: ignore[arg-type]
        "refcount": lambda: pool.refcount(value),  # type: ignore[arg-type]
    }
    with pool_unchanged(pool), pytest.raises(InvalidId) as refused:
        calls[call]()
    if isinstance(value, int) and not isinstance(value, bool):
        assert str(value) in str(refused.value) and "9223372036854775807" in str(refused.value)


def test_allocating_more_than_the_pool_holds_is_refused_before_any_memory_is_set_aside() -> None:
    pool = BlockPool(16)
    with pool_unchanged(pool), pytest.raises(OutOfBlocks, match="cannot allocate 17179869184 blocks: only 16 of 16"):
        pool.allocate(2**34)  # its ids alone would take 64 GiB


def test_numpy_integer_counts_are_counts() -> None:
    pool = BlockPool(16)
    table = pool.allocate(np.int64(3))
    assert pool.refcount(np.int32(table[0])) == 1
    assert pool.dec_ref_range(table, np.uint8(0), np.int16(3)) == 3
    pool.check_invariants()


@pytest.mark.parametrize("call", ["inc_ref", "dec_ref"])
def test_an_object_array_holding_none_is_refused_naming_it(call: str) -> None:
    pool = BlockPool(16)
    pool.allocate(4)
    with pool_unchanged(pool), pytest.raises(InvalidId, match="got None"):
        getattr(pool, call)(np.array([1, None], dtype=object))


def test_an_object_array_of_numpy_integers_is_a_batch_of_ids() -> None:
    pool = BlockPool(16)
    pool.allocate(4)
    pool.inc_ref(np.array([np.int64(1), 2], dtype=object))
    assert pool.dec_ref(np.array([np.int32(1), np.uint64(2)], dtype=object)) == 0
    assert (pool.refcount(1), pool.refcount(2)) == (1, 1)
    pool.check_invariants()


@pytest.mark.parametrize(
    ("dst", "src", "message"),
    [
        (np.zeros(4, np.uint8), np.zeros(5, np.uint8), "destination holds 4 bytes, source 5"),
        (bytes(4), np.zeros(4, np.uint8), "dst must be a writable contiguous byte buffer, got bytes"),
        (None, np.zeros(4, np.uint8), "got NoneType"),
        (np.zeros(4, np.uint8), np.zeros(4, np.float32), "src must be a contiguous byte buffer"),
        (np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8), "dst must be a writable contiguous byte buffer"),
        (np.zeros(4, np.uint8), 4, "src must be a contiguous byte buffer, got int"),
    ],
    ids=["sizes", "read-only", "none", "dtype", "strided", "not-a-buffer"],
)
def test_stream_copy_refuses_bad_buffers_naming_them(dst: Any, src: Any, message: str) -> None:
    with pytest.raises(InvalidId, match=message):
        stream_copy(dst, src)


@pytest.mark.parametrize(
    "rows",
    [np.zeros((1, 2), np.int64), np.zeros((1, 3), np.int32), np.zeros((2, 3), np.int64).T, [[0, 0, 0]], None],
    ids=["columns", "dtype", "non-contiguous", "list", "none"],
)
def test_copy_rows_of_the_wrong_kind_are_refused(rows: Any) -> None:
    bounds = np.zeros(1, np.int64)
    with pytest.raises(InvalidId, match="rows must be a C-contiguous \\(n, 3\\) int64 array"):
        memmove_rows(rows)
    with pytest.raises(InvalidId, match="rows must be a C-contiguous \\(n, 3\\) int64 array"):
        first_bad_row(rows, bounds, bounds)


@pytest.mark.parametrize(
    "starts", [np.zeros(1, np.float64), np.zeros((1, 1), np.int64), None], ids=["dtype", "2-D", "none"]
)
def test_copy_bounds_of_the_wrong_kind_are_refused(starts: Any) -> None:
    with pytest.raises(InvalidId, match="starts must be a contiguous 1-D int64 array"):
        first_bad_row(np.zeros((1, 3), np.int64), starts, np.zeros(1, np.int64))


def test_copy_bounds_that_do_not_pair_up_are_refused() -> None:
    with pytest.raises(InvalidId, match="2 starts but 1 ends"):
        first_bad_row(np.zeros((1, 3), np.int64), np.zeros(2, np.int64), np.zeros(1, np.int64))


@given(start=not_a_c_index)
def test_put_int32_declines_a_start_that_fits_no_c_index(start: object) -> None:
    dst = np.zeros(4, np.int32)
    assert not put_int32(dst, start, np.ones(1, np.int32))  # type: ignore[arg-type]
    assert not dst.any()


def test_a_swap_tier_whose_host_memory_cannot_be_had_refuses_and_keeps_the_sequence(
    model: HybridModel, rng: np.random.Generator
) -> None:
    seq = filled(model, rng)
    tier = SwapTier(model, host_bytes=1 << 62)
    with unchanged(model, seq), pytest.raises(PoolExhausted, match=f"host_bytes={1 << 62} cannot be allocated"):
        tier.swap_out(seq)
    assert not seq.is_freed and tier.num_swapped_out == 0
    model.free_sequence(seq)


def test_reclaiming_more_blocks_than_any_pool_has_is_no_overflow(model: HybridModel) -> None:
    cache_the_whole_pool(model)
    try:
        freed = model.reclaim_prefix_blocks(2**64)
    except LifecycleError as exc:  # a refusal must name the value; evicting everything is fine too
        assert str(2**64) in str(exc)
    else:
        assert freed == model.num_total_blocks() == model.num_free_blocks()
    model.check_invariants()


def test_reclaim_prefix_blocks_for_refuses_an_adapter_slot_that_is_not_an_int(model: HybridModel) -> None:
    with unchanged(model), pytest.raises(InvalidId, match="None"):
        model.reclaim_prefix_blocks_for([1, 2, 3, 4, 5], None, 1)  # type: ignore[arg-type]


def test_save_snapshot_refuses_a_token_count_that_is_not_an_int(device: Device, rng: np.random.Generator) -> None:
    model = HybridModel(swap_config(num_snapshots=4), device)
    try:
        seq = filled(model, rng, 8)
        with unchanged(model, seq), pytest.raises(InvalidId, match="'4'"):
            model.save_snapshot(seq, "4")  # type: ignore[arg-type]
        model.free_sequence(seq)
    finally:
        model.teardown()


# ---------------------------------------------------------------------------------- 7. calls after teardown


def test_stats_after_teardown_raise_torn_down(device: Device) -> None:
    model = HybridModel(swap_config(), device)
    model.teardown()
    with pytest.raises(TornDown, match="torn down"):
        model.stats()


def test_num_live_sequences_after_teardown_raises_torn_down(device: Device) -> None:
    model = HybridModel(swap_config(), device)
    model.teardown()
    with pytest.raises(TornDown, match="torn down"):
        model.num_live_sequences  # noqa: B018


# ---------------------------------------------------------------------------------- 8. false corruption alarms

#: Recounts tried while two threads admit and finish requests (a recount read apart from the calls it
#: checks used to raise a false alarm within ~10,000).
RECOUNTS = 50_000


def test_the_core_recount_raises_no_false_alarm_under_concurrent_calls() -> None:
    pool = BlockPool(64)
    core = KVCacheCore(pool, BS)
    stop = threading.Event()
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                n = int(rng.integers(5, 30))
                tokens = np.arange(n, dtype=np.int32) + int(rng.integers(0, 4)) * 100
                try:
                    handle = core.admit(tokens, -(-n // BS), (n - 1) // BS)
                except OutOfBlocks:
                    core.evict(8)
                    continue
                core.finish(handle)
                if rng.random() < 0.3:
                    core.evict(int(rng.integers(1, 8)))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    workers = [threading.Thread(target=serve, args=(seed,)) for seed in range(2)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(RECOUNTS):
            core.check_invariants()
    finally:
        stop.set()
        for worker in workers:
            worker.join()
        sys.setswitchinterval(interval)
    assert errors == []
    while core.evict(64):
        pass
    core.check_invariants()
    assert pool.num_free == pool.num_total


# ---------------------------------------------------------------------------------- 9. forged sizes


class Endless:
    """A reader past the header delivers as many bytes as asked, up to ``limit`` in all (the
    record's owner could stream this much; restore must not buffer what it announces)."""

    def __init__(self, header: bytes, limit: int = 1 << 20) -> None:
        self._header = header
        self._limit = limit
        self.delivered = 0

    def readinto(self, buffer: memoryview) -> int:
        if self.delivered < len(self._header):
            n = min(buffer.nbytes, len(self._header) - self.delivered)
            buffer[:n] = self._header[self.delivered : self.delivered + n]
        else:
            assert self.delivered < self._limit, "restore buffers what a forged header announced"
            n = buffer.nbytes
        self.delivered += n
        return n


@SHARED_MODEL
@given(num_tokens=st.integers(MAX_TOKENS + 1, 2**32))
def test_a_header_announcing_more_tokens_than_the_model_holds_is_refused_before_reading_them(
    model: HybridModel, rng: np.random.Generator, num_tokens: int
) -> None:
    source = filled(model, rng)
    target = model.alloc_sequence()
    reader = Endless(forged_header(record_of(model, source), num_tokens))
    try:
        with unchanged(model, target), pytest.raises(SwapFormatError, match=f"num_tokens={num_tokens} exceeds"):
            model.restore_sequence_state(target, source.num_blocks, cast(io.BytesIO, reader))
        assert reader.delivered == HEADER_BYTES
    finally:
        model.free_sequence(target)
        model.free_sequence(source)


def test_the_issues_forged_record_names_the_per_sequence_limit(model: HybridModel, rng: np.random.Generator) -> None:
    source = filled(model, rng)
    target = model.alloc_sequence()
    reader = Endless(forged_header(record_of(model, source), MAX_RECORD_TOKENS))
    with (
        unchanged(model, target),
        pytest.raises(
            SwapFormatError,
            match=f"num_tokens=2147483647 exceeds the per-sequence limit of {MAX_TOKENS} tokens "
            f"\\({MAX_BLOCKS} blocks of {BS} tokens\\)",
        ),
    ):
        model.restore_sequence_state(target, source.num_blocks, cast(io.BytesIO, reader))
    assert reader.delivered == HEADER_BYTES
    model.free_sequence(target)
    model.free_sequence(source)


def test_a_header_forging_prompt_len_past_its_tokens_is_refused(model: HybridModel, rng: np.random.Generator) -> None:
    source = filled(model, rng)
    record = record_of(model, source)
    header = parse_header(record[:HEADER_BYTES])
    forged = dataclasses.replace(header, prompt_len=header.num_tokens + 1).pack() + record[HEADER_BYTES:]
    target = model.alloc_sequence()
    with unchanged(model, target), pytest.raises(SwapFormatError, match=f"prompt_len={header.num_tokens + 1}"):
        model.restore_sequence_state(target, source.num_blocks, io.BytesIO(forged))
    model.free_sequence(target)
    model.free_sequence(source)


# ---------------------------------------------------------------------------------- 10. the command line

#: Absurd on any machine (tens of TiB each), so the refusal does not depend on this one's memory.
ABSURD = [
    (["--kv-budget", "64T"], "--kv-budget", "KV pool"),
    (["--blocks", "2000000000"], "--blocks", "KV pool"),
    (["--snapshots", "1000000000"], "--snapshots", "SSM snapshots"),
    (["--max-live", "100000000"], "--max-live", "SSM slots"),
    (["--swap-host-mb", "100000000"], "--swap-host-mb", "swap space"),
    (["--requests", "10000000000"], "--requests", "a trace of 10,000,000,000 requests"),
]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model built anyway makes the test fail: size checks come before any allocation."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built before the sizes were checked")

    monkeypatch.setattr(lifecycle.model, "HybridModel", refuse)
    monkeypatch.setattr(lifecycle.simulate, "trace_for_model", refuse)


@pytest.mark.parametrize(("options", "option", "what"), ABSURD, ids=[a[1] for a in ABSURD])
@pytest.mark.usefixtures("no_model")
def test_a_size_no_machine_has_is_refused_naming_its_option(
    capsys: pytest.CaptureFixture[str], options: list[str], option: str, what: str
) -> None:
    assert main(["simulate", *options]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"lifecycle simulate: error: argument {option}: ") and what in error
    assert error.endswith("is available")


@pytest.mark.usefixtures("no_model")
def test_sizes_that_only_together_exceed_the_memory_are_refused_naming_the_largest(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle.cli, "_available_host_bytes", lambda: 300 << 20)
    assert main(["simulate", "--swap-host-mb", "200", "--blocks", "4000"]) == 2
    err = capsys.readouterr().err
    assert "argument --swap-host-mb: the run would take" in err and "in all" in err and "300.0 MiB is available" in err


@pytest.mark.parametrize("turns", ["127", "1000"])
@pytest.mark.usefixtures("no_model")
def test_turns_past_their_meaningful_range_are_refused(capsys: pytest.CaptureFixture[str], turns: str) -> None:
    assert main(["simulate", "--turns", turns]) == 2
    assert f"argument --turns: {turns} is more than the 126 turns" in capsys.readouterr().err


def test_trace_for_model_refuses_more_turns_than_max_turns() -> None:
    config = preset("small-hybrid", num_blocks=2048, num_snapshots=256)
    limit = lifecycle.simulate.max_turns(config)
    with pytest.raises(ConfigError, match=f"turns={limit + 1} is more than the {limit} turns"):
        lifecycle.simulate.trace_for_model(config, seed=0, num_requests=1, turns=limit + 1)


def test_the_most_meaningful_turns_are_served(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--turns", "126", "--requests", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 3


@pytest.mark.parametrize("options", [["--blocks", "0"], ["--blocks", "2000000000"], ["--turns", "1000"]])
def test_json_mode_prints_a_refused_option_as_a_json_error(
    capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    assert main(["simulate", "--json", *options]) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error["option"] == options[0] and error["exit_status"] == 2 and error["type"] == "usage"
    assert error["message"] in captured.err


def test_json_mode_prints_an_unknown_option_as_a_json_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--no-such-option", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert "unrecognized arguments: --no-such-option" in error["message"]


def test_json_mode_prints_a_failed_run_as_a_json_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise OutOfBlocks("cannot allocate 9 blocks: only 2 of 512 are free")

    monkeypatch.setattr(lifecycle.simulate, "simulate", fail)
    assert main(["simulate", "--requests", "4", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["error"] == {
        "type": "OutOfBlocks",
        "message": "cannot allocate 9 blocks: only 2 of 512 are free",
        "option": None,
        "exit_status": 1,
    }
    assert "OutOfBlocks: cannot allocate 9 blocks" in captured.err


@pytest.mark.parametrize("json_mode", [False, True], ids=["table", "json"])
def test_ctrl_c_ends_the_run_without_a_traceback_and_tears_the_model_down(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, json_mode: bool
) -> None:
    real_simulate, models = lifecycle.simulate.simulate, []

    def interrupted(model: HybridModel, trace: Any, options: Any, **kwargs: Any) -> Any:
        models.append(model)

        def ctrl_c(done: int) -> None:
            raise KeyboardInterrupt

        return real_simulate(model, trace, options, on_request_done=ctrl_c)

    monkeypatch.setattr(lifecycle.simulate, "simulate", interrupted)
    assert main(["simulate", "--requests", "8", *(["--json"] if json_mode else ["--quiet"])]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "lifecycle simulate: interrupted" in captured.err
    assert models and models[0].teardown_report is not None
    if json_mode:
        assert json.loads(captured.out)["error"]["type"] == "interrupted"


def test_a_large_trace_is_announced_before_it_is_generated(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle.cli, "_ANNOUNCE_TRACE_BYTES", 0)
    assert main(["simulate", "--requests", "5"]) == 0
    assert "generating a trace of 5 requests (about" in capsys.readouterr().err


def test_the_trace_estimate_is_within_a_factor_of_two_of_the_trace() -> None:
    import tracemalloc

    config = preset("small-hybrid", num_blocks=2048, num_snapshots=256)
    tracemalloc.start()
    try:
        trace = lifecycle.simulate.trace_for_model(config, seed=0, num_requests=2000, turns=8)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    estimate = lifecycle.simulate.trace_nbytes(config, num_requests=2000, turns=8)
    assert held / 2 <= estimate <= 2 * held and len(trace) == 2000


def test_a_pool_too_small_for_any_chat_is_blamed_on_the_option_that_sized_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--blocks", "3"]) == 2
    assert "error: argument --blocks: a KV pool of 3 blocks" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- issue 28: a hostile pass

#: A pure-attention model: 8 blocks (32 tokens) a sequence at most.
ATTENTION = ModelConfig(
    layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BS, num_blocks=32, max_seqs=4,
    max_blocks_per_seq=8, name="bad-input-attention",
)


@pytest.fixture
def attention() -> Iterator[HybridModel]:
    m = HybridModel(ATTENTION, "host")
    yield m
    if m.teardown_report is None:
        m.check_invariants()
        m.teardown()


SALTED_PROMPT = list(range(1, 22))  # 5 whole blocks and one more token


@pytest.mark.parametrize(
    ("prompt", "grow_to"),
    [(SALTED_PROMPT, 8 * BS + 1), ([*SALTED_PROMPT[:-1], -1], None)],
    ids=["grow_to over the limit", "negative token"],
)
def test_a_refused_salted_attach_leaves_the_key_unsalted_and_the_retry_reuses_the_prefix(
    attention: HybridModel, prompt: list[int], grow_to: int | None
) -> None:
    first = attention.alloc_sequence_for(8 * BS)
    attention.attach_prefix(first, SALTED_PROMPT, grow_to=len(SALTED_PROMPT), cache_salt="tenant")
    attention.finish_sequence(first)
    seq = attention.alloc_sequence_for(8 * BS)
    key = attention.core.cache_key(seq.handle)
    with unchanged(attention, seq), pytest.raises(InvalidId):
        attention.attach_prefix(seq, prompt, grow_to=grow_to, cache_salt="tenant")
    assert attention.core.cache_key(seq.handle) == key
    assert attention.attach_prefix(seq, SALTED_PROMPT, cache_salt="tenant") == 5 * BS
    attention.free_sequence(seq)


@pytest.mark.parametrize(("prompt", "named"), [([1.7, 2, 3, 4, 5], "integer"), ([1, 2**31, 3, 4, 5], str(2**31))],
                         ids=["float token", "token past int32"])
@pytest.mark.parametrize("mm_keys", [None, [(b"image", 0, 2)]], ids=["plain", "multimodal"])
def test_a_prompt_that_is_not_int32_token_ids_is_refused_with_or_without_multimodal_keys(
    attention: HybridModel, prompt: list[Any], named: str, mm_keys: Any
) -> None:
    seq = attention.alloc_sequence_for(8 * BS)
    with unchanged(attention, seq), pytest.raises(InvalidId, match=named):
        attention.attach_prefix(seq, prompt, mm_keys=mm_keys)
    attention.free_sequence(seq)


def test_common_prefix_blocks_of_no_sequence_list_is_an_invalid_id(attention: HybridModel) -> None:
    with unchanged(attention), pytest.raises(InvalidId, match="None"):
        attention.num_common_prefix_blocks(None)  # type: ignore[arg-type]


def test_evict_blocks_names_a_uint64_id_past_int64_by_its_value(attention: HybridModel) -> None:
    seq = attention.alloc_sequence_for(8 * BS)
    attention.attach_prefix(seq, SALTED_PROMPT, grow_to=len(SALTED_PROMPT))
    attention.finish_sequence(seq)
    with unchanged(attention), pytest.raises(InvalidId, match=rf"(?<!-){2**63}"):
        attention.evict_blocks(np.array([2**63], dtype=np.uint64))
    assert attention.core.num_cached_blocks == 5


# Decided (issue 28.15): after teardown every call but teardown raises TornDown, freed sequences'
# included; while the model lives a second free is a no-op, and save_snapshot of a freed sequence
# returns False like a cache_sequence that caches nothing.


@pytest.mark.parametrize("call", ["free_sequence", "finish_sequence"])
def test_freeing_a_freed_sequence_after_teardown_raises_torn_down(attention: HybridModel, call: str) -> None:
    seq = attention.alloc_sequence_for(8 * BS)
    attention.attach_prefix(seq, SALTED_PROMPT)
    getattr(attention, call)(seq)
    getattr(attention, call)(seq)  # a second call while the model lives: a no-op
    attention.teardown()
    with pytest.raises(TornDown, match="torn down"):
        getattr(attention, call)(seq)


def test_growing_a_freed_sequence_is_a_state_error_and_after_teardown_torn_down(attention: HybridModel) -> None:
    seq = attention.alloc_sequence_for(8 * BS)
    attention.attach_prefix(seq, SALTED_PROMPT)
    attention.free_sequence(seq)
    with unchanged(attention), pytest.raises(SequenceStateError, match="freed"):
        attention.grow(seq, 24)
    attention.teardown()
    with pytest.raises(TornDown, match="torn down"):
        attention.grow(seq, 24)


def test_save_snapshot_of_a_freed_sequence_returns_false_and_changes_nothing(
    device: Device, rng: np.random.Generator  # noqa: F811
) -> None:
    model = HybridModel(swap_config(num_snapshots=4), device)
    try:
        seq = filled(model, rng, num_tokens=9)
        assert model.save_snapshot(seq, 8) is True  # snapshots are on: False below is the freed sequence's
        model.free_sequence(seq)
        with unchanged(model, seq):
            assert model.save_snapshot(seq, 8) is False
    finally:
        model.teardown()
