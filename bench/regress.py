"""Baselines of the pytest-benchmark suites of bench/: saved locally or committed per release,
checked against, and their history drawn.

    python bench/regress.py save                 # run bench/, save it as a local baseline (.benchmarks/)
    python bench/regress.py save --record        # ... and commit-ready: bench/baselines/VERSION_DATE_MACHINE.json
    python bench/regress.py check                # run bench/; fail if a minimum is > 25% slower than the
                                                 # latest committed baseline (bench/baselines/)
    python bench/regress.py check --storage .benchmarks   # ... than the newest local one instead
    python bench/regress.py check --threshold 40 -- bench/test_bench_prefix.py -k cached
    python bench/regress.py history --plot bench-history.png   # each benchmark's minimum, run by run

A committed baseline keeps, per benchmark, the statistics of its rounds (not the rounds), with the
machine it ran on (host name, CPU, cores, system, Python) and the commit: a few kilobytes a release.
Figures from another machine than the check's are compared all the same, with a note: the check is
meant for the machine the baseline was taken on.

Made for a small, shared machine whose speed wanders:

- every benchmark runs calibrated rounds (each at least ``MIN_ROUND_S`` long, so the timer's
  resolution and one interruption weigh little), at least ``MIN_ROUNDS`` of them after a warmup,
  with the cyclic GC off;
- the check compares each benchmark's *minimum* round with the baseline's: noise only ever adds
  time, so the fastest round is the figure it moves least (comparing means reported 8 false
  regressions on an unchanged tree, where minimum and median reported none);
- a benchmark over the threshold is measured again, up to ``--retries`` times, ``--pause`` seconds
  apart, and the fastest minimum of its attempts counts. The machine has slow spells of seconds in
  which every benchmark's minimum grows alike (by up to 1.9x, measured in back-to-back runs of an
  unchanged tree); one cannot fail the check, a real regression fails every attempt.

Take the baseline and the check close together on an otherwise idle machine: check out the base
commit, ``save``, check out the change, ``check``. Absolute figures drift across hours (up to 2x on
this project's development VM), which no threshold absorbs.

Arguments after ``--`` go to pytest (files, ``-k``, other ``--benchmark-*`` options); without any,
the whole bench/ folder runs; arguments that select no benchmark end in one line saying so. ``--storage
DIR`` keeps the saved runs elsewhere than ``.benchmarks/``. Against a local baseline the check also
prints pytest-benchmark's own side-by-side table of the baseline and the first run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

BASELINES = HERE / "baselines"
BASELINE_FORMAT = "lifecycle-bench-baseline/1"
BASELINE_NAME = "baseline"
STATISTICS = ("min", "median", "mean", "stddev", "rounds", "iterations")
EXIT_NO_TESTS = 5  # pytest's status when the arguments select nothing
DEFAULT_THRESHOLD_PERCENT = 25.0
DEFAULT_RETRIES = 3
DEFAULT_PAUSE_S = 5.0
MIN_ROUND_S = 0.0002
MIN_ROUNDS = 20
MAX_TIME_S = 1.0

#: The options of every run: calibrated rounds, warmup, no GC, benchmarks only, no pytest cache.
CALIBRATION = (
    f"--benchmark-min-time={MIN_ROUND_S}",
    f"--benchmark-min-rounds={MIN_ROUNDS}",
    f"--benchmark-max-time={MAX_TIME_S}",
    "--benchmark-warmup=on",
    "--benchmark-warmup-iterations=1000",
    "--benchmark-disable-gc",
    "--benchmark-only",
    "--benchmark-sort=fullname",
    "--benchmark-columns=min,median,mean,stddev,rounds,iterations",
    "-p",
    "no:cacheprovider",
    # pytest-benchmark warns "not saving anything" when no benchmark ran; the project's pytest
    # settings turn warnings into errors, which would end the run in a traceback.
    "-W",
    "default::pytest_benchmark.logger.PytestBenchmarkWarning",
)


@dataclass(frozen=True)
class Verdict:
    """One benchmark's minimum in the baseline and now (the fastest of the attempts)."""

    name: str
    baseline_s: float
    now_s: float

    @property
    def change(self) -> float:
        """Relative change of the minimum: +0.30 is 30% slower."""
        return self.now_s / self.baseline_s - 1.0

    def regressed(self, threshold_percent: float) -> bool:
        return self.change * 100.0 > threshold_percent


