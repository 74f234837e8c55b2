"""``KVCacheCore(eviction_policy="branch-lru")``: the core's branch-lru against the block model's
(bench/policies.py ``BranchLRU``), victim for victim, and its life with retention priorities,
pins, session TTLs, explicit eviction and bad input. The free and cached counts and
``check_invariants()`` (which checks the lists' stamp order, the head keys and the tournament)
are checked after every step."""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from lifecycle._blockpool import BlockPool
from lifecycle._kvcache import REMOVED, KVCacheCore
from lifecycle.errors import ConfigError, LifecycleError

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import policies  # noqa: E402

BS = 4


def checked(core: KVCacheCore, pool: BlockPool) -> None:
    core.check_invariants()
    assert core.num_evictable_blocks <= core.num_cached_blocks <= pool.num_total - pool.num_free
    if core.num_live_sequences == 0:
        assert pool.num_free + core.num_cached_blocks == pool.num_total


def random_trace(seed: int, n: int = 160) -> list[tuple[np.ndarray, int, int]]:
    """Requests (tokens, blocks needed, reusable blocks) over a few shared documents, with
    conversations (a request continuing an earlier one) and generated tails."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 60, BS * int(rng.integers(2, 12))).astype(np.int32) for _ in range(5)]
    out: list[tuple[np.ndarray, int, int]] = []
    for _ in range(n):
        if out and rng.random() < 0.3:
            base = out[int(rng.integers(len(out)))][0][: 10 * BS]
        else:
            d = docs[int(rng.integers(len(docs)))]
            base = d[: BS * int(rng.integers(0, len(d) // BS + 1))]
        prompt = np.concatenate([base, rng.integers(0, 60, int(rng.integers(BS + 1, 4 * BS))).astype(np.int32)])
        tokens = np.concatenate([prompt, rng.integers(0, 60, int(rng.integers(0, 3 * BS))).astype(np.int32)])
        out.append((tokens, -(-len(tokens) // BS), (len(prompt) - 1) // BS))
    return out


class Logged(policies.BranchLRU):
    """The model's branch-lru, recording each victim with the admission it was taken for."""

    def bind(self, cache: policies.Cache) -> None:
        super().bind(cache)
        self.victims: list[tuple[int, int]] = []

    def victim(self) -> int:
        b = super().victim()
        self.victims.append((self.cache.now, b))
        return b


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_core_evicts_what_the_models_branch_lru_evicts(seed: int) -> None:
    """Every admission's hit and the blocks each admission evicts (by content hash, mapped to the
    model's prefix ids) are the model's, on a pool small enough to evict all along."""
    requests = random_trace(seed)
    pool_blocks, max_live = 80, 3
    contents = []
    for tokens, _, _ in requests:
        rows = tokens[: len(tokens) // BS * BS].reshape(-1, BS)
        contents.append(np.stack([policies._content_hashes(rows, 1), policies._content_hashes(rows, 2)], axis=1))
    trace = policies.block_trace_of(
        contents, [r for _, _, r in requests], [n for _, n, _ in requests], block_size=BS,
        num_blocks=pool_blocks, max_live=max_live, prompt_tokens=sum(len(t) for t, _, _ in requests),
    )
    model = Logged()
    outcome = policies.replay(trace, model)
    expected: list[set[int]] = [set() for _ in requests]
    for i, b in model.victims:
        expected[i].add(b)

    pool = BlockPool(pool_blocks)
    core = KVCacheCore(pool, BS, eviction_policy="branch-lru-exact", events=True)
    ids: dict[int, int] = {}
    for i, (tokens, _, _) in enumerate(requests):
        for j, h in enumerate(np.asarray(core.content_hashes(tokens)).tolist()):
            ids[h] = int(trace.blocks(i)[j])
    live: deque[int] = deque()
    hits, evicted = [], []
    for tokens, needed, reusable in requests:
        if len(live) == max_live:
            core.finish(live.popleft())
            checked(core, pool)
        core.take_events()
        h = core.admit(tokens, needed, reusable)
        live.append(h)
        hits.append(core.cached_tokens(h) // BS)
        events = core.take_events()
        removed: set[int] = set()
        at = 0
        for entry in events.entries:
            if entry["kind"] == REMOVED:
                removed |= {ids[int(x)] for x in events.hashes[at : at + entry["count"]]}
            at += int(entry["count"])
        evicted.append(removed)
        checked(core, pool)
    while live:
        core.finish(live.popleft())
        checked(core, pool)
    assert sum(len(e) for e in expected) > 50  # it evicted all along
    assert hits == outcome.hits.tolist()
    assert evicted == expected
    assert core.counters()["blocks_evicted"] == outcome.blocks_evicted
    assert pool.num_free + core.num_cached_blocks == pool.num_total


def test_lru_stays_the_default_and_branch_lru_orders_by_reuse() -> None:
    """Pool of 8 blocks, prompts of 2 cached blocks holding 3: A (reused once), B and C cached,
    D short of one block. LRU trims A's last block (the oldest); branch-lru keeps A (half a
    pool's worth of stamps ahead for its reuse) and trims B's, so A hits both blocks again."""
    def prompt(label: int) -> np.ndarray:
        return np.full(2 * BS + 1, label, dtype=np.int32)

    kept = {}
    for policy in ("lru", "branch-lru"):
        pool = BlockPool(8)
        core = KVCacheCore(pool, BS) if policy == "lru" else KVCacheCore(pool, BS, eviction_policy=policy)
        assert core.eviction_policy == policy == core.trie.eviction_policy
        for label in (1, 1, 2, 3):
            core.finish(core.admit(prompt(label), 3))
            checked(core, pool)
        core.finish(core.admit(prompt(4), 3))
        checked(core, pool)
        h = core.admit(prompt(1), 3)
        kept[policy] = core.cached_tokens(h) // BS
        core.finish(h)
        checked(core, pool)
    assert kept == {"lru": 1, "branch-lru": 2}


def test_priorities_come_first_and_pins_hold() -> None:
    """Branch-lru orders the default priority alone: a priority-0 run goes before any default
    one and a priority-80 run after all of them; a pinned prefix never goes."""
    pool = BlockPool(24)
    core = KVCacheCore(pool, BS, eviction_policy="branch-lru")
    core.retention.set_time(0.0)
    low = np.full(2 * BS + 1, 7, dtype=np.int32)
    high = np.full(2 * BS + 1, 8, dtype=np.int32)
    pinned = np.full(2 * BS, 9, dtype=np.int32)
    core.finish(core.admit(pinned, 2))
    core.retention.set_pin_budget(2)
    core.pin_prefix(pinned)
    h = core.admit(low, 3)
    core.set_retention(h, [(0, 2 * BS, 0)])
    core.finish(h)
    h = core.admit(high, 3)
    core.set_retention(h, [(0, 2 * BS, 80)])
    core.finish(h)
    checked(core, pool)
    for label in range(10, 14):
        core.finish(core.admit(np.full(2 * BS + 1, label, dtype=np.int32), 3))
        checked(core, pool)
    # Cached: pinned 2, low 2, high 2, four defaults of 2 = 14 of 24. Evict 2: the low run goes.
    assert core.evict(2) == 2
    checked(core, pool)
    assert core.cached_tokens(h := core.admit(low, 3)) == 0
    core.finish(h)
    core.evict(core.num_evictable_blocks - 2)  # every default run, the low one again; high is left
    checked(core, pool)
    assert core.cached_tokens(h := core.admit(high, 3)) == 2 * BS
    core.finish(h)
    assert core.cached_tokens(h := core.admit(np.concatenate([pinned, [1]]).astype(np.int32), 3)) == 2 * BS
    core.finish(h)
    core.evict(pool.num_total)
    checked(core, pool)
    assert core.num_cached_blocks == 2  # the pin alone
    core.unpin_prefix(pinned)
    assert core.evict(2) == 2
    checked(core, pool)
    assert core.num_cached_blocks == 0 and pool.num_free == pool.num_total


def test_session_ttls_decay_into_the_branch_lists() -> None:
    """TTL-hinted paths sit at 36 above every default run until they expire, then join the
    default lists at their MRU end; the lists stay consistent throughout."""
    pool = BlockPool(40)
    core = KVCacheCore(pool, BS, eviction_policy="branch-lru")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 60, 3 * BS + 1).astype(np.int32) for _ in range(8)]
    for i, p in enumerate(prompts):
        core.retention.set_time(float(i))
        h = core.admit(p, 4)
        if i % 2:
            core.set_retention(h, ttl_s=5.0)
        core.finish(h)
        checked(core, pool)
    # At 7.5 prompt 1's hint (finished at 1.0) has expired; 3's, 5's and 7's have not. Twelve of
    # the fifteen default blocks go first.
    core.retention.set_time(7.5)
    for _ in range(4):
        assert core.evict(3) == 3
        checked(core, pool)
    for i in (3, 5, 7):
        h = core.admit(prompts[i], 4)
        assert core.cached_tokens(h) == 3 * BS
        core.finish(h)
        checked(core, pool)
    core.retention.set_time(100.0)
    while core.num_evictable_blocks:
        core.evict(5)
        checked(core, pool)
    assert pool.num_free == pool.num_total


