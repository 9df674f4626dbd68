#!/usr/bin/env bash
# Session 15's fourth GPU call: the C++ hook's keep test again (call c's run of it found the
# library's CUDA path already on from the test before, so its NativeTape was never armed).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_cxx_tape.py tests/agent/test_payload_ring.py > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
