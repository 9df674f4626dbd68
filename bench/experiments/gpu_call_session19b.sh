#!/usr/bin/env bash
# Session 19, after call 19a: window4 made 3.35 new pinned host allocations a step through torch's
# caching host allocator (cudaHostAlloc, 27 ms a step of host_alloc_time, on the autograd thread
# where keep_outputs runs) and its pinned memory grew by as many blocks a step; meta-python and
# window4-notapebytes 0.06-0.24. The fix: the C++ hook's own pool of pinned blocks (_tape.cpp,
# "pinned host blocks"). 1. the hook's GPU tests (the pool's reuse, its event guard);
# 2. thread_cpu.py on window4 (host allocations a step, the autograd thread's CPU);
# 3. the bench: meta-python, window4, 3 repetitions.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/agent/test_cxx_tape.py -rs --durations=5 \
  > "$R/pytest-cxx-tape.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/pytest-cxx-tape.log"
ARGS="--steps 30 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
THREADCPU_STEPS=12-28 THREADCPU_OUT=$R/threads-window4.json timeout 120 \
  python3 -m fsdp_replay record --out /tmp/tc-window4 --payloads window:4 -- \
  python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/experiments/thread_cpu.py \
  examples/train_fsdp.py $ARGS > "$R/threads-window4.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/threads-window4.log"
python3 -c "
import json, sys
from fsdp_replay.trace.reader import Trace
c = Trace.open(sys.argv[1]).rank(0).attrs['end']['counters']
print(json.dumps({k: v for k, v in c.items() if k.startswith(('tape_cxx', 'flight'))}, indent=1))
" /tmp/tc-window4/trace.zarr > "$R/counters-window4.json" 2>&1
left=$((575 - SECONDS))
echo "bench limit ${left}s" > "$R/bench-limit.txt"
BENCH_CONFIGS=meta-python,window4 BENCH_REPS=3 BENCH_STEPS=24 BENCH_WARMUP=8 \
  OUT=$R timeout $left bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
echo "exit: $? at ${SECONDS}s" >> "$R/suite-bench.log"
