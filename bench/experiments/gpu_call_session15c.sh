#!/usr/bin/env bash
# Session 15's third GPU call: the tape's C++ hook records the flight recorder's steps and keeps
# their CUDA outputs itself (device copy, then pinned memory on a side stream), where calls a and b
# showed the tape's Python path costing 14.7 of window:4's 27.7 ms of hook CPU a step.
# 1. the GPU tests of the hook's keep path and the NaN window dump replayed BIT-EXACT;
# 2. window:4 against metadata-only, past the window's warm-up, with the hooks' CPU by part.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 170 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_cxx_tape.py tests/system/test_gpu.py -k "cxx or kept or nan_on_the_gpu" \
  > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=36 BENCH_WARMUP=12 \
  OUT=$R timeout 330 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
