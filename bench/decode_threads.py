"""Two threads stepping two independent models: does the batched step scale with cores?

    python bench/decode_threads.py [--steps 600] [--repeats 5] [--json]

``HybridModel.step`` releases the GIL for the whole batch, so two engine threads (two models, say
two pipeline stages or two replicas in one process) should step at nearly twice the rate of one.
Each model is W4's shape (bench/w4.py): a pool of 65,536 blocks of 16 tokens and 256 running
sequences with W4's first 256 prompts admitted before the clock; every step appends one token to
each (W4's tokens), growing, writing the engine's table and caching filled blocks. No sequence
finishes and nothing is evicted: after the default 600 steps the 256 sequences hold about 50,000 of
the 65,536 blocks (a run that outgrows the pool stops with an error).

- one thread: model A's steps then model B's, each phase timed;
- two threads: A's and B's steps at once, one thread each, started together behind a barrier; the
  wall time from the barrier until both are done.

Scaling = one thread's time / two threads' time (2.0 at best). Each figure is the best of
``--repeats`` rounds on fresh models, the order of the two modes alternating (the median beside
it). Next to it, what the machine allows any C call of a step's length that releases the GIL: the
same two modes hashing 8 KiB with ``hashlib.sha256`` (which releases the GIL above 2 KiB), as many
calls as steps. And the load the machine carried meanwhile (1-minute load average before and
after, the CPU time other processes took per second of the run, from /proc/stat): on a machine
shared with other work, another process on one of two cores takes what two threads could gain.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from decode import make_model  # noqa: E402
from w2 import no_gc  # noqa: E402
from w4 import W4Trace, generate  # noqa: E402

STEPS = 600
REPEATS = 5


class Engine:
    """One model with W4's first ``running`` sequences admitted and its engine table written."""

    def __init__(self, trace: W4Trace) -> None:
        self.model = make_model(trace)
        self.table = np.zeros((trace.running, self.model.config.max_blocks_per_seq), dtype=np.int32)
        self.seqs = []
        for lane in range(trace.running):
            prompt = trace.prompt(lane)
            seq = self.model.alloc_sequence_for(self.table.shape[1] * trace.block_size)
            self.model.attach_prefix(seq, prompt, grow_to=len(prompt) + 1)
            self.model.cache_sequence(seq)
            self.table[lane, : seq.num_blocks] = seq.block_table
            self.seqs.append(seq)
        self.handles = np.array([seq.handle for seq in self.seqs], dtype=np.int64)

    def run(self, tokens: NDArray[np.int32]) -> int:
        """Step once per row of ``tokens``; the wall time in ns."""
        step, handles, table = self.model.step, self.handles, self.table
        started = time.perf_counter_ns()
        for row in tokens:
            if len(step(handles, row, table=table)):
                raise AssertionError("the pool refused a step: the run must fit in the pool")
        return time.perf_counter_ns() - started

    def close(self) -> None:
        self.model.check_invariants()
        for seq in self.seqs:
            self.model.finish_sequence(seq)
        self.model.teardown()


def one_thread(trace: W4Trace, tokens: NDArray[np.int32]) -> int:
    engines = [Engine(trace), Engine(trace)]
    try:
        with no_gc():
            return sum(engine.run(tokens) for engine in engines)
    finally:
        for engine in engines:
            engine.close()


def two_threads(trace: W4Trace, tokens: NDArray[np.int32]) -> int:
    engines = [Engine(trace), Engine(trace)]
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def work(engine: Engine) -> None:
        barrier.wait()
        try:
            engine.run(tokens)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=work, args=(engine,)) for engine in engines]
    try:
        with no_gc():
            for thread in threads:
                thread.start()
            barrier.wait()
            started = time.perf_counter_ns()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter_ns() - started
    finally:
        for engine in engines:
            engine.close()
    if errors:
        raise errors[0]
    return elapsed


def _hash_calls(data: bytes, calls: int) -> None:
    for _ in range(calls):
        hashlib.sha256(data).digest()


def reference(calls: int, threads: int) -> int:
    """Wall ns for ``threads`` threads each hashing 8 KiB ``calls`` times, one after another when
    ``threads`` is 1 (then twice as many calls)."""
    data = bytes(8 << 10)
    if threads == 1:
        started = time.perf_counter_ns()
        _hash_calls(data, 2 * calls)
        return time.perf_counter_ns() - started
    workers = [threading.Thread(target=_hash_calls, args=(data, calls)) for _ in range(threads)]
    started = time.perf_counter_ns()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter_ns() - started


def _busy_seconds_of_others() -> float:
    """CPU seconds every other process has used since boot: the machine's busy time (/proc/stat)
    less this process's own."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    own = os.times()
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK") - (own.user + own.system)


def measure(steps: int = STEPS, repeats: int = REPEATS) -> dict[str, Any]:
    trace = generate(steps=max(steps, 1), running=256)
    tokens = trace.step_tokens()[:steps]
    load_before = os.getloadavg()[0]
    others_before, wall_before = _busy_seconds_of_others(), time.monotonic()
    serial: list[int] = []
    parallel: list[int] = []
    hashed: dict[int, list[int]] = {1: [], 2: []}
    for round_number in range(repeats):
        modes = [(serial, one_thread), (parallel, two_threads)]
        for times, mode in modes if round_number % 2 == 0 else modes[::-1]:
            times.append(mode(trace, tokens))
        for threads in (1, 2) if round_number % 2 == 0 else (2, 1):
            hashed[threads].append(reference(steps, threads))
    seconds = time.monotonic() - wall_before
    others = _busy_seconds_of_others() - others_before
    best_serial, best_parallel = min(serial), min(parallel)
    return {
        "bench": "two threads stepping two models",
        "steps_per_model": steps,
        "running": trace.running,
        "one_thread_us_per_step": round(best_serial / (2 * steps) / 1e3, 3),
        "two_threads_us_per_step": round(best_parallel / (2 * steps) / 1e3, 3),
        "scaling": round(best_serial / best_parallel, 3),
        "scaling_by_round": [round(s / p, 3) for s, p in zip(serial, parallel)],
        "median_scaling": round(statistics.median(serial) / statistics.median(parallel), 3),
        "reference_us_per_call": round(min(hashed[1]) / (2 * steps) / 1e3, 3),
        "reference_scaling": round(min(hashed[1]) / min(hashed[2]), 3),
        "reference_median_scaling": round(statistics.median(hashed[1]) / statistics.median(hashed[2]), 3),
        "cpus": os.cpu_count(),
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "other_processes_cpu_seconds_per_second": round(others / seconds, 2),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.steps, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print("  ".join(f"{key}={value}" for key, value in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
