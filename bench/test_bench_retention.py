"""pytest-benchmark suite for eviction over the retention priority lists: the cost of evicting a
run of blocks with 10k, 100k and 1M blocks cached, which should not grow with the cache.

    python -m pytest bench/test_bench_retention.py --benchmark-only

The cache holds 16-block leaves under 64 shared 16-block prefixes; a quarter of the requests
finished at priority 0, a quarter with a range at 80 for a minute, a quarter with a session TTL,
the rest unhinted, so eviction walks every kind of list and the expiry heap is full. Under
``eviction_policy="branch-lru"`` the priority-0 quarter is left unhinted, so that eviction takes
the default priority's branch lists (the tournament over their heads) from the first call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lifecycle._blockpool import BlockPool  # noqa: E402
from lifecycle._kvcache import KVCacheCore  # noqa: E402

BS = 16
RUN = 16  # blocks per leaf, and per eviction call
PREFIXES = 64
ROUNDS = 300


def filled(num_blocks: int, policy: str = "lru") -> KVCacheCore:
    """A core whose pool is full of cached blocks, ``num_blocks`` of them, hinted four ways."""
    core = KVCacheCore(BlockPool(num_blocks), BS, capacity=num_blocks // RUN * 2 + 1024, eviction_policy=policy)
    core.retention.set_time(0.0)
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(0, 50_000, RUN * BS).astype(np.int32) for _ in range(PREFIXES)]
    leaves = (num_blocks - PREFIXES * RUN) // RUN
    for i in range(leaves):
        prompt = np.concatenate([prefixes[i % PREFIXES], rng.integers(0, 50_000, RUN * BS).astype(np.int32)])
        h = core.admit(prompt, 2 * RUN)
        kind = i % 4
        if kind == 0 and policy == "lru":
            core.set_retention(h, [(RUN * BS, 2 * RUN * BS, 0)])
        elif kind == 1:
            core.set_retention(h, [(0, 2 * RUN * BS, 80, 60.0)])
        elif kind == 2:
            core.set_retention(h, ttl_s=30.0 + i % 60)
        core.finish(h)
    assert core.num_cached_blocks >= num_blocks - 2 * RUN
    return core


@pytest.mark.parametrize("policy", ["lru", "branch-lru"])
@pytest.mark.parametrize("num_blocks", [10_000, 100_000, 1_000_000], ids=["10k", "100k", "1M"])
def test_evict_a_run_from_a_full_cache(benchmark: BenchmarkFixture, num_blocks: int, policy: str) -> None:
    """One ``evict`` of 16 blocks: the lowest list's head leaf, trimmed (the clock past half the
    hints' expiries, so decays are due along the way)."""
    core = filled(num_blocks, policy)
    core.retention.set_time(45.0)

    def evict_run() -> None:
        core.evict(RUN)

    benchmark.pedantic(evict_run, rounds=ROUNDS, iterations=1)  # type: ignore[no-untyped-call]
    core.check_invariants()
