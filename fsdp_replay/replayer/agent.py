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
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.collectives import CollectiveCall, wait_result
from fsdp_replay.agent.config import StepSet
from fsdp_replay.agent.entropy import EntropyReplay
from fsdp_replay.agent.hooks import Hooks
from fsdp_replay.agent.tape import OpTape
from fsdp_replay.errors import ConfigError, ExitCode, FsdpReplayError, TraceFormatError, TraceIncompleteError
from fsdp_replay.replayer import env_watch, feed, overlay, restore, safe_unpickle, verify
from fsdp_replay.replayer.config import ReplayConfig
from fsdp_replay.replayer.expected import RankRecord
from fsdp_replay.replayer.fake_pg import completed_work, redirect_to_fake_pg
from fsdp_replay.replayer.fsdp_frames import feeding_modules
from fsdp_replay.replayer.key_check import KeyCheck
from fsdp_replay.replayer.op_check import OpCheck
from fsdp_replay.replayer.reach import Reach
from fsdp_replay.replayer.report import KIND_TEXT, Divergence, build_report, late_note
from fsdp_replay.replayer.serve import BatchServer
from fsdp_replay.replayer.tape import ReplayTape, attach_tape
from fsdp_replay.trace import signing
from fsdp_replay.trace.completeness import exception_text
from fsdp_replay.trace.layout import RANK_REPORT_FMT, REPORT_JSON, atomic_write
from fsdp_replay.trace.reader import Trace

