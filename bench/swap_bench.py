"""Swap throughput: save and restore of one sequence as a fraction of memcpy of the same bytes.

    python bench/swap_bench.py                        # host device, table
    python bench/swap_bench.py --json                 # one JSON line per measurement
    python bench/swap_bench.py --device cuda --json   # on a GPU (bench/gpu_check.sh)

A llama-like model (Llama-3-8B's attention layers: 8 KV heads of dim 128, float16, blocks of 16
tokens; ``--layers`` of its 32 layers, 4 by default so that a 32k-token sequence's KV is 512 MiB)
holds one sequence of 1k, 4k, 16k and 32k tokens with random KV. For each size, in the same run and
alternating so that background load hits both alike:

- ``memcpy``: the sequence's bytes (each layer's range of blocks) copied once: host: numpy
  ``copyto`` into a pre-faulted buffer of the record's size; CUDA: device -> pinned (save) and
  pinned -> device (restore) copies of the same ranges;
- ``save``: ``save_sequence_state`` into a pre-faulted host buffer (the swap tier's writer),
  checksums included;
- ``restore``: ``restore_sequence_state`` of that record into a fresh sequence (block allocation
  included), every checksum verified.

Fractions are memcpy time / measured time (best of the repeats); target >= 0.70 from 4k tokens. The
staged path (what CUDA uses: device -> pinned staging -> stream) is measured on the host too, for
reference. Also reported: xxh3-64 throughput, and the peak extra memory of save and restore of the
32k-token sequence (tracemalloc peak, plus the staging buffer where one is used).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import numpy.typing as npt
import xxhash

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from lifecycle import swap  # noqa: E402
from lifecycle.config import AttentionLayer, ModelConfig  # noqa: E402
from lifecycle.device import open_device  # noqa: E402
from lifecycle.model import HybridModel  # noqa: E402
from lifecycle.sequence import SequenceState  # noqa: E402
from lifecycle.swap import staging  # noqa: E402
from lifecycle.swap.tier import _ViewReader, _ViewWriter  # noqa: E402

MiB = 1 << 20
TOKENS = [1024, 4096, 16384, 32768]
TARGET = 0.70
Result = dict[str, Any]


def llama_like(num_layers: int, max_tokens: int) -> ModelConfig:
    attention = AttentionLayer(num_kv_heads=8, head_dim=128)
    return ModelConfig(
        layers=(attention,) * num_layers,
        block_size=16,
        num_blocks=2 * (max_tokens // 16) + 8,  # the saved sequence and a restored one
        max_seqs=4,
        num_query_heads=32,
        name=f"llama-like-{num_layers}l",
    )


def best_of(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Best wall time of each run, the runs alternating (after one warm-up each)."""
    for run in runs.values():
        run()
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def prefaulted(nbytes: int) -> npt.NDArray[np.uint8]:
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(1)  # touch every page once, as a reused swap buffer would be
    return buf


def fill_random(model: HybridModel, seq: SequenceState, num_tokens: int, rng: np.random.Generator) -> None:
    model.grow(seq, num_tokens)
    seq.append_tokens(rng.integers(0, 128_000, size=num_tokens))
    kv = model.kv_pool
    assert kv is not None
    noise = rng.integers(1, 256, size=4 * MiB, dtype=np.uint8)
    staging = model.device.alloc_pinned(noise.nbytes)
    model.device.host_array(staging, noise.nbytes)[:] = noise
    for addr, nbytes in kv.block_ranges(seq.block_table.tolist()):
        for start in range(0, nbytes, noise.nbytes):
            model.device.copy_htod(addr + start, staging, min(noise.nbytes, nbytes - start))
    model.device.synchronize()
    model.device.free_pinned(staging)


def layer_ranges(model: HybridModel, seq: SequenceState) -> list[tuple[int, int]]:
    """The device ranges save reads: each layer's runs of consecutive blocks of ``seq``."""
    kv = model.kv_pool
    assert kv is not None
    runs = staging._block_runs(seq.block_table)
    return [
        r for layer in range(kv.num_layers) for r in staging._kv_ranges(kv, layer, kv.layer_block_bytes(layer), runs)
    ]


