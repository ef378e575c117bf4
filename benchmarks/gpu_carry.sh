#!/usr/bin/env bash
# Build device_carry/wheels: the wheels benchmarks/gpu_suite.sh installs on a GPU machine without internet.
#   benchmarks/gpu_carry.sh [DEST]     (DEST defaults to device_carry/wheels)
# It first rewrites benchmarks/gpu_suite_requirements.txt from this venv (rolectl's non-torch
# requirements, pinned at the installed versions; `gpu_suite --dry-run` checks its names in CI).
# Binary wheels for CPython 3.11 and 3.12 on x86_64 Linux (a source-only pure-Python package is built
# into a wheel here), without dependencies: the list is already the whole closure, and torch (with
# numpy) must never be replaced on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIST=benchmarks/gpu_suite_requirements.txt
"$PY" -m benchmarks.gpu_suite --requirements > "$LIST"
DEST=${1:-device_carry/wheels}
mkdir -p "$DEST"
PIP=("$PY" -m pip)
"$PY" -m pip --version >/dev/null 2>&1 || PIP=(pip --python "$PY")  # a venv made --without-pip
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
grep -v '^#' "$LIST" | grep . | while read -r req; do
    for version in 3.11 3.12; do
        if ! "${PIP[@]}" download --quiet --only-binary=:all: --no-deps --dest "$DEST" \
                --python-version "$version" --implementation cp "${PLATFORMS[@]}" "$req" 2>/dev/null; then
            # published as source only (nkeys): build it here; it must come out pure Python
            "${PIP[@]}" wheel --quiet --no-deps --wheel-dir "$DEST" "$req"
            name=$(echo "${req%%==*}" | tr '-' '_')
            ls "$DEST" | grep -iq "^${name}-.*-py3-none-any.whl$" \
                || { echo "gpu_carry.sh: $req has no wheel for CPython $version and is not pure Python" >&2; exit 1; }
            break
        fi
    done
done
cp "$LIST" "$DEST/requirements.txt"
echo "$(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST (carry it: run(carry=[\"device_carry\"]))"
