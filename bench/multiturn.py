"""Hybrid prefix caching on a multi-turn chat workload (issue: SSM snapshots at cached prefix ends).

One seeded trace of multi-turn chats (each turn's prompt extends the previous turn's prompt and
response) runs through ``lifecycle.simulate`` three times:

- ``hybrid+snapshots``: the small-hybrid preset with its SSM snapshot pool;
- ``hybrid-no-snapshots``: the same model without snapshots (a hybrid lookup needs the SSM state
  at the reused point, so nothing is reusable);
- ``attention-only``: the same attention layers and pool without the SSM layers.

It prints the prefix hit rate of each (hit tokens / looked-up prompt tokens) and the gap between
the hybrid model with snapshots and the attention-only one (target: within 5 points).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

from lifecycle import AttentionLayer, HybridModel, ModelConfig, preset  # noqa: E402
from lifecycle.simulate import SimulationOptions, simulate, trace_for_model  # noqa: E402


def configs(num_blocks: int, num_snapshots: int) -> dict[str, ModelConfig]:
    hybrid = preset("small-hybrid", num_blocks=num_blocks, num_snapshots=num_snapshots)
    attention = tuple(layer for layer in hybrid.layers if isinstance(layer, AttentionLayer))
    return {
        "hybrid+snapshots": hybrid,
        "hybrid-no-snapshots": hybrid.replace(num_snapshots=0),
        "attention-only": hybrid.replace(layers=attention, num_snapshots=0, name="small-attention"),
    }


def run(requests: int, turns: int, seed: int, num_blocks: int, num_snapshots: int) -> list[dict[str, Any]]:
    models = configs(num_blocks, num_snapshots)
    trace = trace_for_model(models["hybrid+snapshots"], seed=seed, num_requests=requests, turns=turns)
    options = SimulationOptions(check_every=0)
    results = []
    for name, config in models.items():
        summary = simulate(HybridModel(config, "host"), trace, options).summary
        results.append(
            {
                "workload": "multi-turn",
                "model": name,
                "requests": summary.requests,
                "hit_rate": round(summary.prefix_hit_rate, 4),
                "hit_tokens": summary.prefix_hit_tokens,
                "snapshots_saved": summary.snapshots_saved,
                "snapshot_hits": summary.snapshot_hits,
                "leaked": summary.leaked,
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--snapshots", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = run(args.requests, args.turns, args.seed, args.blocks, args.snapshots)
    rates = {r["model"]: r["hit_rate"] for r in results}
    gap = (rates["attention-only"] - rates["hybrid+snapshots"]) * 100
    for record in results:
        print(json.dumps(record) if args.json else f"{record['model']:<22} hit rate {record['hit_rate']:.2%}")
    summary = {"workload": "multi-turn", "gap_points": round(gap, 2), "target_points": 5.0}
    gap_line = f"attention-only minus hybrid+snapshots: {gap:.2f} points (target <= 5)"
    print(json.dumps(summary) if args.json else gap_line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
