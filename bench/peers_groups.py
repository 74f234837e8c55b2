"""Issue 31's group targets side by side: W3 and W4 per model preset for lifecycle, vLLM's hybrid
``KVCacheManager`` (and its plain one: one full-attention group) and SGLang's SWA cache (and its
``RadixCache``: one full-attention group), at the budget of bench/group_presets.py.

Run through ``python bench/peers.py --workloads w3-groups,w4-groups`` (``python bench/peers_groups.py
FILE...`` prints the table of records saved with ``--json``); the peers run in their own
environments (``peer_vllm_groups.py``, ``peer_sglang_groups.py``, whose docstrings say how each
peer's grouping and pools are set). Lifecycle's rows use the group config API (``preset(name,
kv_budget_bytes=...)``, ``ModelConfig.kv_groups``) and ``workloads.run_w3_groups`` /
``workloads.run_w4_groups`` where this build has them; where it does not, the row says so.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from group_presets import BLOCK_SIZE, CONTEXT_32K, PRESETS  # noqa: E402

UNAVAILABLE = "lifecycle: groups not available in this build"
#: The issue's earlier figures (us/request, hit tokens, 32k sequences), printed beside ours.
ISSUE_FIGURES = {
    ("gpt-oss-120b", "vllm-hybrid"): (5666, 7_270_000, 85),
    ("gpt-oss-120b", "sglang-swa"): (4789, 13_120_000, 71),
    ("gpt-oss-120b", "vllm"): (None, 11_320_000, 64),
    ("gpt-oss-120b", "sglang"): (None, 12_370_000, 64),
    ("gemma-3-27b", "vllm-hybrid"): (8692, 17_460_000, 94),
    ("llama-4-scout", "vllm-hybrid"): (10719, 13_510_000, 78),
}


def run_peer(python: Path, runner: str, args: list[str]) -> list[dict[str, Any]]:
    completed = subprocess.run(
        [str(python), "-W", "ignore", str(HERE / runner), *args], capture_output=True, text=True
    )
    if completed.returncode != 0:
        raise SystemExit(f"[peers] {runner} failed:\n{completed.stderr[-3000:]}")
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def lifecycle_memory(config: Any) -> dict[str, Any]:
    """Concurrent 32k sequences and padding from ``config.kv_groups``: a sequence needs 2,048
    blocks in a full group, ``window + sink`` tokens plus a block in a sliding one, a chunk plus a
    block in a chunked one; one pool per group at its own block size holds no padding."""
    groups = getattr(config, "kv_groups")
    counts = []
    for group in groups:
        windowed = min(CONTEXT_32K, group.window + group.sink_tokens + BLOCK_SIZE)
        tokens = CONTEXT_32K if group.kind == "full" else windowed
        counts.append(group.num_blocks // math.ceil(tokens / BLOCK_SIZE))
    placed = sum(group.num_blocks * group.block_bytes for group in groups)
    return {
        "concurrent_32k_sequences": min(counts) if counts else 0,
        "concurrent_32k_sequences_how": "computed from kv_groups' num_blocks",
        "padding_waste": 0,
        "unplaced_budget_bytes": config.kv_budget_bytes - placed if config.kv_budget_bytes else None,
        "groups": [
            {"kind": g.kind, "window": g.window, "layers": len(g.layer_indices), "num_blocks": g.num_blocks}
            for g in groups
        ],
    }


_PROJECT: dict[str, dict[str, dict[str, Any]]] = {}


def _project_records(workload: str) -> dict[str, dict[str, Any]]:
    """The project's own groups records of ``workload`` by preset (``bench/workloads.py
    w3-groups`` / ``w4-groups``, one repeat, run once per process), empty where this build has
    no such runner."""
    if workload not in _PROJECT:
        import workloads as project
        from traces import MOONCAKE_TRACE

        runner = getattr(project, "run_" + workload.replace("-", "_"), None)
        if runner is None:
            _PROJECT[workload] = {}
        else:
            found = runner(MOONCAKE_TRACE, repeats=1) if workload == "w3-groups" else runner(repeats=1)
            _PROJECT[workload] = {r["preset"]: r for r in found if r.get("setup") == "groups"}
    return _PROJECT[workload]


def lifecycle_records(
    presets: list[str], workloads: list[str], requests: int | None, w4_steps: int
) -> list[dict[str, Any]]:
    """lifecycle's rows, or a row per preset saying the build lacks groups."""
    records = []
    for name in presets:
        base = {"preset": name, "library": "lifecycle"}
        try:
            from lifecycle import preset

            config = preset(name, kv_budget_bytes=PRESETS[name].budget_bytes)
            getattr(config, "kv_groups")  # the groups API, or AttributeError
        except Exception as error:  # noqa: BLE001 - any failure here means no groups in this build
            for workload in workloads:
                records.append({**base, "workload": workload.upper(), "unavailable": UNAVAILABLE, "why": repr(error)})
            continue
        memory = lifecycle_memory(config)
        for workload in workloads:
            mine = _project_records(workload).get(name)
            if mine is None:
                records.append({**base, "workload": workload.upper(), **memory, "unavailable": UNAVAILABLE})
                continue
            records.append({**base, **memory, **mine, "workload": workload.upper()})
    return records


