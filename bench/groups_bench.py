"""W3 through the KV cache core with one KV cache group and with two, side by side.

    python bench/groups_bench.py --json               # one record per setup
    python bench/groups_bench.py --repeats 3 --limit 2000

The two-group core has gpt-oss's shape: its full-attention layers in group 0 and as many
sliding-window layers (a window of 128 tokens) in group 1, so a block of either group holds the same
bytes and both pools get the trace's block count. The replay is ``replay.replay_core``'s: requests
in order, ``admit`` (the prefix every group can serve, the rest allocated) and ``finish`` (each group
cached by its rule: the window group keeps its last window and the windows before its checkpoints).
Each record: ``us_per_request`` (best of the replays), ``hit_tokens``, the window group's cached and
free blocks at the end, and for the two-group core its cost relative to the one-group core's.
``--decode`` adds the decode step's cost (``KVCacheCore.step`` over a batch of sequences, which with
two groups also releases the window blocks each step leaves behind), per sequence-step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from replay import PrefixTrace, replay_core  # noqa: E402
from w2 import no_gc  # noqa: E402

WINDOW = 128


def replay(trace: PrefixTrace, *, groups: bool, retention: int | None = None) -> tuple[float, int, dict[str, Any]]:
    """One timed replay on fresh pools: (seconds, hit tokens, the last group's stats)."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    pool = BlockPool(trace.num_blocks)
    extra: list[tuple[str, int, int, BlockPool]] | None = (
        [("sliding_window", WINDOW, 0, BlockPool(trace.num_blocks))] if groups else None
    )
    core = KVCacheCore(pool, trace.block_size, groups=extra, retention_interval=retention)
    seconds, hits, _ = replay_core(trace, core=core)
    return seconds, hits, core.group_stats()[-1]


def decode(*, groups: bool, batch: int = 64, prompt: int = 2048, steps: int = 512,
           block_size: int = 16) -> float:
    """Seconds per sequence-step of ``steps`` decode steps over ``batch`` sequences of ``prompt``
    tokens (distinct prompts, no cache hits)."""
    import numpy as np

    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    blocks = batch * ((prompt + steps) // block_size + 2)
    extra = [("sliding_window", WINDOW, 0, BlockPool(blocks))] if groups else None
    core = KVCacheCore(BlockPool(blocks), block_size, groups=extra)
    handles = np.array([
        core.admit(np.arange(i * prompt, (i + 1) * prompt, dtype=np.int32) % 50000, prompt // block_size + 1)
        for i in range(batch)
    ], dtype=np.int64)
    tokens = np.ones(batch, dtype=np.int32)
    step = core.step
    with no_gc():
        start = time.perf_counter()
        for _ in range(steps):
            step(handles, tokens)
        seconds = time.perf_counter() - start
    core.check_invariants()
    return seconds / (batch * steps)


def run(trace: PrefixTrace, repeats: int) -> list[dict[str, Any]]:
    """The one-group and the two-group core, replays interleaved (a noisy machine's drift hits both)."""
    runs: dict[bool, list[tuple[float, int, dict[str, Any]]]] = {False: [], True: []}
    for _ in range(repeats):
        for groups in (False, True):
            runs[groups].append(replay(trace, groups=groups))
    records = []
    for groups, name in ((False, "one group (full attention)"), (True, f"two groups (full + sliding window {WINDOW})")):
        best = min(r[0] for r in runs[groups])
        last = runs[groups][0][2]
        records.append({
            "workload": "W3-groups-core",
            "setup": name,
            "us_per_request": round(best / trace.num_requests * 1e6, 3),
            "hit_tokens": runs[groups][0][1],
            "prompt_tokens": sum(trace.prompt_lens),
            "last_group_cached_blocks": last["num_cached"],
            "last_group_free_blocks": last["num_free"],
            "replays": repeats,
        })
    records[1]["cost_vs_one_group"] = round(records[1]["us_per_request"] / records[0]["us_per_request"], 3)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="one JSON line per setup")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first LIMIT requests")
    parser.add_argument("--decode", action="store_true", help="also the decode step's cost per sequence-step")
    args = parser.parse_args(argv)
    from w3 import load_w3

    trace = load_w3(limit=args.limit)
    records = run(trace, args.repeats)
    if args.decode:
        best = {g: min(decode(groups=g) for _ in range(args.repeats)) for g in (False, True)}
        for g in (False, True):
            records.append({
                "workload": "decode-steps-core", "setup": "two groups" if g else "one group",
                "us_per_sequence_step": round(best[g] * 1e6, 4),
                **({"cost_vs_one_group": round(best[True] / best[False], 3)} if g else {}),
            })
    for entry in records:
        print(json.dumps(entry) if args.json else "  ".join(f"{k}={v}" for k, v in entry.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
