"""The block-level model of the prefix cache and its eviction policies (bench/policies.py), on
small traces whose right answers are worked out by hand in each test's docstring, and the model's
LRU against the library's own replay.

Toy traces use blocks of one token, so hit tokens count hit blocks; a request is
``(labels, reusable, needed)``: the content label of each of its full blocks (a block's id is its
whole prefix of labels), how many of them it may reuse, how many blocks it holds while live.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import policies  # noqa: E402
from policies import BlockTrace, Cache, Ints, Outcome, Policy, Ranked, SessionHints  # noqa: E402

Request = tuple[list[int], int, int]


def toy(requests: list[Request], *, pool: int, max_live: int = 1, times: list[int] | None = None) -> BlockTrace:
    contents = [np.array([[label, label * 7919 + 1] for label in labels], dtype=np.uint64).reshape(-1, 2)
                for labels, _, _ in requests]
    return policies.block_trace_of(
        contents, [r for _, r, _ in requests], [n for _, _, n in requests],
        block_size=1, num_blocks=pool, max_live=max_live, prompt_tokens=sum(len(labels) for labels, _, _ in requests),
        times=times,
    )


A, B, C, D, X, Y, Z = 1, 2, 3, 4, 5, 6, 7


class Checked(Policy):
    """Wraps a policy and records each victim with the cache's state at that moment."""

    def __init__(self, inner: Policy) -> None:
        self.inner = inner
        self.victims: list[tuple[int, bool, int, int]] = []  # block, cached, cached children, pins

    def bind(self, cache: Cache) -> None:
        super().bind(cache)
        self.inner.bind(cache)

    def on_hit(self, blocks: Ints) -> None:
        self.inner.on_hit(blocks)

    def on_insert(self, blocks: Ints) -> None:
        self.inner.on_insert(blocks)

    def on_touch(self, blocks: Ints) -> None:
        self.inner.on_touch(blocks)

    def on_finish(self, request: int, blocks: Ints) -> None:
        self.inner.on_finish(request, blocks)

    def offer(self, b: int) -> None:
        self.inner.offer(b)

    def victim(self) -> int:
        b = self.inner.victim()
        c = self.cache
        self.victims.append((b, bool(c.cached[b]), int(c.children[b]), int(c.pins[b])))
        return b


def hints(continues: list[int], ttl: int, unit: str = "requests") -> SessionHints:
    return SessionHints(np.array(continues, dtype=np.int64), ttl, unit)


ALL: list[Callable[[], Ranked]] = [
    policies.LRU, lambda: policies.SLRU(0.5), policies.TwoQ, policies.S3FIFO, policies.LFU, policies.BranchLRU,
    policies.Optimum,
]


# -- block ids -------------------------------------------------------------------------------------


def test_a_block_id_stands_for_its_whole_prefix() -> None:
    trace = toy([([A, B], 2, 2), ([A, C], 2, 2), ([B], 1, 1), ([A, B, C], 3, 3)], pool=8)
    first, second, third, fourth = (trace.blocks(i).tolist() for i in range(4))
    assert first[0] == second[0] == fourth[0]  # A at the root, three times
    assert first == fourth[:2]
    assert second[1] != first[1] and third[0] != first[1]  # B under A is not B at a root, nor C under A
    assert trace.parent[fourth[2]] == fourth[1] and trace.parent[first[0]] == -1
    assert trace.depth[fourth[2]] == 2


def test_conversations_follow_prefix_chains_without_looking_ahead() -> None:
    """r1 holds r0's chain but its last chunk; r3 and r4 hold r1's ([1, 3]), the deeper match;
    r2 and r5 start anew (r2's one chunk leaves nothing to continue)."""
    chains = [[1, 2], [1, 3, 4], [5], [1, 3, 6, 7], [1, 3, 4], [5, 9]]
    assert policies.conversations(chains).tolist() == [-1, 0, -1, 1, 1, -1]


# -- the replay and LRU ----------------------------------------------------------------------------


def test_lru_loses_a_loop_one_longer_than_the_pool_and_the_optimum_keeps_most_of_it() -> None:
    """A B C D A B C D on a pool of 3: LRU always evicts the block asked for next (no hit); the
    optimum evicts C at D (next used last), hits A and B, evicts A at C (neither A nor B comes
    back, A is older) and hits D."""
    trace = toy([([label], 1, 1) for label in (A, B, C, D, A, B, C, D)], pool=3)
    lru = policies.replay(trace, policies.LRU())
    best = policies.replay(trace, policies.Optimum())
    assert lru.hits.tolist() == [0] * 8
    assert best.hits.tolist() == [0, 0, 0, 0, 1, 1, 0, 1]
    assert (lru.hit_tokens, best.hit_tokens) == (0, 3)
    assert (lru.blocks_evicted, best.blocks_evicted) == (5, 2)


