#!/usr/bin/env bash
# A CPU-only venv with the device's Triton (3.6, beside torch's CPU build) at .venv-device-triton, so that the
# offline sm_90 compiles (scripts/kv_fp8_sm90.py, fp8_mid_sm90.py, *_sass.py) show the lowering the GPU will
# run: Triton 3.6 and the test venv's 3.9 emit different SASS for the same kernel (BENCHMARKS §27).
#   bash scripts/device_triton_venv.sh && env -u TRITON_INTERPRET .venv-device-triton/bin/python scripts/kv_fp8_sm90.py
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON=${TRITON_VERSION:-3.6.0}  # the device image's (scripts/gpu_check.sh prints it in each bench header)
[ -x .venv-device-triton/bin/python ] || python3 -m venv .venv-device-triton
.venv-device-triton/bin/python -m pip install -q torch==2.13.0 numpy
.venv-device-triton/bin/python -m pip install -q --no-deps "triton==$TRITON"
.venv-device-triton/bin/python -c 'import triton; print("triton", triton.__version__)'
