"""What the nondeterministic-kernel tape costs a training step, measured inside one process.

    python bench/bench_tape.py --rounds 30 --results bench/results/tape_step_gpu

``bench_record.py`` measures whole recorded runs against unrecorded ones; on the GPU machine its
runs differ by about 10% from one to the next (the unrecorded ones alone spread 89-100 ms), so the
tape's few percent cannot be resolved there. Here the example's model (``examples/train_fsdp.py``:
GPT, FSDP2 on one rank, bf16 autocast, default kernels, AdamW, two micro-steps, gradient clipping)
trains in one process, and consecutive steps take turns between arms (the order rotates every
round), so that each arm's step is compared with the plain step of the same round:

* ``plain``: no tape installed;
* ``tape``: the recording's tape (``agent/tape.py`` + ``agent/record_tape.py``), its taped calls
  written as events by a real writer thread into a spool in a temporary folder, fingerprints only
  (``--tape-payloads none``: what a metadata recording keeps);
* ``tape-cxx``: the same with the tape's C++ hook stacked on it (``agent/cxx/tape.py``): each call
  recorded in C++, the fused kernel launched through the driver; its records drained into events
  after the step, inside the timed region;
* ``tape-torchfp``: the same with the fingerprints by torch ops instead of the one Triton launch
  (``FSDP_REPLAY_TRITON=0``'s path);
* ``tape-passthrough``: the tape's kernels installed, every call passed straight to the op's own
  kernel (the handler inactive): what the dispatcher's call into the Python override costs alone;
* ``deterministic``: no tape, ``torch.use_deterministic_algorithms(True)`` for the step (what
  bit-exactness costs without the tape; ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` is set for the whole
  process, every arm, as deterministic cuBLAS needs it before cuBLAS starts).

The tape is installed before its step and removed after it, outside the timed region. A step is
timed from a device synchronization before it to one after it (wall clock). Reported per arm: the
median step time, and the median over rounds of (arm's step / plain step of the round) with its
95% bootstrap interval; the taped calls per step; the agent's own CPU time in the tape's hooks;
the process's CPU time per step (every thread: the training thread, autograd's, the writer's).
On a machine without CUDA it runs on the CPU (the tape then has no CUDA kernel to tape: a check of
the harness, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, bootstrap_median, machine_info, portable_command, write_results

ARMS = ("plain", "tape", "tape-cxx", "tape-torchfp", "tape-passthrough", "deterministic")
REFERENCE = ["--d-model", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512", "--batch-size", "16"]
REFERENCE += ["--vocab", "8192"]


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("train_fsdp", REPO / "examples" / "train_fsdp.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_fsdp"] = mod
    spec.loader.exec_module(mod)
    return mod


class Tape:
    """The recording's tape handler with its writer, installed for one step at a time."""

    def __init__(self, folder: Path) -> None:
        from fsdp_replay.agent.config import RecordConfig
        from fsdp_replay.agent.counters import AgentState
        from fsdp_replay.agent.record_tape import TapeRecorder
        from fsdp_replay.agent.tensor_record import TensorRecorder
        from fsdp_replay.agent.writer import BackgroundWriter
        from fsdp_replay.trace import spool

        config = RecordConfig.from_env(
            {
                "FSDP_REPLAY_OUT": str(folder),
                "FSDP_REPLAY_PAYLOADS": "none",
                "FSDP_REPLAY_TAPE_PAYLOADS": "none",
            }
        )
        self.state = AgentState(payload_now=False)
        self.writer = BackgroundWriter(spool.SpoolWriter(folder / "spool" / "rank-00000", 0), self._fail)
        self.state.writer = self.writer
        self.recorder = TapeRecorder(
            config, self.state, TensorRecorder(config, self.state), lambda: self.writer, self._fail
        )
        self.op_tape: Any = None
        self.passing = False  # tape-passthrough: installed, every call straight to the op's kernel
        self.cxx = False  # tape-cxx: the C++ hook on top
        self.native: Any = None
        # op -> [contiguous outputs, strided ones read in place, strided ones copied]
        self.layouts: dict[str, list[int]] = {}
        self._taped = self.recorder.taped

    def count_layouts(self, on: bool) -> None:
        """While on (the warm-up rounds), count the taped outputs' layouts: the fused fingerprint
        reads a strided one in place where its rows are whole words, else copies it first."""
        from fsdp_replay.agent.fingerprint import fused
        from fsdp_replay.agent.tape import outputs_of

        def taped(name: str, call: Any) -> Any:
            result = self._taped(name, call)
            counts = self.layouts.setdefault(name, [0, 0, 0])
            for t in outputs_of(result):
                counts[0 if t.is_contiguous() else 1 if fused._layout_of(t) is not None else 2] += 1
            return result

        self.recorder.taped = taped if on else self._taped  # type: ignore[method-assign]

    @staticmethod
    def _fail(where: str, e: BaseException) -> None:
        raise RuntimeError(f"the tape failed in {where}") from e

    def install(self) -> None:
        from fsdp_replay.agent.tape import start_tape

        native = None
        if self.cxx:
            from fsdp_replay.agent.cxx.tape import NativeTape, build

            if self.native is None:
                self.native = NativeTape(build())
            native = self.native
        self.op_tape, error = start_tape(
            _Passing() if self.passing else self.recorder, "", self._fail, native
        )
        if error:
            raise RuntimeError(error)
        if native is not None:
            if self.op_tape.native_error:
                raise RuntimeError(self.op_tape.native_error)
            self.recorder.native = native
            self.recorder.sync_native()

    def drain(self) -> None:
        self.recorder.drain_native()

    def cpu_ns(self) -> int:
        return self.state.cpu_ns + (self.native.state.cpu_ns if self.native is not None else 0)

    def remove(self) -> None:
        self.op_tape.uninstall()
        self.op_tape = None
        self.recorder.native = None

    def close(self) -> None:
        self.writer.flush(60)
        self.writer.close()


