#!/usr/bin/env bash
# The GPU check (docs/gpu.md): tests + measurements + simulator calibration, from the source
# tree, needing only torch, triton, safetensors, tokenizers, numpy.
#   scripts/gpu_check.sh [--dry-run] [--part tests|perf|all] [--out FILE] [--device-profile h100|h200|a100|b200]
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels on the GPU; the interpreter is for CPU tests only
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m loopserve.gpu_check "$@"
