"""BlockPool against a plain-Python model: random batches, including every kind of bad one."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lifecycle._blockpool import BlockPool
from lifecycle.errors import BlockIdOutOfRange, DoubleFree, InvalidId, LifecycleError, OutOfBlocks

NUM_BLOCKS = 24

# The forms a caller may pass ids in: the int32 fast path and the converting fallbacks.
ID_FORMS = st.sampled_from(["int32", "int64", "list", "tuple", "strided-int32"])
RELEASES = st.sampled_from(["dec_ref", "dec_ref_range"])
OUT_OF_RANGE = st.sampled_from([-(2**31), -1, NUM_BLOCKS, NUM_BLOCKS + 1, 2**31 - 1])
RELEASE_CALLS = st.sampled_from(["inc_ref", "dec_ref", "dec_ref_range"])


def as_form(values: list[int], form: str) -> Any:
    if form == "int32":
        return np.array(values, dtype=np.int32)
    if form == "int64":
        return np.array(values, dtype=np.int64)
    if form == "tuple":
        return tuple(values)
    if form == "strided-int32":
        padded = np.full(2 * len(values), -99, dtype=np.int32)
        padded[::2] = values
        return padded[::2]
    return list(values)


def call_pool(pool: BlockPool, call: str, batch: list[int], form: str) -> int | None:
    """``pool.<call>(batch)``; for ``dec_ref_range`` the batch sits inside junk that must be
    ignored (ids out of range, and block 0 whatever its state)."""
    if call != "dec_ref_range":
        result: int | None = getattr(pool, call)(as_form(batch, form))
        return result
    padded = [-7, 0, *batch, NUM_BLOCKS + 3]
    return pool.dec_ref_range(as_form(padded, form), 2, len(batch))


def named_id(error: LifecycleError) -> int:
    match = re.search(r"block id (-?\d+)", str(error))
    assert match, f"message names no block id: {error}"
    return int(match.group(1))


class BlockPoolModel(RuleBasedStateMachine):
    """``refcounts`` is the whole model: a block is free exactly when its count is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refcounts = [0] * NUM_BLOCKS

    # -- helpers --------------------------------------------------------------------------------

    def num_free(self) -> int:
        return self.refcounts.count(0)

    def held(self) -> list[int]:
        return [block for block, count in enumerate(self.refcounts) if count > 0]

    def freed(self) -> list[int]:
        return [block for block, count in enumerate(self.refcounts) if count == 0]

    def expect_refused(
        self, call: str, batch: list[int], form: str, offenders: dict[int, type[LifecycleError]]
    ) -> None:
        """The call must raise one of the offenders' errors, name that offender, and change nothing."""
        before = self.pool.refcounts()
        try:
            call_pool(self.pool, call, batch, form)
        except LifecycleError as error:
            block = named_id(error)
            assert block in offenders, f"{call}({batch}) named block {block}, offenders {offenders}"
            assert type(error) is offenders[block]
        else:
            raise AssertionError(f"{call}({batch}) was accepted; offenders {offenders}")
        np.testing.assert_array_equal(self.pool.refcounts(), before)

    def took_fresh(self, blocks: list[int]) -> None:
        assert len(set(blocks)) == len(blocks), f"ids handed out twice in one batch: {blocks}"
        for block in blocks:
            assert self.refcounts[block] == 0, f"block {block} handed out while held"
            self.refcounts[block] = 1

    # -- rules ----------------------------------------------------------------------------------

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        if n > self.num_free():
            with pytest.raises(OutOfBlocks, match=f"cannot allocate {n} blocks: only {self.num_free()} "):
                self.pool.allocate(n)
            return
        blocks = self.pool.allocate(n)
        assert blocks.dtype == np.int32 and blocks.shape == (n,)
        self.took_fresh(blocks.tolist())

    @rule(n=st.integers(0, NUM_BLOCKS + 2), start=st.integers(0, 3), slack=st.integers(0, 2))
    def allocate_into(self, n: int, start: int, slack: int) -> None:
        table = np.full(start + n + slack, -5, dtype=np.int32)
        if n > self.num_free():
            with pytest.raises(OutOfBlocks):
                self.pool.allocate_into(table, start, n)
            assert (table == -5).all()
            return
        self.pool.allocate_into(table, start, n)
        assert (table[:start] == -5).all() and (table[start + n :] == -5).all()
        self.took_fresh(table[start : start + n].tolist())

    @precondition(lambda self: any(self.refcounts))
    @rule(data=st.data(), form=ID_FORMS)
    def inc_ref(self, data: st.DataObject, form: str) -> None:
        batch = data.draw(st.lists(st.sampled_from(self.held()), max_size=8))
        self.pool.inc_ref(as_form(batch, form))
        for block in batch:
            self.refcounts[block] += 1

    @precondition(lambda self: any(self.refcounts))
    @rule(data=st.data(), form=ID_FORMS, call=RELEASES)
    def dec_ref(self, data: st.DataObject, form: str, call: str) -> None:
        # A valid batch: a sub-multiset of the references held, so repeats never pass a refcount.
        references = [block for block in self.held() for _ in range(self.refcounts[block])]
        shuffled = data.draw(st.permutations(references))
        batch = shuffled[: data.draw(st.integers(0, min(8, len(shuffled))))]
        freed = call_pool(self.pool, call, batch, form)
        for block in batch:
            self.refcounts[block] -= 1
        assert freed == sum(1 for block in set(batch) if self.refcounts[block] == 0)

    @precondition(lambda self: any(self.refcounts))
    @rule(data=st.data(), form=ID_FORMS, call=RELEASES)
    def release_everything_held(self, data: st.DataObject, form: str, call: str) -> None:
        batch = [block for block in self.held() for _ in range(self.refcounts[block])]
        batch = data.draw(st.permutations(batch))
        assert call_pool(self.pool, call, batch, form) == len(set(batch))
        self.refcounts = [0] * NUM_BLOCKS

    @precondition(lambda self: any(count == 0 for count in self.refcounts))
    @rule(data=st.data(), form=ID_FORMS, call=RELEASES)
    def double_free(self, data: st.DataObject, form: str, call: str) -> None:
        free_block = data.draw(st.sampled_from(self.freed()))
        held = st.lists(st.sampled_from(self.held()), max_size=3, unique=True)
        prefix = data.draw(held) if any(self.refcounts) else []
        self.expect_refused(call, [*prefix, free_block], form, {free_block: DoubleFree})

    @precondition(lambda self: any(self.refcounts))
    @rule(data=st.data(), form=ID_FORMS, call=RELEASES)
    def repeated_past_refcount(self, data: st.DataObject, form: str, call: str) -> None:
        block = data.draw(st.sampled_from(self.held()))
        batch = data.draw(st.permutations([block] * (self.refcounts[block] + 1)))
        self.expect_refused(call, list(batch), form, {block: DoubleFree})

    @precondition(lambda self: any(count == 0 for count in self.refcounts))
    @rule(data=st.data(), form=ID_FORMS)
    def inc_ref_of_free_block(self, data: st.DataObject, form: str) -> None:
        free_block = data.draw(st.sampled_from(self.freed()))
        batch = data.draw(st.permutations([free_block, free_block, *self.held()[:3]]))
        self.expect_refused("inc_ref", list(batch), form, {free_block: InvalidId})

    @rule(data=st.data(), form=ID_FORMS, call=RELEASE_CALLS, bad=OUT_OF_RANGE)
    def out_of_range(self, data: st.DataObject, form: str, call: str, bad: int) -> None:
        valid = self.held()[:3]
        batch = list(data.draw(st.permutations([*valid, bad])))
        self.expect_refused(call, batch, form, {bad: BlockIdOutOfRange})

    @precondition(lambda self: any(count == 0 for count in self.refcounts))
    @rule(data=st.data(), form=ID_FORMS, call=RELEASE_CALLS, bad=OUT_OF_RANGE)
    def free_and_out_of_range_together(self, data: st.DataObject, form: str, call: str, bad: int) -> None:
        free_block = data.draw(st.sampled_from(self.freed()))
        batch = list(data.draw(st.permutations([free_block, bad, *self.held()[:2]])))
        refused_free = InvalidId if call == "inc_ref" else DoubleFree
        self.expect_refused(call, batch, form, {free_block: refused_free, bad: BlockIdOutOfRange})

    # -- after every step -----------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free == self.num_free()
        assert self.pool.refcounts().tolist() == self.refcounts


TestBlockPoolModel = BlockPoolModel.TestCase
