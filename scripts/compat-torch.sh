#!/usr/bin/env bash
# The torch compatibility tier (issue 11): runs the part of the suite that touches torch internals
# against another torch than CI's, in a virtualenv of its own, and writes what happened to
# bench/results/compat-torch-VERSION.md (committed, so the claim in README.md has its evidence).
#
#   scripts/compat-torch.sh 2.11.0            # the oldest torch pyproject.toml claims
#   scripts/compat-torch.sh 2.11.0 -k replay  # extra arguments go to pytest (a partial re-run)
#
# CI (`make test`, .venv) tests the newest claimed torch, 2.13, on CPU; this script is the tier for
# the others, run by hand on the project's CPU machine kind (it does not fit in CI's time). Only the
# 2.13 wheel is served as a CPU-only build: other versions pull the CUDA libraries (several GB of
# downloads; the results file says how much), which is fine, they run on CPU.
#
# What it does: creates .venv-torch-VERSION (git-ignored), installs torch==VERSION and numpy, then
# the package with its test extras (an extra that does not install next to that torch is left out
# and named in the results), builds the native fingerprint core as `make` does (`pip install -e`),
# lists the collective ops that torch registers at the dispatcher against fsdp_replay/trace/ops.py,
# and runs the subset below (about 30-40 minutes on 2 cores). Installing is done once (a stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=${1:?usage: scripts/compat-torch.sh TORCH_VERSION [PYTEST_ARGS...] (e.g. 2.11.0)}
shift
PY=${PY:-python3}
VENV=.venv-torch-$VERSION
BIN=$VENV/bin
STAMP=$VENV/.installed
WORK=$VENV/compat
RESULTS=bench/results/compat-torch-$VERSION.md

# The compatibility subset: every layer that touches torch internals.
TESTS=(
    tests/agent/test_dispatcher_ops.py            # the dispatcher ops the agent takes, against this torch's
    tests/agent/test_record.py                    # recording leaves the program's results bit-identical
    tests/agent/test_fingerprint_reference.py     # fingerprints: native core and torch path agree
    tests/agent/test_fingerprint_many.py
    tests/agent/test_fingerprint_regions.py
    tests/agent/test_native.py
    tests/agent/test_tape.py                      # the tape of nondeterministic ops (CPU)
    tests/agent/test_cxx_kernel.py                # the C++ dispatcher kernel, built against this torch
    tests/replayer/test_replay.py                 # FSDP1/FSDP2/DDP replayed from 0 and from a snapshot, all-to-all
    tests/replayer/test_fast_forward.py           # the fast-forward to a snapshot (meta placeholders)
    tests/replayer/test_served_data.py            # served batches
    tests/system/test_frameworks.py               # HF Trainer, accelerate, Lightning, DCP, broadcasts
)

mkdir -p "$WORK"
if [ ! -f "$STAMP" ]; then
    test -x "$BIN/python" || "$PY" -m venv "$VENV"
    "$BIN/pip" install -q --upgrade pip
    # pip says each wheel's size as it downloads (or takes it from its cache): kept for the results
    "$BIN/pip" install --progress-bar off "torch==$VERSION" numpy 2>&1 | tee "$WORK/pip-torch.log"
    # the package and its test extras, torch held at VERSION; one extra at a time if they do not
    # all install together, leaving out (and naming) those that do not
    : >"$WORK/extras-left-out.txt"
    if ! "$BIN/pip" install -q "torch==$VERSION" -e ".[test]" 2>"$WORK/pip-extras.log"; then
        "$BIN/pip" install -q "torch==$VERSION" -e .
        "$BIN/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' |
            while read -r req; do
                "$BIN/pip" install -q "torch==$VERSION" "$req" 2>>"$WORK/pip-extras.log" ||
                    echo "$req" >>"$WORK/extras-left-out.txt"
            done
    fi
    # the native fingerprint core is built by the editable install (setup.py); a missing build
    # would fail the fingerprint tests, so say it here already
    "$BIN/python" -c 'from fsdp_replay.agent.fingerprint import native; assert native.available(), "the native fingerprint core did not build"'
    touch "$STAMP"
fi
"$BIN/python" -c "import torch; assert torch.__version__.split('+')[0] == '$VERSION', torch.__version__"

# the collective ops this torch registers at the dispatcher, against fsdp_replay/trace/ops.py
"$BIN/python" tests/agent/test_dispatcher_ops.py >"$WORK/ops.md"

# A run's JUnit XML and what it was stay in $WORK/runs; the results file is made from all of them
# (each test's latest result), so a partial re-run replaces only the rows of the tests it ran.
mkdir -p "$WORK/runs"
run=$WORK/runs/$(date -u +%Y%m%dT%H%M%S)
if [ $# -gt 0 ]; then args=("$@"); else args=("${TESTS[@]}"); fi
# each test process's hang guard (tests/harness.py; 300 s in CI): this torch's CUDA build runs the
# 1,000-step fast-forward recording slower than CI's CPU wheel, on a machine others share
export FSDP_REPLAY_TEST_TIMEOUT_S=${FSDP_REPLAY_TEST_TIMEOUT_S:-900}
load=$(cut -d' ' -f1-3 /proc/loadavg)
echo "load average before the run: $load"
start=$(date +%s)
set +e
"$BIN/python" -m pytest -p no:cacheprovider -q --junitxml="$run.xml" "${args[@]}" 2>&1 | tee "$run.log"
rc=${PIPESTATUS[0]}
set -e
"$BIN/python" scripts/compat_report.py --version "$VERSION" --work "$WORK" --results "$RESULTS" \
    --run "$run" --load "$load" --timeout "$FSDP_REPLAY_TEST_TIMEOUT_S" --seconds $(($(date +%s) - start)) --exit "$rc" -- "$@"
exit "$rc"
