# Sourced by the gpu_call_session*.sh scripts: their results go to $OUT/r while they run, and into
# one archive, $OUT/results.tar.gz, when they end (the device returns at most 8 files).
ROOT=${OUT:-gpu-results}
R=$ROOT/r
mkdir -p "$R"
finish() { tar -C "$R" -czf "$ROOT/results.tar.gz" . && rm -rf "$R"; }
trap finish EXIT