class _Passing:
    """The tape's handler for ``tape-passthrough``: never active, so every call runs only the op."""

    def active(self) -> bool:
        return False

    def taped(self, name: str, call: Any) -> Any:
        return call()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30, help="measured rounds (one step of every arm each)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured rounds first")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--cpu-size", action="store_true", help="the example's small defaults (a CPU check)")
    p.add_argument("--results", default=str(REPO / "bench" / "results" / "tape_step_gpu"))
    args = p.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    if "plain" not in arms:
        arms.insert(0, "plain")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp_replay.agent.fingerprint import fused

    ex = load_example()
    cuda = torch.cuda.is_available()
    cfg = ex.parse_args([] if args.cpu_size or not cuda else REFERENCE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.manual_seed(cfg.seed)
    model = ex.wrap_model(ex.GPT(cfg).to(device), cfg, device, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    g = torch.Generator(device=device).manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), device=device, generator=g)
        for _ in range(cfg.grad_accum)
    ]
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> None:
        for tokens in batches:
            with amp:
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            (loss / cfg.grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    kernel = fused._get()
    triton_used = bool(kernel) and cuda  # the kernel runs on CUDA tensors only
    times: dict[str, list[float]] = {a: [] for a in arms}
    calls: dict[str, list[int]] = {a: [] for a in arms}
    cpu_ms: dict[str, list[float]] = {a: [] for a in arms}
    proc_ms: dict[str, list[float]] = {a: [] for a in arms}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-tape-") as tmp:
        tape = Tape(Path(tmp))
        for r in range(args.warmup + args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            tape.count_layouts(r < args.warmup)
            for arm in order:
                if arm.startswith("tape"):
                    tape.passing = arm == "tape-passthrough"
                    tape.cxx = arm == "tape-cxx"
                    tape.install()
                    fused._kernel = False if arm == "tape-torchfp" else kernel
                torch.use_deterministic_algorithms(arm == "deterministic")
                calls0, cpu0 = tape.recorder.calls, tape.cpu_ns()
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                if arm == "tape-cxx":
                    tape.drain()  # the records become events at the step's end, on this thread
                sync()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                torch.use_deterministic_algorithms(False)
                if arm.startswith("tape"):
                    tape.remove()
                    fused._kernel = kernel
                if r >= args.warmup:
                    times[arm].append(dt)
                    calls[arm].append(tape.recorder.calls - calls0)
                    cpu_ms[arm].append((tape.cpu_ns() - cpu0) / 1e6)
                    proc_ms[arm].append(dc * 1e3)
            print(
                f"round {r}: " + "  ".join(f"{a} {times[a][-1] * 1e3:.1f} ms" for a in arms if times[a]),
                flush=True,
            )
        tape.close()
    dist.destroy_process_group()
    summary: dict[str, Any] = {}
    for arm in arms:
        ratios = [t / p for t, p in zip(times[arm], times["plain"], strict=True)]
        summary[arm] = {
            "step_ms_median": statistics.median(times[arm]) * 1e3,
            "ratio_to_plain": list(bootstrap_median(ratios)),
            "taped_calls_per_step": statistics.median(calls[arm]),
            "tape_cpu_ms_per_step": statistics.median(cpu_ms[arm]),
            "process_cpu_ms_per_step": statistics.median(proc_ms[arm]),
        }
    doc: dict[str, Any] = {
        "command": portable_command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "took_s": round(time.time() - started, 1),
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name() if cuda else None},
        "config": {**vars(args), "model": vars(cfg), "triton": triton_used},
        "summary": summary,
        "taped_output_layouts": tape.layouts,
        "times_s": times,
    }
    out = Path(args.results)
    lines = [
        "# The tape's cost per training step, arms interleaved step by step in one process",
        "",
        f"- Produced by: `{doc['command']}` (in the repository root)",
        f"- Date: {doc['date']} (took {doc['took_s']} s); device: {doc['machine']['gpu'] or 'CPU'}; "
        f"torch {doc['machine']['torch']}; Triton kernel: {'yes' if triton_used else 'no'}; "
        f"commit {doc['machine']['git_commit']}",
        f"- Step: the example's GPT (d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, seq "
        f"{cfg.seq_len}, batch {cfg.batch_size}, vocab {cfg.vocab}), FSDP2 on one rank, "
        f"{'bf16 autocast, ' if cuda else ''}{cfg.grad_accum} micro-steps, AdamW; "
        f"{args.rounds} rounds after {args.warmup} of warm-up, arms in rotating order",
        "",
        "| arm | step ms (median) | step / plain of the round: median [95% CI] | taped calls a step "
        "| tape hooks' CPU ms a step | process CPU ms a step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in arms:
        s = summary[arm]
        med, lo, hi = s["ratio_to_plain"]
        lines.append(
            f"| {arm} | {s['step_ms_median']:.2f} | {med:.3f} [{lo:.3f}, {hi:.3f}] | "
            f"{s['taped_calls_per_step']:.0f} | {s['tape_cpu_ms_per_step']:.2f} | "
            f"{s['process_cpu_ms_per_step']:.1f} |"
        )
    lines += [""] + [
        f"- taped outputs of `{op}` in the warm-up: {c} contiguous, {n} strided read in place, "
        f"{k} strided copied first"
        for op, (c, n, k) in sorted(tape.layouts.items())
    ]
    if tape.native is not None:
        ns = tape.native.state
        lines += [
            "",
            f"- the C++ hook (tape-cxx): {ns.calls} calls recorded in C++, {ns.deferred} left to Python; the fused "
            f"kernel launched from C++: {'yes' if tape.native.cuda else 'no (' + tape.recorder.native_note + ')'}",
        ]
    lines += [
        "",
        "Reading it: each ratio compares a step with the plain step of the same round, so slow drifts of "
        "the machine cancel. `tape` is what a recording's tape adds to a step (fingerprints only); the "
        "rest of a recording's cost (collectives, step ends, the writer's encoding) is "
        "`bench_record.py`'s `meta-notape`.",
    ]
    write_results(out, doc, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
