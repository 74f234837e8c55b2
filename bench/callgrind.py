"""Instructions per W2 / W3 request by callgrind, at the core and through ``HybridModel``.

    python bench/callgrind.py                 # W2 and W3, core and model
    python bench/callgrind.py --workloads w2  # W2 alone
    python bench/callgrind.py --workloads w3-groups --presets gemma-3-27b,llama-4-scout
                                              # W3 chunked through a preset's groups and one group
    python bench/callgrind.py --workloads w3-events  # W3 at the core, KV events off and on
    python bench/callgrind.py --workloads w4-groups --presets gemma-3-27b
                                              # W4's decode steps through a preset's groups and one group
    python bench/callgrind.py --workloads w3 --libraries core --eviction-policy lru,branch-lru
                                              # the core under each eviction policy, and their ratio

Each figure is one run of this script under ``valgrind --tool=callgrind`` that builds the trace's
requests and the core (or model), then replays them (``bench/replay.py``'s loops) inside the one C
function callgrind collects in; the count over the request count is the replay's cost per request
(imports, preparation and teardown count nothing, so the figure is steady to a few instructions).
``w3-groups`` replays W3 as bench/groups_replay.py does (prefilled in chunks) through the core
with a preset's KV cache groups ("groups") and with one full-attention group at the same budget
("one"). ``w2-events`` / ``w3-events`` replay the trace at the core with KV events off ("off")
and on ("on", drained after every request, as ``bench/workloads.py w3-events`` times it);
``w4-groups`` replays W4 as ``bench/workloads.py w4-groups`` does (bench/groups_replay.py's
``w4_replay``) and counts only inside ``KVCacheCore.step`` (callgrind toggles at its wrapper), so
its figure is instructions per decode step, admissions and finishes left out as the timed replay
leaves them out. ``--keep DIR`` leaves each run's callgrind file there for ``callgrind_annotate``.
Valgrind runs the real interpreter (``sys.executable``, not a pyenv shim) with the cyclic GC off, as
the timed replays run.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def child(workload: str, library: str) -> None:
    """The measured process: prepare, replay, exit at once."""
    from replay import PrefixTrace, core_requests, drive_core, drive_core_events, drive_model, model_requests, new_model

    if workload.startswith("w3-groups:"):
        child_groups(workload.split(":", 1)[1], library)
        return
    if workload.startswith("w4-groups:"):
        child_w4_groups(workload.split(":", 1)[1], library)
        return
    trace: PrefixTrace
    if workload.startswith("w2"):
        from traces import TRACES
        from w2 import load_w2

        trace = load_w2(TRACES)
    else:
        from w3 import load_w3

        trace = load_w3()
    gc.collect()
    gc.disable()
    if library.startswith("core") or library in ("off", "on"):
        from lifecycle._blockpool import BlockPool
        from lifecycle._kvcache import KVCacheCore

        policy = library.split("@", 1)[1] if "@" in library else "lru"
        core = KVCacheCore(
            BlockPool(trace.num_blocks), trace.block_size, events=library == "on", eviction_policy=policy
        )
        requests = core_requests(trace)
        if library == "on":
            counted(lambda: drive_core_events(core, requests, trace.max_live))
        else:
            counted(lambda: drive_core(core, requests, trace.max_live))
    else:
        model = new_model(trace)
        model_reqs = model_requests(trace)
        counted(lambda: drive_model(model, model_reqs, trace.max_live))
    print(trace.num_requests, flush=True)
    os._exit(0)


def child_groups(preset: str, library: str) -> None:
    """The measured process of ``w3-groups``: ``preset``'s groups ("groups") or one group ("one")."""
    from groups_replay import chunked_requests, drive_chunked, new_core, one_group_blocks
    from w3 import load_w3
    from workloads import reference_presets

    trace = load_w3()
    config = reference_presets()[preset]
    if library == "groups":
        core = new_core(trace, config, 0)
    else:
        core = new_core(trace, None, one_group_blocks(config, config.memory_plan().budget_bytes))
    requests = chunked_requests(trace)
    gc.collect()
    gc.disable()
    counted(lambda: drive_chunked(core, requests, trace.max_live))
    print(trace.num_requests, flush=True)
    os._exit(0)