log = logging.getLogger(__name__)
EXIT_OK, EXIT_DIVERGED, EXIT_BAD_INPUT = ExitCode.OK, ExitCode.FOUND, ExitCode.UNUSABLE


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
        self.program_error: str | None = None  # an exception the program did not catch
        self.program_error_files: list[str] = []  # the files of its traceback's frames
        self.ops: OpCheck | None = None
        self.trace = Trace.open(config.trace)
        self._peers: dict[int, dict[str, Any] | FsdpReplayError] = {}
        self.rec = RankRecord(self.trace, self.rank, trusted=config.trust_trace)
        if config.signing_key:  # the attributes this replay reads are the ones signed
            key = signing.load_key(config.signing_key)
            checks = {
                "the root": signing.check(dict(self.trace.root.attrs), key),
                f"rank {self.rank}": signing.check(self.rec.attrs, key),
            }
            for r in self.trace.ranks:  # their file ledgers shape the replay's view of the files
                if r != self.rank and (attrs := self._peer_attrs(r)) is not None:
                    checks[f"rank {r}"] = signing.check(attrs, key)
            line, bad = signing.describe(checks, key)
            if bad:
                raise TraceFormatError(f"the trace is {line}", path=config.trace)
        self.world = self.rec.world_size
        self.key = KeyCheck(self.rec.meta, self.rec.attrs.get("numerics_changes") or [], self.notes)
        self.from_step = config.from_step
        self.to_step = config.to_step
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
        if not self.truncated and self.from_step > int(self.complete["through_step"]):
            raise ConfigError(
                f"rank {self.rank}'s record ends with step {self.complete['through_step']}: nothing to verify "
                f"from step {self.from_step}"
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
        self.reach = Reach(
            self.rec,
            self.rank,
            self.restore_step,
            (self.from_step, self.to_step),
            config.fast_forward_warmup,
            self.live,
            self.notes,
            self.fail,
            self.record_ended,
        )
        self.ff = self.reach.ff
        self.restored = False
        self.roots: list[torch.nn.Module] = []
        self.batch_server: BatchServer | None = None
        if not self.live:
            self.batch_server = BatchServer(
                self.rec,
                config.data,
                self.restore_step,
                self.reach.verify_to(self.to_step),
                self.reach.batch_content,
                self.notes,
                self.record_ended if self.truncated else None,
            )
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
        self.tape: ReplayTape | None = None
        self.op_tape: OpTape | None = None
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
        if self.step == 0 and all(module is not r for r in self.roots):
            self.roots.append(module)  # in the order the recorder listed them (snapshot buffers)
        self.reach.loop_started()
        if self.tap is not None:
            self.tap.name_modules(module)
        if self.ops is not None:
            self.ops.tap.name_modules(module)

    def _tap_enabled(self) -> bool:
        return (
            self.active() and self.verifying() and not self.module_diverged and self.step in self.rec.modules
        )

    def _check_module(self, name: str, kind: str, fp: int, nonfinite: bool, algo: str) -> None:
        idx = self.module_idx
        self.module_idx += 1
        base = {"rank": self.rank, "step": self.step, "micro": self.micro}
        f = verify.module_finding(self.rec.modules[self.step], idx, name, kind, fp, base)
        if f is not None:
            self.module_diverged = True
            self.found(f)

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        recorded = (self.rec.meta.get("versions") or {}).get("torch")
        if recorded and recorded != torch.__version__ and not self.config.force:
            self.refuse(
                f"the trace was recorded with torch {recorded}; this process has torch "
                f"{torch.__version__} (kernels differ between versions; pass --force to replay anyway)"
            )
        restore.restore_rng(self.rec, -1, "process start", self.notes)
        EntropyReplay(self.rec.attrs.get("urandom") or {}, self.notes).install()
        local_trace = [self.config.trace] if "://" not in self.config.trace else []
        pairs = [tuple(p) for p in json.loads(self.config.path_map)] if self.config.path_map else []
        ledgers, start_ns = self._job_ledgers(pairs)
        job = overlay.job_files(ledgers, self.rank, start_ns=start_ns, live=self.live)
        # live ranks share one private folder: each finds what another wrote, as in the recorded job
        self.files, self.changed_inputs = overlay.isolate(
            ledgers[self.rank],
            Path(self.config.report) / "files",
            [self.config.report, *local_trace],
            self.notes,
            job,
        )
        if not self.live:
            backends = {str(g.get("name")): str(g.get("backend")) for g in self.rec.process_groups.values()}
            redirect_to_fake_pg(self.world, self.rank, self.refuse, backends)
            if not self.config.trust_trace:  # received objects are bytes from the trace
                safe_unpickle.install(str(m["name"]) for m in self.rec.attrs.get("modules") or [])
            self.rec.start_prefetch()
        if self.batch_server is not None:
            self.batch_server.install()

    def _peer_attrs(self, rank: int) -> dict[str, Any] | None:
        """Another rank's attributes (read once), or None where its group cannot be read."""
        if rank not in self._peers:
            try:
                self._peers[rank] = self.trace.rank(rank).attrs
            except FsdpReplayError as e:
                self._peers[rank] = e
        found = self._peers[rank]
        return None if isinstance(found, FsdpReplayError) else found

    def _job_ledgers(self, pairs: list[tuple[str, str]]) -> tuple[dict[int, dict[str, Any]], int | None]:
        """Every rank's file ledger (where the recorded folders are here), and when the recording
        began: a program finds what another rank wrote (rank 0's checkpoint) as readily as its own."""
        own = self.rec.attrs
        ledgers = {self.rank: overlay.map_ledger(own.get("files") or {}, pairs)}
        starts = [(own.get("rank_start") or {}).get("start_ns")]
        for r in self.trace.ranks:
            if r == self.rank:
                continue
            attrs = self._peer_attrs(r)
            if attrs is None:  # a damaged peer does not stop this rank's replay
                self.notes.append(
                    f"rank {r}'s file ledger cannot be read ({self._peers[r]}): the files it created are "
                    "not hidden"
                )
                continue
            ledgers[r] = overlay.map_ledger(attrs.get("files") or {}, pairs)
            starts.append((attrs.get("rank_start") or {}).get("start_ns"))
        known = [int(t) for t in starts if isinstance(t, int) and not isinstance(t, bool) and t > 0]
        return ledgers, min(known, default=None)

    def refuse(self, why: str) -> None:
        sys.stderr.write(f"fsdp-replay: refusing to replay: {why}\n")
        self.finish("refused", EXIT_BAD_INPUT, reason=why)

    # -- collectives -----------------------------------------------------------------------
    def run(self, call: CollectiveCall, real: Any) -> Any:
        if self.op_tape is not None and self.op_tape.pending:
            self.op_tape.install_missing()
        try:
            return self._run(call, real)
        except Exception as e:  # a replay that cannot answer a collective cannot go on
            self.fail(f"collective {call.op}", e)
            raise

    def _run(self, call: CollectiveCall, real: Any) -> Any:
        if self.reach.skipping():
            return self.reach.collective(call, real)
        seq = self.seq
        self.seq += 1
        self.rec.advance(seq)
        exp = self.rec.colls.get(seq)
        verify_now = self.verifying()
        if verify_now and not self._threads_checked:
            self._check_threads()
        if exp is None and self.truncated:
            self.record_ended(f"before collective #{seq} ({call.op})")
        if exp is None:
            result = real()
            if verify_now:
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
        base = self._base(seq, call.op, exp.pg)
        if verify_now and self.reach.unverified():
            verify_now = False
        if verify_now and (ended := self.reach.beyond_the_payloads(exp)):
            self.record_ended(ended)
        if verify_now:
            self.found(
                verify.check_call(self.rec, call, exp, base, call.inputs, exp.role("i"), "input", self.notes)
            )
        result = real()
        call.set_outputs(result)  # functional collectives: the outputs exist only now
        wait_result(result, call)
        if verify_now:
            self.found(
                verify.check_call(
                    self.rec, call, exp, base, call.outputs, exp.role("o"), "output", self.notes
                )
            )
        if self.live:
            if verify_now:
                self.found(verify.check_live_outputs(self.rec, call, exp, base))
        else:
            self.found(verify.fill_outputs(self.rec, call, exp, verify_now, base, self.restore_step))
            result = completed_work(result)  # the fake backend's Work has no value; DDP reads it
        self.step_colls += 1
        if verify_now:
            self.verified_colls += 1
        return result

    def _base(self, seq: int, op: str, pg: int) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "micro": self.micro, "seq": seq, "op": op, "pg": pg}

    def found(self, f: verify.Finding | None) -> None:
        if f is not None:
            self.diverge(f.divergence, stop=f.stop, feeding=f.feeding, unusable=f.unusable)

    # -- steps -----------------------------------------------------------------------------
    def on_step_begin(self, opt: torch.optim.Optimizer) -> None:
        if self.primary is None:
            self.primary = opt
            self.key.at_start()

    def on_step_end(self, opt: torch.optim.Optimizer) -> None:
        if opt is not self.primary:
            return
        exp = self.rec.steps.get(self.step)
        if self.verifying():
            self._check_step(opt, exp)
        self.colls_per_step[self.step] = self.step_colls
        done = self.step
        self.key.at_step_end(done)
        if done == 0 and callable(self.on_step_zero_done):
            self.on_step_zero_done()
        self.step += 1
        self.micro = 0
        self.step_colls = 0
        self.module_idx = 0
        self.reach.at_step_end(done)
        if self.ops is not None:
            self.ops.at_step(self.step)
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
            self.record_ended(f"after step {self.record_ends}")

    def record_ended(self, where: str) -> None:
        """The replay needs what the record does not hold: stop, with what was verified."""
        why = "; ".join(self.complete["reasons"])
        self.notes.append(
            f"the record of rank {self.rank} ends {where}{f' ({why})' if why else ''}; "
            "the replay matched everything recorded up to there and stopped"
        )
        self.finish("end", EXIT_OK, reason=f"the record ends {where}")

    def _check_step(self, opt: torch.optim.Optimizer, exp: Any) -> None:
        base: dict[str, Any] = {"rank": self.rank, "step": self.step, "micro": self.micro}
        if exp is None and self.truncated:
            self.record_ended(f"before the end of step {self.step}")
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
        names = self._param_names(capture.optimizer_params(opt))
        for f in verify.check_parameters(self.rec, opt, exp, base, names):
            self.found(f)
        self.verified_steps.append(self.step)

    def _param_names(self, params: list[torch.Tensor]) -> list[str]:
        snap = next(iter(self.rec.snapshots.values()), None)
        if snap:
            names = [row[0] for row in snap.get("params", [])]
            if len(names) == len(params):
                return names
        return [f"param {i}" for i in range(len(params))]

    def _check_rng(self, step: int) -> None:
        d = restore.rng_divergence(self.rec, step, self.rank, self.micro)
        if d is not None:
            self.diverge(d)

    def _restore(self, opt: torch.optim.Optimizer) -> None:
        snap = self.snapshot
        assert snap is not None
        self.seq = self.reach.restoring(self.seq)
        if self.tape is not None:
            self.tape.seq = min(
                (n for n, c in self.rec.tape.items() if c.step >= self.restore_step),
                default=len(self.rec.tape),
            )
        restore.restore_snapshot(self.rec, snap, opt, self.roots, self.notes)
        restore.restore_rng(self.rec, self.restore_step, f"step {self.restore_step}", self.notes)
        self.restored = True
        self.reach.restored()

    # -- backward and batches --------------------------------------------------------------
    def on_backward(self, tensors: Any) -> None:
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        if self.reach.loss(tensors, self.step, self.micro) or not self.verifying():
            return
        exp = self.rec.steps.get(self.step)
        if exp is None or self.micro >= len(exp.losses):
            return
        value = float(tensors.detach().double().item())
        if not verify.same_float(value, exp.losses[self.micro]):
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
        self.reach.end_after_restore()
        if self.op_tape is not None and self.op_tape.pending:
            self.op_tape.install_missing()
        if self.batch_server is not None:  # one count over served and live loaders alike
            n = self.batch_server.next_batch
            self.batch_server.next_batch += 1
        else:
            n = self.batches
            self.batches += 1
        if n >= len(self.rec.batches):
            return None
        base = {"rank": self.rank, "step": self.step, "micro": self.micro}
        fed = feed.recorded_batch(self.rec, n, batch, base, self.notes, first=self.data_differences == 0)
        if fed.differs:
            self.data_differences += 1
        if fed.finding is not None and self.verifying():
            self.found(fed.finding)
        return fed.batch

    # -- divergence and the end ------------------------------------------------------------
    def _check_threads(self) -> None:
        self._threads_checked = True
        msg = verify.thread_note(self.rec)
        if msg is not None:
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
            if unusable:
                what = KIND_TEXT.get(d.kind, d.kind)
                self.finish(
                    "unusable",
                    EXIT_BAD_INPUT,
                    reason=f"{what} (step {d.step}): nothing after it can be checked",
                )
            else:
                self.finish("diverged", EXIT_DIVERGED)

    def _progress(self, step: int) -> None:
        total = len(self.rec.steps) if self.to_step < 0 else self.to_step + 1
        state = self.reach.progress_line(step)
        if state is None:
            return  # skipped steps: a line every 100
        print(
            f"[fsdp-replay] rank {self.rank}: step {step}/{total - 1} {state} ({self.verified_colls} collectives "
            "verified)",
            file=sys.stderr,
            flush=True,
        )

    def _error_reason(self) -> str:
        """Why an uncaught exception of the replayed program is an error, not a finding; where an
        input the recorded run read (its script, say, replayed with --force) changed since, the
        likely cause: a changed file its traceback passes through first."""
        head = (
            f"the replayed program raised {self.program_error} at step {self.step} after {self.seq} "
            "collectives, while every check so far matched the record; the recorded rank went on."
        )
        tail = "(the traceback is in the program's output above)"
        changed = [
            (str(c["path"]), f"changed since the recording ({c['what']})")
            for c in getattr(self, "changed_inputs", None) or []
        ]
        if getattr(self, "files", None) is not None:  # read as it is now, not as the recorded run found it
            changed += [
                (str(x["path"]), "was modified after the recorded run began") for x in self.files.late
            ]
        frames = {os.path.realpath(f) for f in self.program_error_files}
        changed.sort(key=lambda c: os.path.realpath(c[0]) not in frames)
        if not changed:
            return (
                f"{head} This is the replay's environment or a replay defect, not a finding about the "
                f"recorded run {tail}"
            )
        path, what = changed[0]
        where = " and the exception's traceback passes through it" if os.path.realpath(path) in frames else ""
        return (
            f"{head} Likely cause: {path} {what}{where}; a "
            f"replay of changed code or inputs is not a finding about the recorded run {tail}"
        )

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
            if status == "unverified":
                reason = (
                    f"nothing was compared with the record ({reason} at step {self.step}, before the first "
                    "recorded collective or step the replay could check)"
                )
            if status == "interrupted":
                reason = (
                    f"stopped by Ctrl-C (SIGINT) at step {self.step} after {self.seq} collectives: no verdict"
                )
            if status == "error":
                reason = self._error_reason()
        with contextlib.suppress(Exception):  # a replay that stopped before its first step
            self.key.at_start()
        if missed := env_watch.missed():
            self.notes.append(env_watch.note(missed))
        if self.op_tape is not None and self.op_tape.captured:
            self.notes.append(
                f"{self.op_tape.captured} calls of taped (nondeterministic) ops were made while a CUDA graph was "
                "captured: the graph runs their kernels at each launch, outside the tape, so what they computed "
                "was neither recorded nor injected"
            )
        if getattr(self, "files", None) is not None:
            named = {c["path"] for c in self.changed_inputs}  # the note on changed inputs names these
            if late := late_note([x for x in self.files.late if x["path"] not in named]):
                self.notes.append(late)
        ghosts = sorted(self.files.ghosts.served) if getattr(self, "files", None) is not None else []
        if ghosts:
            self.notes.append(
                f"{len(ghosts)} paths the recorded run saw are not here ({', '.join(ghosts[:3])}"
                f"{' ...' if len(ghosts) > 3 else ''}): the program was shown them as recorded (names, sizes, "
                "times; no content), and served the recorded batches"
            )
        out = Path(self.config.report)
        if self.live:
            out = out / RANK_REPORT_FMT.format(rank=self.rank)
        out.mkdir(parents=True, exist_ok=True)
        doc = build_report(self, status, reason or status)
        atomic_write(out / REPORT_JSON, json.dumps(doc, indent=2, default=str) + "\n")
        if not at_exit:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _reproduced_exception(self) -> bool:
        """The program raised what the recorded rank died of, where it did: the replay reproduced
        the failure (a NaN check that raises, an assertion), a finding, not a replay error."""
        end = self.rec.attrs.get("end") or {}
        recorded = str(end.get("exception") or "")
        kind = (self.program_error or "").split(":", 1)[0]
        if not recorded or not kind or not recorded.startswith(kind + "("):
            return False
        if self.step != int(end.get("steps", -1)) or self.seq != len(self.rec.colls):
            return False
        self.notes.append(
            f"the program raised {kind} after step {self.step - 1}, as the "
            f"recorded rank did ({exception_text(recorded)}): the replay reproduced the failure"
        )
        return True

    def _final_status(self, check_complete: bool) -> tuple[str, int]:
        if self.divergences:
            return "diverged", EXIT_DIVERGED
        if check_complete and self.program_error is not None:
            if self._reproduced_exception():
                return "bit-exact", EXIT_OK
            if (self.program_error or "").startswith("KeyboardInterrupt"):
                return "interrupted", ExitCode.INTERRUPTED
            return "error", EXIT_BAD_INPUT
        if check_complete and self.seq < len(self.rec.colls) and self.to_step < 0:
            nxt = self.rec.colls.get(self.seq)
            then = (
                f" (its next: #{nxt.seq} {nxt.op} on process group {nxt.pg} at step {nxt.step})"
                if nxt
                else ""
            )
            self.divergences.append(
                Divergence(
                    kind="ended_early",
                    rank=self.rank,
                    step=self.step,
                    micro=self.micro,
                    seq=self.seq,
                    detail=f"the program ended after {self.seq} collectives; the recorded rank issued "
                    f"{len(self.rec.colls)}{then}",
                )
            )
            return "diverged", EXIT_DIVERGED
        if not self.verified_steps and not self.verified_colls:
            return "unverified", EXIT_BAD_INPUT
        return "bit-exact", EXIT_OK


def attach_replay(config: ReplayConfig) -> Replayer:
    """Install the replayer. Raises on any failure: the caller ends the process (``boot.attach``)."""
    replayer = Replayer(config)
    hooks = Hooks(replayer)
    hooks.install()
    replayer.hooks = hooks
    attach_tape(replayer)
    replayer.start()
    atexit.register(replayer.finish, "exit", EXIT_OK)
    window = StepSet.parse(str((replayer.rec.meta.get("policy") or {}).get("op_fingerprints") or "none"))
    if not window.empty:  # the recorded op-fingerprint window, checked op by op (op_check.py)
        replayer.ops = OpCheck(
            replayer.rec.ops, window, lambda: replayer.micro, replayer.verifying, replayer.fail
        )
        replayer.ops.at_step(0)
    chained = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        frames = traceback.extract_tb(tb) if tb is not None else []
        at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        replayer.program_error = f"{exception_text(f'{kind.__name__}: {exc}')}{at}"
        replayer.program_error_files = [f.filename for f in frames]
        chained(kind, exc, tb)

    sys.excepthook = excepthook  # an exception the program did not catch: finish() says so
    return replayer
