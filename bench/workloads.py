"""SPEC §7 workloads, replayed from the repository's inputs.

    python bench/workloads.py w1 --json         # W1 block churn: lifecycle (both forms) and the C free-list limit
    python bench/workloads.py w2 --json         # W2 prefix-cache replay at the core (one C call per admission/finish)
    python bench/workloads.py w2-model --json   # W2 through the HybridModel API
    python bench/workloads.py w3 --json         # W3 long-context replay at the core, with the never-evict ceiling
    python bench/workloads.py w3-model --json   # W3 through the HybridModel API
    python bench/workloads.py w2-events --json  # W2 at the core with KV events off and on (the overhead)
    python bench/workloads.py w3-events --json  # W3 likewise
    python bench/workloads.py w3-tiers --json   # W3 through the model with a host tier of 0, 1, 4, 8x the pool
    python bench/workloads.py w4 --json         # W4 decode steps: the model's and the core's step, the core's own time
    python bench/workloads.py w3-policies --json  # eviction policies beside the offline optimum (bench/policies.py)
    python bench/workloads.py w2-policies --json  # likewise on W2
    python bench/workloads.py w3-groups --json  # issue 31's presets: W3 through the core with their KV groups
    python bench/workloads.py w4-groups --json  # W4's decode steps through the core with each preset's groups

Each prints one JSON line per library measured (``--json``) or a small table. W1 and W2 read
``bench/data/traces.npz`` (see bench/data/README.md; ``--trace PATH`` names another file, compact or
in the original ``traces.npz`` format); W3 reads ``bench/data/mooncake_synthetic.jsonl.xz``
(``--trace PATH`` names another Mooncake JSONL file, plain or ``.xz``); W4 generates its trace
(bench/w4.py) and takes no ``--trace``.

``w3-groups`` prints two records per published-model preset (lifecycle/presets.py), at the budget
issue 31 measures at (half the all-full-attention footprint of 262,144 blocks of 16 tokens): W3
through a core with the preset's KV cache groups (``setup: groups``: ``us_per_request``,
``hit_tokens``, ``prompt_tokens``, its layout's ``concurrent_32k_sequences``, ``padding_waste``,
and ``cost_vs_one_group``), then W3 through one full-attention group of every KV layer at the same
budget (the hit-rate baseline and the single-group cost). ``w4-groups`` does the same for W4's
decode steps (``us_per_step``) at the budget of W4's pool had every layer full attention
(bench/groups_replay.py says how).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from traces import MOONCAKE_TRACE, TRACES  # noqa: E402

#: The traces every W1/W2 benchmark replays unless told otherwise (the repository's copy).
DEFAULT_TRACE = TRACES
Result = dict[str, Any]
WORKLOADS = (
    "w1", "w2", "w2-model", "w2-events", "w2-policies", "w3", "w3-model", "w3-events", "w3-tiers", "w3-policies",
    "w3-groups", "w4", "w4-groups",
)
#: Replays per figure: the best counts, the median is reported beside it. W3's replay lasts ~50x
#: longer than W2's, so fewer of them give as steady a minimum.
REPEATS = {"w2": 10, "w3": 5}


def run_w2(trace_path: Path, *, model: bool, repeats: int = REPEATS["w2"]) -> Result:
    """W2 through lifecycle; on the reference trace the hit tokens must equal the peers' to the
    token (another ``--trace`` has no reference figures)."""
    from replay import run
    from w2 import REFERENCE_HIT_TOKENS, REFERENCE_PROMPT_TOKENS, load_w2

    trace = load_w2(trace_path)
    record = run("W2", trace, repeats, model=model)
    reference = trace_path.resolve() == TRACES.resolve()
    if reference and (record["hit_tokens"], record["prompt_tokens"]) != (REFERENCE_HIT_TOKENS, REFERENCE_PROMPT_TOKENS):
        raise AssertionError(
            f"W2 hit {record['hit_tokens']} of {record['prompt_tokens']} prompt tokens; the peers hit "
            f"{REFERENCE_HIT_TOKENS} of {REFERENCE_PROMPT_TOKENS}"
        )
    return record


def run_w3(trace_path: Path, *, model: bool, repeats: int = REPEATS["w3"]) -> Result:
    """W3 through lifecycle, with the hit tokens of a cache that never evicts beside its own."""
    from replay import run
    from w3 import load_w3, never_evict_hit_tokens

    trace = load_w3(trace_path)
    record = run("W3", trace, repeats, model=model)
    ceiling = never_evict_hit_tokens(trace)
    if record["hit_tokens"] > ceiling:
        raise AssertionError(f"W3 hit {record['hit_tokens']} tokens, more than a cache that never evicts ({ceiling})")
    record["never_evict_hit_tokens"] = ceiling
    record["never_evict_hit_rate"] = round(ceiling / record["prompt_tokens"], 6)
    return record


def run_w4(repeats: int | None = None) -> list[Result]:
    """W4 through ``HybridModel.step`` and ``KVCacheCore.step``, and the core's own time for the
    same steps (bench/decode.py)."""
    from decode import REPEATS as W4_REPEATS
    from decode import run
    from w4 import generate

    return run(generate(), W4_REPEATS if repeats is None else repeats)


def reference_presets(blocks: int | None = None, max_model_len: int | None = None) -> dict[str, Any]:
    """Each published-model preset at issue 31's budget: half the all-full-attention footprint of
    262,144 blocks (``blocks``: the whole footprint of that many blocks instead). ``max_model_len``
    sizes the split between the groups (never below a preset's largest window or chunk)."""
    from lifecycle.presets import PUBLISHED_CONFIGS, preset, reference_kv_budget

    configs = {}
    for name in PUBLISHED_CONFIGS:
        base = preset(name)
        budget = reference_kv_budget(base) if blocks is None else base.full_attention_bytes(blocks * base.block_size)
        changes: dict[str, Any] = {"kv_budget_bytes": budget}
        if max_model_len is not None:
            spans = [group.window + group.sink_tokens for group in base.kv_groups]
            changes["max_model_len"] = max(max_model_len, *spans)
        configs[name] = base.replace(**changes)
    return configs


def run_w3_groups(trace_path: Path, repeats: int = 3) -> list[Result]:
    """Each published-model preset's groups through the core on W3 at the reference budget, and
    one full-attention group at the same budget (bench/groups_replay.py)."""
    from groups_replay import w3_groups
    from w3 import load_w3

    return w3_groups(load_w3(trace_path), reference_presets(), repeats)


def run_w4_groups(repeats: int = 3) -> list[Result]:
    """W4's decode steps through the core with each preset's groups, and with one group, at the
    budget of W4's pool had every layer full attention, the groups split for W4's longest
    sequence."""
    from groups_replay import w4_groups
    from w4 import GEN_MAX, NUM_BLOCKS, PROMPT_MAX, generate

    return w4_groups(generate(), reference_presets(NUM_BLOCKS, PROMPT_MAX + GEN_MAX), repeats)


def results(workload: str, trace: Path | None) -> list[Result]:
    if workload == "w3-groups":
        return run_w3_groups(trace or MOONCAKE_TRACE)
    if workload == "w4-groups":
        if trace is not None:
            raise SystemExit("w4-groups generates its trace (bench/w4.py); --trace does not apply")
        return run_w4_groups()
    if workload == "w1":
        from w1 import run as run_w1

        return list(run_w1(trace or TRACES))
    if workload == "w3-tiers":
        from replay import run_tiers
        from w3 import load_w3, never_evict_hit_tokens

        w3 = load_w3(trace or MOONCAKE_TRACE)
        ceiling = never_evict_hit_tokens(w3)
        records = run_tiers("W3", w3, (0, 1, 4, 8), repeats=1)
        for entry in records:
            entry["never_evict_hit_rate"] = round(ceiling / entry["prompt_tokens"], 6)
            entry["below_ceiling_points"] = round(100 * (ceiling - entry["hit_tokens"]) / entry["prompt_tokens"], 2)
        return records
    if workload.endswith("events"):
        from replay import run_events
        from w2 import load_w2
        from w3 import load_w3

        name = workload.split("-")[0]
        trace_data = load_w2(trace or TRACES) if name == "w2" else load_w3(trace or MOONCAKE_TRACE)
        return run_events(name.upper(), trace_data, REPEATS[name])
    if workload.endswith("policies"):
        from policies import load
        from policies import run as run_policies

        name = workload.split("-")[0].upper()
        return run_policies(load(name, trace or (TRACES if name == "W2" else MOONCAKE_TRACE)))
    if workload.startswith("w2"):
        return [run_w2(trace or TRACES, model=workload.endswith("model"))]
    if workload.startswith("w3"):
        return [run_w3(trace or MOONCAKE_TRACE, model=workload.endswith("model"))]
    if workload == "w4":
        if trace is not None:
            raise SystemExit("w4 generates its trace (bench/w4.py); --trace does not apply")
        return run_w4()
    raise SystemExit(f"unknown workload {workload!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=WORKLOADS)
    parser.add_argument("--json", action="store_true", help="one JSON line per library")
    parser.add_argument("--trace", type=Path, default=None, help="the trace to replay (default: the repository's)")
    args = parser.parse_args(argv)
    if args.trace is not None and not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    for result in results(args.workload, args.trace):
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("  ".join(f"{key}={value}" for key, value in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
