"""Retention: priorities per token range with durations, a priority for generated tokens, session
TTLs and pinned prefixes, kept by the core and honoured by its eviction (``lifecycle._retention``,
the trie's priority lists)."""

from __future__ import annotations

import pytest

from kvcache_support import Core, make_core
from lifecycle.errors import RetentionError

BS = 4


def _tokens(base: int, blocks: int) -> list[int]:
    return [base + i for i in range(blocks * BS)]


def _serve(core: Core, tokens: list[int], ranges: object = None, **hints: object) -> int:
    """Admit, hint, finish one request; returns the tokens it hit."""
    before = core.counters()["prefix_hit_tokens"]
    h = core.admit(tokens, len(tokens) // BS + 1)
    if ranges is not None or hints:
        core.set_retention(h, ranges or (), **hints)  # type: ignore[arg-type]
    core.finish(h)
    core.check_invariants()
    return core.counters()["prefix_hit_tokens"] - before


def _hits(core: Core, tokens: list[int]) -> int:
    """Tokens of ``tokens`` the cache would serve now (admitted and released uncached)."""
    before = core.counters()["prefix_hit_tokens"]
    h = core.admit(tokens + [7], len(tokens) // BS + 1)
    core.finish(h, cache=False)
    return core.counters()["prefix_hit_tokens"] - before


def _flood(core: Core, base: int, count: int, priority: int | None = None) -> None:
    for i in range(count):
        _serve(core, _tokens(base + 1000 * i, 4), None if priority is None else [(0, 4 * BS, priority)])


@pytest.fixture
def core() -> Core:
    c = make_core(48, BS)
    c.retention.set_time(0.0)
    return c


def test_without_hints_eviction_is_lru(core: Core) -> None:
    first = _tokens(100, 4)
    _serve(core, first)
    _flood(core, 10_000, 12)
    assert _hits(core, first) == 0


def test_a_high_priority_range_outlives_a_flood_of_default_prompts(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system + _tokens(500, 2), [(0, len(system), 90)])
    _flood(core, 10_000, 30)
    assert _hits(core, system) == len(system)


def test_low_priority_prompts_go_before_older_default_ones(core: Core) -> None:
    kept = _tokens(100, 4)
    _serve(core, kept)
    _flood(core, 10_000, 30, priority=0)
    assert _hits(core, kept) == len(kept)


def test_a_priority_decays_to_the_default_after_its_duration(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system, [(0, len(system), 90, 10.0)])
    core.retention.set_time(11.0)
    _flood(core, 10_000, 30)
    assert _hits(core, system) == 0


def test_a_priority_holds_until_its_duration_ends(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system, [(0, len(system), 90, 10.0)])
    core.retention.set_time(9.0)
    _flood(core, 10_000, 30)
    assert _hits(core, system) == len(system)


def test_a_session_ttl_keeps_the_conversation_for_its_time(core: Core) -> None:
    turn = _tokens(100, 6)
    _serve(core, turn, ttl_s=30.0)
    core.retention.set_time(20.0)
    _flood(core, 10_000, 30)
    assert _hits(core, turn) == len(turn)
    core.retention.set_time(31.0)
    _flood(core, 50_000, 30)
    assert _hits(core, turn) == 0


def _squeeze(core: Core, blocks: int) -> None:
    """Evict exactly ``blocks`` cached blocks (a request as large as the free blocks and those)."""
    h = core.admit([1, 2, 3], core.pool.num_free + blocks)
    core.finish(h, cache=False)
    core.check_invariants()


def test_generated_tokens_take_the_decode_priority(core: Core) -> None:
    older = _tokens(100, 6)
    _serve(core, older)
    prompt = _tokens(500, 3)
    h = core.admit(prompt, 6)
    core.set_retention(h, decode_priority=0)
    core.append(h, _tokens(900, 3))
    core.finish(h)
    _squeeze(core, 3)  # under LRU the older request's blocks would go
    assert _hits(core, older) == len(older)
    assert _hits(core, prompt + _tokens(900, 3)) == len(prompt)


def test_a_run_spanning_two_priorities_is_cut_at_the_boundary(core: Core) -> None:
    tokens = _tokens(100, 6)
    nodes = core.trie.num_nodes
    _serve(core, tokens, [(0, 2 * BS, 80)])
    assert core.trie.num_nodes == nodes + 2
    _flood(core, 10_000, 30)
    assert _hits(core, tokens) == 2 * BS


def test_a_deeper_range_keeps_its_prefix_too(core: Core) -> None:
    tokens = _tokens(100, 6)
    _serve(core, tokens, [(3 * BS, 6 * BS, 80)])
    _flood(core, 10_000, 30)
    assert _hits(core, tokens) == len(tokens)


def test_a_reused_block_keeps_the_higher_priority(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system, [(0, len(system), 90)])
    assert _serve(core, system + _tokens(500, 2), [(0, len(system) + 2 * BS, 0)]) == len(system)
    _flood(core, 10_000, 30)
    assert _hits(core, system) == len(system)


def test_a_hint_on_a_request_finished_uncached_changes_nothing(core: Core) -> None:
    h = core.admit(_tokens(100, 4), 5)
    core.set_retention(h, [(0, 4 * BS, 90)])
    core.finish(h, cache=False)
    assert core.retention.num_hinted == 0
    assert core.num_cached_blocks == 0
    core.check_invariants()


@pytest.mark.parametrize(
    ("ranges", "hints", "named"),
    [
        ([(0, 5 * BS, 50)], {}, "range [0, 20)"),
        ([(-1, 4, 50)], {}, "range [-1, 4)"),
        ([(4, 4, 50)], {}, "range [4, 4)"),
        ([(0, 4, 101)], {}, "101"),
        ([(0, 4, -1)], {}, "-1"),
        ([(0, 4, 50, -2.0)], {}, "-2.0"),
        ([(0, 4, True)], {}, "True"),
        ([(0, 4)], {}, "(0, 4)"),
        ([], {"decode_priority": 200}, "200"),
        ([], {"ttl_s": -5}, "-5"),
        ([], {"ttl_s": float("inf")}, "inf"),
        ([], {"decode_duration_s": -1.0}, "-1.0"),
    ],
)
def test_bad_hints_are_refused_naming_the_value(core: Core, ranges: object, hints: dict[str, object],
                                                  named: str) -> None:
    h = core.admit(_tokens(100, 4), 5)
    core.set_retention(h, [(0, 4, 60)])
    with pytest.raises(RetentionError, match=named.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        core.set_retention(h, ranges, **hints)  # type: ignore[arg-type]
    assert core.retention.num_hinted == 1  # the old hint stands
    core.finish(h)
    assert core.retention.num_hinted == 0
    core.check_invariants()


def test_a_hint_on_a_stale_handle_is_refused(core: Core) -> None:
    h = core.admit(_tokens(100, 4), 5)
    core.finish(h)
    with pytest.raises(Exception, match=str(h)):
        core.set_retention(h, [(0, 4, 60)])
    assert core.retention.num_hinted == 0


def test_a_pinned_prefix_is_never_evicted(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system)
    core.retention.set_pin_budget(8)
    assert core.pin_prefix(system) == 4
    assert core.num_evictable_blocks == 0
    _flood(core, 10_000, 30)
    assert _hits(core, system) == len(system)
    core.check_invariants()


def test_an_unpinned_prefix_is_evictable_again(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system)
    core.retention.set_pin_budget(8)
    core.pin_prefix(system)
    assert core.unpin_prefix(system) == 4
    assert core.retention.pinned_blocks == 0
    _flood(core, 10_000, 30)
    assert _hits(core, system) == 0
    core.check_invariants()


def test_a_pin_over_the_budget_is_refused_and_pins_nothing(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system)
    core.retention.set_pin_budget(3)
    with pytest.raises(RetentionError, match="budget of 3"):
        core.pin_prefix(system)
    assert core.retention.pinned_blocks == 0
    assert core.num_evictable_blocks == 4
    core.check_invariants()


def test_a_budget_below_the_pinned_blocks_is_refused(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system)
    core.retention.set_pin_budget(4)
    core.pin_prefix(system)
    with pytest.raises(RetentionError, match="budget 2"):
        core.retention.set_pin_budget(2)
    assert core.retention.pin_budget == 4


def test_unpinning_what_is_not_pinned_is_refused(core: Core) -> None:
    with pytest.raises(RetentionError, match="no pinned prefix"):
        core.unpin_prefix(_tokens(100, 4))


def test_a_prefix_not_cached_pins_nothing(core: Core) -> None:
    core.retention.set_pin_budget(8)
    assert core.pin_prefix(_tokens(100, 4)) == 0
    assert core.retention.pinned_blocks == 0


def test_cache_read_and_write_tokens_are_counted(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system + [1])
    _serve(core, system + _tokens(500, 1) + [1])
    counters = core.counters()
    assert counters["cache_read_tokens"] == len(system)
    assert counters["cache_write_tokens"] == (4 + 1) * BS


def test_flood_of_low_priority_one_offs_keeps_every_hit_of_a_high_priority_prefix() -> None:
    """vLLM #47802's shape: a high-priority prefix within its budget, one-off low-priority prompts
    filling the pool many times over."""
    core = make_core(256, BS)
    system = _tokens(100, 16)
    _serve(core, system, [(0, len(system), 100)])
    served = hit = 0
    for i in range(300):
        hit += _serve(core, system + _tokens(10_000 + 1000 * i, 2) + [1], [(len(system), len(system) + 2 * BS, 0)])
        served += len(system)
        _serve(core, _tokens(900_000 + 1000 * i, 24), [(0, 24 * BS, 0)])
    assert core.counters()["blocks_evicted"] > 4 * 256
    assert hit == served


def test_a_hint_reaches_blocks_cached_mid_life_when_the_request_finishes_uncached(core: Core) -> None:
    """The engines cache blocks as they fill (``cache``) and release without caching more."""
    older = _tokens(100, 6)
    _serve(core, older)
    mine = _tokens(500, 3)
    h = core.admit(mine + [1], 4)
    core.set_retention(h, [(0, len(mine), 0)])
    core.cache(h, 3)
    core.finish(h, cache=False)
    _squeeze(core, 3)  # under LRU the older request's blocks would go
    assert _hits(core, older) == len(older)
    assert _hits(core, mine) == 0


def test_prioritize_raises_a_cached_prefix_for_its_duration(core: Core) -> None:
    system = _tokens(100, 4)
    _serve(core, system + _tokens(500, 2))
    assert core.retention.prioritize(system, 0, 90, 10.0) == 4
    _flood(core, 10_000, 30)
    assert _hits(core, system) == len(system)
    core.retention.set_time(11.0)
    _flood(core, 50_000, 30)
    assert _hits(core, system) == 0


@pytest.mark.parametrize(("priority", "duration"), [(101, None), (-1, None), (50, -1.0)])
def test_prioritize_refuses_a_bad_priority_or_duration(core: Core, priority: int, duration: float | None) -> None:
    system = _tokens(100, 4)
    _serve(core, system)
    with pytest.raises(RetentionError, match=str(priority if duration is None else duration)):
        core.retention.prioritize(system, 0, priority, duration)
    _flood(core, 10_000, 30)
    assert _hits(core, system) == 0


def test_the_model_passes_hints_and_pins_to_its_core() -> None:
    from lifecycle import AttentionLayer, HybridModel, ModelConfig

    config = ModelConfig(layers=(AttentionLayer(num_kv_heads=1, head_dim=8),), block_size=BS, num_blocks=48,
                         max_seqs=4, name="retention")
    model = HybridModel(config, "host")
    system = _tokens(100, 4)
    seq = model.alloc_sequence()
    model.attach_prefix(seq, system + [1], grow_to=len(system) + 1)
    model.set_retention(seq, [(0, len(system), 90)])
    model.finish_sequence(seq)
    for i in range(30):
        flood = model.alloc_sequence()
        prompt = _tokens(10_000 + 1000 * i, 4) + [1]
        model.attach_prefix(flood, prompt, grow_to=len(prompt))
        model.finish_sequence(flood)
    probe = model.alloc_sequence()
    assert model.attach_prefix(probe, system + [2]) == len(system)
    model.free_sequence(probe)
    model.set_pin_budget(4)
    assert model.pin_prefix(system) == 4
    with pytest.raises(RetentionError, match="budget of 4"):
        model.pin_prefix(system)
    assert model.unpin_prefix(system) == 4
    model.check_invariants()
    model.teardown()


def test_random_hinted_traffic_keeps_every_invariant() -> None:
    """Requests over a few shared prefixes with random hints, mid-life caching, decays, pins,
    raised prefixes and evictions: the recount (lists, priorities, pins, references) holds after
    every step and nothing leaks."""
    import random

    rng = random.Random(5)
    core = make_core(96, BS)
    core.retention.set_time(0.0)
    core.retention.set_pin_budget(12)
    prefixes = [_tokens(100 * (k + 1), rng.randint(1, 4)) for k in range(4)]
    pinned: list[list[int]] = []
    now = 0.0
    for step in range(400):
        tokens = rng.choice(prefixes) + _tokens(10_000 + 100 * rng.randint(0, 40), rng.randint(0, 5)) + [1]
        h = core.admit(tokens, len(tokens) // BS + 1)
        ranges = []
        for _ in range(rng.randint(0, 3)):
            start = rng.randrange(0, len(tokens))
            ranges.append((start, rng.randint(start + 1, len(tokens)), rng.randint(0, 100),
                           rng.choice([None, 0.0, 1.0, 5.0])))
        core.set_retention(h, ranges, decode_priority=rng.choice([None, 0, 70]),
                           ttl_s=rng.choice([None, 2.0, 10.0]))
        core.append(h, _tokens(90_000 + step * 8, rng.randint(0, 2)))
        if rng.random() < 0.3:
            core.cache(h, min(len(tokens) // BS, core.num_blocks(h)))
        core.finish(h, cache=rng.random() < 0.8)
        now += rng.choice([0.0, 0.5, 3.0])
        core.retention.set_time(now)
        choice = rng.random()
        if choice < 0.1:
            core.evict(rng.randint(1, 20))
        elif choice < 0.15 and not pinned:
            prefix = rng.choice(prefixes)
            try:
                if core.pin_prefix(prefix):
                    pinned.append(prefix)
            except RetentionError:
                pass
        elif choice < 0.2 and pinned:
            core.unpin_prefix(pinned.pop())
        elif choice < 0.25:
            core.retention.prioritize(rng.choice(prefixes), 0, rng.randint(0, 100), rng.choice([None, 2.0]))
        core.check_invariants()
        assert core.pool.num_free + core.num_cached_blocks == core.pool.num_total
    assert core.retention.num_hinted == 0


def test_evicted_blocks_below_the_demotion_minimum_are_logged_without_their_ids() -> None:
    core = make_core(48, BS)
    core.set_events(False, demote=True)
    core.set_demote_min_priority(35)
    _serve(core, _tokens(0, 3), [(0, 3 * BS, 10)])   # below: dropped for good
    _serve(core, _tokens(5000, 2))                    # the default, 35: demoted
    core.evict(48)
    raw = core.take_events()
    removed = raw.entries[raw.entries["kind"] == 2]
    assert sorted(zip(removed["has_ids"].tolist(), removed["count"].tolist())) == [(False, 3), (True, 2)]
    assert len(raw.ids) == 2
    core.check_invariants()


def test_a_bad_demotion_minimum_is_refused_naming_it() -> None:
    core = make_core(8, BS)
    with pytest.raises(RetentionError, match=r"demote_min_priority must be an int in \[0, 100\], got 101"):
        core.set_demote_min_priority(101)
    assert core.demote_min_priority == 0


def test_a_low_priority_hint_leaves_a_run_another_request_branched_below_at_its_priority() -> None:
    """A request hints its first block low, and another request's cached run branched off its path
    below that block: the first block keeps a priority at least the branch's, so the branch (a
    leaf) goes before it and the lists keep every parent after its children (found by a random
    replay: the check looked only at the run's own children)."""
    core = make_core(24, BS)
    core.retention.set_time(0.0)

    def stems(*ids: int) -> list[int]:
        return [t for s in ids for t in range(s * 8, s * 8 + 8)]

    a = core.admit(stems(2, 0, 0, 0), 11)
    b = core.admit(stems(2, 1, 0), 8)
    core.set_retention(b, [(0, BS, 0, 2.0)], decode_priority=0)
    assert core.cache(b, 6) == 6  # b's prompt is cached mid-life; a branches off it after block 2
    core.finish(a)
    core.check_invariants()
    core.finish(b)
    core.check_invariants()
    # The branch is evicted before the blocks it hangs from.
    assert _hits(core, stems(2, 0, 0, 0)[:8]) == 8
