#!/usr/bin/env bash
# Prepared in session 17 (no device time that session): is the flight recorder's remaining cost
# (window4 1.156 of metadata-only, steps 20-30 ms slower, the program's CUDA calls slower in the
# profile) the program's stream's device-to-device memcpys queuing on a copy engine behind the
# side stream's host copies (about 1 GB a step)? 1. the keep and payload-ring tests, the keep test
# with the SM copy (FSDP_REPLAY_SM_COPY) too; 2. torch.profiler over steps 16-18 of meta-python,
# window4 and window4 with FSDP_REPLAY_SM_COPY=1 (bench/experiments/copy_overlap.py: the main
# stream's gaps, by the op after them, and how much of them a DtoH copy elsewhere covered);
# 3. the bench: meta-python, window4, window4-smcopy.
set -uo pipefail
source "$(dirname "$0")/gpu_call_archive.sh"
gpu_setup
timeout 100 python3 -m pytest -q -s -p no:cacheprovider -m gpu -o addopts="" --durations=0 \
  tests/agent/test_cxx_tape.py tests/agent/test_payload_ring.py > "$R/gpu-tests.log" 2>&1
echo "gpu tests exit: $?" >> "$R/gpu-tests.log"
ARGS="--steps 20 --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"
for run in "meta-python::--payloads none --no-cxx-kernel" "window4::--payloads window:4" \
  "window4-smcopy:FSDP_REPLAY_SM_COPY=1:--payloads window:4"; do
  tag=${run%%:*} rest=${run#*:}
  setting=${rest%%:*} mode=${rest#*:}
  env $setting OVERLAP_STEPS=16-18 OVERLAP_OUT=$R/overlap-$tag timeout 100 \
    python3 -m fsdp_replay record --out /tmp/ovl-$tag $mode -- \
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/experiments/copy_overlap.py \
    examples/train_fsdp.py $ARGS > "$R/overlap-$tag.log" 2>&1
  echo "exit: $?" >> "$R/overlap-$tag.log"
done
BENCH_CONFIGS=meta-python,window4,window4-smcopy BENCH_REPS=2 BENCH_STEPS=30 BENCH_WARMUP=12 \
  OUT=$R timeout 260 bash bench/gpu_suite.sh bench > "$R/suite-bench.log" 2>&1
