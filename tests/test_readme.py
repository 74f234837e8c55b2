"""The README's API tour runs as written and is clean under ``mypy --strict``, its Quick start
matches what CI runs, and what it points to is in the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_api_tour_runs() -> None:
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None, "README has no API tour code block"
    exec(compile(match.group(1), "README.md (API tour)", "exec"), {"__name__": "readme_tour"})


def test_engine_integration_tour_runs() -> None:
    match = re.search(r"### Engine integration\n.*?```python\n(.*?)```", README, re.S)
    assert match is not None, "README has no engine integration code block"
    exec(compile(match.group(1), "README.md (engine integration)", "exec"), {"__name__": "readme_engine"})


def test_ci_runs_the_readme_test_command() -> None:
    quick = re.search(r"## Quick start\n\n```bash\n(.*?)```", README, re.S)
    assert quick is not None
    lines = [line.split("#")[0].strip() for line in quick.group(1).strip().splitlines()]
    assert len(lines) == 2, lines
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_api_tour_is_clean_under_mypy_strict(tmp_path: Path) -> None:
    match = re.search(r"## API tour\n\n```python\n(.*?)```", README, re.S)
    assert match is not None
    tour = tmp_path / "readme_tour.py"
    tour.write_text(match.group(1))
    env = {**os.environ, "MYPYPATH": str(ROOT)}  # the checkout's lifecycle, whatever is installed
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--config-file", str(ROOT / "pyproject.toml"),
         str(tour)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_repository_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"`((?:bench|docs|tests|lifecycle|pyx|stubs)/[\w./-]*)`", README))
    assert named, "the pattern no longer finds the README's paths"
    assert not [path for path in named if not (ROOT / path).exists()]


def test_the_readme_cites_nothing_outside_the_repository() -> None:
    assert "SPEC" not in README and "§" not in README
    assert "../shared" not in README


# -- every command the README shows, each run in a short form --------------------------------------

_COMMAND = re.compile(r"(python|pip|lifecycle|bash|vllm|cython-lint)( |$)")
BENCH = "bench/test_bench_blockpool.py::test_share_then_release[16]"
QUICK = "--benchmark-max-time=0.05 --benchmark-min-rounds=3"
WHEEL = "kv_lifecycle-{version}-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
VLLM_CLASS = (
    "python -c \"import lifecycle.integrations.vllm as m\n"
    "try:\n    assert isinstance(m.LifecycleAsyncScheduler, type)\n"
    "except ImportError as e:\n    assert 'kv-lifecycle[vllm]' in str(e), e\""
)


def readme_commands() -> list[str]:
    """Every command of the README: each line of its bash blocks, and each command in backticks
    in its prose (``lifecycle simulate --help``, ``pip install '.[plot]'``)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        commands += [line.split(" #")[0].strip() for line in block.splitlines() if line.split(" #")[0].strip()]
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if _COMMAND.match(span) and (" " in span.strip()) and not re.match(r"(lifecycle|pip install)\s*$", span):
            commands.append(span)
    return list(dict.fromkeys(commands))


