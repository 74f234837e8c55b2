"""W1, W2, W3 and W4 for lifecycle, vLLM and SGLang, side by side in one run (SPEC §7). Not part of CI.

    python bench/peers.py              # install the peers if needed, run, print one table
    python bench/peers.py --json       # one JSON line per (workload, library)
    python bench/peers.py --workloads w4   # W4 alone (any comma-separated subset of w1,w2,w3,w4)
    python bench/peers.py --no-adapters    # without W2/W3 through lifecycle's drop-in adapters
    python bench/peers.py --workloads w3-groups,w4-groups   # issue 31's model presets (peers_groups.py)

Each peer gets its own virtual environment under ``bench/.venv-peers/`` (ignored by git) with
CPU-only torch and no GPU dependency: torch is pinned to the local CPU wheel by a constraints file
(``torch==2.13.0`` resolves to /opt/wheels' ``+cpu`` build, so pip never pulls a CUDA build), the
peer itself is installed with ``--no-deps``, and only the packages that its block pool / radix tree
modules import come next to it (listed below with the versions measured; vLLM's also has what its
``Scheduler`` needs to run on a model config without weights, SGLang's what its schedule policy
imports, for the adapters' scheduler tests).

The peers run from ``peer_vllm.py`` and ``peer_sglang.py`` inside their environments, replaying the
same traces by the same rules as ``w2.py`` (hit tokens are checked against the reference there) and
the same decode trace as ``w4.py`` (W4: the step's bookkeeping per step and per sequence-step, each
peer's ratio to lifecycle's batched call from Python and to its core call). With W2 or W3 chosen,
each peer's environment also replays them through lifecycle's drop-in adapter for that engine
beside the engine's own classes (``peer_adapters.py``), listed in a table of their own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from traces import MOONCAKE_TRACE  # noqa: E402
from workloads import DEFAULT_TRACE  # noqa: E402

VENVS = HERE / ".venv-peers"
WORKLOADS = ("w1", "w2", "w3", "w4")
GROUP_WORKLOADS = ("w3-groups", "w4-groups")
TORCH = "torch==2.13.0"


@dataclass(frozen=True)
class Peer:
    name: str
    package: str
    runner: str
    deps: tuple[str, ...]
    probe: str  # the imports the runner needs, checked after installing


PEERS = {
    "vllm": Peer(
        name="vllm",
        package="vllm==0.33.0",
        runner="peer_vllm.py",
        deps=(
            "aiohttp==3.14.5", "cachetools==8.0.2", "cbor2==6.3.0", "cloudpickle==3.1.3", "einops==0.8.2",
            "fastapi==0.165.0", "llguidance==1.9.1", "msgspec==0.22.0", "openai-harmony==0.0.8",
            "openai==3.57.0", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0",
            "prometheus-client==0.26.0", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
            "pyzmq==27.3.0", "requests==2.34.2", "uvloop==0.23.0", "xgrammar==0.2.9",
        ),
        probe="from vllm.v1.core.block_pool import BlockPool; from vllm.utils.hashing import get_hash_fn_by_name",
    ),
    "sglang": Peer(
        name="sglang",
        package="sglang==0.5.23",
        runner="peer_sglang.py",
        deps=(
            "aiohttp==3.14.5", "apache-tvm-ffi==0.1.11", "compressed-tensors==0.20.1", "dill==0.4.1",
            "gguf==0.19.0", "ipython==9.18.1", "msgspec==0.22.0", "openai==3.57.0", "orjson==3.13.0",
            "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0", "pybase64==1.5.1", "pyzmq==27.3.0",
            "sentencepiece==0.2.3", "starlette==1.10.0", "triton==3.9.0",
        ),
        probe=(
            "import sys; sys.path.insert(0, {here!r}); from peer_common import stub_torchvision; "
            "stub_torchvision(); from sglang.srt.mem_cache.radix_cache import RadixCache; "
            "from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator"
        ),
    ),
}


def _python(env: Path) -> Path:
    return env / "bin" / "python"


def _pip(env: Path, *args: str) -> None:
    command = [str(_python(env)), "-m", "pip", "install", "-q", "-c", str(env / "constraints.txt"), *args]
    print(f"[peers] {' '.join(command[2:])}", file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def ensure_peer(peer: Peer) -> Path:
    """The peer's virtual environment, created and filled unless it already matches the spec."""
    env = VENVS / peer.name
    marker = env / "lifecycle-peer.json"
    spec = {"package": peer.package, "torch": TORCH, "deps": list(peer.deps)}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return env
    print(f"[peers] creating {env}", file=sys.stderr, flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    (env / "constraints.txt").write_text(f"{TORCH}\n")
    _pip(env, TORCH, "numpy")
    _pip(env, *peer.deps)
    _pip(env, "--no-deps", peer.package)
    probe = subprocess.run(
        [str(_python(env)), "-c", peer.probe.format(here=str(HERE))], capture_output=True, text=True
    )
    if probe.returncode != 0:
        raise SystemExit(
            f"[peers] {peer.package} installed but its modules do not import:\n{probe.stderr[-3000:]}"
        )
    marker.write_text(json.dumps(spec))
    return env


def run_peer(
    peer: Peer, env: Path, trace: Path, repeats: int, w3_repeats: int, w4_repeats: int, workloads: list[str]
) -> list[dict[str, Any]]:
    completed = subprocess.run(
        [
            str(_python(env)), "-W", "ignore", str(HERE / peer.runner), str(trace),
            "--repeats", str(repeats), "--w3-repeats", str(w3_repeats), "--w4-repeats", str(w4_repeats),
            "--workloads", ",".join(workloads),
        ],
        capture_output=True,
        text=True,
    )
    if completed.returncode != 0:
        raise SystemExit(f"[peers] {peer.runner} failed:\n{completed.stderr[-3000:]}")
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def run_adapters(
    peer: Peer, env: Path, trace: Path, repeats: int, w3_repeats: int, w4_repeats: int, workloads: list[str]
) -> list[dict[str, Any]]:
    """W2/W3/W4 through lifecycle's adapter for ``peer`` and through the engine's own classes, in the
    peer's environment (lifecycle imported from the checkout, its dependencies from this
    interpreter's site-packages)."""
    chosen = [name for name in workloads if name in ("w2", "w3", "w4")]
    if not chosen:
        return []
    paths = sysconfig.get_paths()
    site = [arg for path in sorted({paths["purelib"], paths["platlib"]}) for arg in ("--site", path)]
    completed = subprocess.run(
        [
            str(_python(env)), "-W", "ignore", str(HERE / "peer_adapters.py"), peer.name, str(trace), *site,
            "--repeats", str(repeats), "--w3-repeats", str(w3_repeats), "--w4-repeats", str(w4_repeats),
            "--workloads", ",".join(chosen),
        ],
        capture_output=True,
        text=True,
    )
    if completed.returncode != 0:
        raise SystemExit(f"[peers] peer_adapters.py {peer.name} failed:\n{completed.stderr[-3000:]}")
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def adapters_table(rows: list[dict[str, Any]]) -> list[str]:
    """Each engine's own classes beside lifecycle's adapter for it: W2/W3 per request (whole replay
    and time inside the cache calls), W4 per step; best of the repeats, and the adapter's speedups."""
    lines: list[str] = []
    requests = [r for r in rows if r["workload"] != "W4"]
    if requests:
        lines += [
            "",
            f"{'workload':<9} {'library':<17} {'us/request':>11} {'cache us/request':>17} {'hit tokens':>11}"
            "  speedup (whole / cache calls)",
        ]
        for r in requests:
            speedup = r.get("speedup")
            ratio = f"{speedup['us_per_request']:.1f}x / {speedup['cache_us_per_request']:.1f}x" if speedup else ""
            lines.append(
                f"{r['workload']:<9} {r['library']:<17} {r['us_per_request']:>11} {r['cache_us_per_request']:>17} "
                f"{r['hit_tokens']:>11}  {ratio}"
            )
    steps = [r for r in rows if r["workload"] == "W4"]
    if steps:
        lines += ["", f"{'workload':<9} {'library':<17} {'us/step':>11} {'hit tokens':>11}  speedup"]
        for r in steps:
            ratio = f"{r['speedup']['us_per_step']:.1f}x" if "speedup" in r else ""
            lines.append(f"{r['workload']:<9} {r['library']:<17} {r['us_per_step']:>11} {r['hit_tokens']:>11}  {ratio}")
    return lines


def run_lifecycle_w1(trace: Path) -> list[dict[str, Any]]:
    """W1 for lifecycle (both forms) and its limit, a plain C free-list loop."""
    from w1 import run as run_w1

    return list(run_w1(trace))


def run_lifecycle(trace: Path, workloads: list[str]) -> list[dict[str, Any]]:
    """One window of lifecycle's W2 and W3 replays (at the core and through HybridModel) and W4,
    those of ``workloads``."""
    from workloads import run_w2, run_w3, run_w4

    records = []
    if "w2" in workloads:
        records += [run_w2(trace, model=False), run_w2(trace, model=True)]
    if "w3" in workloads:
        records += [run_w3(MOONCAKE_TRACE, model=False), run_w3(MOONCAKE_TRACE, model=True)]
    if "w4" in workloads:
        records += run_w4()
    return records


def figure_key(record: dict[str, Any]) -> str:
    """The key of a record's figure (lower is better): per request for W1-W3, per step for W4."""
    return "us_per_step" if record["workload"] == "W4" else "us_per_request"


def best_windows(windows: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (workload, library), the record of its fastest window, with every window's figure beside it."""
    best: dict[tuple[str, str], dict[str, Any]] = {}
    seen: dict[tuple[str, str], list[float]] = {}
    for window in windows:
        for record in window:
            key, figure = (record["workload"], record["library"]), figure_key(record)
            seen.setdefault(key, []).append(record[figure])
            if key not in best or record[figure] < best[key][figure]:
                best[key] = record
    return [{**record, "windows_" + figure_key(record): seen[key]} for key, record in best.items()]


def table(results: list[dict[str, Any]]) -> str:
    """W1 per library, then W2 and W3 side by side with each peer's ratio to lifecycle's core, then W4."""
    lines: list[str] = []
    for record in results:
        if record["workload"] == "W1":
            lines += [] if lines else [f"{'library':<17} {'W1 ns/block':>12}"]
            lines.append(f"{record['library']:<17} {record['ns_per_block']:>12}")
    for workload in ("W2", "W3"):
        rows = [r for r in results if r["workload"] == workload]
        if not rows:
            continue
        ours = next((r["us_per_request"] for r in rows if r["library"] == "lifecycle"), None)
        header = f"{'library':<17} {workload + ' us/request':>14} {'hit rate':>9} {'hit tokens':>11} {'evicted':>9}"
        lines += ["", header + "  vs lifecycle"]
        for r in rows:
            ratio = f"{r['us_per_request'] / ours:.1f}x" if ours and r["library"] != "lifecycle" else ""
            lines.append(
                f"{r['library']:<17} {r['us_per_request']:>14} {r['hit_rate'] * 100:>8.3f}% {r['hit_tokens']:>11} "
                f"{r['blocks_evicted']:>9}  {ratio}"
            )
        ceiling = next((r["never_evict_hit_tokens"] for r in rows if "never_evict_hit_tokens" in r), None)
        if ceiling is not None:
            prompt_tokens = rows[0]["prompt_tokens"]
            lines.append(f"{'never-evict':<17} {'-':>14} {ceiling / prompt_tokens * 100:>8.3f}% {ceiling:>11}")
    lines += w4_table([r for r in results if r["workload"] == "W4"])
    return "\n".join(lines).lstrip("\n")


def w4_table(rows: list[dict[str, Any]]) -> list[str]:
    """W4 per step and per sequence-step; each row's ratio to lifecycle's batched call from Python
    (``lifecycle-model``) and to its core call (``lifecycle``)."""
    if not rows:
        return []
    by_library = {r["library"]: r["us_per_step"] for r in rows}
    model, core = by_library.get("lifecycle-model"), by_library.get("lifecycle")
    lines = [
        "",
        f"{'library':<20} {'W4 us/step':>11} {'ns/seq-step':>12} {'us/turnover':>12} {'hit tokens':>11}"
        "  vs lifecycle-model  vs lifecycle",
    ]
    for r in rows:
        ratios = [f"{r['us_per_step'] / ours:.2f}x" if ours else "-" for ours in (model, core)]
        lines.append(
            f"{r['library']:<20} {r['us_per_step']:>11} {r['ns_per_sequence_step']:>12} "
            f"{r.get('us_per_turnover', '-'):>12} "
            f"{r['hit_tokens']:>11}  {ratios[0]:>18}  {ratios[1]:>12}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON line per (workload, library)")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--peers", default="vllm,sglang", help="comma-separated subset of vllm,sglang")
    parser.add_argument("--repeats", type=int, default=3, help="W1/W2 replays per peer, the best counts")
    parser.add_argument("--w3-repeats", type=int, default=1, help="W3 replays per peer (each lasts seconds to minutes)")
    parser.add_argument("--w4-repeats", type=int, default=1, help="W4 replays per peer (each lasts a minute or more)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of w1,w2,w3,w4")
    parser.add_argument("--no-adapters", action="store_true", help="skip W2/W3 through the drop-in adapters")
    parser.add_argument("--presets", default=None, help="w3-groups/w4-groups: comma-separated model presets")
    parser.add_argument("--requests", type=int, default=None, help="w3-groups: the first N requests of the trace")
    parser.add_argument("--w4-steps", type=int, default=2000, help="w4-groups: decode steps of the W4 trace")
    parser.add_argument(
        "--caching", default="as-scheduled,at-finish", help="w3-groups: when the peers cache (see peers_groups.py)"
    )
    args = parser.parse_args(argv)
    requested = [name for name in args.workloads.split(",") if name]
    if not requested or not set(requested) <= set(WORKLOADS + GROUP_WORKLOADS):
        parser.error(f"--workloads {args.workloads!r}: choose among {','.join(WORKLOADS + GROUP_WORKLOADS)}")
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file")
    chosen = [PEERS[name] for name in args.peers.split(",") if name]
    envs = {peer.name: ensure_peer(peer) for peer in chosen}
    groups = [name for name in requested if name in GROUP_WORKLOADS]
    workloads = [name for name in requested if name in WORKLOADS]
    if groups:
        from group_presets import DEFAULT_PRESETS
        from peers_groups import normalise, run as run_groups, table as groups_table

        presets = args.presets.split(",") if args.presets else list(DEFAULT_PRESETS)
        group_records = normalise(run_groups(envs, presets, groups, args.requests, args.w4_steps, args.caching))
        if args.json:
            for record in group_records:
                print(json.dumps(record), flush=True)
        else:
            print(groups_table(group_records), flush=True)
        if not workloads:
            return 0
    # lifecycle's window of replays lasts seconds, a peer's minutes: one slow spell of this shared
    # machine can cover all of ours. So its replays run before the peers and again after each of
    # them, and its fastest window counts (each window's figure is kept in the JSON record).
    results = run_lifecycle_w1(args.trace) if "w1" in workloads else []
    windows = [run_lifecycle(args.trace, workloads)]
    peer_results: list[dict[str, Any]] = []
    adapter_results: list[dict[str, Any]] = []
    for peer in chosen:
        peer_results += run_peer(
            peer, envs[peer.name], args.trace, args.repeats, args.w3_repeats, args.w4_repeats, workloads
        )
        if not args.no_adapters:
            adapter_results += run_adapters(
                peer, envs[peer.name], args.trace, args.repeats, args.w3_repeats, args.w4_repeats, workloads
            )
        windows.append(run_lifecycle(args.trace, workloads))
    results += best_windows(windows) + peer_results
    for workload in ("W2", "W3", "W4"):
        ours = [r for r in results if r["workload"] == workload and r["library"].startswith("lifecycle")]
        best_peer = max((r["hit_tokens"] for r in peer_results if r["workload"] == workload), default=0)
        if any(r["hit_tokens"] < best_peer for r in ours):
            raise SystemExit(f"{workload}: lifecycle hit fewer tokens than a peer ({best_peer})")
    if args.json:
        for record in results + adapter_results:
            print(json.dumps(record), flush=True)
    else:
        print("\n".join([table(results), *adapters_table(adapter_results)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