def test_eviction_takes_a_leaf_never_the_block_above_it() -> None:
    """2Q keeps A1in in insertion order, where A (cached at r0's finish) is older than B (under A,
    cached at r1's finish); r2 needs one block: only B is a leaf, so B goes and r3 still hits A."""
    trace = toy([([A], 1, 1), ([A, B], 1, 2), ([C], 1, 2), ([A, B], 2, 2)], pool=3)
    checked = Checked(policies.TwoQ())
    outcome = policies.replay(trace, checked)
    assert outcome.hits.tolist() == [0, 1, 0, 1]
    assert [v[0] for v in checked.victims] == [int(trace.blocks(1)[1])]


def test_a_pinned_prefix_is_never_evicted() -> None:
    """Two live at most, a pool of 4. r2 reuses A, which stays pinned while r2 lives; r3 needs two
    blocks with one free: A is the least recently used but pinned, so B goes (r4 misses B) and r5,
    admitted after r2 finished, still hits A."""
    trace = toy([([A], 1, 1), ([B], 1, 1), ([A], 1, 2), ([C], 1, 2), ([B], 1, 1), ([A], 1, 1)], pool=4, max_live=2)
    checked = Checked(policies.LRU())
    outcome = policies.replay(trace, checked)
    assert outcome.hits.tolist() == [0, 0, 1, 0, 0, 1]
    assert checked.victims[0][0] == int(trace.blocks(1)[0])


def branching_trace() -> BlockTrace:
    """300 requests: a document shared at a random depth, then a suffix of their own; a small
    pool, four live."""
    rng = np.random.default_rng(7)
    requests: list[Request] = []
    for i in range(300):
        shared = [100 * int(rng.integers(4)) + d for d in range(int(rng.integers(1, 12)))]
        labels = shared + [10_000 + 50 * i + d for d in range(int(rng.integers(1, 6)))]
        requests.append((labels, len(labels) - 1, len(labels) + 1))
    return toy(requests, pool=100, max_live=4)


def test_every_policy_evicts_only_unpinned_cached_leaves() -> None:
    """On the branching trace every victim of every policy was cached, unpinned and had no cached
    child."""
    trace = branching_trace()
    continues = [-1] + list(range(299))
    hinted: list[Callable[[], Ranked]] = [
        lambda: policies.BranchLRU(hints=hints(continues, 20)), lambda: policies.LRU(hints(continues, 5))
    ]
    for make in ALL + hinted:
        checked = Checked(make())
        policies.replay(trace, checked)
        assert checked.victims, "the pool was meant to be short"
        assert all(cached and children == 0 and pins == 0 for _, cached, children, pins in checked.victims)


class MonotoneChecked(policies.BranchLRU):
    """Branch LRU that, before each choice, checks every cached, unpinned block's key against its
    cached, unpinned parent's."""

    inversions = 0

    def choose(self) -> int:
        c = self.cache
        for b in np.flatnonzero(c.cached & (c.pins == 0)).tolist():
            p = int(c.trace.parent[b])
            if p >= 0 and c.pins[p] == 0 and self.key(p) < self.key(b):
                self.inversions += 1
        return super().choose()


def test_branch_lru_keys_grow_toward_the_root() -> None:
    """What lets the C buckets keep key order without a leaf check: on the branching trace no
    unpinned parent ever has a lower key than its child (stamp, reuse bonus and length bonus each
    grow toward the root)."""
    policy = MonotoneChecked()
    policies.replay(branching_trace(), policy)
    assert policy.inversions == 0


def test_the_models_lru_hits_and_evicts_exactly_what_the_library_does() -> None:
    """The first 200 W3 requests, 4 live, on a pool of 40,000 blocks (evicting all along), replayed by the
    library's core and by the model."""
    pytest.importorskip("lifecycle._kvcache")
    from replay import replay_core
    from w3 import load_w3

    w3 = dataclasses.replace(load_w3(limit=200), num_blocks=40_000, max_live=4)
    _, hit_tokens, evicted = replay_core(w3)
    model = policies.replay(policies.block_trace(w3), policies.LRU())
    assert evicted > 0
    assert (model.hit_tokens, model.blocks_evicted) == (hit_tokens, evicted)


# -- session hints ---------------------------------------------------------------------------------

SESSION: list[Request] = [([A], 0, 1), ([A, B], 1, 2), ([X], 1, 1), ([Y], 1, 1), ([Z], 1, 1), ([A, B, C], 2, 3)]
#: r1 continues r0 and r5 continues r1; the rest are one-off prompts.
CONTINUES = [-1, 0, -1, -1, -1, 1]