def memcpy_runs(
    model: HybridModel, ranges: list[tuple[int, int]], record: npt.NDArray[np.uint8]
) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(save-direction copy, restore-direction copy, cleanup) of the sequence's bytes."""
    device = model.device
    if device.kind == "host":
        views = [device.device_array(addr, (nbytes,), np.uint8) for addr, nbytes in ranges]
        offsets = np.cumsum([0] + [n for _, n in ranges]).tolist()

        def out() -> None:
            for view, start in zip(views, offsets, strict=False):
                np.copyto(record[start : start + view.nbytes], view)

        def back() -> None:
            for view, start in zip(views, offsets, strict=False):
                np.copyto(view, record[start : start + view.nbytes])

        return out, back, lambda: None
    total = sum(n for _, n in ranges)
    pinned = device.alloc_pinned(total)

    def out_cuda() -> None:
        offset = 0
        for addr, nbytes in ranges:
            device.copy_dtoh(pinned + offset, addr, nbytes)
            offset += nbytes
        device.synchronize()

    def back_cuda() -> None:
        offset = 0
        for addr, nbytes in ranges:
            device.copy_htod(addr, pinned + offset, nbytes)
            offset += nbytes
        device.synchronize()

    return out_cuda, back_cuda, lambda: device.free_pinned(pinned)


