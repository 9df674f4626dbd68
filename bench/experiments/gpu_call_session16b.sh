#!/usr/bin/env bash
# Session 16's second GPU call: the tape's C++ hook keeps recording while CUPTI traces, marking its
# own launches as the agent's (call a: under --cupti always every taped call took the Python path,
# 4.7 ms of hook CPU a step). 1. the GPU tests: the hook's marks (ctypes stand-ins), CUPTI's kernel
# counts and order against torch.profiler with default kernels too; 2. the CUPTI bench.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
timeout 230 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_cxx_tape.py tests/system/test_cupti_gpu.py > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
BENCH_REPS=${BENCH_REPS:-3} BENCH_STEPS=25 OUT=$R timeout 290 bash bench/gpu_suite.sh cupti \
  > "$R/suite-bench.log" 2>&1
