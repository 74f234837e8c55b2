#!/usr/bin/env bash
# The GPU check, made to pass in one call of the device tool (python3, no network, about 9 minutes):
#   1. versions of the build tools and of the driver, first;
#   2. pip install of this checkout (--no-build-isolation --no-deps: nothing is fetched);
#   3. the gpu-marked tests: the device suites on the real driver, a bit-exact 256 MiB batch,
#      wait_stream after a torch kernel, the bandwidth run (bench/device_bench.py);
#   4. the swap bench (bench/swap_bench.py);
#   5. one summary table, last.
# Each step has a timeout (together under 540 s); a failed step is reported and the later ones still
# run where they can. Exit status 0 only when every step passed.
#
#   bench/gpu_check.sh             on the GPU machine
#   bench/gpu_check.sh --dry-run   anywhere without a GPU: the emulated driver (tests/emu_cuda, built
#                                  with cc) stands in for the GPU; GPU_CHECK_DRY_RUN=1 does the same
#
# Needs python3 (or $PYTHON) with pip, setuptools, cython, numpy, cuda-bindings, pytest, hypothesis and
# xxhash (torch, where present, runs three more tests); a C compiler. Files (at most 8) go to $OUT, else to a new temp dir: gpu_check.log (every
# step's full output), gpu-tests.xml, device_bench_gpu.jsonl, swap_bench_gpu.jsonl, summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

DRY_RUN="${GPU_CHECK_DRY_RUN:-0}"
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
    esac
done
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$(mktemp -d -t lifecycle-gpu-check.XXXXXX)}"
mkdir -p "$OUT_DIR"
export OUT="$OUT_DIR"  # the bandwidth test writes its JSON lines there
LOG="$OUT_DIR/gpu_check.log"
STEPS="$(mktemp -t lifecycle-gpu-check-steps.XXXXXX)"  # name<TAB>status<TAB>seconds<TAB>detail
: >"$LOG"
export PYTHONUNBUFFERED=1
# Deprecations in third-party packages must not sink the one run: reported in the log, not fatal.
export LIFECYCLE_GPU_PYTEST_ARGS="-W default::DeprecationWarning -W default::PendingDeprecationWarning"
export LIFECYCLE_GPU_SUITE_TIMEOUT=170 LIFECYCLE_GPU_BENCH_TIMEOUT=80

# Timeouts of the steps, in seconds (their sum stays under the 540 s the device tool allows).
T_VERSIONS=30 T_SMI=10 T_INSTALL=170 T_TESTS=240 T_SWAP=75 T_SUMMARY=10

say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$STEPS"; }

# run_step NAME TIMEOUT CMD...: the command's output goes to the log and to $STEP_OUT (until the
# next step); on failure its tail is shown. Sets STEP_SECONDS.
STEP_OUT="$(mktemp -t lifecycle-gpu-check-step.XXXXXX)"
run_step() {
    local name="$1" limit="$2"
    shift 2
    local start=$SECONDS rc
    printf '\n===== %s (timeout %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
    timeout "$limit" "$@" >"$STEP_OUT" 2>&1
    rc=$?
    cat "$STEP_OUT" >>"$LOG"
    STEP_SECONDS=$((SECONDS - start))
    if [ "$rc" -eq 124 ]; then
        say "$name: timed out after ${limit}s; its last lines:"
        tail -n 25 "$STEP_OUT"
    elif [ "$rc" -ne 0 ]; then
        say "$name: failed (exit $rc); its last lines:"
        tail -n 25 "$STEP_OUT"
    fi
    return "$rc"
}

# ----------------------------------------------------------------------------------- dry run set-up
if [ "$DRY_RUN" = 1 ]; then
    say "DRY RUN: the emulated CUDA driver stands in for the GPU"
    EMU_DIR="$("$PY" tests/emu_cuda/build.py 2>>"$LOG")" || { say "could not build the emulated driver (see $LOG)"; exit 2; }
    export LD_LIBRARY_PATH="$EMU_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LIFECYCLE_GPU_STANDIN=emulator EMU_CUDA_DRIVER_VERSION="${EMU_CUDA_DRIVER_VERSION:-13000}"
fi

# ----------------------------------------------------------------------------------- 1. versions
say "python: $PY; results in $OUT_DIR"
VERSIONS_PY='
import importlib, platform, sys
def version(module, attr="__version__"):
    try:
        return str(getattr(importlib.import_module(module), attr))
    except Exception as exc:
        return f"MISSING ({type(exc).__name__}: {exc})"
