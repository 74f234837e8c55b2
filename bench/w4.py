"""W4, the decode replay: every engine step, every running sequence gains one token.

256 sequences run at once, each in a lane (a row of the engine's block table). A sequence's prompt
is prefilled when it is admitted; then it decodes one token per step for its generation length, and
after its last step it finishes (every full block of its prompt and generated tokens goes into the
prefix cache) and the next sequence is admitted into its lane before the next step. Blocks of 16
tokens, a pool of 65,536 blocks, 20,000 steps.

Every number derives from ``splitmix64`` (w3.py's rule: ``z = x + 0x9E3779B97F4A7C15;
z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9; z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return
z ^ (z >> 31)``, all mod 2**64) of ``SEED * 2**50 + kind * 2**44 + a * 2**20 + b``, written
``draw(kind, a, b)`` below; so any library can regenerate the trace without numpy's generators:

- sequence ``r`` (numbered from 0 in admission order) shares a system prompt when
  ``draw(0, r, 0) % 4 == 0`` (a quarter of them), namely system prompt ``draw(0, r, 1) % 8``;
- its prompt length is ``1000 + draw(0, r, 2) % 3001`` (1,000..4,000 tokens), or with a system
  prompt ``1025 + draw(0, r, 2) % 2976`` (the 1,024-token system prompt and 1..2,976 tokens of
  its own);
- its generation length is ``128 + draw(0, r, 3) % 897`` (128..1,024 tokens);
- token ``j`` of system prompt ``s`` is ``draw(1, s, j) % 32000``; the prompt's own token at
  position ``j`` (counted from the prompt's start) is ``draw(2, r, j) % 32000``; generated token
  ``j`` is ``draw(3, r, j) % 32000``.

Schedule: sequences 0..255 take lanes 0..255 before step 0. A sequence admitted before step ``a``
with generation length ``g`` appends its generated token ``k`` at step ``a + k`` and finishes after
step ``a + g - 1``; before step ``a + g`` the next sequence number takes its lane (lanes freed by the
same step in lane order). Sequences still running after the last step are not finished.

The replay's token accounting, the same for every library: at admission the prompt's ``P`` tokens
are prefilled (the longest cached prefix in whole blocks is reused, never the block holding the
prompt's last token, and the rest allocated, evicting least recently used cached blocks when short);
step ``k`` appends generated token ``k`` at position ``P + k`` and gives it a slot, growing the
sequence by one block whenever that position starts a block (evicting when short). The figure is
the steps' bookkeeping alone: admission and finish (what W2 and W3 time) are timed apart.

Only numpy and the standard library here, so that the peers' environments can import it.
"""

from __future__ import annotations

import heapq
import statistics
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from w3 import splitmix64  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 65_536
RUNNING = 256
STEPS = 20_000
PROMPT_MIN, PROMPT_MAX = 1_000, 4_000
GEN_MIN, GEN_MAX = 128, 1_024
NUM_SYSTEM_PROMPTS = 8
SYSTEM_PROMPT_TOKENS = 1_024
SHARED_ONE_IN = 4
VOCAB = 32_000
SEED = 4

_ATTRIBUTES, _SYSTEM, _PROMPT, _GENERATED = 0, 1, 2, 3


def draw(kind: int, a: NDArray[np.uint64] | int, b: NDArray[np.uint64] | int) -> NDArray[np.uint64]:
    """``splitmix64(SEED * 2**50 + kind * 2**44 + a * 2**20 + b)`` elementwise."""
    base = np.uint64(SEED << 50) + np.uint64(kind << 44)
    x = base + np.asarray(a, dtype=np.uint64) * np.uint64(1 << 20) + np.asarray(b, dtype=np.uint64)
    return splitmix64(np.asarray(x, dtype=np.uint64))


def _tokens(kind: int, a: int, positions: NDArray[np.uint64]) -> NDArray[np.int32]:
    return (draw(kind, a, positions) % np.uint64(VOCAB)).astype(np.int32)


def system_prompt(s: int) -> NDArray[np.int32]:
    """The 1,024 tokens of system prompt ``s``."""
    return _tokens(_SYSTEM, s, np.arange(SYSTEM_PROMPT_TOKENS, dtype=np.uint64))


@dataclass(frozen=True)
class W4Trace:
    """The sequences of a W4 replay and its schedule: sequence ``r`` runs in lane ``lanes[r]`` from
    step ``admit_steps[r]`` for ``gen_lens[r]`` steps (the last ones may outlast the replay)."""

    prompt_lens: NDArray[np.int32]
    gen_lens: NDArray[np.int32]
    system_ids: NDArray[np.int32]  # -1: no system prompt
    lanes: NDArray[np.int32]
    admit_steps: NDArray[np.int32]
    steps: int = STEPS
    running: int = RUNNING
    block_size: int = BLOCK_SIZE
    num_blocks: int = NUM_BLOCKS

    @property
    def num_sequences(self) -> int:
        return len(self.prompt_lens)

    @property
    def sequence_steps(self) -> int:
        return self.steps * self.running

    def prompt(self, r: int) -> NDArray[np.int32]:
        length = int(self.prompt_lens[r])
        tokens = _tokens(_PROMPT, r, np.arange(length, dtype=np.uint64))
        s = int(self.system_ids[r])
        if s >= 0:
            tokens[:SYSTEM_PROMPT_TOKENS] = system_prompt(s)
        return tokens

    def generated(self, r: int) -> NDArray[np.int32]:
        return _tokens(_GENERATED, r, np.arange(int(self.gen_lens[r]), dtype=np.uint64))

    def reusable_blocks(self, r: int) -> int:
        """Most cached blocks sequence ``r`` may reuse: never the block holding its last prompt token."""
        return (int(self.prompt_lens[r]) - 1) // self.block_size

    def finishes(self, r: int) -> bool:
        """Whether sequence ``r`` runs its last step within the replay."""
        return int(self.admit_steps[r]) + int(self.gen_lens[r]) <= self.steps

    @cached_property
    def _first_admitted(self) -> NDArray[np.int64]:
        # Sequences are numbered in admission order, so those admitted before a step are a range.
        return np.searchsorted(self.admit_steps, np.arange(self.steps + 1), side="left").astype(np.int64)

    def admitted_before(self, step: int) -> range:
        """The sequences admitted before ``step``, in lane order (each replaces its lane's previous
        sequence, which finished after ``step - 1``)."""
        first = self._first_admitted
        return range(int(first[step]), int(first[step + 1]))

    def step_tokens(self) -> NDArray[np.int32]:
        """``(steps, running)`` int32: the token each lane appends at each step."""
        table = np.empty((self.steps, self.running), dtype=np.int32)
        for r in range(self.num_sequences):
            start = int(self.admit_steps[r])
            stop = min(start + int(self.gen_lens[r]), self.steps)
            table[start:stop, self.lanes[r]] = self.generated(r)[: stop - start]
        return table


