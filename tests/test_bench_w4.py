"""W4's decode trace (bench/w4.py) follows the rules its docstring states, and the lifecycle replay
(bench/decode.py) keeps the engine's table in step with the sequences. Timing stays in bench/."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import decode  # noqa: E402
import w4  # noqa: E402

MASK64 = (1 << 64) - 1


def draw_reference(kind: int, a: int, b: int) -> int:
    """``draw`` exactly as the docstring writes it, in Python ints."""
    z = (w4.SEED * 2**50 + kind * 2**44 + a * 2**20 + b + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@cache
def trace() -> w4.W4Trace:
    return w4.generate(steps=3_000, running=64)


def test_sequence_attributes_follow_the_documented_draws() -> None:
    t = trace()
    for r in (0, 1, 77, t.num_sequences - 1):
        shared = draw_reference(0, r, 0) % 4 == 0
        low, span = (1025, 2976) if shared else (1000, 3001)
        assert int(t.system_ids[r]) == (draw_reference(0, r, 1) % 8 if shared else -1)
        assert int(t.prompt_lens[r]) == low + draw_reference(0, r, 2) % span
        assert int(t.gen_lens[r]) == 128 + draw_reference(0, r, 3) % 897


def test_tokens_follow_the_documented_draws() -> None:
    t = trace()
    r = int(np.flatnonzero(t.system_ids >= 0)[0])
    s, prompt = int(t.system_ids[r]), t.prompt(r)
    assert prompt[5] == draw_reference(1, s, 5) % 32000
    assert prompt[w4.SYSTEM_PROMPT_TOKENS + 3] == draw_reference(2, r, w4.SYSTEM_PROMPT_TOKENS + 3) % 32000
    assert t.generated(r)[7] == draw_reference(3, r, 7) % 32000


def test_lengths_stay_in_their_ranges() -> None:
    t = w4.generate()
    assert w4.PROMPT_MIN <= t.prompt_lens.min() and t.prompt_lens.max() <= w4.PROMPT_MAX
    assert w4.GEN_MIN <= t.gen_lens.min() and t.gen_lens.max() <= w4.GEN_MAX


def test_shared_prompts_begin_with_their_system_prompt() -> None:
    t = trace()
    shared = np.flatnonzero(t.system_ids >= 0)[:5]
    for r in shared:
        head = t.prompt(int(r))[: w4.SYSTEM_PROMPT_TOKENS]
        assert np.array_equal(head, w4.system_prompt(int(t.system_ids[r])))


def test_each_lane_runs_its_sequences_back_to_back() -> None:
    t = trace()
    for lane in range(t.running):
        mine = np.flatnonzero(t.lanes == lane)
        ends = t.admit_steps[mine[:-1]] + t.gen_lens[mine[:-1]]
        assert t.admit_steps[mine[0]] == 0 and np.array_equal(t.admit_steps[mine[1:]], ends)
        assert t.admit_steps[mine[-1]] + t.gen_lens[mine[-1]] >= t.steps


def test_sequences_are_numbered_in_admission_order_lanes_breaking_ties() -> None:
    t = trace()
    order = np.lexsort((t.lanes, t.admit_steps))
    assert np.array_equal(order, np.arange(t.num_sequences))


def test_step_tokens_are_each_sequences_generated_tokens_in_order() -> None:
    t = trace()
    table = t.step_tokens()
    r = int(np.flatnonzero(t.admit_steps > 0)[0])
    start, lane = int(t.admit_steps[r]), int(t.lanes[r])
    count = min(int(t.gen_lens[r]), t.steps - start)
    assert np.array_equal(table[start : start + count, lane], t.generated(r)[:count])


def test_the_lifecycle_replay_keeps_the_engine_table_and_leaks_nothing() -> None:
    # The replay checks the engine's table against every sequence and the teardown report itself.
    small = w4.generate(steps=200, running=8)
    for through_model in (True, False):
        run = decode.replay(small, through_model=through_model)
        assert run.refused == 0 and run.turnovers > small.running