def session_hits(policy: Ranked, times: list[int] | None = None) -> Outcome:
    return policies.replay(toy(SESSION, pool=3, times=times), policy)


def test_without_a_hint_lru_lets_the_conversations_tail_go() -> None:
    """Pool of 3: r3 and r4 each need a block and LRU takes B, then A (cached at r1's finish,
    older than X and Y); r5 finds nothing of its conversation."""
    assert session_hits(policies.LRU()).hits.tolist() == [0, 1, 0, 0, 0, 0]


def test_a_session_ttl_keeps_the_tail_until_the_next_turn() -> None:
    """r1's finish hints its path [A, B] for 10 requests: r3 and r4 take X, then Y instead, and
    r5 reuses A and B."""
    assert session_hits(policies.LRU(hints(CONTINUES, 10))).hits.tolist() == [0, 1, 0, 0, 0, 2]


def test_an_expired_session_ttl_changes_nothing() -> None:
    """A TTL of 1 request expires at r3's admission, before any eviction: plain LRU's result."""
    assert session_hits(policies.LRU(hints(CONTINUES, 1))).hits.tolist() == session_hits(policies.LRU()).hits.tolist()


@pytest.mark.parametrize(("ttl", "r5_hits"), [(100, 2), (5, 0)])
def test_a_session_ttl_in_trace_time(ttl: int, r5_hits: int) -> None:
    """Requests 10 ms apart; r1 finishes at r2's arrival (20 ms): a 100 ms hint lasts to r5, a
    5 ms one is gone by r3's eviction (30 ms)."""
    outcome = session_hits(policies.LRU(hints(CONTINUES, ttl, "ms")), times=[0, 10, 20, 30, 40, 50])
    assert outcome.hits.tolist()[-1] == r5_hits


def test_a_hinted_block_goes_when_nothing_unhinted_is_left() -> None:
    """Every request hinted for long: the pool still turns over (the earliest hint first) and the
    loop behaves as under LRU, which it is in hint order."""
    trace = toy([([label], 1, 1) for label in (A, B, C, D, A, B, C, D)], pool=3)
    hinted = policies.replay(trace, policies.LRU(hints([0] * 8, 100)))
    assert (hinted.hit_tokens, hinted.blocks_evicted) == (0, 5)


# -- the records -----------------------------------------------------------------------------------


def test_run_reports_every_policy_then_the_optimum() -> None:
    labels = [A, B, C, D, A, B, C, D]
    trace = toy([([label], 1, 1) for label in labels], pool=3)
    workload = policies.Workload("toy", trace, [[label, 0] for label in labels], None)
    records = policies.run(workload, check_library=False)
    names = [r["policy"] for r in records]
    assert names[0] == "lru" and names[-1] == "optimum" and len(set(names)) == len(names)
    assert {"policy", "hit_tokens", "hit_rate", "us_per_request"} <= set(records[0])
    assert all(("hints" in r) == ("+ttl" in r["policy"]) for r in records)
    assert records[-1]["hit_tokens"] == 3 and records[-1]["never_evict_hit_tokens"] == 4
    assert records[0]["gap_closed"] == 0 and records[-1]["gap_closed"] == 1


def test_the_cores_records_measure_lru_and_session_ttls_through_the_library() -> None:
    """The first 300 W3 requests on a pool of 30,000 blocks: ``core:lru`` is the library's own
    replay, ``core:lru+ttl-120s`` the same with every continuing request hinted, and the same two
    under ``eviction_policy="branch-lru"``."""
    pytest.importorskip("lifecycle._kvcache")
    import json

    from replay import replay_core
    from traces import MOONCAKE_TRACE, mooncake_lines
    from w3 import load_w3

    trace = dataclasses.replace(load_w3(limit=300), num_blocks=30_000, max_live=4)
    times = [int(json.loads(line)["timestamp"]) for line in mooncake_lines(MOONCAKE_TRACE)][:300]
    cut = policies.Workload("W3", policies.block_trace(trace, times), trace.chunk_ids, trace)
    continues = policies.conversations(cut.chains)
    _, library, _ = replay_core(trace)
    records = policies.core_records(cut, library, 1, continues)
    assert [r["policy"] for r in records] == [
        "core:lru", "core:lru+ttl-120s", "core:branch-lru", "core:branch-lru+ttl-120s",
    ]
    assert records[2]["hit_tokens"] != library
    assert records[0]["hit_tokens"] == library
    assert records[1]["hints"]["sessions_hinted"] == int((continues >= 0).sum()) > 0
    assert records[1]["hit_tokens"] != library
