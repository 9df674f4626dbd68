#!/usr/bin/env bash
# Session 16's third GPU call (call b's bench ran past its time limit; its default-kernels CUPTI
# test stored payloads, so the C++ hook never recorded): the CUPTI test with default kernels and no
# payloads stored (the C++ hook records and marks), then the CUPTI bench (meta, meta-cupti).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 120 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_cupti_gpu.py -k "default-kernels" > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
CUPTI_BENCH_CONFIGS=meta,meta-cupti BENCH_REPS=3 BENCH_STEPS=25 OUT=$R timeout 330 bash bench/gpu_suite.sh cupti \
  > "$R/suite-bench.log" 2>&1
