"""Shared by the peer runners (``peer_*.py``), which run inside each peer's virtual environment.

Only numpy and the standard library here: the peers' environments do not have ``lifecycle``.
Every runner prints one JSON line per workload, in the same shape as ``bench/workloads.py``.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from traces import load_traces, meta  # noqa: E402
from w2 import REPEATS, W2Trace, load_w2, no_gc, result, timed  # noqa: E402
from w4 import DecodeRun, W4Trace  # noqa: E402

W1Replay = Callable[[NDArray[np.int32], int], float]
W2Replay = Callable[[W2Trace], tuple[float, int, int]]
W4Replay = Callable[[W4Trace], DecodeRun]


class _ImportStub(types.ModuleType):
    """A module whose every attribute is another stub; calling anything in it raises."""

    def __getattr__(self, name: str) -> _ImportStub:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _ImportStub(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(f"{self.__name__} is an import stub: the benchmark must not use it")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, package: str, version: str) -> None:
        self.package = package
        self.version = version

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.package or fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _ImportStub(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = self.version  # type: ignore[attr-defined]


def stub_torchvision(version: str = "0.28.0") -> None:
    """Make ``import torchvision...`` succeed with stubs (see peer_sglang.py for why)."""
    sys.meta_path.insert(0, _StubFinder("torchvision", version))


def load_w1(trace_path: Path) -> tuple[NDArray[np.int32], int, int]:
    """The W1 ops ``(op, seq_id, k)``, the pool size, and the blocks allocated in all."""
    w1 = meta(trace_path)["w1"]
    return load_traces(trace_path)["w1_ops"], int(w1["num_blocks"]), int(w1["blocks_allocated"])


def w1_record(library: str, seconds: float, blocks: int, note: str = "") -> dict[str, Any]:
    record: dict[str, Any] = {
        "workload": "W1",
        "library": library,
        "ns_per_block": round(seconds / blocks * 1e9, 2),
    }
    if note:
        record["note"] = note
    return record


def main(
    library: str,
    replay_w1: W1Replay,
    replay_w2: W2Replay,
    *,
    w1_note: str = "",
    w2_note: str = "",
    replay_w4: W4Replay | None = None,
    w4_note: str = "",
) -> int:
    """Run W1, W2, W3 (best of ``--repeats``; W3 by the W2 replay over the W3 trace) and W4 (best of
    ``--w4-repeats``) and print one JSON line each."""
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", type=Path)
    parser.add_argument("--w3-trace", type=Path, default=None, help="the Mooncake trace (default: the repository's)")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--w3-repeats", type=int, default=1, help="W3 replays (each lasts seconds to minutes)")
    parser.add_argument("--w4-repeats", type=int, default=1, help="W4 replays (each lasts a minute or more)")
    parser.add_argument("--workloads", default="w1,w2,w3,w4")
    args = parser.parse_args()
    wanted = set(args.workloads.split(","))
    if "w1" in wanted:
        ops, num_blocks, blocks = load_w1(args.trace)
        seconds = float("inf")
        for _ in range(args.repeats):
            with no_gc():
                seconds = min(seconds, replay_w1(ops, num_blocks))
        print(json.dumps(w1_record(library, seconds, blocks, w1_note)), flush=True)
    if "w2" in wanted:
        trace = load_w2(args.trace)
        runs = [timed(replay_w2, trace) for _ in range(args.repeats)]
        _, hit_tokens, evicted = runs[0]
        record = result(
            library, min(r[0] for r in runs), hit_tokens, sum(trace.prompt_lens), evicted, trace.num_requests
        )
        if w2_note:
            record["note"] = w2_note
        print(json.dumps(record), flush=True)
    if "w3" in wanted:
        from traces import MOONCAKE_TRACE
        from w3 import load_w3

        w3 = load_w3(args.w3_trace or MOONCAKE_TRACE)
        runs = [timed(replay_w2, w3) for _ in range(args.w3_repeats)]  # type: ignore[arg-type]
        _, hit_tokens, evicted = runs[0]
        record = result(library, min(r[0] for r in runs), hit_tokens, w3.prompt_tokens, evicted, w3.num_requests)
        record["workload"] = "W3"
        if w2_note:
            record["note"] = w2_note
        print(json.dumps(record), flush=True)
    if "w4" in wanted and replay_w4 is not None:
        from w4 import generate, record as w4_record

        w4 = generate()
        decode_runs: list[DecodeRun] = []
        for _ in range(args.w4_repeats):
            with no_gc():
                decode_runs.append(replay_w4(w4))
        print(json.dumps(w4_record(library, decode_runs, w4, note=w4_note)), flush=True)
    return 0