def generate(steps: int = STEPS, running: int = RUNNING) -> W4Trace:
    """The W4 trace (``steps`` and ``running`` smaller for tests; the rules stay the same)."""
    if steps < 1 or running < 1:
        raise ValueError(f"steps={steps} and running={running} must both be >= 1")
    # Enough sequences for every lane to reach the last step with the shortest generations.
    bound = running * (-(-steps // GEN_MIN) + 1)
    r = np.arange(bound, dtype=np.uint64)
    shared = draw(_ATTRIBUTES, r, 0) % np.uint64(SHARED_ONE_IN) == 0
    system_ids = np.where(shared, draw(_ATTRIBUTES, r, 1) % np.uint64(NUM_SYSTEM_PROMPTS), -1).astype(np.int32)
    own = draw(_ATTRIBUTES, r, 2)
    low = np.where(shared, SYSTEM_PROMPT_TOKENS + 1, PROMPT_MIN).astype(np.uint64)
    prompt_lens = (low + own % (np.uint64(PROMPT_MAX + 1) - low)).astype(np.int32)
    gen_lens = (GEN_MIN + draw(_ATTRIBUTES, r, 3) % np.uint64(GEN_MAX - GEN_MIN + 1)).astype(np.int32)

    lanes = np.empty(bound, dtype=np.int32)
    admit_steps = np.empty(bound, dtype=np.int32)
    ends: list[tuple[int, int]] = []  # (step before which the lane frees, lane)
    for seq in range(running):
        lanes[seq], admit_steps[seq] = seq, 0
        ends.append((int(gen_lens[seq]), seq))
    heapq.heapify(ends)
    count = running
    while ends[0][0] < steps:
        step, lane = heapq.heappop(ends)
        lanes[count], admit_steps[count] = lane, step
        heapq.heappush(ends, (step + int(gen_lens[count]), lane))
        count += 1
    return W4Trace(
        prompt_lens=prompt_lens[:count],
        gen_lens=gen_lens[:count],
        system_ids=system_ids[:count],
        lanes=lanes[:count],
        admit_steps=admit_steps[:count],
        steps=steps,
        running=running,
    )


@dataclass(frozen=True)
class DecodeRun:
    """One replay's clocks (ns) and counts, whatever the library."""

    step_ns: int  # wall time inside the steps' bookkeeping
    turnover_ns: int  # admissions, each with the finish of its lane's previous sequence
    turnovers: int  # admissions (the first 256 included)
    refused: int  # sequence-steps the pool could not serve (0 in a valid replay)
    hit_tokens: int  # prompt tokens reused from the prefix cache at admission
    core_ns: int = 0  # lifecycle only: the core's own time inside the step calls


def record(
    library: str, runs: list[DecodeRun], trace: W4Trace, *, clock: str = "step_ns", note: str = ""
) -> dict[str, Any]:
    """The JSON record of ``runs`` (the best of them, the median beside it) in the shape every
    library reports for W4; a replay whose pool refused a step is no measurement."""
    refused = max(run.refused for run in runs)
    if refused:
        raise AssertionError(f"W4 {library}: the pool refused {refused} sequence-steps")
    times = [getattr(run, clock) for run in runs]
    best = min(times)
    result: dict[str, Any] = {
        "workload": "W4",
        "library": library,
        "us_per_step": round(best / trace.steps / 1e3, 3),
        "median_us_per_step": round(statistics.median(times) / trace.steps / 1e3, 3),
        "ns_per_sequence_step": round(best / trace.sequence_steps, 1),
        "us_per_turnover": round(min(run.turnover_ns for run in runs) / runs[0].turnovers / 1e3, 3),
        "steps": trace.steps,
        "running": trace.running,
        "turnovers": runs[0].turnovers,
        "hit_tokens": runs[0].hit_tokens,
        "replays": len(runs),
    }
    if note:
        result["note"] = note
    return result


if __name__ == "__main__":
    import json
    import time

    started = time.perf_counter()
    w4 = generate()
    tokens = w4.step_tokens()
    print(
        json.dumps(
            {
                "workload": "W4",
                "sequences": w4.num_sequences,
                "finished": int(sum(w4.finishes(r) for r in range(w4.num_sequences))),
                "shared": int((w4.system_ids >= 0).sum()),
                "prompt_tokens": int(w4.prompt_lens.sum()),
                "sequence_steps": w4.sequence_steps,
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
    )
