#!/usr/bin/env bash
# Everything that needs a CUDA device (the GPU machine is lent by the minute), in parts that each
# fit one call: `tests` (the gpu-marked tests and the native core's), `bench` (the
# recording-overhead benchmark on 1 GPU, default kernels, with and without the tape) and `cupti`
# (the same benchmark for the CUPTI capture in every step, against torch.profiler's CUDA-only
# capture of the same steps), `ring` (the payload ring against the plain copy,
# bench/bench_payload_ring.py) and `tape` (the tape's cost per step, arms interleaved step by step
# in one process, bench/bench_tape.py); no argument runs them all. Results go to $OUT (or
# ./gpu-results). Python packages the image lacks travel as
# wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The agent's native fingerprint core (pip install -e . builds it here; PYTHONPATH does not).
if command -v gcc >/dev/null; then
  gcc -O3 -std=gnu11 -shared -fPIC -o fsdp_replay/agent/fingerprint/_fpcore.so \
    fsdp_replay/agent/fingerprint/_fpcore.c 2>&1 | tee "$OUT/native-build.log"
else
  echo "no gcc: fingerprints use the torch path" | tee "$OUT/native-build.log"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$OUT/machine.txt"
PART=${1:-all}
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  python3 -m pytest -q -s -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/system/test_gpu.py tests/system/test_gpu_memory.py tests/system/test_cupti_gpu.py tests/agent/test_payload_ring.py tests/agent/test_fingerprint_many.py tests/agent/test_fingerprint_fused.py tests/agent/test_fingerprint_regions.py} -o addopts="" --durations=0 2>&1 | tee "$OUT/gpu-tests.log"
  echo "gpu tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
  if [ "${GPU_CPU_TESTS:-1}" = 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/agent/test_native.py tests/agent/test_tape.py -o addopts="" 2>&1 | tee -a "$OUT/gpu-tests.log"
    echo "native core and tape tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
  fi
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  python3 bench/bench_record.py --nproc 1 --device cuda --steps ${BENCH_STEPS:-30} --reps ${BENCH_REPS:-4} \
    --warmup-steps ${BENCH_WARMUP:-3} --configs ${BENCH_CONFIGS:-meta,meta-notape,tape-payloads} --cooldown 0 \
    --train-args="${BENCH_TRAIN_ARGS:---d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2}" \
    --results "$OUT/record_overhead_gpu" 2>&1 | tail -40 | tee "$OUT/bench.log"
fi
if [ "$PART" = ring ] || [ "$PART" = all ]; then
  python3 bench/bench_payload_ring.py --reps ${RING_REPS:-10} --steps ${RING_STEPS:-20} \
    --results "$OUT/payload_ring_gpu" 2>&1 | tail -30 | tee "$OUT/bench-ring.log"
fi
if [ "$PART" = tape ] || [ "$PART" = all ]; then
  python3 bench/bench_tape.py --rounds ${TAPE_ROUNDS:-30} --results "$OUT/tape_step_gpu" 2>&1 | tail -20 | tee "$OUT/bench-tape.log"
fi
if [ "$PART" = cupti ] || [ "$PART" = all ]; then
  python3 bench/bench_record.py --nproc 1 --device cuda --steps ${BENCH_STEPS:-30} --reps ${BENCH_REPS:-4} \
    --warmup-steps ${BENCH_WARMUP:-3} --configs ${CUPTI_BENCH_CONFIGS:-meta,meta-cupti,torch-profiler} --cooldown 0 \
    --train-args="${BENCH_TRAIN_ARGS:---d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2}" \
    --results "$OUT/cupti_overhead_gpu" 2>&1 | tail -40 | tee "$OUT/bench-cupti.log"
fi
