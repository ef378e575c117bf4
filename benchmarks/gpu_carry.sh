#!/usr/bin/env bash
# Build device_carry/: what benchmarks/gpu_suite.sh installs on a GPU machine without internet, cut
# into the two device calls that carry it (docs/gpu.md, "The two calls"):
#   benchmarks/gpu_carry.sh
#     device_carry/call1/   part 1 of the ray wheel (too large for one call) and its manifest
#     device_carry/call2/   every other wheel (wheels/), part 2 and the manifest, the two requirement lists
# It first rewrites benchmarks/gpu_suite_requirements.txt (rolectl's non-torch requirements) and
# benchmarks/gpu_suite_engine_requirements.txt (what the hf and fsdp engines add, less the GPU image's
# packages) from this venv, pinned at the installed versions (`gpu_suite --dry-run` checks their names in CI).
# Binary wheels for CPython $PYTHON_VERSIONS (default 3.12, the GPU image's) on x86_64 Linux (a
# source-only pure-Python package is built into a wheel here), without dependencies: the lists are the
# whole closure, and torch (with numpy) must never be replaced on the GPU machine. A wheel over
# $SPLIT_ABOVE_MIB (40: ray's) is split in two, so that both calls leave the same room under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x "$PY" ]] || PY=$(command -v python3)
BASE=benchmarks/gpu_suite_requirements.txt
ENGINE=benchmarks/gpu_suite_engine_requirements.txt
"$PY" -m benchmarks.gpu_carry --requirements > "$BASE"
"$PY" -m benchmarks.gpu_carry --engine-requirements > "$ENGINE"
CARRY=device_carry
rm -rf "$CARRY/call1" "$CARRY/call2"
WHEELS=$CARRY/call2/wheels
mkdir -p "$CARRY/call1" "$WHEELS"
PIP=("$PY" -m pip)
"$PY" -m pip --version >/dev/null 2>&1 || PIP=(pip --python "$PY")  # a venv made --without-pip
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
grep -hv '^#' "$BASE" "$ENGINE" | grep . | while read -r req; do
    for version in ${PYTHON_VERSIONS:-3.12}; do
        if ! "${PIP[@]}" download --quiet --only-binary=:all: --no-deps --dest "$WHEELS" \
                --python-version "$version" --implementation cp "${PLATFORMS[@]}" "$req" 2>/dev/null; then
            # published as source only (nkeys): build it here; it must come out pure Python
            "${PIP[@]}" wheel --quiet --no-deps --wheel-dir "$WHEELS" "$req"
            name=$(echo "${req%%==*}" | tr '-' '_')
            ls "$WHEELS" | grep -iq "^${name}-.*-py3-none-any.whl$" \
                || { echo "gpu_carry.sh: $req has no wheel for CPython $version and is not pure Python" >&2; exit 1; }
            break
        fi
    done
done
cp "$BASE" "$CARRY/call2/requirements.txt"
cp "$ENGINE" "$CARRY/call2/engine_requirements.txt"

# Too large for one call: split so that both calls leave the same room under their limit (call 2
# carries every other wheel besides part 2).
split=0
for wheel in "$WHEELS"/*.whl; do
    size=$(stat -c %s "$wheel")
    (( size > ${SPLIT_ABOVE_MIB:-40} << 20 )) || continue
    (( split == 0 )) || { echo "gpu_carry.sh: a second wheel over ${SPLIT_ABOVE_MIB:-40} MiB ($wheel): call 1 carries one part 1" >&2; exit 1; }
    rest=$(( $(du -sb "$CARRY/call2" | cut -f1) - size ))
    bash benchmarks/gpu_two_part.sh split "$wheel" "$(( (size + rest) / 2 ))" "$CARRY/call1" "$CARRY/call2"
    rm "$wheel"
    split=1
done
echo "$(ls "$WHEELS"/*.whl | wc -l) wheels in $WHEELS, $(du -sh "$CARRY/call1" | cut -f1) in call1, $(du -sh "$CARRY/call2" | cut -f1) in call2"
# bytes each call sends with the working tree; exit 1 when one is over 64 MiB
"$PY" -m benchmarks.gpu_carry --sizes
