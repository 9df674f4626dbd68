#!/usr/bin/env bash
# Prepared in session 16, not run (no device time left): the detach between CUPTI windows after
# call d's failure (99 kernels of step 4 placed in step 1: correlation ids start over after a
# finalize, and the decoder still held the first window's launches; fixed by
# Decoder.forget_launches). 1. the CUPTI tests (the two-window case with FSDP_REPLAY_CUPTI_DETACH=1,
# and torch.profiler inside a run, whose pause now lets the launches go too); 2. what the default
# window (step 1) leaves in the steps after it: meta (attached), meta-detach, meta-nocupti.
# If the test passes and meta-detach is as fast as meta-nocupti, make the detach the default
# (activity.py: process_switch(DETACH_ENV, True); docs/configuration.md).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/system/test_cupti_gpu.py -k "windows or inside" > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
CUPTI_BENCH_CONFIGS=meta,meta-detach,meta-nocupti BENCH_REPS=3 BENCH_STEPS=20 OUT=$R timeout 290 \
  bash bench/gpu_suite.sh cupti > "$R/suite-bench.log" 2>&1
