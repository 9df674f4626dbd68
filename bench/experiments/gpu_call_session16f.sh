#!/usr/bin/env bash
# Prepared in session 16, not run (no device time left): where the flight recorder's remaining
# cost on healthy steps comes from. Session 15's call c had window4 at 1.156 of metadata-only with
# every measured step about 20-30 ms slower (not the periodic snapshots alone), and session 16's
# call a profile showed the main thread's own forward taking about twice the CPU per step, outside
# the agent's frames. window4-notapebytes keeps everything but the taped results' bytes (about
# 1 GB a step): if it is close to meta-python, the kept tape outputs are the cost; window4-nocupti
# leaves CUPTI out entirely (its step-1 window leaves libcupti in every later CUDA call).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
BENCH_CONFIGS=meta-python,window4,window4-notapebytes,window4-nocupti BENCH_REPS=2 BENCH_STEPS=30 BENCH_WARMUP=12 \
  OUT=$R timeout 500 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
