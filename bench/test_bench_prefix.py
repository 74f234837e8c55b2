"""pytest-benchmark suite for the KV cache core (one request's admission and finish, reuse of a long
cached prefix, eviction, and the W2 replay).

    python bench/regress.py save -- bench/test_bench_prefix.py    # a baseline under .benchmarks/
    python bench/regress.py check -- bench/test_bench_prefix.py   # fail if a minimum is > 25% slower

Shapes follow W2 and W3: blocks of 16 tokens; a shared 64-block system prompt under many unique
suffixes; a 15k-token long-context prompt most of which is cached.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from pytest_benchmark.fixture import BenchmarkFixture

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from lifecycle._blockpool import BlockPool  # noqa: E402
from lifecycle._kvcache import KVCacheCore  # noqa: E402

BS = 16
SYSTEM_BLOCKS = 64
SUFFIX_BLOCKS = 16
NUM_SUFFIXES = 512
LONG_BLOCKS = 960  # W3's mean prompt, 15.3k tokens
TRACE = HERE / "data" / "traces.npz"


def requests(num: int = NUM_SUFFIXES) -> list[NDArray[np.int32]]:
    rng = np.random.default_rng(7)
    system = rng.integers(0, 50_000, SYSTEM_BLOCKS * BS).astype(np.int32)
    return [np.concatenate([system, rng.integers(0, 50_000, SUFFIX_BLOCKS * BS).astype(np.int32)]) for _ in range(num)]


def filled_core() -> tuple[KVCacheCore, list[NDArray[np.int32]]]:
    """A core whose cache holds the system prompt under every suffix."""
    core = KVCacheCore(BlockPool(NUM_SUFFIXES * (SYSTEM_BLOCKS + SUFFIX_BLOCKS) * 2), BS)
    tokens = requests()
    for request in tokens:
        core.finish(core.admit(request, len(request) // BS))
    return core, tokens


def test_admit_and_finish_a_cached_request(benchmark: BenchmarkFixture) -> None:
    """A request whose 80 blocks are all cached: the hit, pins and references, then the release."""
    core, tokens = filled_core()
    request = tokens[17]

    def one_request() -> None:
        core.finish(core.admit(request, len(request) // BS + 1))

    benchmark(one_request)
    core.check_invariants()


def test_admit_and_finish_a_new_suffix(benchmark: BenchmarkFixture) -> None:
    """W2's shape: the system prompt hits, 16 new blocks are allocated and cached at finish (the
    cache grows by a branch per round; eviction keeps the pool bounded)."""
    core, _ = filled_core()
    fresh = iter(requests(100_000)[NUM_SUFFIXES:])

    def one_request() -> None:
        request = next(fresh)
        core.finish(core.admit(request, len(request) // BS + 1))

    benchmark.pedantic(one_request, rounds=2000, iterations=1)  # type: ignore[no-untyped-call]
    core.check_invariants()


def test_admit_and_finish_a_long_cached_prompt(benchmark: BenchmarkFixture) -> None:
    """W3's shape: a 15k-token prompt of which all but the last block is cached."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 32_000, LONG_BLOCKS * BS).astype(np.int32)
    core = KVCacheCore(BlockPool(4 * LONG_BLOCKS), BS)
    core.finish(core.admit(prompt, LONG_BLOCKS))

    def one_request() -> None:
        core.finish(core.admit(prompt, LONG_BLOCKS + 1))

    benchmark(one_request)
    core.check_invariants()


def test_evict_and_refill_64_blocks(benchmark: BenchmarkFixture) -> None:
    """Evict 64 least recently used cached blocks, then cache a new request of that size."""
    core, _ = filled_core()
    fresh = iter(requests(200_000)[NUM_SUFFIXES:])

    def evict_and_refill() -> None:
        core.evict(SYSTEM_BLOCKS)
        request = next(fresh)
        core.finish(core.admit(request, len(request) // BS))

    benchmark.pedantic(evict_and_refill, rounds=2000, iterations=1)  # type: ignore[no-untyped-call]
    core.check_invariants()


def test_w2_replay(benchmark: BenchmarkFixture) -> None:
    from replay import replay_core
    from w2 import REFERENCE_HIT_TOKENS, load_w2

    trace = load_w2(TRACE)
    _, hit_tokens, _ = benchmark.pedantic(replay_core, args=(trace,), rounds=5, iterations=1)  # type: ignore[no-untyped-call]
    assert hit_tokens == REFERENCE_HIT_TOKENS
