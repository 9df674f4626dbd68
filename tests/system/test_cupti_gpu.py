"""On a CUDA device: the CUPTI capture (issue #13, items 1 and 2) against torch.profiler.

(a) The example, recorded with ``--cupti always`` (one rank; deterministic, and with default kernels,
whose nondeterministic calls the tape's C++ hook records and marks), and the same workload
run unrecorded under torch.profiler (CUDA activities only, ``tests/workloads/cuda_profiled.py``):
the kernels of each whole step, their number and their names in launch order, must be the same;
copies must be there. (b) torch.profiler opened inside a recorded run: the profiler gets its
kernels, our capture stands aside saying so in the trace, and comes back after the window.

Needs cupti-python (the ``gpu`` extra; ``bench/gpu_suite.sh`` installs it from ``.whl/``). Run on
the GPU machine by ``bench/gpu_suite.sh tests``; each test prints what it compared, so a failure
can be read from the log alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from harness import CLI, EXAMPLE, child_env, run, torchrun_cmd

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
WORKLOADS = Path(__file__).parents[1] / "workloads"
STEPS = 5
ARGS = ("--steps", str(STEPS), "--layers", "2", "--d-model", "128", "--seq-len", "64")


@pytest.fixture(autouse=True)
def _needs_cupti() -> None:
    pytest.importorskip("cupti", reason="cupti-python (the gpu extra) is not installed")


def _demangler() -> Any:
    """``name -> demangled name`` through libstdc++'s ``__cxa_demangle``, as Kineto demangles."""
    lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    libc = ctypes.CDLL(None)
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    libc.free.argtypes = [ctypes.c_void_p]

    def demangle(name: str) -> str:
        status = ctypes.c_int(0)
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not ptr:
            return name
        try:
            return ctypes.string_at(ptr).decode(errors="replace")
        finally:
            libc.free(ptr)

    return demangle


def _record(rec: Path, cupti: str, program: Path, *args: str, policy: tuple[str, ...] = ()) -> list[str]:
    """``fsdp-replay record`` of ``program`` on one rank, with the ``--cupti`` policy given."""
    return [
        *CLI,
        "record",
        "--out",
        str(rec),
        "--cupti",
        cupti,
        *("--payloads", "all"),  # (record's default on a GPU is the flight recorder)
        *policy,
        "--",
        *torchrun_cmd(1, program, *args),
    ]


def _env(detach: bool = True, **extra: str) -> dict[str, str]:
    """The recorded run's environment; ``detach``: CUPTI let go between windows (the default;
    False keeps it attached, ``FSDP_REPLAY_CUPTI_DETACH=0``)."""
    return child_env(**({} if detach else {"FSDP_REPLAY_CUPTI_DETACH": "0"}), **extra)


def _ours(r: RankTrace) -> tuple[dict[int, list[str]], dict[int, int]]:
    k, c = r.table("kernels"), r.table("copies")
    names = r.names("kernel")
    kernels: dict[int, list[str]] = {}
    for step, code in zip(k["step"].tolist(), k["name"].tolist(), strict=True):
        kernels.setdefault(int(step), []).append(names[code])
    copies: dict[int, int] = {}
    for step in c["step"].tolist():
        copies[int(step)] = copies.get(int(step), 0) + 1
    return kernels, copies


