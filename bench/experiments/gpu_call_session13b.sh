#!/usr/bin/env bash
# Session 13's second GPU call: CUPTI's buffers read in native code (agent/cupti/_records.cpp).
# The CUPTI GPU tests (kernel counts and order against torch.profiler, now through the native
# reader; torch.profiler inside a recorded run); then whole recorded runs on the reference step
# (bench_record.py): meta, meta-cupti (native reader), meta-cupti-python (cupti-python's
# per-record callback, FSDP_REPLAY_CUPTI_NATIVE=0) and torch.profiler's CUDA-only capture.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
GPU_CPU_TESTS=0 GPU_TESTS="tests/system/test_cupti_gpu.py" \
  OUT=$R timeout 180 bash bench/gpu_suite.sh tests > "$R/suite-tests.log" 2>&1
CUPTI_BENCH_CONFIGS=meta,meta-cupti,meta-cupti-python,torch-profiler BENCH_REPS=${BENCH_REPS:-2} BENCH_STEPS=25 \
  OUT=$R timeout 380 bash bench/gpu_suite.sh cupti > "$R/suite-bench.log" 2>&1
