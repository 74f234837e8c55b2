"""W1 block churn (SPEC §7): lifecycle's BlockPool and a plain C free-list replay the same trace.

The trace is ``w1_ops`` of the reference traces (``bench/data/traces.npz``): rows ``(op, seq_id, k)``, op 1 allocates k
blocks for the new sequence ``seq_id``, op 0 frees every block of ``seq_id``; it ends with the drain
of the sequences still live. Without that file, ``generate_w1_ops`` builds a trace of the same shape
from a seed. The figure is the replay's time divided by the blocks allocated (each is also freed),
the median over a few repeats.

lifecycle is driven the way a scheduler drives it: a Python loop over the ops calling the public
API, in the two forms it offers. ``lifecycle``: ``allocate(k)`` returns a new block table for a new
sequence and ``dec_ref(its block table)`` releases it when it finishes. ``lifecycle-table``: the
scheduler keeps its block tables in one preallocated int32 table, a row of ``max_k`` ids per live
sequence (as vLLM and SGLang hold theirs), and calls ``allocate_into(table, row, k)`` and
``dec_ref_range(table, row, k)``; no object is made per sequence. The rows are turned into Python
ints before the clock starts, as was done for the peers measured on this trace. ``c-limit`` is the
same replay as one C loop (bench/c_limit.c), timed inside that call.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("lifecycle") is None:  # a source checkout built in place, not installed
    sys.path.insert(0, str(HERE.parent))

from lifecycle._blockpool import BlockPool  # noqa: E402

sys.path.insert(0, str(HERE))
from traces import TRACES, load_traces, meta  # noqa: E402

C_LIMIT_SOURCE = HERE / "c_limit.c"

NUM_BLOCKS = 65_536
N_MAIN_OPS = 200_000
MAX_BLOCKS_PER_SEQ = 64
REPEATS = 7

Row = tuple[int, int, int]


def generate_w1_ops(
    seed: int = 0, num_blocks: int = NUM_BLOCKS, n_main_ops: int = N_MAIN_OPS, max_k: int = MAX_BLOCKS_PER_SEQ
) -> NDArray[np.int32]:
    """A W1 trace of the reference's shape: each new sequence draws k uniform in 1..max_k; while
    its k blocks do not fit, a random live sequence is freed (one op each), then it is allocated
    (one op). After ``n_main_ops`` ops the live sequences are drained in random order. Rows are
    ``(op, seq_id, k)``; a free row's k is the sequence's block count."""
    if num_blocks < max_k:
        raise ValueError(f"num_blocks {num_blocks} must be >= max_k {max_k} so that every draw can fit")
    rng = np.random.default_rng(seed)
    draws = iter(rng.integers(1, max_k + 1, size=n_main_ops + 1).tolist())
    picks = iter(rng.random(n_main_ops).tolist())
    rows: list[Row] = []
    live: list[tuple[int, int]] = []  # (seq_id, k); a random one is removed by swapping with the last
    free = num_blocks
    next_seq = 0
    wanted = next(draws)
    while len(rows) < n_main_ops:
        if wanted <= free:
            rows.append((1, next_seq, wanted))
            live.append((next_seq, wanted))
            next_seq += 1
            free -= wanted
            wanted = next(draws)
        else:
            index = int(next(picks) * len(live))
            live[index], live[-1] = live[-1], live[index]
            seq_id, held = live.pop()
            rows.append((0, seq_id, held))
            free += held
    for index in rng.permutation(len(live)).tolist():
        seq_id, held = live[index]
        rows.append((0, seq_id, held))
    return np.array(rows, dtype=np.int32).reshape(-1, 3)


def load_w1(trace_path: Path) -> tuple[NDArray[np.int32], int, int | None]:
    """(ops, num_blocks, blocks the trace's metadata says it allocates), or a generated trace."""
    if not trace_path.is_file():
        print(f"W1: {trace_path} not found; replaying generate_w1_ops(seed=0)", file=sys.stderr)
        return generate_w1_ops(), NUM_BLOCKS, None
    ops = np.ascontiguousarray(load_traces(trace_path)["w1_ops"], dtype=np.int32)
    w1 = meta(trace_path)["w1"]
    return ops, int(w1["num_blocks"]), int(w1["blocks_allocated"])


def verify_lifecycle(rows: list[Row], num_blocks: int) -> int:
    """Replay once, untimed, counting: returns the blocks allocated, after checking that exactly
    as many were freed and that the pool ends whole."""
    pool = BlockPool(num_blocks)
    tables: dict[int, NDArray[np.int32]] = {}
    allocated = freed = 0
    for op, seq_id, k in rows:
        if op:
            tables[seq_id] = pool.allocate(k)
            allocated += len(tables[seq_id])
        else:
            freed += pool.dec_ref(tables.pop(seq_id))
    pool.check_invariants()
    if tables or freed != allocated or pool.num_free != num_blocks:
        raise AssertionError(
            f"W1 replay left {len(tables)} sequences live, freed {freed} of {allocated} blocks, "
            f"{pool.num_free} of {num_blocks} free"
        )
    return allocated


def time_lifecycle(rows: list[Row], num_blocks: int) -> int:
    """Nanoseconds for one replay through the public API (a fresh pool, the loop only)."""
    pool = BlockPool(num_blocks)
    allocate = pool.allocate
    release = pool.dec_ref
    tables: dict[int, NDArray[np.int32]] = {}
    start = time.perf_counter_ns()
    for op, seq_id, k in rows:
        if op:
            tables[seq_id] = allocate(k)
        else:
            release(tables.pop(seq_id))
    elapsed = time.perf_counter_ns() - start
    if pool.num_free != num_blocks:
        raise AssertionError(f"W1 replay ended with {pool.num_free} of {num_blocks} blocks free")
    return elapsed


def time_lifecycle_table(rows: list[Row], num_blocks: int) -> int:
    """Nanoseconds for one replay through the in-place form: block tables are rows of one
    preallocated table, filled by ``allocate_into`` and released by ``dec_ref_range``."""
    pool = BlockPool(num_blocks)
    allocate_into = pool.allocate_into
    release = pool.dec_ref_range
    # Every live sequence holds at least one block: num_blocks rows always suffice.
    table = np.empty(num_blocks * MAX_BLOCKS_PER_SEQ, dtype=np.int32)
    free_rows = list(range(0, num_blocks * MAX_BLOCKS_PER_SEQ, MAX_BLOCKS_PER_SEQ))
    take_row = free_rows.pop
    give_row = free_rows.append
    row_of: dict[int, int] = {}
    start = time.perf_counter_ns()
    for op, seq_id, k in rows:
        if op:
            row = take_row()
            allocate_into(table, row, k)
            row_of[seq_id] = row
        else:
            row = row_of.pop(seq_id)
            release(table, row, k)  # a free row's k is the sequence's block count
            give_row(row)
    elapsed = time.perf_counter_ns() - start
    if pool.num_free != num_blocks:
        raise AssertionError(f"W1 (table form) ended with {pool.num_free} of {num_blocks} blocks free")
    return elapsed


def _build_c_limit(workdir: Path) -> Any:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("c-limit needs a C compiler (cc or gcc) on PATH")
    library = workdir / "c_limit.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(C_LIMIT_SOURCE)], check=True)
    replay = ctypes.CDLL(str(library)).w1_replay
    replay.restype = ctypes.c_int64
    replay.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
    ]
    return replay