#: How each README command runs here, in a short form. A check is one of:
#:   "run: CMD"    run CMD in the checkout (placeholders below), which must exit 0;
#:   "help: CMD"   run CMD (a --help), exit 0, and every --option of the README's command is in its output;
#:   "ci: TEXT"    .ci/run holds TEXT: CI runs the command as it is;
#:   "suite: FILE" the test suite runs the command itself in FILE;
#:   "extras"      the extras it names are the project's, the wheel it names is the one tools/build_wheel.sh makes.
SHORT: dict[str, list[str]] = {
    "pip install . && lifecycle simulate": [
        "ci: tools/check_wheel.sh", "run: python -m lifecycle simulate --requests 20 --quiet"
    ],
    "python -m pip install -e '.[test]' && python -m pytest": [
        "ci: python -m pip install -e '.[test]' && python -m pytest"
    ],
    "bash tools/build_wheel.sh": ["ci: tools/build_wheel.sh", "run: bash -n tools/build_wheel.sh",
                                  "help: bash tools/build_wheel.sh --help"],
    f"bash tools/check_wheel.sh wheelhouse/{WHEEL}": ["ci: tools/check_wheel.sh", "run: bash -n tools/check_wheel.sh",
                                                      "extras"],
    "vllm serve MODEL --scheduler-cls lifecycle.integrations.vllm.LifecycleAsyncScheduler": [f"run: {VLLM_CLASS}"],
    "python bench/workloads.py w1 --json": ["run: python bench/workloads.py w1 --json --trace {w2}"],
    "python bench/workloads.py w2 --json": ["run: python bench/workloads.py w2 --json --trace {w2}"],
    "python bench/workloads.py w2-model --json": ["run: python bench/workloads.py w2-model --json --trace {w2}"],
    "python bench/workloads.py w3 --json": ["run: python bench/workloads.py w3 --json --trace {w3}"],
    "python bench/workloads.py w3-model --json": ["run: python bench/workloads.py w3-model --json --trace {w3}"],
    "python bench/workloads.py w2-events --json": ["run: python bench/workloads.py w2-events --json --trace {w2}",
                                                   "run: python bench/workloads.py w3-events --json --trace {w3}"],
    "python bench/workloads.py w2-events": ["run: python bench/workloads.py w2-events --trace {w2}"],
    "python bench/workloads.py w3-tiers --json": ["run: python bench/workloads.py w3-tiers --json --trace {w3}"],
    "python bench/workloads.py w3-groups --json": ["run: python bench/workloads.py w3-groups --json --trace {w3}"],
    "python bench/workloads.py w4-groups --json": ["help: python bench/workloads.py --help"],
    "python bench/tiers_bench.py": ["run: python bench/tiers_bench.py --part copies --repeats 1"],
    "python bench/memory.py --json": ["run: python bench/memory.py --blocks 20000 --json"],
    "python bench/memory.py": ["run: python bench/memory.py --blocks 20000"],
    "python bench/workloads.py w4 --json": ["help: python bench/workloads.py --help", "run: python bench/w4.py"],
    "python bench/peers.py": ["help: python bench/peers.py --help"],  # needs the engines' venvs and an hour
    "python bench/peers.py --workloads w4": ["help: python bench/peers.py --help"],
    "python bench/callgrind.py": ["help: python bench/callgrind.py --help"],
    "python bench/callgrind.py --workloads w3-groups,w4-groups --presets gpt-oss-120b": [
        "help: python bench/callgrind.py --help",
        "run: python bench/callgrind.py --child w4-groups:gpt-oss-120b groups",  # the measured replay, no valgrind
    ],
    "python bench/peers.py --w3-repeats 3": ["help: python bench/peers.py --help"],
    "python bench/decode_threads.py": ["run: python bench/decode_threads.py --steps 20 --repeats 1"],
    "python bench/w4.py": ["run: python bench/w4.py"],
    "python bench/device_bench.py": ["run: python bench/device_bench.py --max-size 256KiB"],
    "python bench/swap_bench.py": ["run: python bench/swap_bench.py --tokens 64 --repeats 1"],
    "python bench/multiturn.py": ["run: python bench/multiturn.py --requests 30"],
    "python bench/w3.py": ["run: python bench/w3.py"],
    "python bench/groups_bench.py --json": ["run: python bench/groups_bench.py --json --repeats 1 --limit 200"],
    "python bench/reliability.py --ops 1000000 --json": [
        "run: python bench/reliability.py --ops 300 --episode-ops 150 --fuzz 5 --thread-runs 1 --fault-ops 50 --json"
    ],
    "bash bench/gpu_check.sh": ["run: bash -n bench/gpu_check.sh", "suite: tests/test_gpu_check_script.py"],
    "bash bench/gpu_check.sh --dry-run": ["run: bash -n bench/gpu_check.sh", "suite: tests/test_gpu_check_script.py"],
    "python bench/regress.py save --record": [
        f"run: python bench/regress.py save --record --storage {{tmp}}/s --baselines {{tmp}}/b -- {BENCH} {QUICK}"
    ],
    "python bench/regress.py check": [
        f"run: python bench/regress.py check --threshold 10000 --retries 0 -- {BENCH} {QUICK}"
    ],
    "python bench/regress.py save": [f"run: python bench/regress.py save --storage {{tmp}}/s -- {BENCH} {QUICK}"],
    "python bench/regress.py check --storage .benchmarks": [
        f"run: python bench/regress.py save --storage {{tmp}}/s -- {BENCH} {QUICK}",
        f"run: python bench/regress.py check --storage {{tmp}}/s --threshold 10000 --retries 0 -- {BENCH} {QUICK}",
    ],
    "python bench/regress.py check -- bench/test_bench_prefix.py -k cached": [
        "run: python bench/regress.py check --threshold 10000 --retries 0 -- bench/test_bench_prefix.py -k "
        f"'cached_request' {QUICK}"
    ],
    "python bench/regress.py history --plot bench-history.png": [
        "run: python bench/regress.py history --plot {tmp}/bench-history.png"
    ],
    "python -m pytest tests/test_static.py": ["suite: tests/test_static.py"],
    "python -m ruff check .": ["suite: tests/test_lint.py"],
    "cython-lint pyx": ["suite: tests/test_lint.py"],
    "python -m sphinx -W -b html docs docs/_build": ["suite: tests/test_docs.py"],
    "python setup.py -q build_ext --inplace -j 2": ["suite: tests/test_install.py"],
    "lifecycle simulate": ["run: python -m lifecycle simulate --requests 20 --quiet"],
    "lifecycle simulate --plot": ["run: python -m lifecycle simulate --requests 20 --quiet --plot {tmp}/run.png"],
    "lifecycle simulate --help": ["run: python -m lifecycle simulate --help"],
    "lifecycle simulate --requests 50": ["run: python -m lifecycle simulate --requests 50 --quiet"],
    "lifecycle info": ["run: python -m lifecycle info"],
    "lifecycle --version": ["run: python -m lifecycle --version"],
    "pip install -e '.[plot]'": ["extras"],
    "pip install '.[plot]'": ["extras"],
    "pip install .": ["ci: tools/check_wheel.sh"],
    f"pip install '{WHEEL}[plot]'": ["extras", "ci: tools/check_wheel.sh"],
    "pip install '.[cuda12]'": ["extras"],
    "pip install '.[cuda13]'": ["extras"],
    "pip install 'kv-lifecycle[vllm]'": ["extras"],
}


