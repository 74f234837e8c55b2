"""The ``lifecycle`` command line: ``simulate`` end to end, its output, and every refused option."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.cli import main

# A small trace on a tight pool: prefix hits, evictions and swaps all happen, invariants every step.
REPO = Path(__file__).resolve().parents[1]
SMALL = ["simulate", "--requests", "40", "--blocks", "512", "--check-every", "1"]


def run_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main([*SMALL, "--json", *extra]) == 0
    out = capsys.readouterr().out
    result: dict[str, Any] = json.loads(out)  # the whole of stdout is one JSON object
    return result


def test_json_run_serves_every_request_and_leaks_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys)
    assert result["requests"] == 40
    assert result["leaked"] == 0
    assert result["teardown"]["live_sequences"] == 0 and result["teardown"]["live_blocks"] == 0
    assert result["model"] == "small-hybrid" and result["device"]


def test_json_run_reuses_prefixes(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys)
    assert 0 < result["prefix_hit_rate"] <= 1
    assert result["prefix_hit_tokens"] > 0 and result["snapshots_saved"] > 0


def test_json_counts_are_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys)
    stats = result["stats"]
    assert stats["sequences_allocated"] == stats["sequences_freed"]
    assert stats["prefix_lookups"] == result["requests"] + result["recomputes"]
    assert result["swaps_out"] == result["swaps_in"] == stats["swaps_out"] > 0
    assert result["preemptions"] == result["swaps_out"] + result["recomputes"]
    assert result["swap_bytes"] == stats["bytes_swapped_out"] + stats["bytes_swapped_in"]
    assert result["prefix_hit_rate"] == pytest.approx(stats["prefix_hit_tokens"] / stats["prefix_lookup_tokens"])
    assert result["evicted_blocks"] == stats["blocks_evicted"] > 0
    assert 0 < result["compactions"] <= result["requests"]
    assert result["invariant_checks"] == result["steps"] + 1
    assert result["library_us_per_request"] == pytest.approx(stats["time_in_library_ns"] / 1e3 / 40)


def test_json_names_the_seed_the_pools_and_what_dominates_library_time(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys, "--seed", "3")
    assert result["seed"] == 3
    assert result["pools"]["kv_blocks"] == 512 and result["pools"]["snapshots"] > 0
    assert result["copy_ns"] + result["bookkeeping_ns"] == result["stats"]["time_in_library_ns"]
    assert result["dominant"] in ("device copies", "bookkeeping")


def test_json_run_is_deterministic_for_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = run_json(capsys, "--seed", "3"), run_json(capsys, "--seed", "3")
    for key in ("prompt_tokens", "generated_tokens", "prefix_hit_tokens", "evicted_blocks", "swaps_out", "steps"):
        assert first[key] == second[key]


def test_json_mode_prints_no_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    run_json(capsys)
    assert capsys.readouterr().err == ""


def test_summary_table_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--quiet"]) == 0
    captured = capsys.readouterr()
    for label in ("requests", "prompt tokens", "prefix hit rate", "evicted blocks", "swaps (out / in)",
                  "swap bytes", "compactions", "library time per request", "dominated by", "leaked at teardown"):
        assert label in captured.out
    leak_row = next(line for line in captured.out.splitlines() if "leaked at teardown" in line)
    assert leak_row.split()[-2] == "0"
    assert captured.err == ""


def test_progress_bar_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    captured = capsys.readouterr()
    assert "40/40" in captured.err
    assert "40/40" not in captured.out


@pytest.mark.parametrize(
    "options",
    [
        ["--model", "tiny-hybrid"],
        ["--model", "llama-like", "--kv-budget", "32M"],
        pytest.param(["--model", "qwen3-next-like", "--requests", "6"], marks=pytest.mark.slow),  # 74 MiB slots
    ],
)
def test_every_preset_runs_clean(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    assert main(["simulate", "--requests", "20", "--check-every", "1", "--json", *options]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == options[1] and result["leaked"] == 0


def test_python_m_lifecycle_simulate_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lifecycle", "simulate", "--help"], capture_output=True, text=True, timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--requests", "--model", "--device", "--json", "--plot", "--spill-dir"):
        assert option in done.stdout


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--requests", "0"], "--requests: 0 must be >= 1"),
        (["--requests", "-5"], "--requests: -5 must be >= 1"),
        (["--requests", "many"], "--requests: 'many' is not an integer"),
        (["--turns", "0"], "--turns: 0 must be >= 1"),
        (["--seed", "-1"], "--seed: -1 must be >= 0"),
        (["--model", "gpt-9"], "unknown preset 'gpt-9'"),
        (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
        (["--max-live", "0"], "--max-live: 0 must be >= 1"),
        (["--blocks", "0"], "--blocks: 0 must be >= 1"),
        (["--blocks", "64", "--kv-budget", "1M"], "not allowed with argument"),
        (["--kv-budget", "lots"], "--kv-budget: 'lots' is not a size"),
        (["--kv-budget", "0"], "--kv-budget: '0' must be more than 0 bytes"),
        (["--blocks", "3"], "too small for chats"),
        (["--model", "llama-like", "--snapshots", "4"], "argument --snapshots: 4 needs an SSM layer"),
        (["--kv-budget", "1K"], "argument --kv-budget: 1024 is too small for one block of 32768 bytes"),
        (["--host-tier-mb", "16", "--store", "redis://127.0.0.1:1"],
         "argument --host-tier-mb: a store holds KV blocks only"),
        (["--model", "small-attention", "--store", "redis://127.0.0.1:1"],
         "argument --host-tier-mb: a store needs a host tier above it (--host-tier-mb > 0)"),
        (["--log-level", "loud"], "--log-level: invalid choice: 'loud'"),
        (["--snapshots", "-1"], "--snapshots: -1 must be >= 0"),
        (["--snapshot-every", "-2"], "--snapshot-every: -2 must be >= 0"),
        (["--swap-host-mb", "-1"], "--swap-host-mb: -1 must be >= 0"),
        (["--spill-dir", "/no/such/dir"], "--spill-dir: '/no/such/dir' is not a writable directory"),
        (["--check-every", "-1"], "--check-every: -1 must be >= 0"),
        (["--plot", "out.txt"], "--plot: 'out.txt' must end in one of .png"),
        (["--plot", "/no/such/dir/out.png"], "cannot write '/no/such/dir/out.png'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    ],
)
def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    assert main(["simulate", *options]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_a_plot_path_that_is_a_directory_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    folder = tmp_path / "plot.png"
    folder.mkdir()
    assert main(["simulate", "--plot", str(folder)]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    target = tmp_path / "run.png"
    assert main([*SMALL, "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert "[plot]'" in err and "pip install matplotlib" in err
    assert not target.exists()


def test_plot_draws_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "run.png"
    assert main([*SMALL, "--quiet", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {target}" in capsys.readouterr().out


def test_simulate_runs_on_cuda_over_the_emulated_driver() -> None:
    from emu_cuda.build import build_emulator, compiler

    if compiler() is None:
        pytest.skip("no C compiler to build the emulated CUDA driver")
    env = dict(os.environ)
    # The dynamic loader reads LD_LIBRARY_PATH at process start: the run needs a child process.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(build_emulator()), env.get("LD_LIBRARY_PATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "lifecycle", *SMALL, "--device", "cuda", "--json"],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["device"] != "host" and result["leaked"] == 0
    assert result["swaps_out"] == result["swaps_in"] > 0 and result["prefix_hit_rate"] > 0


def test_cuda_without_a_gpu_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.device import open_device
    from lifecycle.errors import DeviceError

    try:
        open_device("cuda").close()
    except DeviceError:
        pass
    else:
        pytest.skip("a CUDA device is present")
    assert main([*SMALL, "--device", "cuda"]) == 2
    assert "--device: cuda is not available here" in capsys.readouterr().err


def emulated_driver_env() -> dict[str, str]:
    """The environment of a child process whose CUDA driver is the emulator (skips without cc)."""
    from emu_cuda.build import build_emulator, compiler

    if compiler() is None:
        pytest.skip("no C compiler to build the emulated CUDA driver")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(build_emulator()), env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    import tomllib

    import lifecycle

    assert main(["--version"]) == 0
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert capsys.readouterr().out.strip() == f"lifecycle {project['version']}" == f"lifecycle {lifecycle.__version__}"


def test_the_snapshots_help_states_the_default_runs_use(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.cli import SIMULATION_SIZING

    assert main(["simulate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    sizing = SIMULATION_SIZING["small-hybrid"]
    assert f"SSM snapshot pool size of a hybrid model (default: {sizing['num_snapshots']} for small-hybrid" in text
    assert f"KV blocks in the pool (default: {sizing['num_blocks']} for small-hybrid" in text


def test_in_options_names_the_option_that_sets_a_field() -> None:
    from lifecycle.cli import in_options

    assert in_options("num_blocks=3 must be >= 4") == ("--blocks", "--blocks 3 must be >= 4")
    named = in_options("needs a host tier (host_tier_blocks > 0)")
    assert named == ("--host-tier-mb", "needs a host tier (--host-tier-mb > 0)")
    assert in_options("a message naming no field") == (None, "a message naming no field")


def warn_during_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    import lifecycle.simulate

    real_simulate = lifecycle.simulate.simulate

    def warning_then_run(*args: Any, **kwargs: Any) -> Any:
        logging.getLogger("lifecycle.tiers.store").warning("store at %s unreachable", "redis://cache:6379")
        logging.getLogger("lifecycle.device").info("open_device: a record below the default level")
        return real_simulate(*args, **kwargs)

    monkeypatch.setattr(lifecycle.simulate, "simulate", warning_then_run)


def test_library_warnings_are_shown_with_the_logger_that_raised_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    warn_during_the_run(monkeypatch)
    assert main(["simulate", "--requests", "3", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "lifecycle.tiers.store: WARNING: store at redis://cache:6379 unreachable" in err
    assert "a record below the default level" not in err


@pytest.mark.parametrize("where", ["before the command", "after the command"])
def test_log_level_chooses_the_records_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    warn_during_the_run(monkeypatch)
    run = ["simulate", "--requests", "3", "--quiet"]
    for level, shown in (("error", ()), ("info", ("WARNING: store at", "INFO: open_device: a record below"))):
        options = ["--log-level", level, *run] if where == "before the command" else [*run, "--log-level", level]
        assert main(options) == 0
        err = capsys.readouterr().err
        assert all(text in err for text in shown) and ("unreachable" in err) == bool(shown), err


def test_the_log_handler_is_gone_after_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    before = list(logging.getLogger("lifecycle").handlers)
    assert main(["info", "--json"]) == 0
    assert logging.getLogger("lifecycle").handlers == before


def test_ctrl_c_prints_no_teardown_report_of_the_live_sequences(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lifecycle.simulate

    real_simulate, models = lifecycle.simulate.simulate, []

    def interrupted_after_some_requests(model: Any, trace: Any, options: Any, **kwargs: Any) -> Any:
        models.append(model)

        def ctrl_c(done: int) -> None:
            if done == 5:
                raise KeyboardInterrupt

        return real_simulate(model, trace, options, on_request_done=ctrl_c)

    monkeypatch.setattr(lifecycle.simulate, "simulate", interrupted_after_some_requests)
    assert main(["simulate", "--requests", "40", "--quiet"]) == 130
    report = models[0].teardown_report
    assert report is not None and report.leaked > 0  # sequences were live: the teardown had something to say
    assert capsys.readouterr().err.splitlines() == ["lifecycle simulate: interrupted"]


def test_a_teardown_report_outside_ctrl_c_is_shown() -> None:
    import logging

    from lifecycle.cli import _InterruptedTeardown

    record = logging.LogRecord("lifecycle.model", logging.WARNING, __file__, 1, "teardown of %r ...", ("m",), None)
    assert _InterruptedTeardown().filter(record)
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        assert not _InterruptedTeardown().filter(record)


def test_the_library_logs_nothing_by_itself() -> None:
    warn = "import logging; logging.getLogger('lifecycle.tiers.store').warning('store down')"
    quiet = subprocess.run([sys.executable, "-c", f"import lifecycle._logging; {warn}"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    bare = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert quiet.returncode == bare.returncode == 0
    assert quiet.stderr == "" and "store down" in bare.stderr  # Python's last resort prints it otherwise


def test_info_says_what_open_device_auto_picks_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    from lifecycle.device import open_device

    device = open_device("auto")
    kind = device.kind
    device.close()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f'open_device("auto")  {kind}:' in out
    for name in ("lifecycle", "python", "numpy", "cuda-bindings", "CUDA driver", "device"):
        assert any(line.strip().split("  ")[0] == name for line in out.splitlines()), name


def test_info_json_names_versions_driver_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    import lifecycle

    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["lifecycle"] == lifecycle.__version__ and info["packages"]["numpy"] == np.__version__
    assert info["auto_device"] in ("host", "cuda") and info["auto_reason"]
    assert (info["cuda_driver"] is None) == (info["cuda_driver_missing"] is not None)


def test_info_over_the_emulated_driver_reports_its_version_and_device() -> None:
    done = subprocess.run([sys.executable, "-m", "lifecycle", "info", "--json"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=emulated_driver_env())
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["auto_device"] == "cuda" and "Emulated CUDA device" in info["device"]
    assert info["cuda_driver"] == "13.0" and info["device_memory"]["total"] > 0


def test_info_names_the_extra_for_a_driver_older_than_the_bindings() -> None:
    from lifecycle.cli import DRIVER_MINIMUM, _bindings_note

    assert f"NVIDIA drivers {DRIVER_MINIMUM[13]} or newer" in _bindings_note("13.4.4", 13000)
    note = _bindings_note("13.4.4", 12040)
    assert "this driver is CUDA 12.4: too old for them; pip install 'kv-lifecycle[cuda12]'" in note
    assert "too old" not in _bindings_note("12.9.4", 13000)


# --- --model PRESET with several KV groups: the memory plan per group --------------------------------

PUBLISHED = ("gpt-oss-20b", "gpt-oss-120b", "gemma-3-27b", "llama-4-scout", "deepseek-v3", "deepseek-v3.2",
             "qwen3-next-80b-a3b", "nemotron-h")


def plan_of(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["simulate", *args, "--json"]) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out)
    return result


@pytest.mark.parametrize("name", PUBLISHED)
def test_plan_reports_memory_per_group_of_every_published_preset(capsys: pytest.CaptureFixture[str], name: str) -> None:
    from lifecycle.presets import preset

    config = preset(name)
    plan = plan_of(capsys, "--model", name, "--plan")["memory_plan"]
    assert [(g["kind"], g["num_blocks"]) for g in plan["groups"]] == [(g.kind, g.num_blocks) for g in config.kv_groups]
    assert sum(g["bytes"] for g in plan["groups"]) == config.kv_pool_bytes()
    assert plan["reference"]["concurrent_sequences"] >= 0.95 * plan["reference"]["ideal_sequences"] > 0


def test_a_model_with_several_groups_replays_and_reports_each_group(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_of(capsys, "--model", "gpt-oss-20b", "--requests", "5", "--kv-budget", "1G")
    assert result["requests"] == 5 and result["leaked"] == 0
    kinds = [(g["kind"], g["num_blocks"]) for g in result["kv_groups"]]
    assert kinds == [(g["kind"], g["num_blocks"]) for g in result["memory_plan"]["groups"]]
    assert kinds[1][0] == "sliding_window"
    window = result["kv_groups"][1]
    assert window["blocks_released"] > 0  # the decode released what left the window
    assert all(g["num_free"] + g["num_cached"] == g["num_blocks"] for g in result["kv_groups"])


def test_a_model_with_several_groups_replays_without_swap(capsys: pytest.CaptureFixture[str]) -> None:
    result = plan_of(capsys, "--model", "llama-4-scout", "--requests", "5", "--kv-budget", "1G")
    assert result["swaps_out"] == 0 and result["pools"]["swap_host_bytes"] == 0


def test_the_plan_table_names_each_group_and_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "llama-4-scout", "--kv-budget", "16G", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "chunked_local" in out and "8,192" in out
    assert "concurrent sequences of 32,768 tokens" in out and "reference budget" in out


def test_the_replay_table_of_several_groups_ends_with_each_groups_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "gpt-oss-20b", "--requests", "5", "--kv-budget", "1G", "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "group 1 sliding_window (12 layers)" in last and "released from the window" in last


def test_the_plan_follows_the_kv_budget_option(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_of(capsys, "--model", "gemma-3-27b", "--kv-budget", "64G", "--plan")["memory_plan"]
    assert plan["budget_bytes"] == 64 << 30
    assert plan["concurrent_sequences"] > 0


def test_one_block_count_for_several_groups_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "gpt-oss-20b", "--blocks", "100"]) == 2
    assert "argument --blocks: 100 is one count; the model has 2 KV groups" in capsys.readouterr().err


def test_a_replay_reports_its_memory_plan_too(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_json(capsys)
    (group,) = result["memory_plan"]["groups"]
    assert group["kind"] == "full" and group["num_blocks"] == result["pools"]["kv_blocks"] == 512


def test_a_replay_table_ends_with_the_memory_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--quiet"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("KV memory per group: group 0 full (2 layers): 512 blocks of")
