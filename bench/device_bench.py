"""Device copy bandwidth: compaction-style and swap-style copies as a fraction of a plain copy.

    python bench/device_bench.py                      # host device, table
    python bench/device_bench.py --device cuda --json # one JSON line per size

For each total size (64 KiB .. 256 MiB) the same bytes are moved four ways, in the same run:

- ``plain``: one copy of the whole size (host: ``ctypes.memmove``; CUDA: one ``cuMemcpyDtoDAsync``),
  and for the swap directions one device->pinned / pinned->device copy of the whole size;
- ``compaction``: ``copy_batch`` of block-sized ranges (64 KiB, a (layer, block) of a typical KV
  layout) from scattered sources to scattered destinations, device to device;
- ``swap_out`` / ``swap_in``: ``copy_batch`` gathering the same blocks into pinned staging memory,
  and scattering them back.

Ratios are plain time / measured time (1.0 = as fast as one plain copy). Times are the best of a
few repeats, each ending with ``synchronize()``. On CUDA the pageable (numpy) device->host copy is
reported beside the pinned one.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from lifecycle.device import open_device  # noqa: E402
from lifecycle.device.base import Device  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
SIZES = [64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
BLOCK = 64 * KiB
TARGET = 0.8  # the target ratio for sizes >= 1 MiB

Result = dict[str, Any]


def best_time(run: Callable[[], None], budget_s: float = 0.25, min_reps: int = 3, max_reps: int = 40) -> float:
    """Best wall time of ``run`` over repeats (at least ``min_reps``, until ``budget_s`` is spent)."""
    run()  # warm-up: first touch of pages, lazy driver work
    best = float("inf")
    spent = 0.0
    reps = 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        spent += elapsed
        reps += 1
    return best


def size_label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def measure(device: Device, nbytes: int, block: int = BLOCK, seed: int = 0) -> Result:
    """Times of the plain and the block-wise copies of ``nbytes`` on ``device``, and their ratios."""
    block = min(block, nbytes)
    nblocks = nbytes // block
    nbytes = nblocks * block
    src = device.alloc(nbytes)
    dst = device.alloc(nbytes)
    staging = device.alloc_pinned(nbytes)
    pageable = np.empty(nbytes, dtype=np.uint8)
    try:
        device.memset(src, 0x5A, nbytes)
        device.memset(dst, 0, nbytes)
        device.host_array(staging, nbytes)[:] = 1
        pageable[:] = 2
        device.synchronize()
        rng = np.random.default_rng(seed)
        offsets = np.arange(nblocks, dtype=np.int64) * block
        scattered_src = src + rng.permutation(offsets)
        scattered_dst = dst + rng.permutation(offsets)
        sizes = np.full(nblocks, block, dtype=np.int64)
        compaction = np.stack([scattered_dst, scattered_src, sizes], axis=1)
        gather = np.stack([staging + offsets, scattered_src, sizes], axis=1)
        scatter = np.stack([scattered_dst, staging + offsets, sizes], axis=1)

        def synced(action: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:
                action()
                device.synchronize()

            return run

        if device.kind == "host":
            def memmove() -> None:
                ctypes.memmove(dst, src, nbytes)

            plain_dtod = best_time(memmove)
            plain_dtoh = plain_htod = plain_dtod
            pageable_dtoh = plain_dtod
        else:
            plain_dtod = best_time(synced(lambda: device.copy_dtod(dst, src, nbytes)))
            plain_dtoh = best_time(synced(lambda: device.copy_dtoh(staging, src, nbytes)))
            plain_htod = best_time(synced(lambda: device.copy_htod(dst, staging, nbytes)))
            pageable_dtoh = best_time(synced(lambda: device.copy_dtoh(pageable.ctypes.data, src, nbytes)))
        t_compaction = best_time(synced(lambda: device.copy_batch(compaction)))
        t_swap_out = best_time(synced(lambda: device.copy_batch(gather)))
        t_swap_in = best_time(synced(lambda: device.copy_batch(scatter)))
    finally:
        device.free_pinned(staging)
        device.free(dst)
        device.free(src)

    def gbps(seconds: float) -> float:
        return nbytes / seconds / 1e9

    return {
        "device": device.name,
        "bytes": nbytes,
        "block_bytes": block,
        "copies": nblocks,
        "plain_dtod_GBps": gbps(plain_dtod),
        "plain_dtoh_pinned_GBps": gbps(plain_dtoh),
        "plain_htod_pinned_GBps": gbps(plain_htod),
        "dtoh_pageable_GBps": gbps(pageable_dtoh),
        "compaction_GBps": gbps(t_compaction),
        "swap_out_GBps": gbps(t_swap_out),
        "swap_in_GBps": gbps(t_swap_in),
        "compaction_ratio": plain_dtod / t_compaction,
        "swap_out_ratio": plain_dtoh / t_swap_out,
        "swap_in_ratio": plain_htod / t_swap_in,
    }


def run(device: Device, sizes: list[int] | None = None, block: int = BLOCK) -> list[Result]:
    """One result per size (default: 64 KiB .. 256 MiB)."""
    return [measure(device, n, block) for n in (sizes or SIZES)]


def format_table(results: list[Result]) -> str:
    """The ratios (and plain bandwidths) as a fixed-width text table."""
    head = f"{'size':>8} {'copies':>6} {'plain GB/s':>10} {'compaction':>10} {'swap out':>9} {'swap in':>8}"
    if results and not results[0]["device"].startswith("host"):
        head += f" {'D2H pinned':>10} {'D2H pageable':>12}"
    lines = [f"device: {results[0]['device']}" if results else "no results", head]
    for r in results:
        line = (
            f"{size_label(r['bytes']):>8} {r['copies']:>6} {r['plain_dtod_GBps']:>10.1f} "
            f"{r['compaction_ratio']:>10.0%} {r['swap_out_ratio']:>9.0%} {r['swap_in_ratio']:>8.0%}"
        )
        if not r["device"].startswith("host"):
            line += f" {r['plain_dtoh_pinned_GBps']:>10.1f} {r['dtoh_pageable_GBps']:>12.1f}"
        lines.append(line)
    big = [r for r in results if r["bytes"] >= MiB]
    if big:
        worst = min(min(r["compaction_ratio"], r["swap_out_ratio"], r["swap_in_ratio"]) for r in big)
        verdict = "meets" if worst >= TARGET else "misses"
        lines.append(f"worst ratio for sizes >= 1 MiB: {worst:.0%} ({verdict} the {TARGET:.0%} target)")
    return "\n".join(lines)


def parse_size(text: str) -> int:
    units = {"KIB": KiB, "MIB": MiB, "K": KiB, "M": MiB}
    upper = text.strip().upper()
    for suffix, scale in units.items():
        if upper.endswith(suffix):
            return int(float(upper[: -len(suffix)]) * scale)
    return int(upper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "host", "cuda"], default="host")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    parser.add_argument("--max-size", type=parse_size, default=256 * MiB, help="largest total size (e.g. 64MiB)")
    parser.add_argument("--block", type=parse_size, default=BLOCK, help="bytes per copied range (default 64KiB)")
    args = parser.parse_args(argv)
    device = open_device(args.device)
    try:
        results = run(device, [n for n in SIZES if n <= args.max_size], args.block)
    finally:
        device.close()
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