def test_every_readme_command_has_a_short_form() -> None:
    commands = readme_commands()
    assert len(commands) > 40, "the pattern no longer finds the README's commands"
    shown = {command.replace(project_version(), "{version}") for command in commands}
    known = set(SHORT)
    assert not shown - known, f"give these README commands a short form in SHORT: {sorted(shown - known)}"
    assert not known - shown, f"SHORT names commands the README no longer shows: {sorted(known - shown)}"


def project_version() -> str:
    import tomllib

    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def small_w2_trace(target: Path, requests: int = 40, w1_sequences: int = 300) -> Path:
    """The repository's W1/W2 traces cut to their first requests and sequences."""
    import json

    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from traces import load_traces, meta

    full, info = load_traces(), meta()
    ops = full["w1_ops"]
    kept = ops[ops[:, 1] < w1_sequences]
    offsets = full["w2_prompt_offsets"][: requests + 1]
    info["w1"]["blocks_allocated"] = int(kept[kept[:, 0] == 1, 2].sum())
    np.savez(target, w1_ops=kept, w2_prompt_tokens=full["w2_prompt_tokens"][: int(offsets[-1])],
             w2_prompt_offsets=offsets, w2_gen_tokens=full["w2_gen_tokens"][:requests],
             w2_system_id=full["w2_system_id"][:requests], meta=np.array(json.dumps(info)))
    return target


def small_w3_trace(target: Path, requests: int = 40) -> Path:
    import lzma

    with lzma.open(ROOT / "bench" / "data" / "mooncake_synthetic.jsonl.xz", "rt") as source:
        target.write_text("".join(line for _, line in zip(range(requests), source)))
    return target


@pytest.fixture(scope="module")
def short_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("readme")
    return {"w2": str(small_w2_trace(folder / "w2.npz")), "w3": str(small_w3_trace(folder / "w3.jsonl"))}


def _extras_check(command: str) -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = re.findall(r"\[(\w+)\]", command)
    assert named or "wheelhouse/" in command, command
    assert all(name in extras for name in named), (command, sorted(extras))
    for wheel in re.findall(r"kv_lifecycle-[^'\[ ]+\.whl", command):
        assert wheel == WHEEL.format(version=project_version()), f"{command}: tools/build_wheel.sh names it otherwise"


@pytest.mark.parametrize("command", sorted(SHORT))
def test_the_readme_command_runs_in_its_short_form(command: str, short_inputs: dict[str, str], tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for check in SHORT[command]:
        kind, _, argument = check.partition(": ")
        if kind == "extras":
            _extras_check(command.replace("{version}", project_version()))
        elif kind == "ci":
            assert argument in (ROOT / ".ci" / "run").read_text(), check
        elif kind == "suite":
            assert (ROOT / argument).is_file(), check
        else:
            line = argument.format(tmp=tmp_path, **short_inputs)
            done = subprocess.run(line, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            if kind == "help":
                options = re.findall(r"(--[\w-]+)", command)
                assert all(option in done.stdout for option in options), (options, done.stdout)