def _first_difference(a: list[str], b: list[str]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at launch {i}: ours {a[max(0, i - 2) : i + 3]} vs torch.profiler's {b[max(0, i - 2) : i + 3]}"


@pytest.mark.parametrize(
    ("deterministic", "cupti"),
    [(True, "always"), (False, "always"), (True, "steps:1,4")],
    ids=["deterministic", "default-kernels", "windows-detached-between"],
)
def test_kernel_counts_and_order_per_step_match_torch_profiler(
    tmp_path: Path, deterministic: bool, cupti: str
) -> None:
    """With default kernels the tape records nondeterministic calls, in its C++ hook while CUPTI
    traces: the hook's fingerprint launches must be marked as the agent's and left out. With two
    windows (steps 1 and 4) CUPTI is finalized after the first (the default detach)
    (``cupti_detaches``) and set up anew for the second, whose kernels must be as whole and as
    right as the first's (session 16's run found 99 of step 4's placed in step 1: correlation ids
    start over after a finalize; ``Decoder.forget_launches``)."""
    args = (*ARGS, "--deterministic") if deterministic else ARGS
    # default kernels: no payloads stored, so the C++ hook (not the Python path) records the calls
    policy = () if deterministic else ("--payloads", "none")
    windows = cupti != "always"
    captured = [1, 4] if windows else list(range(1, STEPS))
    rec = tmp_path / "rec"
    proc = run(_record(rec, cupti, EXAMPLE, *args, policy=policy), env=_env(detach=windows))
    print(proc.stderr[-1500:])
    prof_out = tmp_path / "profiled"
    run(
        torchrun_cmd(1, WORKLOADS / "cuda_profiled.py", str(EXAMPLE), *args),
        env=child_env(COUNT_OUT=str(prof_out)),
    )
    theirs = json.loads((prof_out / "kernels-0.json").read_text())
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    counters = r.attrs["end"]["counters"]
    states = r.attrs[schema.CUPTI_ATTR]["states"]
    ours, our_copies = _ours(r)
    print("capture states:", json.dumps(states)[:3000])
    print("counters:", {k: v for k, v in counters.items() if k.startswith("cupti")})
    print("torch.profiler: markers", theirs["markers"], "activity types", theirs["activity_types"])
    print("kernels per step, ours:", {s: len(v) for s, v in sorted(ours.items())})
    print("kernels per step, torch.profiler:", {s: len(v) for s, v in theirs["kernels"].items()})
    print("copies per step, ours:", our_copies, "torch.profiler:", theirs["copies"])
    assert theirs["markers"] == STEPS, "the profiled run must have marked every optimizer step"
    assert states and states[0]["state"] == "armed", states
    detail = states[0].get("detail") or {}
    print("decoder:", detail.get("decoder"), detail.get("decoder_reason", ""))
    if shutil.which("g++"):  # the native reader is built wherever a compiler is
        assert detail.get("decoder") == "native", detail
    assert not [s for s in states if s["state"] in ("error", "lost", "off")], states
    assert counters["cupti_errors"] == 0 and counters["cupti_dropped_error"] == 0
    assert counters["cupti_dropped_buffer"] == 0 and counters["cupti_dropped_incomplete"] == 0
    assert counters["cupti_agent_records"] > 0  # the agent's fingerprints ran on the GPU, and were left out
    print("tape's C++ hook:", {k: v for k, v in counters.items() if k.startswith("tape_cxx")})
    if not deterministic:  # taped calls recorded (and their launches marked) by the C++ hook
        assert counters["tape_cxx_marked"] > 0 and counters["tape_cxx_mark_errors"] == 0, counters
    if windows:  # armed, disarmed, finalized, armed again
        assert detail.get("detach") == "between windows", detail
        assert counters["cupti_detaches"] >= 1, counters
        assert [s["step"] for s in states if s["state"] == "armed"] == [1, 4], states
        assert sorted(ours) == captured, sorted(ours)
    demangle = _demangler()
    for step in captured:  # whole steps: step 0 is never captured, the tail after the last is partial
        mine = [demangle(n) for n in ours.get(step, [])]
        raw = ours.get(step, [])
        kineto = theirs["kernels"].get(str(step), [])
        print(f"step {step}: {len(mine)} kernels ours, {len(kineto)} torch.profiler's")
        assert len(mine) == len(kineto), f"step {step}: kernel counts differ; " + _first_difference(
            mine, kineto
        )
        same = [a == b or r_ == b for a, r_, b in zip(mine, raw, kineto, strict=True)]
        assert all(same), f"step {step}: kernel order differs; " + _first_difference(mine, kineto)
    assert sum(our_copies.get(s, 0) for s in captured) > 0, "no copies captured"
    kinds = {schema.COPY_KINDS[x] for x in r.table("copies")["kind"].tolist()}
    print("copy kinds:", kinds)
    assert {"htod", "dtoh"} <= kinds  # the batches in, the logged loss out
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)["per_rank"][0]["cupti"]
    assert summary["kernels"] == len(r.table("kernels")) and summary["steps"][0] == 1


@pytest.mark.parametrize(
    ("cupti", "detach"), [("always", False), ("steps:1,2,8,9", True)], ids=["always", "windows-detached"]
)
def test_torch_profiler_inside_a_recorded_run_both_get_their_kernels(
    tmp_path: Path, cupti: str, detach: bool
) -> None:
    """torch.profiler opened at step 4 of a recorded run. With windows and the detach
    (the default), CUPTI was let go after the first window (steps 1-2) before
    the profiler took it, and is set up anew for the second (steps 8-9)."""
    rec, profile_out = tmp_path / "rec", tmp_path / "profile.json"
    steps, first, last = 10, 4, 5
    proc = run(
        _record(
            rec,
            cupti,
            WORKLOADS / "profiler_window.py",
            *("--steps", str(steps), "--profile-from", str(first), "--profile-to", str(last)),
        ),
        env=_env(detach=detach, PROFILE_OUT=str(profile_out)),
    )
    theirs = json.loads(profile_out.read_text())
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    states = r.attrs[schema.CUPTI_ATTR]["states"]
    counters = r.attrs["end"]["counters"]
    ours, _ = _ours(r)
    print("torch.profiler saw:", theirs)
    print("capture states:", json.dumps(states))
    print("counters:", {k: v for k, v in counters.items() if k.startswith("cupti")})
    print("kernels per step, ours:", {s: len(v) for s, v in sorted(ours.items())})
    print("Kineto's complaints:", [x for x in proc.stderr.splitlines() if "unknown buffer" in x][:5])
    kineto_kernels = theirs["activity_types"].get("kernel", 0)
    # the profiler got its data: its two steps' kernels (the program's, and the agent's in them)
    steady = len(ours.get(2, []))
    assert steady > 0 and kineto_kernels >= 2 * steady, (kineto_kernels, steady)
    # ours stood aside, saying so, and came back
    paused = [s for s in states if s["state"] == "paused"]
    assert len(paused) == 1 and "torch.profiler" in paused[0]["reason"], states
    assert paused[0]["step"] == first
    rearmed = [s for s in states if s["state"] == "armed" and "re-armed after" in s["reason"]]
    assert rearmed and rearmed[0]["step"] > last, states
    assert not [s for s in states if s["state"] in ("error", "lost")], states
    assert counters["cupti_pauses"] == 1 and counters["cupti_errors"] == 0
    before = (1, 2) if detach else (1, 2, 3)
    for step in before:
        assert len(ours.get(step, [])) == steady, f"step {step} before the window: {len(ours.get(step, []))}"
    back = rearmed[0]["step"]
    assert back < steps, "the capture must be back before the run ends"
    if detach:
        assert counters["cupti_detaches"] >= 1 and back == 8, (counters, states)
    for step in range(back, steps):
        assert len(ours.get(step, [])) == steady, f"step {step} after the window: {len(ours.get(step, []))}"
    for step in range(before[-1] + 1 if detach else first + 1, back):
        assert step not in ours, f"step {step} was captured outside a window or while the profiler traced"
