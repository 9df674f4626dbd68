#!/usr/bin/env bash
# Session 19, after call 19c (one repetition: window4 1.292 of meta-python, window4-nocupti 1.033,
# window4-notapebytes 0.990): with no periodic snapshot CUPTI captures step 1 only in both, so
# what window4 pays for CUPTI is its interception after the window, on the kept outputs' many more
# CUDA calls. 1. the CUPTI detach tests (session 16's call e: two windows with the detach, and
# torch.profiler inside a run); 2. the bench: window4 against window4-detach, as many repetitions
# as the call's time allows.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
timeout 90 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_cupti_gpu.py -k "windows or inside" > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $? at ${SECONDS}s" >> "$R/gpu-tests.log"
left=$((240 - SECONDS))
echo "bench limit ${left}s" > "$R/bench-limit.txt"
BENCH_CONFIGS=meta-python,window4,window4-detach BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