def run(
    envs: dict[str, Path], presets: list[str], workloads: list[str], requests: int | None, w4_steps: int, caching: str
) -> list[dict[str, Any]]:
    """Every library's records for ``presets``: lifecycle's, then vLLM's, then SGLang's."""
    common = ["--presets", ",".join(presets), *(["--requests", str(requests)] if requests else [])]
    records = lifecycle_records(presets, workloads, requests, w4_steps)
    if "vllm" in envs:
        records += run_peer(
            envs["vllm"] / "bin" / "python",
            "peer_vllm_groups.py",
            [*common, "--workloads", ",".join(workloads), "--w4-steps", str(w4_steps), "--caching", caching],
        )
    if "sglang" in envs and "w3-groups" in workloads:
        records += run_peer(envs["sglang"] / "bin" / "python", "peer_sglang_groups.py", [*common, "--caching", caching])
    return records


def _figure(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def table(records: list[dict[str, Any]]) -> str:
    """Per preset: W3 rows (us/request, hit tokens, 32k sequences, padding), the issue's earlier
    figures beside them, then W4 rows (us/step)."""
    lines: list[str] = []
    presets = list(dict.fromkeys(r["preset"] for r in records))
    for name in presets:
        preset = PRESETS[name]
        budget = f"budget {preset.budget_bytes / 2**30:,.1f} GiB, ideal 32k sequences {preset.ideal_32k_sequences()}"
        lines += ["", f"== {name}: {budget}"]
        w3 = [r for r in records if r["preset"] == name and r["workload"] == "W3-GROUPS"]
        if w3:
            lines.append(
                f"{'W3 library':<13} {'caching':<13} {'us/request':>11} {'hit tokens':>12} {'32k seqs':>9} "
                f"{'padding B':>10}   issue's earlier figures"
            )
        for r in w3:
            if "unavailable" in r or "not_served" in r:
                lines.append(f"{r['library']:<13} {r.get('unavailable') or 'not served: ' + r['not_served']}")
                continue
            earlier = ISSUE_FIGURES.get((name, r["library"]))
            note = f"{_figure(earlier[0])} us, {earlier[1] / 1e6:.2f}M, {earlier[2]}" if earlier else ""
            if "stopped_at_request" in r:
                note = f"stopped at request {r['stopped_at_request']:,} by a failed SGLang check; " + note
            sequences = _figure(r.get("concurrent_32k_sequences"))
            if r.get("concurrent_sequences_of_32767_tokens") not in (None, r.get("concurrent_32k_sequences")):
                sequences += f"/{r['concurrent_sequences_of_32767_tokens']}"  # at 32,767 tokens (chunked)
            lines.append(
                f"{r['library']:<13} {r.get('caching', '-'):<13} {_figure(r['us_per_request'], 1):>11} "
                f"{_figure(r['hit_tokens']):>12} {sequences:>9} "
                f"{_figure(r.get('padding_waste')):>10}   {note}"
            )
        w4 = [r for r in records if r["preset"] == name and r["workload"] == "W4-GROUPS"]
        if w4:
            lines.append(f"{'W4 library':<13} {'':<13} {'us/step':>11} {'ns/seq-step':>12} {'hit tokens':>11}")
        for r in w4:
            if "unavailable" in r:
                lines.append(f"{r['library']:<13} {r['unavailable']}")
                continue
            lines.append(
                f"{r['library']:<13} {'':<13} {_figure(r['us_per_step'], 1):>11} "
                f"{_figure(r['ns_per_sequence_step'], 1):>12} {_figure(r['hit_tokens']):>11}"
            )
    return "\n".join(lines).lstrip("\n")


def normalise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One workload spelling (``W3-GROUPS`` / ``W4-GROUPS``) across the runners."""
    return [{**r, "workload": r["workload"].upper()} for r in records]


if __name__ == "__main__":
    # The table of records saved with ``peers.py --json`` (or the runners' own output), one JSON line each.
    lines = [line for path in sys.argv[1:] for line in Path(path).read_text().splitlines()]
    saved = [json.loads(line) for line in lines if line.startswith("{")]
    print(table(normalise(saved)))
