#!/usr/bin/env bash
# Device checks on a GPU machine, in one call and under 5 minutes:
#   install the package (no registry access: --no-deps --no-build-isolation), run the gpu-marked
#   tests (the device suites on the real driver, a bit-exact 256 MiB batch, the bandwidth run) and
#   print the bandwidth table last. Results go to $OUT when it is set (else a temp dir).
# Needs: Python with cuda-bindings, cython, numpy, pytest, pytest-benchmark, hypothesis, xxhash, rich.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$(mktemp -d -t lifecycle-gpu-check.XXXXXX)}"
mkdir -p "$OUT_DIR"
export OUT="$OUT_DIR"  # the bandwidth test saves its JSON lines there
PY="${PYTHON:-python}"
say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { say "FAILED: $*"; exit 1; }

say "python: $($PY --version 2>&1); results in $OUT_DIR"
if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
        | tee "$OUT_DIR/nvidia-smi.txt" || say "nvidia-smi did not answer"
fi

say "pip install --no-build-isolation --no-deps ."
timeout 240 "$PY" -m pip install --no-build-isolation --no-deps --no-input -q . >"$OUT_DIR/pip.log" 2>&1 \
    || { tail -n 40 "$OUT_DIR/pip.log"; fail "pip install (see $OUT_DIR/pip.log)"; }

# The tests import lifecycle from the source tree (pytest pythonpath "."): reuse the compiled
# modules pip just built instead of compiling them a second time.
SITE_PKG="$(cd / && "$PY" -c 'import lifecycle, os; print(os.path.dirname(lifecycle.__file__))')"
if [ "$SITE_PKG" != "$(pwd)/lifecycle" ]; then
    for so in "$SITE_PKG"/_*.so; do
        if [ -e "$so" ]; then cp -f "$so" lifecycle/; fi
    done
fi

say "gpu-marked tests"
set +e
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs -s \
    --junitxml="$OUT_DIR/gpu-tests.xml" tests/test_device_gpu.py 2>&1 | tee "$OUT_DIR/gpu-tests.log"
status=${PIPESTATUS[0]}
set -e
tail -n 1 "$OUT_DIR/gpu-tests.log" >"$OUT_DIR/gpu-tests.summary"
if grep -q "needs an NVIDIA GPU" "$OUT_DIR/gpu-tests.log"; then
    fail "no GPU visible to the CUDA driver"
fi
[ "$status" -eq 0 ] || fail "gpu tests (exit $status, see $OUT_DIR/gpu-tests.log)"

say "tests: $(cat "$OUT_DIR/gpu-tests.summary")"
say "bandwidth (ratio = plain copy time / batched copy time; target >= 80% from 1 MiB)"
if [ -s "$OUT_DIR/device_bench_gpu.jsonl" ]; then
    BENCH_JSON="$OUT_DIR/device_bench_gpu.jsonl"
else
    timeout 150 "$PY" bench/device_bench.py --device cuda --json >"$OUT_DIR/device_bench_gpu.jsonl" \
        || fail "device bench"
    BENCH_JSON="$OUT_DIR/device_bench_gpu.jsonl"
fi
say "swap save/restore on the GPU (fraction of pinned<->device copies of the same bytes)"
timeout 120 "$PY" bench/swap_bench.py --device cuda --json >"$OUT_DIR/swap_bench_gpu.jsonl" 2>"$OUT_DIR/swap_bench_gpu.err" \
    || say "swap bench failed (see $OUT_DIR/swap_bench_gpu.err)"
"$PY" - "$BENCH_JSON" <<'PYEOF' | tee "$OUT_DIR/summary.txt"
import json, sys
sys.path.insert(0, "bench")
from device_bench import format_table
results = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
print(format_table(results))
PYEOF
