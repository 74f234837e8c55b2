"""Long mode of the reliability suites: the seeded random driver for a million operations (or
``--ops``), swap-record fuzzing, thread stress, and fault injection at every driver call through
the emulated CUDA driver (run in a child process, which loads the emulator as its driver).

    python bench/reliability.py --ops 1000000 --json

prints the counts docs/reliability.md reports: operations, invariant checks, bad inputs tried and
refused (by kind: ``driver.bad_by_kind``, with issue #14's unrestorable swap-outs, forged handles,
broken streams, forged record sizes and pool counts past 64 bits), refusals under pressure, swap round
trips, faults injected and survived (by kind, with the
number of driver call sites enumerated), fuzzed records rejected, leaks found. Exit status 1 if a
leak was found or a check failed (the failing check's exception propagates).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from reliability_driver import CONFIGS, Counts, fuzz_restore, run_random  # noqa: E402


def host_part(args: argparse.Namespace) -> dict[str, Any]:
    """The random driver over every configuration, then the fuzzer and the thread stress."""
    started = time.perf_counter()
    last = [started]

    def progress(counts: Counts) -> None:
        now = time.perf_counter()
        if now - last[0] >= 10 or counts.operations >= args.ops:
            last[0] = now
            rate = counts.operations / (now - started)
            print(
                f"  {counts.operations:>9,} ops, {counts.invariant_checks:,} invariant checks, "
                f"{counts.leaks} leaks, {rate:,.0f} ops/s",
                file=sys.stderr,
                flush=True,
            )

    counts = run_random(args.ops, seed=args.seed, ops_per_episode=args.episode_ops, progress=progress)
    driver_s = time.perf_counter() - started
    fuzz_started = time.perf_counter()
    fuzz = fuzz_restore(args.fuzz, seed=args.seed)
    fuzz_s = time.perf_counter() - fuzz_started
    threads = thread_part(args.thread_runs)
    return {
        "driver": {
            **counts.as_dict(),
            "seconds": round(driver_s, 1),
            "ops_per_second": round(counts.operations / driver_s) if driver_s else 0,
            "configs": sorted(CONFIGS),
        },
        "fuzz": {
            "tried": fuzz.tried,
            "rejected": fuzz.rejected,
            "accepted_resealed": fuzz.accepted,
            "by_error": dict(sorted(fuzz.by_error.items())),
            "seconds": round(fuzz_s, 1),
        },
        "threads": threads,
    }


def thread_part(runs: int) -> dict[str, Any]:
    from test_threads import hammer

    totals = {"runs": 0, "ops": 0, "invariant_checks": 0, "slot_races": 0, "refusals": 0}
    for i in range(runs):
        tally = hammer(drop_sequences=bool(i % 2), concurrent_checks=not i % 2)
        totals["runs"] += 1
        totals["ops"] += tally.ops
        totals["invariant_checks"] += tally.invariant_checks
        totals["slot_races"] += tally.slot_races
        totals["refusals"] += tally.refusals
    return totals


def fault_child(args: argparse.Namespace) -> dict[str, Any]:
    """Runs under the emulated driver: the two sweeps over every driver call, the budget sweep,
    and the soak over every configuration."""
    from devices import CUDA_ERROR_ILLEGAL_ADDRESS, CUDA_ERROR_LAUNCH_FAILED, loaded_emulator, make_device
    from lifecycle.errors import CudaError
    from lifecycle.model import HybridModel
    from reliability_driver import count_lifecycle_calls, fault_sweep, one_shot_faults, soak

    make_device().close()  # loads the driver
    emu = loaded_emulator()
    if emu is None:
        raise SystemExit("the child did not load the emulated driver")
    calls, steps = count_lifecycle_calls(emu, make_device, CONFIGS["hybrid"])
    with one_shot_faults(emu):
        transient = fault_sweep(emu, make_device, sticky=False, code=CUDA_ERROR_LAUNCH_FAILED)
    sticky = fault_sweep(emu, make_device, sticky=True, code=CUDA_ERROR_ILLEGAL_ADDRESS)

    # allocation failure past a budget: every budget below what the model needs
    dev = make_device()
    base_bytes, base_allocs = emu.live_bytes, emu.live_allocations
    m = HybridModel(CONFIGS["hybrid"], dev)
    need = emu.live_bytes - base_bytes
    m.teardown()
    budgets = refused = budget_leaks = 0
    for budget in range(0, need, max(need // 64, 1)):
        emu.set_alloc_budget(base_bytes + budget)
        budgets += 1
        try:
            HybridModel(CONFIGS["hybrid"], dev).teardown()
        except CudaError:
            refused += 1
        budget_leaks += emu.live_allocations - base_allocs
    emu.reset()
    dev.close()

    soaks: dict[str, Any] = {}
    for name in sorted(CONFIGS):
        dev = make_device()
        with one_shot_faults(emu):
            driver = soak(dev, emu, CONFIGS[name], args.fault_ops, seed=args.seed)
        dev.close()
        soaks[name] = {
            "operations": driver.counts.operations,
            "faults_injected": driver.counts.faults_injected,
            "faults_survived": driver.counts.faults_survived,
            "leaks": driver.counts.leaks,
            "invariant_checks": driver.counts.invariant_checks,
            "by_call": dict(sorted(driver.counts.faults_by_call.items())),
        }

    def sweep(result: Any) -> dict[str, Any]:
        return {
            "injected": result.calls,
            "surfaced": result.surfaced,
            "survived": result.survived,
            "broken": dict(result.broken),
            "never_surfaced": result.never_surfaced,
            "teardown_raised": result.teardown_raised,
            "leaks": result.leaks,
        }

    return {
        "driver_calls": calls,
        "call_sites": sorted({f"{step} / {call}" for step, call in transient.sites}),
        "calls_per_step": steps,
        "transient": sweep(transient),
        "sticky": sweep(sticky),
        "alloc_budget": {"budgets": budgets, "refused": refused, "leaks": budget_leaks, "model_bytes": need},
        "soak": soaks,
    }


def fault_part(args: argparse.Namespace) -> dict[str, Any]:
    from emu_cuda.build import build_emulator
    from test_device_emulated import emulated_env

    env = emulated_env(build_emulator())
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--fault-child",
        "--seed",
        str(args.seed),
        "--fault-ops",
        str(args.fault_ops),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"fault child failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def leaks_found(report: dict[str, Any]) -> int:
    total = int(report["driver"]["leaks"])
    faults = report.get("faults")
    if faults:
        total += faults["transient"]["leaks"] + faults["sticky"]["leaks"] + faults["alloc_budget"]["leaks"]
        total += sum(s["leaks"] for s in faults["soak"].values())
    return total


def print_table(report: dict[str, Any]) -> None:
    d = report["driver"]
    print(
        f"random driver: {d['operations']:,} operations over {d['episodes']} episodes "
        f"({', '.join(d['configs'])}) in {d['seconds']} s ({d['ops_per_second']:,} ops/s)"
    )
    print(
        f"  invariant checks {d['invariant_checks']:,}; bad inputs refused {d['bad_inputs']:,} "
        f"({len(d['bad_by_kind'])} kinds); "
        f"refusals under pressure {d['refusals_under_pressure']:,}; swap round trips {d['round_trips']:,}; "
        f"corrupted records refused {d['bad_records']:,}; leak checks {d['leak_checks']}; leaks {d['leaks']}"
    )
    f = report["fuzz"]
    print(
        f"fuzzed records: {f['tried']:,} tried, {f['rejected']:,} rejected {f['by_error']}, "
        f"{f['accepted_resealed']:,} accepted (resealed, valid)"
    )
    t = report["threads"]
    print(f"threads: {t['runs']} runs, {t['ops']:,} ops, {t['invariant_checks']:,} concurrent invariant checks")
    faults = report.get("faults")
    if faults:
        print(f"faults: {faults['driver_calls']} driver calls in the lifecycle, {len(faults['call_sites'])} call sites")
        for kind in ("transient", "sticky"):
            s = faults[kind]
            print(
                f"  {kind}: {s['injected']} injected, {s['surfaced']} surfaced, {s['survived']} survived, "
                f"teardown raised {s['teardown_raised']}, leaks {s['leaks']}"
            )
        b = faults["alloc_budget"]
        print(f"  allocation budget: {b['budgets']} budgets, {b['refused']} refused, leaks {b['leaks']}")
        for name, s in faults["soak"].items():
            print(
                f"  soak {name}: {s['faults_injected']} faults over {s['operations']:,} ops, "
                f"{s['faults_survived']} survived, leaks {s['leaks']}"
            )
    print(f"leaks found: {report['leaks_found']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000, help="random driver operations (default 1,000,000)")
    parser.add_argument("--episode-ops", type=int, default=2000, help="operations per model (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz", type=int, default=20_000, help="mutated swap records to restore")
    parser.add_argument("--thread-runs", type=int, default=4, help="thread stress runs")
    parser.add_argument("--fault-ops", type=int, default=5000, help="soak operations per configuration")
    parser.add_argument("--no-faults", action="store_true", help="skip the emulated-driver part")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--fault-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fault_child:
        print(json.dumps(fault_child(args)))
        return 0
    started = time.perf_counter()
    report = host_part(args)
    if not args.no_faults:
        report["faults"] = fault_part(args)
    report["leaks_found"] = leaks_found(report)
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 1 if report["leaks_found"] else 0


if __name__ == "__main__":
    sys.exit(main())
