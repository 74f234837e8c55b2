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
from typing import Any

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
def saved_and_recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    storage, baselines = tmp_path_factory.mktemp("benchmarks"), tmp_path_factory.mktemp("baselines")
    result = run_regress("save", "--record", "--storage", str(storage), "--baselines", str(baselines), "--", BENCH,
                         *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    return storage, baselines


@pytest.fixture(scope="module")
def saved(saved_and_recorded: tuple[Path, Path]) -> Path:
    return saved_and_recorded[0]


@pytest.fixture
def recorded(saved_and_recorded: tuple[Path, Path], tmp_path: Path) -> Path:
    """A copy of the committed-baselines folder the fixture's save --record wrote."""
    shutil.copytree(saved_and_recorded[1], tmp_path / "baselines")
    return tmp_path / "baselines"


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


def doctored(baseline: Path, factor: float, datetime: str | None = None) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(baseline.read_text())
    for bench in data["benchmarks"]:
        for stat in ("min", "median", "mean"):
            bench[stat] *= factor
    if datetime is not None:
        data["datetime"] = datetime
    return data


def test_a_selection_of_no_benchmark_ends_in_one_line_not_a_traceback(tmp_path: Path) -> None:
    result = run_regress("save", "--storage", str(tmp_path), "--", "bench/test_bench_prefix.py", "-k", "no_such")
    assert result.returncode == regress.EXIT_NO_TESTS
    assert "the pytest arguments select no benchmark" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def test_record_writes_a_small_baseline_naming_the_machine_and_version(recorded: Path) -> None:
    (baseline,) = recorded.glob("*.json")
    data = json.loads(baseline.read_text())
    assert data["format"] == regress.BASELINE_FORMAT and data["version"] == regress.project_version()
    assert data["machine"]["node"] and data["machine"]["cpu"] and data["machine"]["cores"]
    assert [bench["name"] for bench in data["benchmarks"]] == [BENCH]
    assert baseline.name.startswith(f"{data['version']}_") and baseline.stat().st_size < 4096
    assert regress.minimums(baseline)[BENCH] == data["benchmarks"][0]["min"] > 0


def test_check_compares_with_the_latest_committed_baseline(recorded: Path) -> None:
    (baseline,) = recorded.glob("*.json")
    older = recorded / "0.0.1_20000101_elsewhere.json"
    older.write_text(json.dumps(doctored(baseline, 10.0, datetime="2000-01-01T00:00:00")))  # would pass anything
    result = run_regress("check", "--baselines", str(recorded), "--threshold", "100", "--pause", "1", "--", BENCH,
                         *QUICK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"minimum vs baseline {baseline.name}" in result.stdout and "all 1 within the threshold" in result.stdout


def test_a_regression_against_the_committed_baseline_fails_the_check(recorded: Path) -> None:
    (baseline,) = recorded.glob("*.json")
    baseline.write_text(json.dumps(doctored(baseline, 0.1)))
    options = ["--baselines", str(recorded), "--threshold", "100", "--retries", "0"]
    result = run_regress("check", *options, "--", BENCH, *QUICK)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"REGRESSED  {BENCH}" in result.stdout


def test_a_baseline_of_another_machine_is_named_in_the_check(recorded: Path) -> None:
    (baseline,) = recorded.glob("*.json")
    data = json.loads(baseline.read_text())
    data["machine"] = {**data["machine"], "node": "some-other-host", "cpu": "Some Other CPU"}
    baseline.write_text(json.dumps(data))
    result = run_regress("check", "--baselines", str(recorded), "--threshold", "100", "--pause", "1", "--", BENCH,
                         *QUICK)
    assert "the baseline ran on some-other-host (Some Other CPU" in result.stdout, result.stdout


def test_check_without_a_committed_baseline_says_how_to_record_one(tmp_path: Path) -> None:
    result = run_regress("check", "--baselines", str(tmp_path))
    assert result.returncode == 2 and "run `python bench/regress.py save --record`" in result.stderr


def test_history_lists_every_committed_run_oldest_first_and_draws_them(recorded: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    (baseline,) = recorded.glob("*.json")
    later = doctored(baseline, 2.0, datetime="2999-01-01T00:00:00")
    (recorded / "9.9.9_29990101_later.json").write_text(json.dumps(later))
    plot = tmp_path / "history.png"
    result = run_regress("history", "--baselines", str(recorded), "--plot", str(plot))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.index(f"({baseline.name})") < result.stdout.index("(9.9.9_29990101_later.json)")
    first = regress.minimums(baseline)[BENCH] * 1e9
    row = next(line for line in result.stdout.splitlines() if line.endswith(BENCH))
    assert [float(cell) for cell in row.split()[:2]] == pytest.approx([first, 2 * first], rel=1e-3)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_without_a_committed_baseline_says_how_to_record_one(tmp_path: Path) -> None:
    result = run_regress("history", "--baselines", str(tmp_path))
    assert result.returncode == 2 and "save --record" in result.stderr


def test_the_committed_baselines_are_readable_and_name_their_machine() -> None:
    runs = regress.committed_baselines()
    assert runs, "bench/baselines/ holds no committed baseline"
    for path, data in runs:
        assert data["machine"]["node"] and data["machine"]["cpu"], path
        assert regress.minimums(path) and path.stat().st_size < 32768, path