def minimums(report: Path) -> dict[str, float]:
    """Benchmark full name -> minimum round (seconds per iteration) of a pytest-benchmark JSON file
    or a committed baseline."""
    data = json.loads(report.read_text())
    if data.get("format") == BASELINE_FORMAT:
        return {bench["name"]: float(bench["min"]) for bench in data["benchmarks"]}
    return {bench["fullname"]: float(bench["stats"]["min"]) for bench in data["benchmarks"]}


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def machine_of(machine_info: dict[str, Any]) -> dict[str, Any]:
    """The machine a pytest-benchmark run names, as a committed baseline keeps it."""
    cpu = machine_info.get("cpu", {})
    return {
        "node": machine_info.get("node", ""),
        "cpu": cpu.get("brand_raw", machine_info.get("processor", "")),
        "cores": cpu.get("count"),
        "system": f"{machine_info.get('system', '')} {machine_info.get('release', '')}".strip(),
        "python": f"{machine_info.get('python_implementation', '')} {machine_info.get('python_version', '')}".strip(),
    }


def record(report: Path, folder: Path = BASELINES) -> Path:
    """A pytest-benchmark JSON report as a committed baseline in ``folder``
    (``VERSION_DATE_MACHINE.json``): each benchmark's statistics, the machine and the commit."""
    data = json.loads(report.read_text())
    machine = machine_of(data.get("machine_info", {}))
    commit = data.get("commit_info", {})
    baseline = {
        "format": BASELINE_FORMAT,
        "version": project_version(),
        "datetime": data["datetime"],
        "commit": {"id": commit.get("id"), "dirty": commit.get("dirty")},
        "machine": machine,
        "options": list(CALIBRATION),
        "benchmarks": [
            {"name": bench["fullname"], **{stat: bench["stats"][stat] for stat in STATISTICS}}
            for bench in sorted(data["benchmarks"], key=lambda bench: bench["fullname"])
        ],
    }
    day = str(data["datetime"])[:10].replace("-", "")
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", machine["node"] or "unknown")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{baseline['version']}_{day}_{host}.json"
    target.write_text(json.dumps(baseline, indent=1) + "\n")
    return target


def committed_baselines(folder: Path = BASELINES) -> list[tuple[Path, dict[str, Any]]]:
    """Every committed baseline under ``folder``, oldest first (by the time its run started)."""
    runs = [(path, json.loads(path.read_text())) for path in folder.glob("*.json")]
    runs = [(path, data) for path, data in runs if data.get("format") == BASELINE_FORMAT]
    return sorted(runs, key=lambda run: (str(run[1]["datetime"]), run[0].name))


def newest_committed(folder: Path = BASELINES) -> Path | None:
    runs = committed_baselines(folder)
    return runs[-1][0] if runs else None


def newest_baseline(storage: Path) -> Path | None:
    """The most recent saved baseline under ``storage`` (pytest-benchmark's NNNN_baseline.json)."""
    saved = sorted(storage.glob(f"*/*_{BASELINE_NAME}.json"), key=lambda path: (path.stat().st_mtime, path.name))
    return saved[-1] if saved else None


def compare(baseline: dict[str, float], now: dict[str, float]) -> list[Verdict]:
    """A verdict for every benchmark measured in both runs (new or unselected ones are left out)."""
    return [Verdict(name, baseline[name], now[name]) for name in sorted(now) if name in baseline]


def pytest_command(storage: Path, extra: list[str], pytest_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "pytest", *CALIBRATION, f"--benchmark-storage=file://{storage}", *extra,
        *(pytest_args or [str(HERE)]),
    ]


