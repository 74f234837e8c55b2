"""The decode step: one batched call (``HybridModel.step``, ``KVCacheCore.step``) for every running
sequence.

Each test below pins one behaviour of the call; ``check_invariants()`` runs after every step. The
state machine at the end checks that a batched step equals the per-sequence calls it replaces
(``grow`` then ``append_tokens``, then ``cache_sequence`` when it caches), refusal included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle.config import AttentionLayer, ModelConfig
from lifecycle.errors import InvalidId, LifecycleError, OutOfBlocks, SequenceStateError
from lifecycle.model import HybridModel
from lifecycle.sequence import SequenceState

BS = 4
NUM_BLOCKS = 12
MAX_SEQS = 4
COLUMNS = NUM_BLOCKS


def make_model(**overrides: Any) -> HybridModel:
    fields: dict[str, Any] = dict(
        layers=(AttentionLayer(num_kv_heads=1, head_dim=8),),
        block_size=BS,
        num_blocks=NUM_BLOCKS,
        max_seqs=MAX_SEQS,
    )
    fields.update(overrides)
    return HybridModel(ModelConfig(**fields), "host")


@pytest.fixture
def model() -> Iterator[HybridModel]:
    m = make_model()
    yield m
    m.teardown()


def admit(model: HybridModel, prompt: list[int], grow_to: int | None = None) -> SequenceState:
    seq = model.alloc_sequence_for(NUM_BLOCKS * BS)
    model.attach_prefix(seq, prompt, grow_to=len(prompt) if grow_to is None else grow_to)
    model.check_invariants()
    return seq


def handles(*seqs: SequenceState) -> npt.NDArray[np.int64]:
    return np.array([seq.handle for seq in seqs], dtype=np.int64)


def engine_table(*seqs: SequenceState) -> npt.NDArray[np.int32]:
    """The engine's block table for ``seqs`` (row i = seqs[i]), unused entries -1."""
    table = np.full((len(seqs), COLUMNS), -1, dtype=np.int32)
    for row, seq in enumerate(seqs):
        table[row, : seq.num_blocks] = seq.block_table
    return table


def fill_cache(model: HybridModel, prompt: list[int]) -> None:
    """Leave ``prompt``'s full blocks cached and unreferenced (evictable)."""
    seq = admit(model, prompt)
    model.finish_sequence(seq)
    model.check_invariants()


def state(model: HybridModel, *seqs: SequenceState) -> tuple[Any, ...]:
    """Everything a step may change, for comparing before and after."""
    return (
        [seq.tokens.tolist() for seq in seqs],
        [seq.block_table.tolist() for seq in seqs],
        model.num_free_blocks(),
        model.core.num_cached_blocks,
    )


# -- what a step does ----------------------------------------------------------------------------


def test_step_appends_each_sequence_its_token(model: HybridModel) -> None:
    a, b = admit(model, [1, 2, 3]), admit(model, [4, 5])
    model.step([a, b], [7, 8])
    model.check_invariants()
    assert (a.tokens.tolist(), b.tokens.tolist()) == ([1, 2, 3, 7], [4, 5, 8])


def test_step_by_handles_equals_step_by_sequences(model: HybridModel) -> None:
    a = admit(model, [1, 2, 3])
    model.step(handles(a), [7])
    model.check_invariants()
    model.step([a], [8])
    model.check_invariants()
    assert a.tokens.tolist() == [1, 2, 3, 7, 8]


def test_step_grows_a_sequence_whose_token_starts_a_block(model: HybridModel) -> None:
    full, partial = admit(model, [1, 2, 3, 4]), admit(model, [5, 6])
    model.step([full, partial], [7, 8])
    model.check_invariants()
    assert (full.num_blocks, partial.num_blocks) == (2, 1)


def test_step_writes_new_block_ids_at_the_columns_they_take(model: HybridModel) -> None:
    full, partial = admit(model, [1, 2, 3, 4, 5, 6, 7, 8]), admit(model, [5, 6])
    table = engine_table(full, partial)
    before = table.copy()
    model.step([full, partial], [9, 9], table=table)
    model.check_invariants()
    expected = before.copy()
    expected[0, 2] = full.block_table[2]
    assert table.tolist() == expected.tolist()