def child_w4_groups(preset: str, library: str) -> None:
    """The measured process of ``w4-groups``: W4's steps through ``preset``'s groups ("groups") or
    one group ("one"); callgrind collects inside ``KVCacheCore.step`` alone."""
    from groups_replay import one_group_blocks, w4_replay
    from w4 import GEN_MAX, NUM_BLOCKS, PROMPT_MAX, generate
    from workloads import reference_presets

    trace = generate()
    config = reference_presets(NUM_BLOCKS, PROMPT_MAX + GEN_MAX)[preset]
    tokens_by_step = trace.step_tokens()
    gc.collect()
    gc.disable()
    if library == "groups":
        w4_replay(trace, config, 0, tokens_by_step)
    else:
        w4_replay(trace, None, one_group_blocks(config, config.memory_plan().budget_bytes), tokens_by_step)
    print(trace.steps, flush=True)
    os._exit(0)


#: Where callgrind collects in a W4 run: the wrapper of ``KVCacheCore.step`` (Cython numbers it).
STEP_WRAPPER = "__pyx_pw_9lifecycle_8_kvcache_11KVCacheCore_*step"


def counted(call: Callable[[], object]) -> None:
    """Run ``call`` inside ``math.fsum``, the one C function callgrind collects in (nothing else
    this process runs calls it), so that imports and preparation count nothing."""

    def once() -> Iterator[float]:
        call()
        yield 0.0

    math.fsum(once())


def instructions(workload: str, library: str, keep: Path | None = None) -> tuple[int, int]:
    """Instructions callgrind counted for one run of :func:`child`, and the trace's request count
    (``w4-groups``: its step count)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            out = keep / f"callgrind.{workload.replace(':', '.')}.{library.replace('@', '.')}"
        toggle = STEP_WRAPPER if workload.startswith("w4-groups:") else "math_fsum"
        command = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={toggle}",
            f"--callgrind-out-file={out}", sys.executable, __file__,
            "--child", workload, library,
        ]
        env = dict(os.environ, PYTHONPATH=str(HERE.parent), PYTHONHASHSEED="0")
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        match = re.search(r"Collected : (\d+)", result.stderr)
        if match is None:
            raise RuntimeError(f"no instruction count in callgrind's output:\n{result.stderr[-2000:]}")
        return int(match.group(1)), int(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="w2,w3")
    parser.add_argument(
        "--libraries", default=None, help="core,model (w3-groups, w4-groups: groups,one; w3-events: off,on)"
    )
    parser.add_argument(
        "--presets", default="gemma-3-27b,llama-4-scout", help="w3-groups, w4-groups: presets to replay"
    )
    parser.add_argument("--keep", type=Path, default=None, help="a folder to leave the callgrind files in")
    parser.add_argument(
        "--eviction-policy", default="lru",
        help="the core's eviction policies to count, comma-separated (lru, branch-lru); the core library only",
    )
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "LIBRARY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1])
        return
    workloads = []
    for workload in args.workloads.split(","):
        if workload in ("w3-groups", "w4-groups"):
            workloads += [f"{workload}:{preset}" for preset in args.presets.split(",")]
        else:
            workloads.append(workload)
    for workload in workloads:
        grouped = workload.startswith(("w3-groups:", "w4-groups:"))
        unit = "step" if workload.startswith("w4-groups:") else "request"
        logged = workload.endswith("-events")
        libraries = args.libraries or ("groups,one" if grouped else "off,on" if logged else "core,model")
        per: dict[str, float] = {}
        policies = args.eviction_policy.split(",")
        runs = []
        for library in libraries.split(","):
            if library == "core" and not grouped:
                runs += ["core" if policy == "lru" else f"core@{policy}" for policy in policies]
            else:
                runs.append(library)
        for library in runs:
            total, requests = instructions(workload, library, args.keep)
            per[library] = total / requests
            print(f"{workload} {library}: {per[library]:,.0f} instructions per {unit}", flush=True)
        for library in runs:
            if library.startswith("core@") and "core" in per:
                print(f"{workload} {library}/core: {per[library] / per['core']:.3f}x", flush=True)
        if "core" in per and "model" in per:
            print(f"{workload} model/core: {per['model'] / per['core']:.3f}x", flush=True)
        if "groups" in per and "one" in per:
            print(f"{workload} groups/one: {per['groups'] / per['one']:.3f}x", flush=True)
        if "off" in per and "on" in per:
            print(f"{workload} on/off: {per['on'] / per['off']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
