#!/usr/bin/env bash
# Session 14's third GPU call: snapshots copied into pinned memory on the program's stream without
# the host waiting (the writer waits), their parameter entries fingerprinted on the device; the
# flight recorder's payloads landing in pinned memory of their own (call a). 1. the GPU tests that
# record, snapshot and replay; 2. the healthy-step cost of window:4 with the default ring against
# metadata-only, past the window's warm-up (its first N + interval + 2 = 10 steps pin its memory).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 230 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 tests/system/test_gpu.py \
  -k "bit_identical or default_kernels_replay_bit_exact or late_snapshot or nan_on_the_gpu" \
  > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=36 BENCH_WARMUP=12 \
  OUT=$R timeout 320 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