def test_evict_blocks_drops_subtrees_under_branch_lru() -> None:
    pool = BlockPool(64)
    core = KVCacheCore(pool, BS, eviction_policy="branch-lru")
    shared = np.arange(2 * BS, dtype=np.int32)
    tables = []
    for k in range(4):
        tokens = np.concatenate([shared, np.full(2 * BS, 100 + k, dtype=np.int32), [0]]).astype(np.int32)
        h = core.admit(tokens, 5)
        tables.append(core.block_table(h).tolist())
        core.finish(h)
        checked(core, pool)
    dropped = core.evict_blocks([tables[0][1]])  # the shared prefix's second block: everything below it
    checked(core, pool)
    assert sorted(dropped.tolist()) == sorted({tables[0][1], *[b for t in tables for b in t[2:4]]})
    assert core.num_cached_blocks == 1


def test_a_bad_policy_name_is_a_config_error_naming_it() -> None:
    for bad in ("LRU", "branch_lru", "branch-lru-Exact", "", None, 1):
        with pytest.raises(ConfigError, match=repr(bad).replace("(", r"\(")) as info:
            KVCacheCore(BlockPool(8), BS, eviction_policy=bad)  # type: ignore[arg-type]
        assert isinstance(info.value, LifecycleError)
    with pytest.raises(ConfigError, match="branch-lru"):
        KVCacheCore(BlockPool(8), BS, eviction_policy="branch-lru", groups=[("sliding_window", 8, 0, BlockPool(8))])