def dist(name):
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "MISSING"
rows = [
    ("python", platform.python_version() + " " + sys.executable),
    ("pip", version("pip")),
    ("setuptools", version("setuptools")),
    ("cython", version("Cython")),
    ("numpy", version("numpy")),
    ("cuda-bindings", dist("cuda-bindings")),
    ("pytest", version("pytest")),
    ("pytest-benchmark", dist("pytest-benchmark")),
    ("hypothesis", version("hypothesis")),
    ("xxhash", version("xxhash", "VERSION")),
    ("rich", dist("rich")),
    ("torch", dist("torch")),
]
try:
    from cuda.bindings import driver
    (err,) = driver.cuInit(0)
    rc, v = driver.cuDriverGetVersion()
    rows.append(("CUDA driver", f"{int(v)} (cuInit: {err.name})"))
except Exception as exc:
    rows.append(("CUDA driver", f"not loaded ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc})"))
for name, value in rows:
    print(f"{name:>17}  {value}")
short = {"python": "python", "cython": "cython", "numpy": "numpy", "cuda-bindings": "cuda-bindings", "CUDA driver": "driver"}
print("versions: " + " ".join(f"{short[n]}={v.split()[0]}" for n, v in rows if n in short))
required = {"pip", "setuptools", "cython", "numpy", "cuda-bindings", "pytest", "hypothesis", "xxhash"}
missing = [name for name, value in rows if name in required and value.startswith("MISSING")]
if missing:
    print("missing: " + ", ".join(missing))
    sys.exit(1)
'
start=$SECONDS
versions_ok=1
cc_version="$( (command -v "${CC:-cc}" >/dev/null && "${CC:-cc}" --version 2>&1 | head -n 1) || echo 'no C compiler')"
printf '%17s  %s\n' "cc" "$cc_version" | tee -a "$LOG"
if command -v nvcc >/dev/null 2>&1; then
    printf '%17s  %s\n' "nvcc" "$(nvcc --version 2>&1 | tail -n 1)" | tee -a "$LOG"
fi
timeout "$T_VERSIONS" "$PY" -c "$VERSIONS_PY" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || versions_ok=0
if [ "$DRY_RUN" != 1 ] && command -v nvidia-smi >/dev/null 2>&1; then
    smi="$(timeout "$T_SMI" nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)" \
        || smi="nvidia-smi did not answer"
    printf '%17s  %s\n' "nvidia-smi" "$smi" | tee -a "$LOG"
fi
summary_versions="$(grep '^versions: ' "$LOG" | tail -n 1 | sed 's/^versions: //')"
if [ "$versions_ok" = 1 ]; then
    record "versions" "ok" "$((SECONDS - start))" "$summary_versions"
else
    record "versions" "FAILED" "$((SECONDS - start))" "$(grep '^missing:' "$LOG" | head -n 1)"
fi

# ----------------------------------------------------------------------------------- 2. install
installed=0
if [ "$versions_ok" = 1 ]; then
    say "pip install --no-build-isolation --no-deps --disable-pip-version-check ."
    if run_step "install" "$T_INSTALL" "$PY" -m pip install --no-build-isolation --no-deps --disable-pip-version-check \
            --no-input .; then
        # The tests import lifecycle from this tree (pytest's pythonpath "."): give it the compiled
        # modules pip just built instead of compiling them a second time.
        site_pkg="$(cd / && "$PY" -c 'import lifecycle, os; print(os.path.dirname(lifecycle.__file__))' 2>>"$LOG")"
        if [ -n "$site_pkg" ] && [ "$site_pkg" != "$(pwd)/lifecycle" ]; then
            for so in "$site_pkg"/_*.so; do
                [ -e "$so" ] && cp -f "$so" lifecycle/
            done
        fi
        if "$PY" -c 'import lifecycle._blockpool, lifecycle._coreviews, lifecycle._dlpack, lifecycle._evlog, lifecycle._groups, lifecycle._hostcopy, lifecycle._hosttier, lifecycle._kvcache, lifecycle._modelcalls, lifecycle._radix, lifecycle._records, lifecycle._retention, lifecycle._saltmap, lifecycle._sglang_pagetree, lifecycle._slots, lifecycle._snapids, lifecycle._sync, lifecycle._tierkey' >>"$LOG" 2>&1; then
            installed=1
            record "install" "ok" "$STEP_SECONDS" "pip install --no-build-isolation --no-deps; compiled modules import"
        else
            record "install" "FAILED" "$STEP_SECONDS" "installed, but the compiled modules do not import (see gpu_check.log)"
        fi
    else
        record "install" "FAILED" "$STEP_SECONDS" "pip install failed (see gpu_check.log)"
    fi
else
    record "install" "skipped" 0 "a required package is missing"
fi

