"""The device suites and a bandwidth run on a real GPU (``gpu`` marker; skipped without one).

``bench/gpu_check.sh`` runs this module on a GPU machine. The suites run in a child pytest with
``LIFECYCLE_TEST_DEVICE=cuda`` (the same files and list as the emulated run); the bandwidth run
prints the ratios of ``bench/device_bench.py``. ``bench/gpu_check.sh --dry-run`` sets
``LIFECYCLE_GPU_STANDIN=emulator`` so that the emulated driver stands in for the GPU here.

The environment can bound the child runs (``LIFECYCLE_GPU_SUITE_TIMEOUT``,
``LIFECYCLE_GPU_BENCH_TIMEOUT``, seconds) and add pytest options to the suites' child run
(``LIFECYCLE_GPU_PYTEST_ARGS``), as gpu_check.sh does to fit the device tool's time limit.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devices import (
    EXPECT_DRIVER_VERSION_ENV,
    EXPECT_EMULATOR_ENV,
    TEST_DEVICE_ENV,
    loaded_emulator,
    read_device,
    write_device,
)
from lifecycle.errors import DriverNotFound
from test_device_emulated import EMULATED_SUITES

REPO = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
STANDIN_ENV = "LIFECYCLE_GPU_STANDIN"
SUITE_TIMEOUT_S = int(os.environ.get("LIFECYCLE_GPU_SUITE_TIMEOUT", "300"))
BENCH_TIMEOUT_S = int(os.environ.get("LIFECYCLE_GPU_BENCH_TIMEOUT", "300"))
EXTRA_PYTEST_ARGS = shlex.split(os.environ.get("LIFECYCLE_GPU_PYTEST_ARGS", ""))


def emulator_stands_in() -> bool:
    """True in the dry run of bench/gpu_check.sh: the emulated driver plays the GPU."""
    return os.environ.get(STANDIN_ENV) == "emulator"


def gpu_present() -> bool:
    """True when a real CUDA driver loads in this process and sees a GPU (or the emulated one,
    where it stands in)."""
    if loaded_emulator() is not None and not emulator_stands_in():
        return False
    try:
        from lifecycle.device.cuda import CudaDevice

        CudaDevice(0).close()
    except DriverNotFound:
        return False
    return emulator_stands_in() or loaded_emulator() is None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_present(), reason="needs an NVIDIA GPU and driver")]


def test_device_suites_pass_on_the_gpu() -> None:
    env = dict(os.environ)
    env[TEST_DEVICE_ENV] = "cuda"
    env.pop(EXPECT_EMULATOR_ENV, None)
    env.pop(EXPECT_DRIVER_VERSION_ENV, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rfEs",
           *EXTRA_PYTEST_ARGS, *EMULATED_SUITES]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT_S, check=False)
    output = proc.stdout + proc.stderr
    print(f"device suites on the GPU: {output.strip().splitlines()[-1] if output.strip() else '(no output)'}")
    assert proc.returncode == 0, output[-8000:]


def test_a_256_mib_scattered_batch_is_bit_exact_on_the_gpu() -> None:
    from lifecycle.device.cuda import CudaDevice

    dev = CudaDevice(0)
    try:
        block = 64 * 1024
        nblocks = 256 * MiB // block
        data = np.random.default_rng(0).integers(0, 256, nblocks * block, dtype=np.uint8)
        src = dev.alloc(data.nbytes)
        dst = dev.alloc(data.nbytes)
        write_device(dev, src, data)
        order = np.random.default_rng(1).permutation(nblocks).astype(np.int64)
        rows = np.stack([dst + order * block, src + np.arange(nblocks, dtype=np.int64) * block,
                         np.full(nblocks, block, dtype=np.int64)], axis=1)
        dev.copy_batch(rows)
        dev.synchronize()
        out = read_device(dev, dst, data.nbytes).reshape(nblocks, block)
        assert np.array_equal(out[order], data.reshape(nblocks, block))
        print(f"{dev.name}: driver {dev.driver_version}, cuMemcpyBatchAsync used: {dev.batch_copies}")
        dev.free(src)
        dev.free(dst)
    finally:
        dev.close()


def cuda_torch() -> Any:
    """torch with a GPU it can use (the test is skipped otherwise, and under the emulator)."""
    if loaded_emulator() is not None:
        pytest.skip("needs a real GPU to run a torch kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own import-time warnings are not ours to fail on
        torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    return torch


def test_copies_after_wait_stream_see_what_a_torch_kernel_wrote() -> None:
    torch = cuda_torch()
    from lifecycle.device.cuda import CudaDevice

    dev = CudaDevice(0)
    try:
        nbytes = 64 * MiB
        ptr = dev.alloc(nbytes)
        dev.memset(ptr, 0, nbytes)
        dev.synchronize()
        target = torch.as_tensor(dev.device_array(ptr, (nbytes,), np.uint8), device="cuda")
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            sleep = getattr(torch.cuda, "_sleep", None)
            if sleep is not None:
                sleep(200_000_000)  # keeps the engine's stream busy while the wait is issued
            target.fill_(7)
        dev.wait_stream(engine)
        out = read_device(dev, ptr, nbytes)
        engine.synchronize()
        del target
        assert (out == 7).all()
        dev.free(ptr)
    finally:
        dev.close()


def test_copies_inside_use_stream_follow_a_torch_kernel_on_that_stream() -> None:
    torch = cuda_torch()
    from lifecycle.device.cuda import CudaDevice

    dev = CudaDevice(0)
    try:
        nbytes = 64 * MiB
        src, dst = dev.alloc(nbytes), dev.alloc(nbytes)
        dev.memset(src, 0, nbytes)
        dev.synchronize()
        target = torch.as_tensor(dev.device_array(src, (nbytes,), np.uint8), device="cuda")
        engine = torch.cuda.Stream()
        with torch.cuda.stream(engine):
            sleep = getattr(torch.cuda, "_sleep", None)
            if sleep is not None:
                sleep(200_000_000)  # keeps the engine's stream busy while the copy is issued
            target.fill_(7)
        with dev.use_stream(engine):
            dev.copy_dtod(dst, src, nbytes)  # after fill_ on the same stream, no wait issued
        out = read_device(dev, dst, nbytes)  # the device's stream joined the block's at its end
        engine.synchronize()
        del target
        assert (out == 7).all()
        dev.free(src)
        dev.free(dst)
    finally:
        dev.close()


def test_torch_takes_cuda_kv_views_through_dlpack_as_their_dtype_without_a_copy() -> None:
    torch = cuda_torch()
    from lifecycle.config import AttentionLayer, ModelConfig
    from lifecycle.device.cuda import CudaDevice
    from lifecycle.pools import KVPool

    dev = CudaDevice(0)
    layers = (AttentionLayer(num_kv_heads=2, head_dim=64, dtype="bfloat16"),
              AttentionLayer(num_kv_heads=2, head_dim=64, dtype="float8_e4m3fn"))
    kv = KVPool(dev, ModelConfig(layers=layers, block_size=16, num_blocks=32))
    try:
        tensors = [torch.from_dlpack(kv.kv_view(layer)) for layer in range(2)]
        assert [t.dtype for t in tensors] == [torch.bfloat16, torch.float8_e4m3fn]
        assert [t.data_ptr() for t in tensors] == list(kv.layer_ptrs)
        assert tuple(tensors[0].shape) == kv.layer_shape(0)
        tensors[0][3].fill_(1.5)
        torch.cuda.synchronize()
        del tensors
        block = read_device(dev, kv.block_addr(0, 3), kv.layer_block_bytes(0)).view(np.uint16)
        assert (block == 0x3FC0).all()  # 1.5 in bfloat16
    finally:
        kv.release()
        dev.close()


def test_bandwidth_ratios_on_the_gpu() -> None:
    cmd = [sys.executable, str(REPO / "bench" / "device_bench.py"), "--device", "cuda", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["bytes"] for r in results] == [64 * 1024 * 4**i for i in range(7)]
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "device_bench_gpu.jsonl").write_text(proc.stdout)
    for r in results:
        print(f"{r['bytes'] // 1024:>7} KiB  compaction {r['compaction_ratio']:.0%}  swap out {r['swap_out_ratio']:.0%}"
              f"  swap in {r['swap_in_ratio']:.0%}  plain D2D {r['plain_dtod_GBps']:.0f} GB/s")
