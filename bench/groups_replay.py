"""W3 and W4 through the KV cache core with each published-model preset's KV cache groups.

- ``w3_groups``: per preset, W3 (bench/w3.py) through a core built with one group per
  ``config.kv_groups`` entry (group 0's pool the core's, each other group a ``BlockPool`` of its
  ``num_blocks``) at issue 31's budget (half the all-full-attention footprint of 262,144 blocks of
  16 tokens), and, at the same budget, through one group of full attention holding every KV layer
  (``budget // every KV layer's block bytes`` blocks): the hit-rate baseline and the single-group
  cost the groups' cost is compared with. Both run the same calls (:func:`replay_chunked`).
- ``w4_groups``: per preset, W4's decode steps (bench/w4.py) through ``KVCacheCore.step`` with a
  table per group, at the budget of W4's pool (65,536 blocks) had every KV layer full attention,
  beside the same steps through one full-attention group at that budget. Admission is
  ``KVCacheCore.admit`` (longest prefix every group serves, blocks for the prompt and one token)
  with each group's table written into its lane's row; finish is ``KVCacheCore.finish``. Both
  setups step with ``cache=False`` (a core with several groups caches at finish, not during the
  step), so the ratio compares the same work. Only the steps are timed.

Why W3 is prefilled in chunks here: the windowed groups' pools are sized for what a sequence holds
at once (its window plus a block, :meth:`lifecycle.config.MemoryPlan`), not for a whole prompt; a
request admitted with all its blocks (``replay.replay_core``'s one ``admit``) would need every
block of its prompt in those pools too. So each request is admitted as an engine with chunked
prefill runs it: a lookup (``admit`` with no growth, then ``finish`` without caching, as the vLLM
facade's ``get_computed_blocks`` does) gives the cut every group serves; ``open`` + ``attach`` of
the prompt up to the cut and one chunk; then, chunk by chunk, ``cache`` of the full blocks computed
so far (as vLLM caches every full block once computed), ``grow`` and ``append`` (which releases
the blocks that left a window: cached ones stay in the cache, evictable), and an empty ``append``
once the last chunk is computed; ``finish`` at the end caches the rest.
Prefill chunks are :data:`PREFILL_CHUNK` tokens (a multiple of the block size).

Replays of the two setups are interleaved so that a noisy machine's drift hits both.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import deque
from typing import Any

import numpy as np
from replay import check_no_leak, record
from w2 import no_gc
from w3 import W3Trace
from w4 import DecodeRun, W4Trace
from w4 import record as w4_record

from lifecycle.config import ModelConfig

TOKENS_32K = 32768
_NOTHING = np.zeros(0, dtype=np.int32)
#: Tokens per prefill chunk (vLLM's default ``max_num_batched_tokens`` for online serving).
PREFILL_CHUNK = 2048
#: The issue's speed target: a preset's groups cost at most this many times the single group's.
COST_TARGET = 1.5


def one_group_blocks(config: ModelConfig, budget: int) -> int:
    """Blocks a single full-attention group of every KV layer gets out of ``budget`` bytes."""
    block_bytes = sum(group.block_bytes for group in config.kv_groups)
    return budget // block_bytes


def _memory_fields(config: ModelConfig) -> dict[str, Any]:
    plan = config.memory_plan()
    return {
        "concurrent_32k_sequences": plan.concurrent_sequences(TOKENS_32K),
        "ideal_32k_sequences": plan.ideal_sequences(TOKENS_32K),
        "padding_waste": round(plan.padding_waste(TOKENS_32K), 6),
        "kv_budget_bytes": plan.budget_bytes,
        "groups": [f"{group.kind}:{group.layers}x{group.num_blocks}" for group in plan.groups],
    }


def admit_chunked(core: Any, tokens: Any, reusable: int, grow_tokens: int) -> tuple[int, int]:
    """Admit ``tokens`` as chunked prefill does (see the module's docstring), its table grown to
    ``grow_tokens`` tokens at the end: (the record's handle, blocks reused)."""
    bs = core.block_size
    probe = core.admit(tokens, 0, reusable)
    cut = core.num_blocks(probe)
    core.finish(probe, False)
    total = len(tokens)
    end = min(total, cut * bs + PREFILL_CHUNK)
    handle = core.open()
    reused = core.attach(handle, tokens[:end], -(-end // bs), cut)
    cache = core.cache
    cache(handle, end // bs)
    while end < total:
        stop = min(total, end + PREFILL_CHUNK)
        core.grow(handle, -(-stop // bs))
        core.append(handle, tokens[end:stop])
        end = stop
        cache(handle, end // bs)
    core.append(handle, _NOTHING)  # the prompt's KV is computed: the windows release what they left
    if grow_tokens > total:
        core.grow(handle, -(-grow_tokens // bs))
    return handle, reused


def new_core(trace: W3Trace, config: ModelConfig | None, num_blocks: int) -> Any:
    """A core with ``config``'s groups, else one group of ``num_blocks``, at ``trace``'s block size."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore
    from lifecycle.kv_groups import core_groups

    pool = BlockPool(config.kv_groups[0].num_blocks if config is not None else num_blocks)
    return KVCacheCore(pool, trace.block_size, groups=core_groups(config) if config is not None else None)


def chunked_requests(trace: W3Trace) -> list[tuple[Any, int]]:
    """Each request's tokens and reusable blocks, as :func:`drive_chunked` takes them."""
    return [(trace.tokens[i], trace.reusable_blocks(i)) for i in range(trace.num_requests)]


def drive_chunked(core: Any, requests: list[tuple[Any, int]], max_live: int) -> int:
    """The replay's loop (at most ``max_live`` requests live, oldest finished first); returns the
    blocks reused."""
    live: deque[int] = deque()
    finish = core.finish
    hit_blocks = 0
    for tokens, reusable in requests:
        if len(live) == max_live:
            finish(live.popleft())
        handle, hit = admit_chunked(core, tokens, reusable, len(tokens))
        hit_blocks += hit
        live.append(handle)
    while live:
        finish(live.popleft())
    return hit_blocks


def replay_chunked(trace: W3Trace, config: ModelConfig | None, num_blocks: int) -> tuple[float, int, int]:
    """One timed W3 replay, prefilled in chunks (see the module's docstring), on a core with
    ``config``'s groups, else one group of ``num_blocks``; returns (seconds, hit tokens, blocks
    evicted)."""
    core = new_core(trace, config, num_blocks)
    requests = chunked_requests(trace)
    with no_gc():
        start = time.perf_counter()
        hit_blocks = drive_chunked(core, requests, trace.max_live)
        seconds = time.perf_counter() - start
    core.check_invariants()
    check_no_leak(core)
    return seconds, hit_blocks * trace.block_size, core.counters()["blocks_evicted"]


def w3_groups(trace: W3Trace, presets: dict[str, ModelConfig], repeats: int) -> list[dict[str, Any]]:
    """Two records per preset: its groups, then one full-attention group at the same budget."""
    records = []
    for name, config in presets.items():
        budget = config.memory_plan().budget_bytes
        blocks = one_group_blocks(config, budget)
        single = dataclasses.replace(trace, num_blocks=blocks)
        grouped: list[tuple[float, int, int]] = []
        alone: list[tuple[float, int, int]] = []
        for _ in range(repeats):
            grouped.append(replay_chunked(trace, config, 0))
            alone.append(replay_chunked(trace, None, blocks))
        mine = record("W3-groups", "lifecycle", grouped, trace)
        base = record("W3-groups", "lifecycle", alone, single)
        mine.update(preset=name, setup="groups", prefill_chunk=PREFILL_CHUNK, **_memory_fields(config))
        mine["one_group_hit_tokens"] = base["hit_tokens"]
        mine["one_group_us_per_request"] = base["us_per_request"]
        mine["cost_vs_one_group"] = round(mine["us_per_request"] / base["us_per_request"], 3)
        mine["median_cost_vs_one_group"] = round(mine["median_us_per_request"] / base["median_us_per_request"], 3)
        mine["cost_target_met"] = mine["cost_vs_one_group"] <= COST_TARGET
        mine["hit_tokens_vs_one_group"] = round(mine["hit_tokens"] / max(base["hit_tokens"], 1), 4)
        base.update(preset=name, setup="one full-attention group", prefill_chunk=PREFILL_CHUNK, num_blocks=blocks)
        records += [mine, base]
    return records


def w4_replay(trace: W4Trace, config: ModelConfig | None, num_blocks: int, tokens_by_step: Any) -> DecodeRun:
    """One timed W4 replay at the core: with ``config``'s groups, else one group of ``num_blocks``."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore
    from lifecycle.kv_groups import core_groups
    from w4 import GEN_MAX, PROMPT_MAX

    groups = core_groups(config) if config is not None else None
    pool = BlockPool(config.kv_groups[0].num_blocks if config is not None else num_blocks)
    # Rows wide enough for the longest sequence; the core refuses a window wider than a sequence may grow.
    spans = [group.window for group in config.kv_groups] if config is not None else []
    width = -(-max([PROMPT_MAX + GEN_MAX, *spans]) // trace.block_size)
    core = KVCacheCore(pool, trace.block_size, max_blocks_per_seq=width, groups=groups)
    num_groups = core.num_groups
    tables = [np.full((trace.running, width), -1, dtype=np.int32) for _ in range(num_groups)]
    table, extra = tables[0], tables[1:] or None
    handles = np.zeros(trace.running, dtype=np.int64)
    live = [-1] * trace.running
    prompts = {r: trace.prompt(r) for r in range(trace.num_sequences)}
    finish, step, write = core.finish, core.step, core.write_table
    perf = time.perf_counter_ns
    step_ns = turnover_ns = refused = turnovers = 0
    with no_gc():
        for s in range(trace.steps):
            admitted = trace.admitted_before(s)
            if admitted:
                started = perf()
                for r in admitted:
                    lane = int(trace.lanes[r])
                    if live[lane] >= 0:
                        finish(live[lane])
                    prompt = prompts[r]
                    handle = admit_chunked(core, prompt, trace.reusable_blocks(r), len(prompt) + 1)[0]
                    for g in range(num_groups):
                        write(handle, tables[g][lane], None, g)
                    handles[lane] = live[lane] = handle
                turnover_ns += perf() - started
                turnovers += len(admitted)
            tokens = tokens_by_step[s]
            started = perf()
            out = step(handles, tokens, None, table, None, False, extra)
            step_ns += perf() - started
            refused += len(out)
    for lane, handle in enumerate(live):
        for g in range(num_groups):
            # A step gives the new ids; a block released from a window stays in the engine's row
            # (the kernel never reads it), so only the blocks the core holds are compared.
            held = core.block_table(handle, g)
            row = tables[g][lane, : len(held)]
            if not np.array_equal(row[held >= 0], held[held >= 0]):
                raise AssertionError(f"lane {lane}, group {g}: the engine's table row differs from the core's")
    hit_tokens = core.counters()["prefix_hit_tokens"]
    for handle in live:
        finish(handle)
    core.check_invariants()
    check_no_leak(core)
    return DecodeRun(step_ns, turnover_ns, turnovers, refused, hit_tokens)


def w4_groups(trace: W4Trace, presets: dict[str, ModelConfig], repeats: int) -> list[dict[str, Any]]:
    """Two records per preset: its groups, then one full-attention group at the same budget."""
    tokens_by_step = trace.step_tokens()
    records = []
    for name, config in presets.items():
        blocks = one_group_blocks(config, config.memory_plan().budget_bytes)
        grouped: list[DecodeRun] = []
        alone: list[DecodeRun] = []
        for _ in range(repeats):
            grouped.append(w4_replay(trace, config, 0, tokens_by_step))
            alone.append(w4_replay(trace, None, blocks, tokens_by_step))
        mine = w4_record("lifecycle", grouped, trace)
        base = w4_record("lifecycle", alone, trace)
        mine.update(workload="W4-groups", preset=name, setup="groups", **_memory_fields(config))
        mine["cost_vs_one_group"] = round(mine["us_per_step"] / base["us_per_step"], 3)
        mine["median_cost_vs_one_group"] = round(
            statistics.median(a.step_ns / b.step_ns for a, b in zip(grouped, alone)), 3
        )
        mine["cost_target_met"] = mine["cost_vs_one_group"] <= COST_TARGET
        mine["one_group_hit_tokens"] = base["hit_tokens"]
        base.update(workload="W4-groups", preset=name, setup="one full-attention group", num_blocks=blocks)
        records += [mine, base]
    return records
