#!/usr/bin/env bash
# Session 18, after call 18a (window4 1.446 [1.271, 1.525] of meta-python, window4-smcopy 1.292
# [1.292, 1.323]: the SM copy does not close it; call 17a's profile: the main stream idle most of
# a step in every configuration, so the cost is on the CPU). Hypothesis: the kept outputs' host
# copies (about 1 GB a step of DMA into host memory) slow the CPU's own work (the last-level cache,
# DDIO; memory bandwidth). 1. bench/experiments/dma_cpu_interference.py: CPU work timed under
# device-to-host, host-to-device and device-to-device copy loads; 2. the bench: meta-python,
# window4, window4-notapebytes (no taped results' bytes kept), 3 repetitions.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
DMA_OUT=$R/dma_cpu_interference.json timeout 120 python3 bench/experiments/dma_cpu_interference.py \
  > "$R/dma.log" 2>&1
echo "exit: $?" >> "$R/dma.log"
cat /proc/cpuinfo | grep -m1 'model name' >> "$R/dma.log"; lscpu | grep -i 'cache\|numa' >> "$R/dma.log"
left=$((575 - SECONDS))
echo "bench limit ${left}s" > "$R/bench-limit.txt"
BENCH_CONFIGS=meta-python,window4,window4-notapebytes BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