def test_step_writes_into_the_rows_given(model: HybridModel) -> None:
    a = admit(model, [1, 2, 3, 4])
    table = np.full((3, COLUMNS), -1, dtype=np.int32)
    model.step([a], [9], table=table, rows=[2])
    model.check_invariants()
    expected = np.full((3, COLUMNS), -1, dtype=np.int32)
    expected[2, 1] = a.block_table[1]
    assert table.tolist() == expected.tolist()


def test_step_evicts_a_cached_block_when_the_free_list_is_empty(model: HybridModel) -> None:
    fill_cache(model, [9] * 16)  # 4 cached blocks, nothing else holds them
    seq = admit(model, [1] * 4 * (NUM_BLOCKS - 4))  # every free block, each one full
    assert model.num_free_blocks() == 0
    model.step([seq], [3], cache=False)
    model.check_invariants()
    assert (seq.num_blocks, model.core.num_cached_blocks) == (NUM_BLOCKS - 3, 3)


def test_a_refused_sequence_is_left_exactly_as_it_was(model: HybridModel) -> None:
    first, second = admit(model, [1, 2, 3, 4]), admit(model, [5] * 4 * (NUM_BLOCKS - 2))
    assert model.num_free_blocks() == 1  # enough for one of the two
    table = engine_table(first, second)
    before = state(model, second), table[1].tolist()
    model.step([first, second], [7, 8], table=table)
    model.check_invariants()
    assert (state(model, second)[:2], table[1].tolist()) == (before[0][:2], before[1])


def test_step_returns_the_positions_it_refused(model: HybridModel) -> None:
    first, second = admit(model, [1, 2, 3, 4]), admit(model, [5] * 4 * (NUM_BLOCKS - 2))
    refused = model.step([second, first], [8, 7])
    model.check_invariants()
    assert refused.tolist() == [1] and second.num_tokens == 4 * (NUM_BLOCKS - 2) + 1


def test_counts_split_the_tokens_among_the_sequences_in_order(model: HybridModel) -> None:
    a, b, c = admit(model, [1]), admit(model, [2]), admit(model, [3])
    model.step([a, b, c], [10, 11, 12, 30], counts=[3, 0, 1])
    model.check_invariants()
    assert (a.tokens.tolist(), b.tokens.tolist(), c.tokens.tolist()) == ([1, 10, 11, 12], [2], [3, 30])


def test_a_count_spanning_blocks_writes_every_block_it_adds(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3])
    table = engine_table(seq)
    model.step([seq], list(range(10, 16)), counts=[6], table=table)  # 9 tokens: two blocks more
    model.check_invariants()
    assert table[0, :3].tolist() == seq.block_table.tolist() and seq.num_blocks == 3


def test_cache_true_caches_the_blocks_a_step_fills(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3])
    model.step([seq], [4], cache=True)
    model.check_invariants()
    probe = model.alloc_sequence_for(8)
    assert model.attach_prefix(probe, [1, 2, 3, 4, 5]) == 4


def test_cache_false_leaves_the_filled_blocks_uncached(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3])
    model.step([seq], [4], cache=False)
    model.check_invariants()
    probe = model.alloc_sequence_for(8)
    assert model.attach_prefix(probe, [1, 2, 3, 4, 5]) == 0


def test_the_model_caches_by_default_with_the_prefix_cache_on(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3])
    model.step([seq], [4])
    model.check_invariants()
    assert model.core.num_cached_blocks == 1


# -- bad arguments raise before anything changes -------------------------------------------------

Step = Callable[[HybridModel, SequenceState, SequenceState], object]


def _stale(model: HybridModel, ok: SequenceState, full: SequenceState) -> object:
    gone = model.alloc_sequence_for(8)
    model.free_sequence(gone)
    return model.step(np.array([ok.handle, full.handle, gone.handle]), [7, 8, 9])


def _retired(model: HybridModel, ok: SequenceState, full: SequenceState) -> object:
    model.retire_sequence(full)
    return model.step([ok, full], [7, 8])


