#!/usr/bin/env bash
# Install a kv-lifecycle wheel as a user would, into a fresh venv with no C compiler on PATH, and
# run it: `lifecycle simulate --requests 50`, then the plot extra added from the same wheel (pip
# must not build anything: with no compiler, a build would fail) and a run with --plot.
#
#   tools/check_wheel.sh WHEEL [PYTHON]       PYTHON: the interpreter of the venv (default: python3)
#
# Needs PyPI for the wheel's dependencies. Runs outside the checkout, so the checkout's lifecycle
# cannot be what is imported.
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
name="$(basename "$1")"
wheel="$(cd "$(dirname "$1")" && pwd)/$name"
python="${2:-python3}"
[ -f "$wheel" ] || { echo "check_wheel.sh: no wheel at $wheel" >&2; exit 2; }

scratch="$(mktemp -d -t lifecycle-check-wheel.XXXXXX)"
rm_command="$(command -v rm)"  # PATH will not have it
trap '"$rm_command" -rf "$scratch"' EXIT
"$python" -m venv "$scratch/venv"
cd "$scratch"
unset CC CXX LDSHARED
export PATH="$scratch/venv/bin"  # nothing else: no cc, gcc or clang
for compiler in cc gcc clang; do
    if command -v "$compiler" >/dev/null 2>&1; then
        echo "check_wheel.sh: $compiler is still on PATH" >&2
        exit 1
    fi
done

echo "== pip install $name"
pip install -q --disable-pip-version-check --only-binary :all: "$wheel"
echo "== lifecycle simulate --requests 50"
lifecycle simulate --requests 50 --quiet
echo "== pip install '$name[plot]'"
pip install -q --disable-pip-version-check --only-binary :all: "$wheel[plot]"
lifecycle simulate --requests 50 --quiet --plot "$scratch/occupancy.png" >/dev/null
[ -s "$scratch/occupancy.png" ] || { echo "check_wheel.sh: --plot wrote nothing" >&2; exit 1; }
echo "check_wheel.sh: ok ($(lifecycle --version))"