def _run(command: list[str]) -> int:
    print("+ " + " ".join(command), flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    if status == EXIT_NO_TESTS:
        print(
            "regress.py: the pytest arguments select no benchmark; list them with: "
            "python -m pytest --collect-only -q bench/",
            file=sys.stderr,
        )
    return status


def save(storage: Path, pytest_args: list[str], record_in: Path | None = None) -> int:
    with tempfile.TemporaryDirectory(prefix="lifecycle-bench-") as scratch:
        report = Path(scratch) / "run.json"
        extra = [f"--benchmark-save={BASELINE_NAME}", *([f"--benchmark-json={report}"] if record_in else [])]
        status = _run(pytest_command(storage, extra, pytest_args))
        if status == 0 and record_in is not None:
            print(f"recorded {record(report, record_in)} (commit it)")
        return status


def _machine_note(baseline_file: Path, report: Path) -> str | None:
    """A line when the baseline was taken on another machine than this run."""
    data = json.loads(baseline_file.read_text())
    if data.get("format") != BASELINE_FORMAT:
        return None
    then, now = data["machine"], machine_of(json.loads(report.read_text()).get("machine_info", {}))
    if (then["node"], then["cpu"]) == (now["node"], now["cpu"]):
        return None
    return (f"note: the baseline ran on {then['node']} ({then['cpu']}, {then['cores']} cores), this run on "
            f"{now['node']} ({now['cpu']}, {now['cores']} cores): a machine's figures are not another's")


def check(
    storage: Path, baseline_file: Path, threshold: float, retries: int, pause_s: float, pytest_args: list[str]
) -> int:
    baseline = minimums(baseline_file)
    local = json.loads(baseline_file.read_text()).get("format") != BASELINE_FORMAT
    note: str | None = None
    best: dict[str, float] = {}
    regressed: list[Verdict] = []
    with tempfile.TemporaryDirectory(prefix="lifecycle-bench-") as scratch:
        for attempt in range(retries + 1):
            report = Path(scratch) / f"attempt{attempt}.json"
            if attempt == 0:
                # The first run shows pytest-benchmark's table against a local baseline.
                against = [f"--benchmark-compare={baseline_file.stem.split('_')[0]}"] if local else []
                extra = [*against, f"--benchmark-json={report}"]
                args = pytest_args
            else:
                extra, args = [f"--benchmark-json={report}"], [v.name for v in regressed]
                print(f"\nmeasuring again ({attempt} of {retries}): {len(args)} over {threshold:g}%", flush=True)
                time.sleep(pause_s)
            status = _run(pytest_command(storage, extra, args))
            if status != 0 or not report.is_file():
                print(f"pytest failed (exit {status}); nothing compared", file=sys.stderr)
                return status or 1
            if attempt == 0:
                note = _machine_note(baseline_file, report)
            for name, seconds in minimums(report).items():
                best[name] = min(seconds, best.get(name, seconds))
            regressed = [v for v in compare(baseline, best) if v.regressed(threshold)]
            if not regressed:
                break
    verdicts = compare(baseline, best)
    if note:
        print(f"\n{note}")
    print(f"\nminimum vs baseline {baseline_file.name} (fail above +{threshold:g}%):")
    for verdict in verdicts:
        mark = "REGRESSED" if verdict.regressed(threshold) else "ok"
        print(
            f"  {verdict.change * 100:+7.1f}%  {verdict.baseline_s * 1e9:12.1f} ns -> "
            f"{verdict.now_s * 1e9:12.1f} ns  {mark:9}  {verdict.name}"
        )
    if not verdicts:
        print("  no benchmark of this run is in the baseline")
    failed = [v for v in verdicts if v.regressed(threshold)]
    print(f"{len(failed)} of {len(verdicts)} regressed" if failed else f"all {len(verdicts)} within the threshold")
    return 1 if failed else 0


def _short(name: str) -> str:
    """A benchmark's name without its folder and file suffix: test_bench_prefix.py::test_x[4]
    -> prefix::test_x[4]."""
    module, _, test = name.rpartition("::")
    return f"{Path(module).stem.removeprefix('test_bench_')}::{test.removeprefix('test_')}"


def history(folder: Path, plot: Path | None) -> int:
    """Print each benchmark's minimum in every committed baseline, oldest first; with ``plot``, draw
    them, one panel a benchmark."""
    runs = committed_baselines(folder)
    if not runs:
        print(f"regress.py: no committed baseline under {folder}: make one with `python bench/regress.py save "
              "--record`", file=sys.stderr)
        return 2
    labels = [f"{data['version']} {str(data['datetime'])[:10]} {data['machine']['node']}" for _, data in runs]
    series: dict[str, list[float | None]] = {}
    for index, (path, _) in enumerate(runs):
        for name, seconds in minimums(path).items():
            series.setdefault(name, [None] * len(runs))[index] = seconds
    for index, label in enumerate(labels):
        print(f"run {index}: {label} ({runs[index][0].name})")
    print("minimum ns per call, by run:")
    for name in sorted(series):
        cells = " ".join(f"{seconds * 1e9:12.1f}" if seconds is not None else f"{'-':>12}" for seconds in series[name])
        print(f"{cells}  {name}")
    if plot is not None:
        draw_history(series, labels, plot)
        print(f"plot written to {plot}")
    return 0


def draw_history(series: dict[str, list[float | None]], labels: list[str], target: Path) -> None:
    """One small panel a benchmark: its minimum (ns per call) in each committed run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(series)
    columns = min(5, len(names))
    rows = -(-len(names) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.3 * rows + 0.8), squeeze=False)
    positions = list(range(len(labels)))
    for axis, name in zip(axes.flat, names):
        points = [(x, seconds) for x, seconds in zip(positions, series[name]) if seconds is not None]
        top = max(seconds for _, seconds in points)
        unit, scale = next((u, s) for u, s in (("s", 1.0), ("ms", 1e3), ("µs", 1e6), ("ns", 1e9)) if top * s >= 1)
        axis.plot([x for x, _ in points], [seconds * scale for _, seconds in points], marker="o", linewidth=1.2)
        axis.set_title(_short(name), fontsize=7)
        axis.set_xticks(positions, [str(x) for x in positions], fontsize=7)
        axis.set_xlim(-0.5, len(labels) - 0.5)
        axis.set_ylim(bottom=0, top=top * scale * 1.25)
        axis.tick_params(axis="y", labelsize=7)
        axis.set_ylabel(f"minimum, {unit}/call", fontsize=7)
    for axis in list(axes.flat)[len(names):]:
        axis.set_visible(False)
    legend = "; ".join(f"{x}: {label}" for x, label in enumerate(labels))
    figure.suptitle(f"bench/: each benchmark's minimum, by committed run ({legend})", fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.5 / figure.get_figheight()))
    figure.savefig(target, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s {save,check,history} [options] [-- PYTEST ARGS]",
    )
    parser.add_argument(
        "mode",
        choices=["save", "check", "history"],
        help="save a baseline, check against the latest one, or print (--plot: draw) the committed ones",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD_PERCENT,
        help="check: fail when a minimum is more than this many percent slower (%(default)g)",
    )
    parser.add_argument(
        "--retries", type=int, default=DEFAULT_RETRIES, help="check: re-measurements of a slow one (%(default)d)"
    )
    parser.add_argument(
        "--pause", type=float, default=DEFAULT_PAUSE_S, help="check: seconds before a re-measurement (%(default)g)"
    )
    parser.add_argument(
        "--storage",
        type=Path,
        help="where local runs are saved (save; default .benchmarks/); check: against the newest there "
        "instead of the latest committed baseline",
    )
    parser.add_argument("--record", action="store_true", help="save: also write a committed baseline")
    parser.add_argument("--baselines", type=Path, default=BASELINES, help="the committed baselines (%(default)s)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="history: draw it (needs matplotlib)")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1 :]
    storage = (args.storage or ROOT / ".benchmarks").resolve()
    if args.mode == "history":
        return history(args.baselines, args.plot)
    if args.mode == "save":
        return save(storage, pytest_args, args.baselines if args.record else None)
    if args.storage is None:
        baseline_file = newest_committed(args.baselines)
        if baseline_file is None:
            parser.error(f"no committed baseline under {args.baselines}: run `python bench/regress.py save --record`")
    else:
        baseline_file = newest_baseline(storage)
        if baseline_file is None:
            parser.error(
                f"no saved baseline under {storage}: run `python bench/regress.py save` on the base tree first"
            )
    return check(storage, baseline_file, args.threshold, args.retries, args.pause, pytest_args)


if __name__ == "__main__":
    raise SystemExit(main())
