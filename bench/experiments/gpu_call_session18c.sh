#!/usr/bin/env bash
# Session 18, the session's last device time (about 330 s): after call 18b (window4 1.259 of
# meta-python; the hooks' CPU accounts for about 10 of its 26 ms a step; DMA does not slow the
# CPU), is the program's thread running longer or waiting? bench/experiments/thread_cpu.py:
# per-thread CPU and context switches over steps 12-28, meta-python and window4, twice each.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
ARGS="--steps 30 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
for rep in 1 2; do
  for run in "meta-python:--payloads none --no-cxx-kernel" "window4:--payloads window:4"; do
    [ "$SECONDS" -gt 175 ] && break 2
    tag=${run%%:*} mode=${run#*:}
    THREADCPU_STEPS=12-28 THREADCPU_OUT=$R/threads-$tag-$rep.json timeout 60 \
      python3 -m fsdp_replay record --out /tmp/tc-$tag-$rep $mode -- \
      python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/experiments/thread_cpu.py \
      examples/train_fsdp.py $ARGS > "$R/threads-$tag-$rep.log" 2>&1
    echo "exit: $? at ${SECONDS}s" >> "$R/threads-$tag-$rep.log"
  done
done
