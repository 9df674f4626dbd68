# Sourced by the gpu_call_session*.sh scripts: their results go to $OUT/r while they run, and into
# one archive, $OUT/results.tar.gz, when they end (the device returns at most 8 files).
ROOT=${OUT:-gpu-results}
R=$ROOT/r
mkdir -p "$R"
finish() { tar -C "$R" -czf "$ROOT/results.tar.gz" . && rm -rf "$R"; }
trap finish EXIT
# The set-up every call makes first: the packages (bench/gpu_suite.sh none) and the environment
# the tests and benches run with (the image's packages and the repository on the path; NVLink
# multicast off, as the machine's notes ask).
gpu_setup() {
  bash bench/gpu_suite.sh none > "$R/setup.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
}
