"""Save a pytest-benchmark baseline of bench/, then check a later tree against it.

    python bench/regress.py save                 # run bench/, save it as the baseline (.benchmarks/)
    python bench/regress.py check                # run bench/ again; fail if a minimum is > 25% slower
    python bench/regress.py check --threshold 40 -- bench/test_bench_prefix.py -k match

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
the whole bench/ folder runs. ``--storage DIR`` keeps the saved runs elsewhere than ``.benchmarks/``.
The check also prints pytest-benchmark's own side-by-side table of the baseline and the first run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

BASELINE_NAME = "baseline"
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
    """Benchmark full name -> minimum round (seconds per iteration) of a pytest-benchmark JSON file."""
    data = json.loads(report.read_text())
    return {bench["fullname"]: float(bench["stats"]["min"]) for bench in data["benchmarks"]}


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
    return subprocess.run(command, cwd=ROOT).returncode


def save(storage: Path, pytest_args: list[str]) -> int:
    return _run(pytest_command(storage, [f"--benchmark-save={BASELINE_NAME}"], pytest_args))


def check(
    storage: Path, baseline_file: Path, threshold: float, retries: int, pause_s: float, pytest_args: list[str]
) -> int:
    baseline = minimums(baseline_file)
    best: dict[str, float] = {}
    regressed: list[Verdict] = []
    with tempfile.TemporaryDirectory(prefix="lifecycle-bench-") as scratch:
        for attempt in range(retries + 1):
            report = Path(scratch) / f"attempt{attempt}.json"
            if attempt == 0:
                # The first run shows pytest-benchmark's table against the baseline.
                extra = [f"--benchmark-compare={baseline_file.stem.split('_')[0]}", f"--benchmark-json={report}"]
                args = pytest_args
            else:
                extra, args = [f"--benchmark-json={report}"], [v.name for v in regressed]
                print(f"\nmeasuring again ({attempt} of {retries}): {len(args)} over {threshold:g}%", flush=True)
                time.sleep(pause_s)
            status = _run(pytest_command(storage, extra, args))
            if status != 0 or not report.is_file():
                print(f"pytest failed (exit {status}); nothing compared", file=sys.stderr)
                return status or 1
            for name, seconds in minimums(report).items():
                best[name] = min(seconds, best.get(name, seconds))
            regressed = [v for v in compare(baseline, best) if v.regressed(threshold)]
            if not regressed:
                break
    verdicts = compare(baseline, best)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s {save,check} [options] [-- PYTEST ARGS]",
    )
    parser.add_argument("mode", choices=["save", "check"], help="save a baseline, or check against the newest one")
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
    parser.add_argument("--storage", type=Path, default=ROOT / ".benchmarks", help="where saved runs live")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    pytest_args = argv[split + 1 :]
    storage = args.storage.resolve()
    if args.mode == "save":
        return save(storage, pytest_args)
    baseline_file = newest_baseline(storage)
    if baseline_file is None:
        parser.error(f"no saved baseline under {storage}: run `python bench/regress.py save` on the base tree first")
    return check(storage, baseline_file, args.threshold, args.retries, args.pause, pytest_args)


if __name__ == "__main__":
    raise SystemExit(main())