# ----------------------------------------------------------------------------------- 3. gpu tests
if [ "$installed" = 1 ]; then
    say "gpu-marked tests (device suites on the driver, 256 MiB batch, wait_stream after torch, bandwidth)"
    run_step "gpu tests" "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs -s \
        -W default::DeprecationWarning -W default::PendingDeprecationWarning \
        --junitxml="$OUT_DIR/gpu-tests.xml" tests/test_device_gpu.py
    rc=$?
    last="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$STEP_OUT" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')"
    suites="$(grep -E '^device suites on the GPU: ' "$STEP_OUT" | tail -n 1 | sed 's/^device suites on the GPU: //')"
    if grep -q "needs an NVIDIA GPU" "$STEP_OUT"; then
        record "gpu tests" "FAILED" "$STEP_SECONDS" "no GPU visible to the CUDA driver ($last)"
    elif [ "$rc" -eq 0 ]; then
        record "gpu tests" "ok" "$STEP_SECONDS" "$last; device suites: ${suites:-?}"
    else
        record "gpu tests" "FAILED" "$STEP_SECONDS" "exit $rc: ${last:-no summary}; device suites: ${suites:-?}"
    fi
    if [ -s "$OUT_DIR/device_bench_gpu.jsonl" ]; then
        record "bandwidth" "ok" "-" "$("$PY" -c '
import json, sys
sys.path.insert(0, "bench")
from device_bench import MiB, TARGET
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
big = [r for r in rows if r["bytes"] >= MiB]
worst = min(min(r["compaction_ratio"], r["swap_out_ratio"], r["swap_in_ratio"]) for r in big)
peak = max(r["plain_dtod_GBps"] for r in rows)
print(f"worst ratio from 1 MiB {worst:.0%} (target {TARGET:.0%}); plain D2D up to {peak:.0f} GB/s")
' "$OUT_DIR/device_bench_gpu.jsonl" 2>>"$LOG")"
    else
        record "bandwidth" "FAILED" "-" "no device_bench_gpu.jsonl (the bandwidth test did not finish)"
    fi
else
    record "gpu tests" "skipped" 0 "not installed"
    record "bandwidth" "skipped" 0 "not installed"
fi

# ----------------------------------------------------------------------------------- 4. swap bench
if [ "$installed" = 1 ]; then
    say "swap save/restore (fraction of pinned<->device copies of the same bytes)"
    if run_step "swap bench" "$T_SWAP" "$PY" bench/swap_bench.py --device cuda --json; then
        grep '^{' "$STEP_OUT" | "$PY" -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin]
rows = [r for r in rows if r.get("bench") == "swap"]
with open(sys.argv[1], "w") as out:
    out.writelines(json.dumps(r) + "\n" for r in rows)
' "$OUT_DIR/swap_bench_gpu.jsonl" 2>>"$LOG"
        detail="$("$PY" -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
top = max(r["tokens"] for r in rows)
parts = ["{} {:.0%}".format(r["op"], r["fraction"]) for r in rows if r["tokens"] == top]
print("{} tokens: {} of memcpy".format(top, ", ".join(parts)))
' "$OUT_DIR/swap_bench_gpu.jsonl" 2>>"$LOG")"
        record "swap bench" "ok" "$STEP_SECONDS" "${detail:-see swap_bench_gpu.jsonl}"
    else
        record "swap bench" "FAILED" "$STEP_SECONDS" "see gpu_check.log"
    fi
else
    record "swap bench" "skipped" 0 "not installed"
fi

# ----------------------------------------------------------------------------------- 5. summary
if [ -s "$OUT_DIR/device_bench_gpu.jsonl" ]; then
    echo
    timeout "$T_SUMMARY" "$PY" -c '
import json, sys
sys.path.insert(0, "bench")
from device_bench import format_table
print(format_table([json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]))
' "$OUT_DIR/device_bench_gpu.jsonl" | tee -a "$LOG"
fi
failed="$(cut -f2 "$STEPS" | grep -cv '^ok$')"
mode="GPU"
[ "$DRY_RUN" = 1 ] && mode="DRY RUN (emulated driver, no GPU)"
{
    echo
    echo "gpu_check summary: $mode"
    printf '%-11s %-8s %5s  %s\n' "step" "status" "secs" "detail"
    while IFS=$'\t' read -r name status secs detail; do
        printf '%-11s %-8s %5s  %s\n' "$name" "$status" "$secs" "$detail"
    done <"$STEPS"
    if [ "$failed" -eq 0 ]; then verdict="PASS"; else verdict="FAIL ($failed step(s) not ok)"; fi
    printf '%-11s %-8s %5s  %s\n' "overall" "$verdict" "$SECONDS" "files in $OUT_DIR: $(ls "$OUT_DIR" | paste -sd' ' -)"
} | tee "$OUT_DIR/summary.txt" | tee -a "$LOG"
rm -f "$STEPS" "$STEP_OUT"
[ "$failed" -eq 0 ]
