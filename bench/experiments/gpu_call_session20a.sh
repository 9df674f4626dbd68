#!/usr/bin/env bash
# Prepared in session 19 (its device time spent), revised in session 20 (no device lent). Call 19c
# (one repetition): window4 1.292 of meta-python, window4-nocupti 1.033; CUPTI's default window is
# step 1 in both, so its share is its interception after the window (libcupti under the autograd
# thread's copy_ in 19a's py-spy). The detach between windows (FSDP_REPLAY_CUPTI_DETACH=1) ends it;
# its two-window test passed in call 19d, the torch.profiler-inside test was cut by the call's
# limit. 1. the dump through the C++ hook's pinned pool and both CUPTI GPU tests, to the end;
# 2. the bench: meta-python and meta-python-detach (metadata-only, CUPTI staying or finalized after
# its window) against window4 and window4-detach, as many repetitions as time allows. If the tests
# pass and the detach takes window4 near its reference, make the detach the default
# (agent/cupti/activity.py: process_switch(DETACH_ENV, True); docs/configuration.md).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
# the flight recorder's dump through the C++ hook's new pinned pool (not run on a GPU since the
# pool: session 19 ran only its unit tests there), then both CUPTI tests
timeout 300 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_gpu.py tests/system/test_cupti_gpu.py \
  -k "nan_on_the_gpu_dumps_the_window or torch_profiler_inside or kernel_counts" > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $? at ${SECONDS}s" >> "$R/gpu-tests.log"
left=$((575 - SECONDS))
echo "bench limit ${left}s" > "$R/bench-limit.txt"
BENCH_CONFIGS=meta-python,meta-python-detach,window4,window4-detach BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