BAD_STEPS: dict[str, tuple[type[LifecycleError], Step]] = {
    "stale handle": (SequenceStateError, _stale),
    "retired sequence": (SequenceStateError, _retired),
    "negative token": (InvalidId, lambda m, ok, full: m.step([ok, full], [7, -8])),
    "token past int32": (InvalidId, lambda m, ok, full: m.step([ok, full], [7, 2**31])),
    "tokens not one each": (InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8, 9])),
    "counts not adding up": (InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8, 9], counts=[1, 1])),
    "negative count": (
        InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8], counts=np.array([3, -1], dtype=np.int32))
    ),
    "table too narrow": (
        InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8], table=np.zeros((2, 1), dtype=np.int32))
    ),
    "table too few rows": (
        InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8], table=np.zeros((1, COLUMNS), dtype=np.int32))
    ),
    "row outside the table": (
        InvalidId,
        lambda m, ok, full: m.step([ok, full], [7, 8], table=np.zeros((2, COLUMNS), dtype=np.int32), rows=[0, 2]),
    ),
    "row given twice": (
        InvalidId,
        lambda m, ok, full: m.step([ok, full], [7, 8], table=np.zeros((2, COLUMNS), dtype=np.int32), rows=[1, 1]),
    ),
    "table not int32": (
        InvalidId, lambda m, ok, full: m.step([ok, full], [7, 8], table=np.zeros((2, COLUMNS), dtype=np.int64))
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_a_bad_argument_raises_before_anything_changes(model: HybridModel, case: str) -> None:
    error, bad_step = BAD_STEPS[case]
    fill_cache(model, [9] * 8)
    ok, full = admit(model, [1, 2]), admit(model, [3, 4, 5, 6])  # ok has room; full needs a block
    before = state(model, ok, full)
    with pytest.raises(error):
        bad_step(model, ok, full)
    model.check_invariants()
    assert state(model, ok, full) == before


def test_another_models_sequence_is_refused() -> None:
    ours, theirs = make_model(), make_model()
    try:
        mine, foreign = admit(ours, [1, 2, 3]), admit(theirs, [4, 5, 6])
        with pytest.raises(SequenceStateError):
            ours.step([foreign], [7])
        ours.check_invariants()
        assert (mine.tokens.tolist(), foreign.tokens.tolist()) == ([1, 2, 3], [4, 5, 6])
    finally:
        ours.teardown()
        theirs.teardown()


# -- arguments the step's checks once let through (found with issue 20) ---------------------------


def test_a_sequence_listed_twice_is_refused_as_a_bad_argument(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3])
    memory = np.full(8, -1, dtype=np.int32)
    table = memory[:4].reshape(2, 2)  # a view, so that a write past the table lands in memory we own
    before = state(model, seq)
    raised = False
    try:
        model.step([seq, seq], [5, 6, 7, 8, 9, 10], counts=[3, 3], table=table)
    except InvalidId:
        raised = True
    model.check_invariants()
    assert raised and state(model, seq) == before and (memory == -1).all()


def test_two_sequences_given_one_row_are_refused_and_the_row_is_not_written(model: HybridModel) -> None:
    fill_cache(model, [9] * 8)
    a, b = admit(model, [1, 2, 3, 4]), admit(model, [5, 6, 7, 8])  # both need a block
    table = np.full((2, COLUMNS), -1, dtype=np.int32)
    before = state(model, a, b)
    with pytest.raises(InvalidId, match="row 1 is given to more than one request"):
        model.step([a, b], [10, 11], table=table, rows=[1, 1])
    model.check_invariants()
    assert state(model, a, b) == before and (table == -1).all()


def test_a_table_without_columns_is_too_narrow(model: HybridModel) -> None:
    seq = admit(model, [1, 2, 3, 4])
    memory = np.full(4, -1, dtype=np.int32)
    table = memory[:0].reshape(1, 0)
    raised = False
    try:
        model.step([seq], [5], table=table)
    except InvalidId:
        raised = True
    model.check_invariants()
    assert raised and (memory == -1).all()


# -- a batched step equals the per-sequence calls it replaces -------------------------------------

# Prompts start with a prefix of one of a few documents and generated tokens come from a small
# alphabet, so that lookups hit blocks that admissions and steps cached.
TOKENS = st.sampled_from((0, 0, 1, 2))
MACHINE_BLOCKS = 8  # a pool small enough that steps run short and evict
DOCUMENTS = ([0] * 12, [1, 2] * 6, [2, 0, 0, 1] * 3)
PROMPTS = st.tuples(st.sampled_from(DOCUMENTS), st.integers(1, 12), st.lists(TOKENS, max_size=2)).map(
    lambda drawn: drawn[0][: drawn[1]] + drawn[2]
)