@pytest.mark.parametrize("seed", [0, 1])
def test_branch_lru_trims_whole_runs_and_stays_consistent(seed: int) -> None:
    """``branch-lru`` takes the victim's whole run (not block by block): the same lists and keys,
    consistent after every step, nothing leaked, and it evicts no fewer blocks than asked."""
    pool = BlockPool(80)
    core = KVCacheCore(pool, BS, eviction_policy="branch-lru")
    live: deque[int] = deque()
    for tokens, needed, reusable in random_trace(seed):
        if len(live) == 3:
            core.finish(live.popleft())
            checked(core, pool)
        live.append(core.admit(tokens, needed, reusable))
        checked(core, pool)
    while live:
        core.finish(live.popleft())
    checked(core, pool)
    assert core.counters()["blocks_evicted"] > 50
    assert pool.num_free + core.num_cached_blocks == pool.num_total


def test_the_model_takes_its_eviction_policy_from_its_config() -> None:
    """``ModelConfig(eviction_policy=...)`` reaches the model's core; served traffic that evicts
    keeps the invariants and leaks nothing; a bad name, or branch-lru on a model of several KV
    groups, is a ``ConfigError`` naming the value, before anything is allocated."""
    from lifecycle import AttentionLayer, HybridModel, ModelConfig, SlidingWindowLayer

    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BS, num_blocks=40,
                         max_seqs=4, name="policy", eviction_policy="branch-lru")
    assert config.replace(num_blocks=48).eviction_policy == "branch-lru"
    model = HybridModel(config, "host")
    assert model.core.eviction_policy == "branch-lru"
    lru = HybridModel(config.replace(eviction_policy="lru"), "host")
    assert lru.core.eviction_policy == "lru"
    lru.teardown()
    for tokens, needed, _ in random_trace(3, 80):
        seq = model.alloc_sequence()
        model.attach_prefix(seq, tokens.tolist(), grow_to=needed * BS)
        model.finish_sequence(seq)
        model.check_invariants()
    assert model.core.counters()["blocks_evicted"] > 0  # the trace overflows the pool: the policy chose victims
    assert model.core.num_live_sequences == 0
    assert model.pool.num_free + model.core.num_cached_blocks == model.pool.num_total
    model.teardown()

    for bad in ("LRU", "fifo", "", None):
        with pytest.raises(ConfigError, match=repr(bad)):
            config.replace(eviction_policy=bad)
    windowed = (AttentionLayer(num_kv_heads=1, head_dim=8), SlidingWindowLayer(num_kv_heads=1, head_dim=8, window=8))
    with pytest.raises(ConfigError, match="branch-lru.*2 KV cache groups"):
        ModelConfig(layers=windowed, block_size=BS, num_blocks=(32, 32), eviction_policy="branch-lru")
    assert ModelConfig(layers=windowed, block_size=BS, num_blocks=(32, 32)).eviction_policy == "lru"
