#!/usr/bin/env bash
# Prepared in session 18 (its device time spent): call 18c found window4's extra cost on the
# autograd thread (pt_autograd_0: 107-109 ms of CPU a step against meta-python's 61; the main
# thread 87-93 against 84), while the C++ hook's own accounting (record + keep_outputs, on that
# thread) says 2.7 ms. So the backward's own work runs longer with the kept copies. 1. per-thread
# CPU and the CUDA allocators' counts a step (cudaMalloc, pinned host allocations) for
# meta-python, window4 and window4-notapebytes (bench/experiments/thread_cpu.py), twice; 2. py-spy
# (native) on the rank of meta-python and window4, the autograd thread's frames summarized
# (profile_summary.py --within Engine::thread_main: inclusive and innermost frames).
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
ARGS="--steps 30 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
for rep in 1 2; do
  for run in "meta-python:--payloads none --no-cxx-kernel" "window4:--payloads window:4" \
    "window4-notapebytes:--payloads window:4 --tape-payloads none"; do
    tag=${run%%:*} mode=${run#*:}
    THREADCPU_STEPS=12-28 THREADCPU_OUT=$R/threads-$tag-$rep.json timeout 120 \
      python3 -m fsdp_replay record --out /tmp/tc-$tag-$rep $mode -- \
      python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/experiments/thread_cpu.py \
      examples/train_fsdp.py $ARGS > "$R/threads-$tag-$rep.log" 2>&1
    echo "exit: $? at ${SECONDS}s" >> "$R/threads-$tag-$rep.log"
  done
done
ARGS="--steps 60 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
PYSPY=$(find /tmp/site -name py-spy -type f -perm -u+x | head -1)
for run in "meta-python:--payloads none --no-cxx-kernel" "window4:--payloads window:4"; do
  [ "$SECONDS" -gt 480 ] && break
  tag=${run%%:*} mode=${run#*:}
  LOG=$R/run-$tag.log
  timeout 100 python3 -m fsdp_replay record --out /tmp/run-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 examples/train_fsdp.py $ARGS > "$LOG" 2>&1 &
  for _ in $(seq 1 80); do grep -q "^step 14 " "$LOG" && break; sleep 1; done
  runner=$(pgrep -f "^[^ ]*python[0-9.]* -m torch.distributed.run" | head -1)
  pid=$(pgrep -P "$runner" -f examples/train_fsdp.py | head -1)
  echo "$mode: torchrun $runner, rank $pid" >> "$R/pyspy.log"
  "$PYSPY" record --pid "$pid" --duration 8 --rate 100 --native --threads --format raw \
    -o "$R/pyspy-$tag.txt" >> "$R/pyspy.log" 2>&1
  wait
  python3 bench/experiments/profile_summary.py "$R/pyspy-$tag.txt" --within Engine::thread_main --top 40 \
    > "$R/summary-autograd-$tag.txt" 2>&1
  gzip "$R/pyspy-$tag.txt"
done
