#!/usr/bin/env bash
# Everything that needs a CUDA device, in one call (the GPU machine is lent by the minute):
# the gpu-marked tests, then the recording-overhead benchmark on 1 GPU. Results go to $OUT
# (or ./gpu-results). Python packages the image lacks travel as wheels in .whl/.
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
  gcc -O3 -std=gnu11 -shared -fPIC -o fsdp_replay/agent/_fpcore.so fsdp_replay/agent/_fpcore.c 2>&1 | tee "$OUT/native-build.log"
else
  echo "no gcc: fingerprints use the torch path" | tee "$OUT/native-build.log"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -o addopts="" 2>&1 | tee "$OUT/gpu-tests.log"
echo "gpu tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
python3 -m pytest -q -p no:cacheprovider tests/agent/test_native.py -o addopts="" 2>&1 | tee -a "$OUT/gpu-tests.log"
echo "native core tests exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
python3 bench/bench_record.py --nproc 1 --device cuda --steps ${BENCH_STEPS:-30} --reps ${BENCH_REPS:-4} \
  --configs ${BENCH_CONFIGS:-meta,meta-nosync} --cooldown 0 \
  --train-args="--deterministic --d-model 1024 --layers 8 --heads 16 --seq-len 512 --batch-size 16 --vocab 8192 --workers 2" \
  --results "$OUT/record_overhead_gpu" 2>&1 | tail -40 | tee "$OUT/bench.log"
