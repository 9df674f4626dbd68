#!/usr/bin/env bash
# Session 16's fourth GPU call: CUPTI finalized between capture windows (cuptiFinalize from an API
# callback's exit). 1. the CUPTI test with two windows (steps 1 and 4): detached after the first,
# set up anew for the second, both windows' kernels against torch.profiler's; 2. what the default
# window (step 1) leaves in later steps: meta (detached after it) against meta-attached
# (FSDP_REPLAY_CUPTI_DETACH=0), two repetitions (the device time left).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 80 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_cupti_gpu.py -k "windows" > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
CUPTI_BENCH_CONFIGS=meta,meta-attached BENCH_REPS=2 BENCH_STEPS=16 OUT=$R timeout 125 \
  bash bench/gpu_suite.sh cupti > "$R/suite-bench.log" 2>&1