def measure_size(model: HybridModel, num_tokens: int, rng: np.random.Generator, repeats: int) -> list[Result]:
    seq = model.alloc_sequence()
    fill_random(model, seq, num_tokens, rng)
    nbytes = swap.record_nbytes(model.config, seq.num_blocks, seq.num_tokens)
    record = prefaulted(nbytes)
    ranges = layer_ranges(model, seq)
    copy_out, copy_back, cleanup = memcpy_runs(model, ranges, record)
    payload = sum(n for _, n in ranges)
    staging = swap.StagingBuffer(model.device)
    staged_ctx = swap.SwapContext(
        model.config, model.device, model.kv_pool, model.ssm_pool, staging=staging, zero_copy_host=False
    )

    def save() -> None:
        model.save_sequence_state(seq, cast(BinaryIO, _ViewWriter(record.data)))

    def save_staged() -> None:
        swap.save(staged_ctx, seq, cast(BinaryIO, _ViewWriter(record.data)))

    def restore() -> None:
        target = model.alloc_sequence()
        try:
            model.restore_sequence_state(target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
        finally:
            model.free_sequence(target)

    def restore_staged() -> None:
        target = model.alloc_sequence()
        model.grow(target, seq.num_tokens)
        try:
            swap.restore(staged_ctx, target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
        finally:
            model.free_sequence(target)

    save()
    times = best_of(
        {"memcpy_out": copy_out, "save": save, "memcpy_back": copy_back, "restore": restore,
         "save_staged": save_staged, "restore_staged": restore_staged},
        repeats,
    )  # fmt: skip
    cleanup()
    staging.release()
    model.free_sequence(seq)
    results = []
    for op, base in (("save", "memcpy_out"), ("restore", "memcpy_back")):
        for path, key in (("direct" if model.device.kind == "host" else "staged", op), ("staged", f"{op}_staged")):
            if model.device.kind != "host" and key.endswith("_staged"):
                continue  # on CUDA the model's own path is the staged one
            results.append({
                "bench": "swap", "device": model.device.kind, "tokens": num_tokens, "op": op, "path": path,
                "record_bytes": nbytes, "payload_bytes": payload, "ranges": len(ranges),
                "seconds": times[key], "memcpy_seconds": times[base],
                "gbps": nbytes / times[key] / 1e9, "memcpy_gbps": payload / times[base] / 1e9,
                "fraction": times[base] / times[key],
                "target": TARGET if num_tokens >= 4096 else None,
            })  # fmt: skip
    return results


def xxh3_throughput() -> list[Result]:
    results = []
    for size in (MiB, 256 * MiB):
        data = np.random.default_rng(1).integers(0, 256, size=size, dtype=np.uint8)
        reps = max(3, (512 * MiB) // size)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                xxhash.xxh3_64_intdigest(data.data)
            best = min(best, (time.perf_counter() - start) / reps)
        results.append({"bench": "xxh3", "bytes": size, "gbps": size / best / 1e9})
    return results


def peak_memory(model: HybridModel, num_tokens: int, rng: np.random.Generator) -> list[Result]:
    """tracemalloc peak of one save and one restore (the record buffer excluded: it is the output)."""
    seq = model.alloc_sequence()
    fill_random(model, seq, num_tokens, rng)
    record = prefaulted(swap.record_nbytes(model.config, seq.num_blocks, seq.num_tokens))
    staging = swap.StagingBuffer(model.device)
    staging.acquire()
    staged_ctx = swap.SwapContext(
        model.config, model.device, model.kv_pool, model.ssm_pool, staging=staging, zero_copy_host=False
    )
    direct = model.device.kind == "host"
    results = []

    def traced(run: Callable[[], None]) -> int:
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        run()
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        return peak

    def restore_with(ctx: swap.SwapContext | None) -> Callable[[], None]:
        def run() -> None:
            target = model.alloc_sequence()
            try:
                if ctx is None:
                    model.restore_sequence_state(target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
                else:
                    model.grow(target, seq.num_tokens)
                    swap.restore(ctx, target, seq.num_blocks, cast(BinaryIO, _ViewReader(record.data)))
            finally:
                model.free_sequence(target)

        return run

    def save_with(ctx: swap.SwapContext | None) -> Callable[[], None]:
        def run() -> None:
            if ctx is None:
                model.save_sequence_state(seq, cast(BinaryIO, _ViewWriter(record.data)))
            else:
                swap.save(ctx, seq, cast(BinaryIO, _ViewWriter(record.data)))

        return run

    # Without the model's staging buffer (model.py as of now) CUDA allocates one per call.
    model_staging = 0 if direct else swap.DEFAULT_STAGING_BYTES
    path = "direct" if direct else "staged"
    runs: list[tuple[str, str, Callable[[], None], int]] = [
        ("save", path, save_with(None), model_staging),
        ("restore", path, restore_with(None), model_staging),
    ]
    if direct:
        runs += [
            ("save", "staged", save_with(staged_ctx), staging.nbytes),
            ("restore", "staged", restore_with(staged_ctx), staging.nbytes),
        ]
    for op, path, run, staging_bytes in runs:
        run()
        peak = traced(run)
        results.append({
            "bench": "peak_memory", "tokens": num_tokens, "op": op, "path": path, "tracemalloc_peak_bytes": peak,
            "staging_bytes": staging_bytes, "extra_bytes": peak + staging_bytes, "record_bytes": record.nbytes,
        })  # fmt: skip
    staging.release()
    model.free_sequence(seq)
    return results


def format_table(results: list[Result]) -> str:
    lines = [f"{'tokens':>7} {'op':>8} {'path':>7} {'record MiB':>10} {'GB/s':>7} {'memcpy GB/s':>11} {'fraction':>8}"]
    for r in results:
        if r["bench"] == "swap":
            flag = "" if r["target"] is None else ("  ok" if r["fraction"] >= r["target"] else "  BELOW 0.70")
            lines.append(
                f"{r['tokens']:>7} {r['op']:>8} {r['path']:>7} {r['record_bytes'] / MiB:>10.1f} {r['gbps']:>7.2f} "
                f"{r['memcpy_gbps']:>11.2f} {r['fraction']:>8.2f}{flag}"
            )
    for r in results:
        if r["bench"] == "xxh3":
            lines.append(f"xxh3-64 over {r['bytes'] // MiB} MiB: {r['gbps']:.1f} GB/s")
    for r in results:
        if r["bench"] == "peak_memory":
            lines.append(
                f"peak extra memory, {r['op']} {r['path']} of {r['tokens']} tokens "
                f"({r['record_bytes'] / MiB:.0f} MiB): "
                f"{r['extra_bytes'] / 1024:.0f} KiB (tracemalloc {r['tracemalloc_peak_bytes'] / 1024:.0f} KiB "
                f"+ staging {r['staging_bytes'] / 1024:.0f} KiB)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["host", "cuda"], default="host")
    parser.add_argument("--layers", type=int, default=4, help="attention layers of the llama-like model (default 4)")
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args(argv)
    device = open_device(args.device)
    model = HybridModel(llama_like(args.layers, max(args.tokens)), device)
    rng = np.random.default_rng(0)
    results: list[Result] = []
    try:
        for num_tokens in args.tokens:
            results += measure_size(model, num_tokens, rng, args.repeats)
        results += xxh3_throughput()
        results += peak_memory(model, max(args.tokens), rng)
        results += peak_memory(model, min(args.tokens), rng)
    finally:
        model.teardown()
        device.close()
    if args.json:
        for result in results:
            print(json.dumps(result))
    else:
        print(f"swap on {device.name}, llama-like x{args.layers} layers (8 KV heads x 128, fp16, 16-token blocks)")
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
