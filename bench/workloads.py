"""SPEC §7 workloads, replayed from the reference traces.

    python bench/workloads.py w1 --json         # W1 block churn: lifecycle (both forms) and the C free-list limit
    python bench/workloads.py w2 --json         # W2 prefix-cache replay at the trie + pool level
    python bench/workloads.py w2-model --json   # W2 through the HybridModel API

Each prints one JSON line per library measured (``--json``) or a small table. The reference traces
are the repository's ``bench/data/traces.npz`` (see bench/data/README.md); ``--trace PATH`` names
another file, compact or in the original ``traces.npz`` format.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from traces import TRACES  # noqa: E402

#: The traces every W1/W2 benchmark replays unless told otherwise (the repository's copy).
DEFAULT_TRACE = TRACES
Result = dict[str, Any]


def _runner(workload: str) -> Callable[[Path], list[Result]]:
    if workload == "w1":
        from w1 import run as run_w1

        return run_w1
    if workload == "w2":
        from w2 import run as run_w2

        return run_w2
    if workload == "w2-model":
        from w2_model import run as run_w2_model

        return run_w2_model
    raise SystemExit(f"unknown workload {workload!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["w1", "w2", "w2-model"])
    parser.add_argument("--json", action="store_true", help="one JSON line per library")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="traces.npz to replay")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"--trace {args.trace}: no such file (the reference traces are {DEFAULT_TRACE})")
    results = _runner(args.workload)(args.trace)
    for result in results:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print("  ".join(f"{key}={value}" for key, value in result.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
