"""The replay's way to its first verified step and the edges around it.

A replay from step S restores the snapshot of S when the program reaches it. Before that the
fast-forward runs (``fastforward.py``): the first steps compute, the rest run without kernels, and
the loss the program passes to ``backward`` gets its recorded value (what it logs from it is what
the recording logged). Right after the restore, collectives whose inputs the program computed before
the snapshot (a loss all-reduced after the optimizer step) are answered but not checked. With a
flight recorder's window, the record's payloads end where its dumps end; with ``--payloads
steps:A-B``, where the run of kept steps from the restored snapshot ends. This module is that
bookkeeping; ``agent.Replayer`` calls it at its hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.collectives import CollectiveCall, wait_result
from fsdp_replay.replayer.expected import ExpectedColl, RankRecord
from fsdp_replay.replayer.fake_pg import completed_work
from fsdp_replay.replayer.fastforward import FastForward
from fsdp_replay.replayer.verify import kept_end


class Reach:
    def __init__(
        self,
        rec: RankRecord,
        rank: int,
        restore_step: int,
        steps: tuple[int, int],  # --from-step, --to-step (-1: to the end)
        warmup: int,
        live: bool,
        notes: list[str],
        fail: Callable[[str, BaseException], None],
        ended: Callable[[str], None],
    ) -> None:
        self.rec = rec
        self.rank = rank
        self.restore_step = restore_step
        self.notes = notes
        self.ended = ended  # the record ends here: stop with what was verified
        # Steps before the snapshot: the first few compute, the rest run without kernels.
        self.ff = FastForward(restore_step, warmup, fail) if restore_step > 0 and not live else None
        # After the restore, until the program draws a batch or calls its model.
        self.after_restore = False
        self.unverified_after_restore = 0
        # --payloads window:N: the record's payloads are those of the dumps' steps only (a dump
        # that found no complete window wrote none: its step range is empty)
        dumps = [
            d for d in rec.attrs.get("flight_dumps") or [] if int(d["first_step"]) <= int(d["last_step"])
        ]
        self.flight_end = max(int(d["last_step"]) for d in dumps) if dumps else None
        self.flight_dumps = len(dumps)
        # --payloads steps:A-B: those of the unbroken run of kept steps from the restored one (a
        # live replay takes its peers' outputs: it needs none). A run that ends before the steps
        # asked for (--from-step, or --to-step past it) is no clean end: the replay stops where the
        # payloads are missing and says so.
        self.policy = str((rec.meta.get("policy") or {}).get("payloads", "all"))
        end = None if live or dumps else kept_end(self.policy, restore_step)
        from_step, to_step = steps
        asked = end is not None and end >= from_step and (to_step < 0 or to_step <= end)
        self.kept_end = end if asked else None

    # -- before the snapshot ---------------------------------------------------------------
    def skipping(self) -> bool:
        """Whether the program's collectives are the fast-forward's (a skipped step, or one
        computed late after new model inputs): not matched to the record by number."""
        return self.ff is not None and (self.ff.active or self.ff.paused)

    def loop_started(self) -> None:
        self.end_after_restore()
        if self.ff is not None:
            self.ff.loop_started()

    def batch_content(self, step: int, lacking: bool) -> str:
        """What a served batch of a recorded ``step`` holds: its bytes where the replay verifies,
        before the snapshot its bytes where the trace has them, else zeros (the model may compute
        on it: a warm-up step, or a step whose model meets new inputs). A batch without its bytes
        past the kept payloads (``steps:A-B``) ends the replay there: the model never computes
        on zeros where the replay would check what it computes."""
        self.loop_started()
        if lacking and self.kept_end is not None and step > self.kept_end:
            self.ended(f"at the batch of step {step}: {self._kept()}")
        return "bytes" if step >= self.restore_step else "zeros"

    def verify_to(self, to_step: int) -> int:
        """The last step the replay verifies, for ``--to-step to_step`` (-1: to the end)."""
        return self.kept_end if self.kept_end is not None and to_step < 0 else to_step

    def collective(self, call: CollectiveCall, real: Any) -> Any:
        """A collective of a step the fast-forward skips (one the program makes outside its model,
        such as a loss it all-reduces to log) or computes late: the fake backend completes it and
        leaves its buffers as they are (an all-reduce's: this rank's own value). The recorded
        answer is not read: a payload read costs milliseconds, about what the skipped step itself
        costs, and the steps before the snapshot do not decide the verdict. A step computed late
        gets zeros, so its model computes on no garbage."""
        ff = self.ff
        assert ff is not None
        result = real()
        call.set_outputs(result)
        wait_result(result, call)
        ff.collectives_seen += 1
        if not ff.active:
            with torch.no_grad():
                for t in call.outputs:
                    capture.local(t).zero_()
        return completed_work(result)

    def loss(self, loss: torch.Tensor, step: int, micro: int) -> bool:
        """A skipped step's loss (zeros) gets its recorded value, so what the program logs from it
        is what the recorded run logged; False when the step is not skipped."""
        if self.ff is None or not self.ff.active:
            return False
        exp = self.rec.steps.get(step)
        if exp is not None and micro < len(exp.losses):
            with torch.no_grad():
                loss.detach().fill_(exp.losses[micro])
            self.ff.values_served += 1
        return True

    def at_step_end(self, done: int) -> None:
        if self.ff is None:
            return
        self.ff.at_step_end(done)
        if self.ff.active and self.ff.steps_skipped == 0:  # read the restored step's payloads ahead
            self.rec.advance(self.rec.first_seq_of_step(self.restore_step))

    def progress_line(self, step: int) -> str | None:
        """The progress state of step ``step``; None: no line (skipped steps: one every 100)."""
        ff = self.ff
        if ff is None or step >= self.restore_step:
            return "verified" if step >= self.restore_step else "fast-forward"
        if step < ff.warmup:
            return "fast-forward, computed"
        if step + 1 < self.restore_step and (step + 1) % 100:
            return None
        return "fast-forward, skipped"

    # -- the restore -----------------------------------------------------------------------
    def restoring(self, seq: int) -> int:
        """The snapshot is about to be restored: the fast-forward ends; the collective number
        the replay goes on from (a skipped model made none of its collectives)."""
        skipped = self.ff is not None and self.ff.steps_skipped > 0
        if self.ff is not None:
            self.ff.finish()
        expected = self.rec.first_seq_of_step(self.restore_step)
        if seq != expected and not skipped:
            self.notes.append(
                f"before step {self.restore_step} the replay issued {seq} collectives; the record has {expected}"
            )
        self.rec.advance(expected)
        return expected

    def restored(self) -> None:
        self.after_restore = True
        self._watch_next_forward()
        if self.ff is not None:
            print(
                f"[fsdp-replay] rank {self.rank}: reached step {self.restore_step} in {self.ff.seconds:.2f} s "
                f"({self.ff.warmup + self.ff.steps_computed_late} steps computed, {self.ff.steps_skipped} run "
                "without kernels); restored its snapshot",
                file=sys.stderr,
                flush=True,
            )

    def unverified(self) -> bool:
        """A collective right after the restore, before the program's next batch or model call:
        its inputs were computed before the snapshot (a logged loss), which no snapshot restores;
        it gets its recorded outputs, its inputs are not checked."""
        if self.after_restore:
            self.unverified_after_restore += 1
        return self.after_restore

    def _watch_next_forward(self) -> None:
        from torch.nn.modules import module as nn_module

        handle: list[Any] = []

        def first_forward(_module: Any, _args: Any) -> None:
            self.end_after_restore()
            if handle:
                handle.pop().remove()

        handle.append(nn_module.register_module_forward_pre_hook(first_forward))

    def end_after_restore(self) -> None:
        if not self.after_restore:
            return
        self.after_restore = False
        n = self.unverified_after_restore
        if n:
            self.notes.append(
                (f"{n} collectives the program made" if n > 1 else "1 collective the program made")
                + " right after the snapshot was restored, before its next batch or model call, carried values "
                "it had computed before the snapshot (a logged loss, say): "
                + (
                    "they got their recorded outputs and their inputs were"
                    if n > 1
                    else "it got its recorded outputs and its inputs were"
                )
                + " not checked"
            )

    # -- where the kept payloads end: a flight recorder's window, or steps:A-B ----------------
    def beyond_the_payloads(self, exp: ExpectedColl) -> str | None:
        """Where the record ends for a trace that kept the payloads of some steps only: the first
        collective past them that lacks one (None: all steps kept, or still inside them). A
        flight recorder's last dump may end inside a step (the failure's): its collectives are
        kept as far as they were made."""
        if self.flight_end is not None:
            if exp.step < self.flight_end or not _lacks_outputs(exp):
                return None
            return (
                f"at collective #{exp.seq} of step {exp.step}: the flight recorder's dumps "
                f"({self.flight_dumps}) hold payloads through there"
            )
        if self.kept_end is None or exp.step <= self.kept_end or not _lacks_outputs(exp):
            return None
        return f"at collective #{exp.seq} of step {exp.step}: {self._kept()}"

    def _kept(self) -> str:
        return (
            f"the recording kept payloads for {self.policy}, through step {self.kept_end} "
            f"from step {self.restore_step}"
        )


def _lacks_outputs(exp: ExpectedColl) -> bool:
    return any(e.payload < 0 for e in exp.role("o"))