class StepMachine(RuleBasedStateMachine):
    """Two models driven alike: ``batched`` steps with one ``step`` call, ``single`` with the calls
    a step replaces (``grow`` to the new length, refused on ``OutOfBlocks``; ``append_tokens``;
    ``cache_sequence`` when the step caches). After every rule both hold the same tokens, block
    tables, free and cached blocks, and the engine's table matches the batched model's sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.batched, self.single = make_model(num_blocks=MACHINE_BLOCKS), make_model(num_blocks=MACHINE_BLOCKS)
        self.live: list[tuple[SequenceState, SequenceState]] = []
        self.table = np.full((MAX_SEQS, COLUMNS), -1, dtype=np.int32)

    def teardown(self) -> None:
        self.batched.teardown()
        self.single.teardown()

    def _row(self, seq: SequenceState) -> int:
        return seq.slot_idx

    @precondition(lambda self: len(self.live) < MAX_SEQS)
    @rule(prompt=PROMPTS, extra=st.integers(0, 4))
    def admit(self, prompt: list[int], extra: int) -> None:
        seqs, refused = [], []
        for m in (self.batched, self.single):
            seq = m.alloc_sequence_for(MACHINE_BLOCKS * BS)
            try:
                m.attach_prefix(seq, prompt, grow_to=len(prompt) + extra)
            except OutOfBlocks:
                refused.append(True)
                m.free_sequence(seq)
            else:
                refused.append(False)
                seqs.append(seq)
        assert refused[0] == refused[1]
        if not refused[0]:
            self.live.append((seqs[0], seqs[1]))
            self.table[self._row(seqs[0])] = -1
            self.table[self._row(seqs[0]), : seqs[0].num_blocks] = seqs[0].block_table

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), use_counts=st.booleans(), cache=st.booleans())
    def step(self, data: st.DataObject, use_counts: bool, cache: bool) -> None:
        order = data.draw(st.permutations(range(len(self.live))))
        chosen = [self.live[i] for i in order[: data.draw(st.integers(1, len(order)))]]
        # Counts stay within the per-sequence limit (the whole pool), which the step would refuse
        # for the batch and the single calls for that sequence only.
        room = [MACHINE_BLOCKS * BS - a.num_tokens for a, _ in chosen]
        counts = [data.draw(st.integers(0, min(4, r))) if use_counts else min(1, r) for r in room]
        if not use_counts and 0 in counts:
            return
        tokens = data.draw(st.lists(TOKENS, min_size=sum(counts), max_size=sum(counts)))
        refused = self.batched.step(
            [a for a, _ in chosen],
            tokens,
            counts=counts if use_counts else None,
            table=self.table,
            rows=[self._row(a) for a, _ in chosen],
            cache=cache,
        )
        expected, start = [], 0
        for position, ((_, b), count) in enumerate(zip(chosen, counts)):
            own, start = tokens[start : start + count], start + count
            try:
                self.single.grow(b, b.num_tokens + count)
            except OutOfBlocks:
                expected.append(position)
                continue
            b.append_tokens(own)
            if cache:
                self.single.cache_sequence(b)
        assert refused.tolist() == expected

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        a, b = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.table[self._row(a)] = -1
        self.batched.finish_sequence(a)
        self.single.finish_sequence(b)

    @precondition(lambda self: len(self.live) < MAX_SEQS)
    @rule(prompt=PROMPTS)
    def lookup(self, prompt: list[int]) -> None:
        reused = []
        for m in (self.batched, self.single):
            probe = m.alloc_sequence_for(MACHINE_BLOCKS * BS)
            reused.append(m.attach_prefix(probe, prompt))
            m.free_sequence(probe)
        assert reused[0] == reused[1]

    @invariant()
    def both_models_agree(self) -> None:
        self.batched.check_invariants()
        self.single.check_invariants()
        for a, b in self.live:
            assert a.tokens.tolist() == b.tokens.tolist()
            assert a.block_table.tolist() == b.block_table.tolist()
            assert self.table[self._row(a), : a.num_blocks].tolist() == a.block_table.tolist()
        assert self.batched.num_free_blocks() == self.single.num_free_blocks()
        assert self.batched.core.num_cached_blocks == self.single.core.num_cached_blocks


TestStepEqualsTheCallsItReplaces = StepMachine.TestCase
TestStepEqualsTheCallsItReplaces.settings = settings(stateful_step_count=50)
