#!/usr/bin/env bash
# Where a recorded step's host time goes, with and without the tape: py-spy samples every process
# of `fsdp-replay record` on the reference example (1 GPU, default kernels) and writes collapsed
# stacks per configuration (thread ids kept, so the training thread and the agent's writer are told
# apart), for bench/experiments/profile_summary.py. Run from the repository root on the GPU machine
# after bench/gpu_suite.sh has installed .whl/ (py-spy travels there as a wheel).
#
#   OUT=dir PROFILE_STEPS=20 bash bench/experiments/profile_tape.sh [config ...]
#
# configs: tape (--payloads none), notape (--payloads none --no-tape), torch-fp (tape, Triton off:
# the batched torch fingerprints).
set -uo pipefail
OUT=${OUT:-gpu-results}
STEPS=${PROFILE_STEPS:-20}
SPY=${PYSPY:-/tmp/site/bin/py-spy}
ARGS=${PROFILE_ARGS:-"--d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2"}
for cfg in "${@:-tape notape}"; do
  for c in $cfg; do
    extra=(--payloads none)
    envs=()
    case $c in
      tape) ;;
      notape) extra+=(--no-tape) ;;
      torch-fp) envs=(FSDP_REPLAY_TRITON=0) ;;
      *) echo "unknown config $c" >&2; exit 2 ;;
    esac
    rm -rf "/tmp/prof-$c"
    env "${envs[@]}" "$SPY" record --subprocesses --threads --nonblocking -r 200 -f raw -o "$OUT/prof-$c.txt" -- \
      python3 -m fsdp_replay record --out "/tmp/prof-$c" "${extra[@]}" -- \
      torchrun --standalone --nproc_per_node 1 examples/train_fsdp.py --steps "$STEPS" $ARGS \
      > "$OUT/prof-$c.log" 2>&1
    echo "$c: exit $? ($(grep -c '^step' "$OUT/prof-$c.log") step lines)"
  done
done
