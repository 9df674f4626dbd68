"""The agent in replay mode: one process plays rank R of N, answering collectives from the trace.

``init_process_group`` is redirected to torch's fake process group (rank R of N, no peers, no
network); the same dispatcher kernels the recorder uses see every collective first, check it
against the record (op, process group, shapes, the fingerprint of every input), let the fake
backend complete it, and fill its outputs with the recorded payload. Step boundaries compare the
rank's parameters, losses and RNG states; DataLoader batches are replaced by the recorded ones.
Replaying from step S restores the latest snapshot at or before S at the same program point it
was taken (the optimizer step hook), after running the earlier steps unverified.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import struct
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_replay.agent import capture
from fsdp_replay.agent.collectives import CollectiveCall, wait_result
from fsdp_replay.agent.config import StepSet
from fsdp_replay.agent.fingerprint import Pending, fingerprint, fingerprint_many
from fsdp_replay.agent.hooks import Hooks
from fsdp_replay.errors import ConfigError, FsdpReplayError, TraceIncompleteError
from fsdp_replay.replayer.config import ReplayConfig
from fsdp_replay.replayer.expected import ExpectedColl, ExpectedTensor, RankRecord
from fsdp_replay.replayer.report import Divergence, magnitude
from fsdp_replay.trace.layout import RANK_REPORT_FMT, REPORT_JSON, atomic_write
from fsdp_replay.trace.ops import ALL_GATHER_OPS
from fsdp_replay.trace.reader import Trace

log = logging.getLogger(__name__)
EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 3


def _value(x: Any) -> Any:
    return x.value() if isinstance(x, Pending) else x


def _same_float(a: float, b: float) -> bool:
    """Bitwise equality, except that any NaN equals any NaN: a loss's NaN payload bits do not
    survive the JSON of the spool (parameters and collectives are compared bit for bit)."""
    if math.isnan(a) and math.isnan(b):
        return True
    return struct.pack("<d", a) == struct.pack("<d", b)


class Replayer:
    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.t0 = time.monotonic()
        self.cpu_ns = 0  # thread CPU time in the hooks (the hooks' Guarded adds to it)
        self.program_ns = 0
        self.live = config.live
        # All-rank replay runs under torchrun: each process replays the rank torchrun gave it.
        self.rank = int(os.environ.get("RANK", config.rank)) if self.live else config.rank
        self.notes: list[str] = []
        self.trace = Trace.open(config.trace)
        self.rec = RankRecord(self.trace, self.rank)
        self.world = self.rec.world_size
        self.from_step = config.from_step
        self.to_step = config.to_step
        # Verdicts are made only over steps whose records are all in the trace.
        # Verdicts are made only over what the record holds (trace/completeness.py). A record
        # that lost something stops the replay after its last whole step (``record_ends``); one
        # that only ends early (a kill) is replayed until the program needs a record past its end.
        self.complete = self.rec.completeness
        self.record_ends: int | None = None
        self.truncated = not self.complete["complete"]
        if self.truncated and not self.complete["prefix"]:
            self.record_ends = int(self.complete["through_step"])
        if self.live:  # every live rank must stop at the same step, or its peers would wait for it
            for r in self.trace.ranks:
                other = self.trace.rank(r).completeness
                if not other["complete"]:
                    end = int(other["through_step"])
                    if self.record_ends is None or end < self.record_ends:
                        self.record_ends = end
                        self.complete = {**other, "reasons": [f"rank {r}: {x}" for x in other["reasons"]]}
        last = int(self.complete["through_step"]) + (0 if self.record_ends is not None else 1)
        if self.truncated and self.from_step > last:
            raise TraceIncompleteError(
                f"rank {self.rank}'s record is complete only through step {self.complete['through_step']} "
                f"({'; '.join(self.complete['reasons'])}): nothing to verify from step {self.from_step}",
                path=self.rec.rank_trace.where,
            )
        damage = self.rec.attrs.get("damage") or []
        if damage:
            self.notes.append(
                f"the spool of rank {self.rank} was damaged when collected ({len(damage)} places, first: "
                f"{damage[0]}); what the replay verifies is what survived"
            )
        snap = self.rec.snapshot_at_or_before(self.from_step) if self.from_step > 0 else None
        self.restore_step = int(snap["step"]) if snap else 0
        self.snapshot = snap
        self.seq = 0
        self.step = 0
        self.micro = 0
        self.step_colls = 0
        self.batches = 0
        self.verified_colls = 0
        self.verified_steps: list[int] = []
        self.colls_per_step: dict[int, int] = {}
        self.primary: Any = None
        self.divergences: list[Divergence] = []
        self.data_differences = 0
        self.stopping = False
        self.finished = False
        self.failed = False
        self.hooks: Hooks | None = None
        self.on_step_zero_done: Any = None  # set by Hooks: drops the module hooks after step 0
        self._threads_checked = False
        self.module_idx = 0
        self.module_diverged = False
        self.tap: Any = None
        if any(step >= self.restore_step for step in self.rec.modules):
            from fsdp_replay.agent.modules import ModuleTap

            self.tap = ModuleTap(self._check_module, self._tap_enabled, self.fail)
            self.tap.install()

    # -- the owner interface the hooks expect -----------------------------------------------
    def active(self) -> bool:
        return os.getpid() == self.pid and not self.stopping

    def fail(self, where: str, exc: BaseException) -> None:
        if self.failed:
            return
        self.failed = True
        if isinstance(exc, FsdpReplayError):  # damaged or missing input: the message names it
            sys.stderr.write(f"fsdp-replay: cannot go on replaying ({where}): {exc}\n")
            self.finish("unusable", EXIT_BAD_INPUT, reason=f"{where}: {exc}")
            return
        log.error(
            "fsdp-replay: replay failed in %s: %s", where, "".join(traceback.format_exception(exc))[-3000:]
        )
        self.finish("error", EXIT_BAD_INPUT, reason=f"{where}: {exc}")

    def verifying(self) -> bool:
        return self.step >= self.restore_step

    def on_root_forward(self, module: torch.nn.Module) -> None:
        if self.tap is not None:
            self.tap.name_modules(module)

    def _tap_enabled(self) -> bool:
        return (
            self.active() and self.verifying() and not self.module_diverged and self.step in self.rec.modules
        )

    def _check_module(self, name: str, kind: str, fp: int, nonfinite: bool, algo: str) -> None:
        expected = self.rec.modules[self.step]
        idx = self.module_idx
        self.module_idx += 1
        if idx >= len(expected):
            return
        _micro, ename, ekind, efp, _ealgo = expected[idx]
        if (ename, ekind) != (name, kind) or efp != fp:
            self.module_diverged = True
            same_place = (ename, ekind) == (name, kind)
            direction = "output" if kind == "fwd" else "output gradient"
            self.diverge(
                Divergence(
                    kind="module",
                    rank=self.rank,
                    step=self.step,
                    micro=self.micro,
                    tensor=f"{name} ({direction})",
                    expected_fp=efp if same_place else None,
                    actual_fp=fp if same_place else None,
                    detail=(
                        f"the earliest module whose {direction} differs: {name}"
                        if same_place
                        else f"module call #{idx} is {name} ({kind}); recorded {ename} ({ekind}): the program took "
                        "another path"
                    ),
                    modules=[name],
                )
            )

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        recorded = (self.rec.meta.get("versions") or {}).get("torch")
        if recorded and recorded != torch.__version__ and not self.config.force:
            self.refuse(
                f"the trace was recorded with torch {recorded}; this process has torch "
                f"{torch.__version__} (kernels differ between versions; pass --force to replay anyway)"
            )
        self._restore_rng(-1, "process start")
        if not self.live:
            self._patch_init()
            self.rec.start_prefetch()

    def refuse(self, why: str) -> None:
        sys.stderr.write(f"fsdp-replay: refusing to replay: {why}\n")
        self.finish("refused", EXIT_BAD_INPUT, reason=why)

    def _patch_init(self) -> None:
        import torch.distributed.distributed_c10d as c10d
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        original_init = c10d.init_process_group
        original_new_group = c10d.new_group
        me = self

        def init_process_group(
            backend: Any = None,
            init_method: Any = None,
            timeout: Any = None,
            world_size: int = -1,
            rank: int = -1,
            store: Any = None,
            **kwargs: Any,
        ) -> None:
            ws = world_size if world_size and world_size > 0 else int(os.environ.get("WORLD_SIZE", me.world))
            rk = rank if rank is not None and rank >= 0 else int(os.environ.get("RANK", me.rank))
            if ws != me.world:
                me.refuse(f"the program asks for world size {ws}; the trace was recorded with {me.world}")
            if rk != me.rank:
                me.refuse(f"the program asks for rank {rk}; this replay plays rank {me.rank}")
            kwargs.pop("device_id", None)  # no eager communicator: there is nothing to connect to
            kwargs.pop("pg_options", None)
            args: dict[str, Any] = {
                "backend": "fake",
                "store": FakeStore(),
                "world_size": me.world,
                "rank": me.rank,
            }
            if timeout is not None:
                args["timeout"] = timeout
            original_init(**args, **kwargs)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("backend", None)
            kwargs.pop("pg_options", None)
            if len(args) > 2:
                args = (*args[:2], None, *args[3:])
            return original_new_group(*args, **kwargs)

        for mod in (dist, c10d):
            setattr(mod, "init_process_group", init_process_group)  # noqa: B010
            setattr(mod, "new_group", new_group)  # noqa: B010

    # -- collectives -----------------------------------------------------------------------
    def run(self, call: CollectiveCall, real: Any) -> Any:
        try:
            return self._run(call, real)
        except Exception as e:  # a replay that cannot answer a collective cannot go on
            self.fail(f"collective {call.op}", e)
            raise

    def _run(self, call: CollectiveCall, real: Any) -> Any:
        seq = self.seq
        self.seq += 1
        self.rec.advance(seq)
        exp = self.rec.colls.get(seq)
        verify = self.verifying()
        if verify and not self._threads_checked:
            self._check_threads()
        if exp is None and self.truncated:
            self._record_ended(f"before collective #{seq} ({call.op})")
        if exp is None:
            result = real()
            if verify:
                self.diverge(
                    Divergence(
                        kind="extra_collective",
                        rank=self.rank,
                        step=self.step,
                        micro=self.micro,
                        seq=seq,
                        op=call.op,
                        detail=f"the recorded rank issued {len(self.rec.colls)} collectives; "
                        "the replay issues more",
                    ),
                    stop=True,
                )
            return result
        if verify:
            self._check_call(call, exp, seq, call.inputs, exp.role("i"), "input")
        result = real()
        call.set_outputs(result)  # functional collectives: the outputs exist only now
        wait_result(result, call)
        if verify:
            self._check_call(call, exp, seq, call.outputs, exp.role("o"), "output")
        if self.live:
            if verify:
                self._check_outputs(call, exp, seq)
        else:
            self._fill_outputs(call, exp, verify)
        self.step_colls += 1
        if verify:
            self.verified_colls += 1
        return result

    def _pg_matches(self, call: CollectiveCall, exp: ExpectedColl) -> str | None:
        info = self.rec.process_groups.get(exp.pg)
        pg = call.process_group
        if info is None or pg is None:
            return None
        if int(info["size"]) != pg.size() or int(info["group_rank"]) != pg.rank():
            return (
                f"process group of size {pg.size()} (group rank {pg.rank()}); recorded size {info['size']} "
                f"(group rank {info['group_rank']}, ranks {info['ranks']})"
            )
        return None

    def _check_call(
        self,
        call: CollectiveCall,
        exp: ExpectedColl,
        seq: int,
        tensors: list[torch.Tensor],
        expected: list[ExpectedTensor],
        role: str,
    ) -> None:
        base: dict[str, Any] = {
            "rank": self.rank,
            "step": self.step,
            "micro": self.micro,
            "seq": seq,
            "op": call.op,
            "pg": exp.pg,
        }
        if role == "input":
            if call.op != exp.op:
                self.diverge(
                    Divergence(kind="op", **base, detail=f"replay issued {call.op}; recorded {exp.op}"),
                    stop=True,
                    feeding=True,
                )
                return
            pg_problem = self._pg_matches(call, exp)
            if pg_problem:
                self.diverge(Divergence(kind="process_group", **base, detail=pg_problem), stop=True)
                return
        if len(expected) != len(tensors):
            self.diverge(
                Divergence(kind="shape", **base, detail=f"{len(tensors)} {role}s; recorded {len(expected)}"),
                stop=True,
            )
            return
        for i, (t, e) in enumerate(zip(tensors, expected, strict=True)):
            t = capture.local(t)
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype != e.dtype or tuple(t.shape) != e.shape:
                self.diverge(
                    Divergence(
                        kind="shape",
                        **base,
                        tensor=f"{role} {i}",
                        detail=f"{dtype}{list(t.shape)}; recorded {e.dtype}{list(e.shape)}",
                    ),
                    stop=True,
                    feeding=True,
                )
                return
        if role != "input":
            return
        ins = expected
        for i, (t, e) in enumerate(zip(call.inputs, ins, strict=True)):
            t = capture.local(t)
            fp, _nf, _ = fingerprint(t, e.algo)
            fp = _value(fp)
            if fp != e.fp:
                self.diverge(
                    Divergence(
                        kind="collective_input",
                        **base,
                        tensor=f"input {i}",
                        expected_fp=e.fp,
                        actual_fp=fp,
                        magnitude=self._input_magnitude(call, exp, t, i),
                    ),
                    stop=True,
                    feeding=True,
                )
                return

    def _input_magnitude(
        self, call: CollectiveCall, exp: ExpectedColl, t: torch.Tensor, i: int
    ) -> dict | None:
        ins = exp.role("i")
        try:
            if ins[i].payload >= 0:
                return magnitude(self.rec.tensor(ins[i]), t)
            outs = exp.role("o")
            pg = call.process_group
            if exp.op in ALL_GATHER_OPS and len(outs) == len(ins) and outs[i].payload >= 0 and pg is not None:
                # An all-gather's output holds every rank's input: this rank's chunk is what it sent.
                chunk = self.rec.tensor(outs[i]).reshape(pg.size(), -1)[pg.rank()]
                return magnitude(chunk.reshape(t.shape), t)
            if exp.op == "allgather_" and len(outs) >= 1 and pg is not None:
                out = outs[pg.rank()]
                if out.payload >= 0:
                    return magnitude(self.rec.tensor(out), t)
        except Exception as e:  # magnitude is a bonus; never let it hide the divergence
            self.notes.append(f"could not compute the divergence magnitude: {e!r}")
        return None

    def _check_outputs(self, call: CollectiveCall, exp: ExpectedColl, seq: int) -> None:
        """All-rank replay: the live result must equal the recorded one."""
        for i, (t, e) in enumerate(zip(call.outputs, exp.role("o"), strict=False)):
            t = capture.local(t)
            fp = _value(fingerprint(t, e.algo)[0])
            if fp != e.fp:
                mag = magnitude(self.rec.tensor(e), t) if e.payload >= 0 else None
                self.diverge(
                    Divergence(
                        kind="collective_output",
                        rank=self.rank,
                        step=self.step,
                        micro=self.micro,
                        seq=seq,
                        op=exp.op,
                        pg=exp.pg,
                        tensor=f"output {i}",
                        expected_fp=e.fp,
                        actual_fp=fp,
                        magnitude=mag,
                    ),
                    feeding=True,
                )
                return

    def _fill_outputs(self, call: CollectiveCall, exp: ExpectedColl, verify: bool) -> None:
        for t, e in zip(call.outputs, exp.role("o"), strict=False):
            dst = capture.local(t)
            if e.payload >= 0:
                with torch.no_grad():
                    dst.copy_(self.rec.tensor(e))
            elif verify:
                self.diverge(
                    Divergence(
                        kind="payload_missing",
                        rank=self.rank,
                        step=self.step,
                        micro=self.micro,
                        seq=exp.seq,
                        op=exp.op,
                        pg=exp.pg,
                        detail=self._missing_payload_hint(exp.step),
                    ),
                    stop=True,
                    unusable=True,
                )
            else:
                with torch.no_grad():
                    dst.zero_()  # fast-forward before the restored snapshot: values are overwritten later

    def _missing_payload_hint(self, step: int) -> str:
        """Why the trace has no payload for ``step``, from what the recording was asked to keep
        and what it reported dropping; and what to do about it."""
        policy = str((self.rec.meta.get("policy") or {}).get("payloads", "all"))
        counters = (self.rec.attrs.get("end") or {}).get("counters") or {}
        dropped = int(counters.get("blobs_dropped", 0))
        damaged = int(self.rec.attrs.get("payload_missing", 0))
        try:
            wanted = step in StepSet.parse(policy)
        except ConfigError:
            wanted = True
        head = f"the trace holds no payload for a collective of step {step}"
        if wanted and dropped:
            return (
                f"{head}: the recording kept payloads for {policy} but dropped {dropped} of them "
                f"({int(counters.get('blob_bytes_dropped', 0)) / 1e6:.1f} MB; the disk was full or the "
                "in-memory bound was reached). Replay steps whose payloads were kept, or record again "
                "with more free space"
            )
        if wanted and damaged:
            return f"{head}: {damaged} stored payloads were lost to spool damage (see `fsdp-replay inspect`)"
        if wanted:
            return f"{head}, although the recording kept payloads for {policy}"
        return (
            f"{head}: the recording kept payloads for {policy}; an isolated replay of steps "
            f"{self.restore_step}.. needs the payloads of those steps (record with --payloads all or "
            f"steps:{self.restore_step}-...)"
        )

    # -- steps -----------------------------------------------------------------------------
    def on_step_begin(self, opt: torch.optim.Optimizer) -> None:
        if self.primary is None:
            self.primary = opt

    def on_step_end(self, opt: torch.optim.Optimizer) -> None:
        if opt is not self.primary:
            return
        exp = self.rec.steps.get(self.step)
        if self.verifying():
            self._check_step(opt, exp)
        self.colls_per_step[self.step] = self.step_colls
        done = self.step
        if done == 0 and callable(self.on_step_zero_done):
            self.on_step_zero_done()
        self.step += 1
        self.micro = 0
        self.step_colls = 0
        self.module_idx = 0
        if self.verifying() and self.step > self.restore_step:
            self._check_rng(self.step)
        if self.step == self.restore_step and self.restore_step > 0:
            self._restore(opt)
        if self.divergences and not self.live:
            self.finish("diverged", EXIT_DIVERGED)
        self._progress(done)
        if self.to_step >= 0 and done >= self.to_step:
            self.finish("end", EXIT_OK, reason=f"stopped after step {done} (--to-step)")
        if self.record_ends is not None and done >= self.record_ends:
            self._record_ended(f"after step {self.record_ends}")

    def _record_ended(self, where: str) -> None:
        """The replay needs what the record does not hold: stop, with what was verified."""
        self.notes.append(
            f"the record of rank {self.rank} ends {where} ({'; '.join(self.complete['reasons'])}); "
            "the replay matched everything recorded up to there and stopped"
        )
        self.finish("end", EXIT_OK, reason=f"the record ends {where}")

    def _check_step(self, opt: torch.optim.Optimizer, exp: Any) -> None:
        base: dict[str, Any] = {"rank": self.rank, "step": self.step, "micro": self.micro}
        if exp is None and self.truncated:
            self._record_ended(f"before the end of step {self.step}")
        if exp is None:
            self.diverge(
                Divergence(
                    kind="extra_step",
                    **base,
                    detail=f"the recorded rank made {len(self.rec.steps)} "
                    "optimizer steps; the replay makes more",
                ),
                stop=True,
            )
            return
        if exp.micro_steps != self.micro:
            self.diverge(
                Divergence(
                    kind="micro_steps",
                    **base,
                    detail=f"{self.micro} backward passes in this step; recorded {exp.micro_steps}",
                )
            )
        params = capture.optimizer_params(opt)
        names = self._param_names(params)
        locals_ = [capture.local(p).detach() for p in params]
        batched = fingerprint_many(locals_)  # the recorder's own path: one read-back on a GPU
        for i, (p, (efp, _enf, algo)) in enumerate(zip(params, exp.params, strict=False)):
            got, _nf, got_algo = batched[i]
            fp = _value(got) if got_algo == algo else _value(fingerprint(locals_[i], algo)[0])
            if fp != efp:
                self.diverge(
                    Divergence(
                        kind="parameters",
                        **base,
                        tensor=names[i],
                        expected_fp=efp,
                        actual_fp=fp,
                        magnitude=self._param_magnitude(i, p),
                        detail="parameters after the optimizer step differ",
                    )
                )
                break
        self.verified_steps.append(self.step)

    def _param_magnitude(self, index: int, p: torch.Tensor) -> dict | None:
        snap = self.rec.snapshots.get(self.step + 1)
        if not snap or snap.get("payload", -1) < 0:
            return None
        state = capture.decode_snapshot(self.rec.blob(int(snap["payload"])))
        return magnitude(state["optimizers"][0]["params"][index], capture.local(p))

    def _param_names(self, params: list[torch.Tensor]) -> list[str]:
        snap = next(iter(self.rec.snapshots.values()), None)
        if snap:
            names = [row[0] for row in snap.get("params", [])]
            if len(names) == len(params):
                return names
        return [f"param {i}" for i in range(len(params))]

    def _check_rng(self, step: int) -> None:
        exp = self.rec.rng.get(step)
        if exp is None:
            return
        fps, _ = capture.encode_rng(capture.rng_state())
        for k in ("python", "torch", "numpy"):
            if k in exp and k in fps and fps[k] != exp[k]:
                self.diverge(
                    Divergence(
                        kind="rng",
                        rank=self.rank,
                        step=step - 1,
                        micro=self.micro,
                        tensor=k,
                        expected_fp=exp[k],
                        actual_fp=fps[k],
                        detail=f"the {k} RNG state at the end of step {step - 1} differs: the "
                        "program drew a different amount of randomness",
                    )
                )
                return

    def _restore_rng(self, step: int, what: str) -> None:
        exp = self.rec.rng.get(step)
        if exp is None or exp["payload"] < 0:
            self.notes.append(f"no RNG state recorded at {what}")
            return
        fps, _ = capture.encode_rng(capture.rng_state())
        differs = [k for k in ("python", "torch", "numpy") if k in exp and k in fps and fps[k] != exp[k]]
        capture.set_rng_state(capture.decode_rng(self.rec.blob(exp["payload"])))
        if differs and step < 0:
            self.notes.append(
                f"the {', '.join(differs)} RNG state at {what} differed from the recorded one and was "
                "restored (Python's and numpy's are seeded from the OS unless the program seeds them)"
            )

    def _restore(self, opt: torch.optim.Optimizer) -> None:
        snap = self.snapshot
        assert snap is not None
        expected_seq = self.rec.first_seq_of_step(self.restore_step)
        if self.seq != expected_seq:
            self.notes.append(
                f"before step {self.restore_step} the replay issued {self.seq} collectives; the record "
                f"has {expected_seq}"
            )
        state = capture.decode_snapshot(self.rec.blob(int(snap["payload"])))
        saved = state["optimizers"][0]
        params = capture.optimizer_params(opt)
        with torch.no_grad():
            for p, value in zip(params, saved["params"], strict=True):
                capture.local(p).copy_(value)
            for p, st in zip(params, saved["state"], strict=True):
                current = opt.state[p]
                for k, v in st.items():
                    cur = current.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                        capture.local(cur).copy_(v)
                    else:
                        current[k] = v
            for group, g in zip(opt.param_groups, saved["param_groups"], strict=True):
                group.update({k: v for k, v in g.items() if k != "params"})
        for sched, s in zip(capture.schedulers_of(opt), saved["schedulers"], strict=False):
            sched.load_state_dict(s["state"])
        self._restore_rng(self.restore_step, f"step {self.restore_step}")

    # -- backward and batches --------------------------------------------------------------
    def on_backward(self, tensors: Any) -> None:
        if not self.verifying() or not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        exp = self.rec.steps.get(self.step)
        if exp is None or self.micro >= len(exp.losses):
            return
        value = float(tensors.detach().double().item())
        if not _same_float(value, exp.losses[self.micro]):
            self.diverge(
                Divergence(
                    kind="loss",
                    rank=self.rank,
                    step=self.step,
                    micro=self.micro,
                    detail=f"loss {value!r}; recorded {exp.losses[self.micro]!r}",
                )
            )

    def after_backward(self) -> None:
        self.micro += 1

    def on_batch(self, iterator: Any, batch: Any) -> Any:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        n = self.batches
        self.batches += 1
        if n >= len(self.rec.batches):
            return None
        exp = self.rec.batches[n]
        leaves, spec = tree_flatten(batch)
        tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        expected: list[ExpectedTensor] = exp["tensors"]
        if len(tensor_idx) != len(expected):
            self.notes.append(
                f"batch {n} has {len(tensor_idx)} tensors; recorded {len(expected)}: not replaced"
            )
            return None
        same = all(
            _value(fingerprint(leaves[i], e.algo)[0]) == e.fp
            for i, e in zip(tensor_idx, expected, strict=True)
        )
        if same:
            return None
        self.data_differences += 1
        if any(e.payload < 0 for e in expected):
            if self.verifying():
                self.diverge(
                    Divergence(
                        kind="batch",
                        rank=self.rank,
                        step=self.step,
                        micro=self.micro,
                        detail=f"batch {n} differs from the recorded one, whose bytes were not stored",
                    ),
                    stop=True,
                    unusable=True,
                )
            return None
        if self.data_differences == 1:
            self.notes.append(
                f"the DataLoader produced different data than recorded (first at batch {n}, step "
                f"{self.step}); the recorded batches were fed instead"
            )
        for i, e in zip(tensor_idx, expected, strict=True):
            leaves[i] = self.rec.tensor(e).to(leaves[i].device).clone()
        return tree_unflatten(leaves, spec)

    # -- divergence and the end ------------------------------------------------------------
    def _check_threads(self) -> None:
        self._threads_checked = True
        recorded = (self.rec.meta.get("threads") or {}).get("intra_op")
        now = torch.get_num_threads()
        if recorded is not None and recorded != now:
            msg = (
                f"intra-op threads: recorded {recorded}, replay {now}. CPU kernels split reductions by thread, "
                "so float results can differ in the last bits: set OMP_NUM_THREADS to the recorded value"
            )
            self.notes.append(msg)
            log.warning("fsdp-replay: %s", msg)

    def diverge(
        self, d: Divergence, *, stop: bool = False, feeding: bool = False, unusable: bool = False
    ) -> None:
        if feeding:
            d.modules = feeding_modules()
        self.divergences.append(d)
        # A live rank must not leave: its peers would wait for it in the next collective.
        if stop and (not self.live or unusable):
            self.finish("unusable" if unusable else "diverged", EXIT_BAD_INPUT if unusable else EXIT_DIVERGED)

    def _progress(self, step: int) -> None:
        total = len(self.rec.steps) if self.to_step < 0 else self.to_step + 1
        state = "verified" if step >= self.restore_step else "fast-forward"
        print(
            f"[fsdp-replay] rank {self.rank}: step {step}/{total - 1} {state} ({self.verified_colls} collectives "
            "verified)",
            file=sys.stderr,
            flush=True,
        )

    def report(self, status: str, reason: str) -> dict[str, Any]:
        return {
            "status": status,
            "reason": reason,
            "rank": self.rank,
            "live": self.live,
            "world_size": self.world,
            "trace": self.trace.url,
            "from_step": self.from_step,
            "to_step": self.to_step,
            "restored_snapshot": self.restore_step if self.restore_step > 0 else None,
            "verified_steps": self.verified_steps,
            "collectives_verified": self.verified_colls,
            "collectives_per_step": self.colls_per_step,
            "recorded_steps": len(self.rec.steps),
            "recorded_collectives": len(self.rec.colls),
            "record_complete": self.complete,
            "replayed_collectives": self.seq,
            "first_divergence": self.divergences[0].as_dict() if self.divergences else None,
            "divergences": [d.as_dict() for d in self.divergences[:20]],
            "data_differences": self.data_differences,
            "notes": self.notes,
            "determinism": self.rec.meta.get("determinism"),
            "recorded_on_cuda": "cuda" in self.rec.attrs.get("device_names", []),
            "seconds": time.monotonic() - self.t0,
        }

    def finish(self, status: str, code: int, reason: str | None = None) -> None:
        """Write report.json; leave the process now unless the program is ending by itself.

        ``status`` "exit" (the program ended) and "end" (--to-step reached) are resolved to
        "bit-exact" or "diverged" from what was verified.
        """
        if self.finished:
            return
        self.finished = True
        self.stopping = True
        at_exit = status == "exit"
        if status in ("exit", "end"):
            reason = reason or "the program ended"
            status, code = self._final_status(check_complete=at_exit)
        out = Path(self.config.report)
        if self.live:
            out = out / RANK_REPORT_FMT.format(rank=self.rank)
        out.mkdir(parents=True, exist_ok=True)
        doc = self.report(status, reason or status)
        atomic_write(out / REPORT_JSON, json.dumps(doc, indent=2, default=str) + "\n")
        if not at_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _final_status(self, check_complete: bool) -> tuple[str, int]:
        if self.divergences:
            return "diverged", EXIT_DIVERGED
        if check_complete and self.seq < len(self.rec.colls) and self.to_step < 0:
            self.divergences.append(
                Divergence(
                    kind="ended_early",
                    rank=self.rank,
                    step=self.step,
                    micro=self.micro,
                    seq=self.seq,
                    detail=f"the program ended after {self.seq} collectives; the recorded rank issued "
                    f"{len(self.rec.colls)}",
                )
            )
            return "diverged", EXIT_DIVERGED
        return "bit-exact", EXIT_OK


def feeding_modules() -> list[str]:
    """Names of the parameters whose collective this is, found in the FSDP frames that issued it."""
    frame = sys._getframe(1)
    found: list[str] = []
    while frame is not None and not found:
        owner = frame.f_locals.get("self")
        fsdp_params = frame.f_locals.get("fsdp_params") or getattr(owner, "fsdp_params", None)
        if fsdp_params:  # FSDP2: FSDPParamGroup.unshard / post_backward
            for fp in fsdp_params:
                fqn = getattr(fp, "_param_fqn", None)
                info = getattr(fp, "_module_info", None)
                if fqn is None and info is not None:
                    fqn = f"{type(info.module).__name__}.{info.param_name}"
                found.append(str(fqn))
        flat = getattr(owner, "flat_param", None)
        if flat is not None and getattr(flat, "_fqns", None):  # FSDP1: FlatParamHandle
            found.extend(str(f) for f in flat._fqns)
        frame = frame.f_back  # type: ignore[assignment]
    return found[:50]


def attach_replay(config: ReplayConfig) -> Replayer:
    """Install the replayer. Raises on any failure: the caller ends the process (``boot.attach``)."""
    replayer = Replayer(config)
    hooks = Hooks(replayer)
    hooks.install()
    replayer.hooks = hooks
    replayer.start()
    atexit.register(replayer.finish, "exit", EXIT_OK)
    return replayer