def time_c_limit(replay: Any, ops: NDArray[np.int32], num_blocks: int, blocks: int) -> int:
    """Nanoseconds for one replay in C (timed inside the call), after checking its block count."""
    freed = ctypes.c_int64(0)
    n_seqs = int(ops[:, 1].max()) + 1 if len(ops) else 0
    max_k = int(ops[:, 2].max()) if len(ops) else 0
    elapsed = int(replay(ops.ctypes.data, len(ops), num_blocks, n_seqs, max_k, ctypes.byref(freed)))
    if elapsed < 0:
        raise RuntimeError(f"c-limit replay failed with status {elapsed}")
    if freed.value != blocks:
        raise AssertionError(f"c-limit freed {freed.value} blocks, the trace allocates {blocks}")
    return elapsed


def _median_ns(samples: list[int]) -> float:
    return float(statistics.median(samples))


def _without_gc(timed: Callable[[list[Row], int], int], rows: list[Row], num_blocks: int) -> int:
    # As timeit does: a collection landing inside one repeat is noise, not the pool's cost.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return timed(rows, num_blocks)
    finally:
        if was_enabled:
            gc.enable()


def run(trace_path: Path) -> list[dict[str, Any]]:
    """Replay W1 through lifecycle and through the C limit; one result dict per library."""
    ops, num_blocks, expected_blocks = load_w1(trace_path)
    rows: list[Row] = [(op, seq_id, k) for op, seq_id, k in ops.tolist()]
    blocks = int(ops[ops[:, 0] == 1, 2].sum())
    if expected_blocks is not None and blocks != expected_blocks:
        raise AssertionError(f"trace allocates {blocks} blocks, its metadata says {expected_blocks}")
    counted = verify_lifecycle(rows, num_blocks)
    if counted != blocks:
        raise AssertionError(f"lifecycle allocated {counted} blocks, the trace asks for {blocks}")

    if int(ops[:, 2].max()) > MAX_BLOCKS_PER_SEQ or any(k <= 0 for op, _, k in rows if not op):
        raise AssertionError(f"the table form needs k <= {MAX_BLOCKS_PER_SEQ} and a block count on every free row")

    lifecycle_ns: list[int] = []
    table_ns: list[int] = []
    c_limit_ns: list[int] = []
    with tempfile.TemporaryDirectory(prefix="lifecycle-c-limit-") as workdir:
        replay = _build_c_limit(Path(workdir))
        # Alternate them so that every median sees the same machine load.
        for _ in range(REPEATS):
            lifecycle_ns.append(_without_gc(time_lifecycle, rows, num_blocks))
            table_ns.append(_without_gc(time_lifecycle_table, rows, num_blocks))
            c_limit_ns.append(time_c_limit(replay, ops, num_blocks, blocks))

    return [
        {"workload": "W1", "library": library, "ns_per_block": round(_median_ns(samples) / blocks, 2), "blocks": blocks}
        for library, samples in (("lifecycle", lifecycle_ns), ("lifecycle-table", table_ns), ("c-limit", c_limit_ns))
    ]


if __name__ == "__main__":
    for result in run(TRACES):
        print(json.dumps(result))
