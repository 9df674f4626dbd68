#!/usr/bin/env bash
# Session 19, after call 19b: with the C++ hook's pinned pool, window4 makes no pinned allocation
# a step (0.06) and its autograd thread runs 35 ms of CPU a step, yet the bench still has it at
# 1.379 [1.288, 1.388] of meta-python; its slow steps are 19 and 23, the steps before its
# snapshots (every 4 steps with window:4), which the default CUPTI policy ("snapshots") captures,
# while meta-python (no periodic snapshots) captures step 1 only. 1. the bench: meta-python,
# window4, window4-nocupti, window4-notapebytes, 3 repetitions; 2. thread_cpu.py on meta-python
# and window4-nocupti (19b has window4's, on another machine: compare within this call only).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
left=$((420 - SECONDS))
echo "bench limit ${left}s" > "$R/bench-limit.txt"
BENCH_CONFIGS=meta-python,window4,window4-nocupti,window4-notapebytes BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
ARGS="--steps 30 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
for run in "meta-python:--payloads none --no-cxx-kernel" "window4-nocupti:--payloads window:4 --cupti off" \
  "window4:--payloads window:4"; do
  tag=${run%%:*} mode=${run#*:}
  left=$((570 - SECONDS))
  [ "$left" -lt 40 ] && break
  THREADCPU_STEPS=12-28 THREADCPU_OUT=$R/threads-$tag.json timeout $left \
    python3 -m fsdp_replay record --out /tmp/tc-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/experiments/thread_cpu.py \
    examples/train_fsdp.py $ARGS > "$R/threads-$tag.log" 2>&1
  echo "exit: $? at ${SECONDS}s" >> "$R/threads-$tag.log"
done
