"""The benchmark baseline/check workflow of bench/regress.py, run end to end on one tiny benchmark.

The end-to-end check uses a wide threshold: it proves the workflow runs (save, compare, verdict) in
CI, right after the rest of the suite on a small machine, where a 25% threshold is a human's call to
make on an idle one. That a check can fail is shown on a doctored baseline ten times faster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import regress  # noqa: E402

BENCH = "bench/test_bench_blockpool.py::test_share_then_release[16]"
QUICK = ["--benchmark-max-time=0.1", "--benchmark-min-rounds=5"]


def run_regress(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(ROOT / "bench" / "regress.py"), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    storage = tmp_path_factory.mktemp("benchmarks")
    result = run_regress("save", "--storage", str(storage), "--", BENCH, *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    return storage


def test_save_writes_one_baseline_with_the_benchmark(saved: Path) -> None:
    baseline = regress.newest_baseline(saved)
    assert baseline is not None
    assert list(regress.minimums(baseline)) == [BENCH]


def test_an_unchanged_tree_passes_the_check(saved: Path) -> None:
    result = run_regress("check", "--storage", str(saved), "--threshold", "100", "--pause", "1", "--", BENCH, *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 1 within the threshold" in result.stdout


def test_a_real_regression_fails_the_check(saved: Path, tmp_path: Path) -> None:
    storage = tmp_path / "doctored"
    shutil.copytree(saved, storage)
    baseline = regress.newest_baseline(storage)
    assert baseline is not None
    data = json.loads(baseline.read_text())
    for bench in data["benchmarks"]:
        for stat in ("min", "max", "mean", "median"):
            bench["stats"][stat] /= 10  # the baseline claims ten times faster than today
    baseline.write_text(json.dumps(data))
    options = ["--storage", str(storage), "--threshold", "100", "--retries", "0"]
    result = run_regress("check", *options, "--", BENCH, *QUICK)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"REGRESSED  {BENCH}" in result.stdout


def test_check_without_a_baseline_says_how_to_make_one(tmp_path: Path) -> None:
    result = run_regress("check", "--storage", str(tmp_path))
    assert result.returncode == 2
    assert "run `python bench/regress.py save`" in result.stderr


def test_a_minimum_over_the_threshold_is_a_regression() -> None:
    verdict = regress.Verdict("b", baseline_s=100e-9, now_s=130e-9)
    assert verdict.regressed(25.0)
    assert not verdict.regressed(35.0)


def test_a_faster_minimum_is_never_a_regression() -> None:
    assert not regress.Verdict("b", baseline_s=100e-9, now_s=50e-9).regressed(0.0)


def test_compare_judges_only_benchmarks_present_in_both_runs() -> None:
    verdicts = regress.compare({"kept": 1.0, "dropped": 1.0}, {"kept": 2.0, "new": 1.0})
    assert [v.name for v in verdicts] == ["kept"]
