"""What the replayed rank is checked against: each check returns its finding; the replayer decides.

A ``Finding`` is a ``Divergence`` plus what it means for the replay: ``stop`` (nothing after it can
be compared), ``feeding`` (name the parameters that feed the collective), ``unusable`` (the trace
cannot answer, which is not a divergence).
"""

from __future__ import annotations

import math
import shlex
import struct
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_replay.agent import capture, objects
from fsdp_replay.agent.collectives import CollectiveCall
from fsdp_replay.agent.config import StepSet
from fsdp_replay.agent.fingerprint import Pending, fingerprint, fingerprint_many
from fsdp_replay.errors import ConfigError
from fsdp_replay.replayer.expected import ExpectedColl, ExpectedTensor, RankRecord
from fsdp_replay.replayer.report import Divergence, magnitude
from fsdp_replay.trace.ops import ALL_GATHER_OPS, RECEIVED_OFF_ROOT


def same_float(a: float, b: float) -> bool:
    """Bitwise equality, except that any NaN equals any NaN: a loss's NaN payload bits do not
    survive the JSON of the spool (parameters and collectives are compared bit for bit)."""
    if math.isnan(a) and math.isnan(b):
        return True
    return struct.pack("<d", a) == struct.pack("<d", b)


@dataclass(slots=True)
class Finding:
    divergence: Divergence
    stop: bool = False
    feeding: bool = False
    unusable: bool = False


def value(x: Any) -> Any:
    """A fingerprint, waiting for it if it is still on the device."""
    return x.value() if isinstance(x, Pending) else x


def pg_problem(rec: RankRecord, call: CollectiveCall, exp: ExpectedColl) -> str | None:
    info = rec.process_groups.get(exp.pg)
    pg = call.process_group
    if info is None or pg is None:
        return None
    if int(info["size"]) != pg.size() or int(info["group_rank"]) != pg.rank():
        return (
            f"process group of size {pg.size()} (group rank {pg.rank()}); recorded size {info['size']} "
            f"(group rank {info['group_rank']}, ranks {info['ranks']})"
        )
    return None


def receives_only(call: CollectiveCall) -> bool:
    """This rank's "inputs" of a broadcast it is not the root of: receive buffers, not data."""
    if call.op not in RECEIVED_OFF_ROOT or call.root is None:
        return False
    pg = call.process_group
    return pg is not None and pg.rank() != int(call.root)


def _check_objects(call: CollectiveCall, exp: ExpectedColl, base: dict[str, Any]) -> Finding | None:
    """An object collective: the objects this rank sent, serialized canonically, against the
    record (the pickled bytes embed storage addresses: they differ in every process)."""
    sending = objects.current()
    recorded = exp.role("j")
    if sending is None or not recorded:
        detail = "the replayed rank issued it from an object collective; the recorded one did not"
        if sending is None:
            detail = "the recorded rank issued it from an object collective; the replayed one did not"
        return Finding(
            Divergence(kind="collective_input", **base, tensor="objects sent", detail=detail), True, True
        )
    sent = sending.sent
    e = recorded[0]
    fp = value(fingerprint(sent, e.algo)[0])
    if fp == e.fp:
        return None
    detail = (
        f"the objects this rank sent through {sending.function} differ from the "
        f"recorded ones (compared serialized with torch.save: {sent.numel()} bytes, recorded {e.shape[0]})"
    )
    d = Divergence(
        kind="collective_input", **base, tensor="objects sent", expected_fp=e.fp, actual_fp=fp, detail=detail
    )
    return Finding(d, stop=True, feeding=True)


def is_object_collective(exp: ExpectedColl) -> bool:
    return objects.current() is not None or bool(exp.role("j"))


def check_call(
    rec: RankRecord,
    call: CollectiveCall,
    exp: ExpectedColl,
    base: dict[str, Any],
    tensors: list[torch.Tensor],
    expected: list[ExpectedTensor],
    role: str,
    notes: list[str],
) -> Finding | None:
    """The op, process group, dtypes and shapes of ``tensors`` (the call's inputs or outputs),
    and for inputs their fingerprints, against the record."""
    if role == "input":
        if call.op != exp.op:
            d = Divergence(kind="op", **base, detail=f"replay issued {call.op}; recorded {exp.op}")
            return Finding(d, stop=True, feeding=True)
        problem = pg_problem(rec, call, exp)
        if problem:
            return Finding(Divergence(kind="process_group", **base, detail=problem), stop=True)
        if exp.reduce_op and call.reduce_op and exp.reduce_op != call.reduce_op:
            d = Divergence(
                kind="op", **base, detail=f"replay reduces with {call.reduce_op}; recorded {exp.reduce_op}"
            )
            return Finding(d, stop=True, feeding=True)
        if is_object_collective(exp):  # the pickled bytes are not compared, what they stand for is
            return _check_objects(call, exp, base)
    elif is_object_collective(exp):
        return None  # a sender's own buffers are sized by its own pickles; fill_outputs takes care
    if len(expected) != len(tensors):
        d = Divergence(kind="shape", **base, detail=f"{len(tensors)} {role}s; recorded {len(expected)}")
        return Finding(d, stop=True)
    for i, (t, e) in enumerate(zip(tensors, expected, strict=True)):
        t = capture.local(t)
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != e.dtype or tuple(t.shape) != e.shape:
            detail = f"{dtype}{list(t.shape)}; recorded {e.dtype}{list(e.shape)}"
            return Finding(Divergence(kind="shape", **base, tensor=f"{role} {i}", detail=detail), True, True)
    if role != "input" or receives_only(call):
        return None
    for i, (t, e) in enumerate(zip(call.inputs, expected, strict=True)):
        t = capture.local(t)
        fp = value(fingerprint(t, e.algo)[0])
        if fp != e.fp:
            d = Divergence(
                kind="collective_input",
                **base,
                tensor=f"input {i}",
                expected_fp=e.fp,
                actual_fp=fp,
                magnitude=input_magnitude(rec, call, exp, t, i, notes),
            )
            return Finding(d, stop=True, feeding=True)
    return None


def input_magnitude(
    rec: RankRecord, call: CollectiveCall, exp: ExpectedColl, t: torch.Tensor, i: int, notes: list[str]
) -> dict[str, Any] | None:
    """How far input ``i`` is from what was recorded: its own payload, or this rank's part of an
    all-gather's recorded output (what it sent)."""
    ins = exp.role("i")
    try:
        if ins[i].payload >= 0:
            return magnitude(rec.tensor(ins[i]), t)
        outs = exp.role("o")
        pg = call.process_group
        if exp.op in ALL_GATHER_OPS and len(outs) == len(ins) and outs[i].payload >= 0 and pg is not None:
            chunk = rec.tensor(outs[i]).reshape(pg.size(), -1)[pg.rank()]
            return magnitude(chunk.reshape(t.shape), t)
        if exp.op == "allgather_" and len(outs) >= 1 and pg is not None:
            out = outs[pg.rank()]
            if out.payload >= 0:
                return magnitude(rec.tensor(out), t)
    except Exception as e:  # magnitude is a bonus; never let it hide the divergence
        notes.append(f"could not compute the divergence magnitude: {e!r}")
    return None


def check_live_outputs(
    rec: RankRecord, call: CollectiveCall, exp: ExpectedColl, base: dict[str, Any]
) -> Finding | None:
    """All-rank replay: the live result must equal the recorded one."""
    if is_object_collective(exp):
        return None  # pickled bytes, with their senders' storage addresses: the senders compare objects
    for i, (t, e) in enumerate(zip(call.outputs, exp.role("o"), strict=False)):
        t = capture.local(t)
        fp = value(fingerprint(t, e.algo)[0])
        if fp != e.fp:
            mag = magnitude(rec.tensor(e), t) if e.payload >= 0 else None
            d = Divergence(
                kind="collective_output",
                **{**base, "op": exp.op},
                tensor=f"output {i}",
                expected_fp=e.fp,
                actual_fp=fp,
                magnitude=mag,
            )
            return Finding(d, feeding=True)
    return None


def fill_outputs(
    rec: RankRecord,
    call: CollectiveCall,
    exp: ExpectedColl,
    verify: bool,
    base: dict[str, Any],
    restore_step: int,
) -> Finding | None:
    """Write the recorded payloads into the call's outputs (what the peers would have sent)."""
    sending = objects.current()
    sender = sending is not None and sending.sends
    for i, (t, e) in enumerate(zip(call.outputs, exp.role("o"), strict=False)):
        dst = capture.local(t)
        if tuple(dst.shape) != e.shape:
            if sender:  # its own objects' pickles, sized here: they stay (checked as objects sent)
                continue
            detail = f"output {i}: {list(dst.shape)}; recorded {list(e.shape)}"
            return Finding(Divergence(kind="shape", **base, tensor=f"output {i}", detail=detail), True, True)
        if e.payload >= 0:
            with torch.no_grad():
                dst.copy_(rec.tensor(e))
        elif verify:
            detail = missing_payload_hint(rec, exp.step, restore_step)
            return Finding(
                Divergence(kind="payload_missing", **base, detail=detail), stop=True, unusable=True
            )
        else:
            with torch.no_grad():
                dst.zero_()  # fast-forward before the restored snapshot: values are overwritten later
    return None


def all_ranks_hint(rec: RankRecord) -> str:
    """What verifies a trace without payloads: every rank again, its collectives live."""
    url = getattr(getattr(rec, "trace", None), "url", None)
    where = shlex.quote(str(url)) if url else "TRACE"
    return (
        f"Verify it by running every rank again with live collectives: `fsdp-replay replay {where} "
        "--all-ranks` (as many processes or devices as the recorded job had)"
    )


def stored_by_policy(rec: RankRecord, step: int, tape: bool = False) -> tuple[bool, str]:
    """Whether the recording was asked to keep the payloads of ``step`` (of the collectives, or
    of the nondeterministic-kernel tape), and that policy as the recording wrote it."""
    policy_of = rec.meta.get("policy") or {}
    policy = str(policy_of.get("payloads", "all"))
    if tape and policy_of.get("tape_payloads") is not None:
        policy = str(policy_of["tape_payloads"])
    try:
        return step in StepSet.parse(policy), policy
    except ConfigError:
        return True, policy


def missing_payload_hint(rec: RankRecord, step: int, restore_step: int, tape: bool = False) -> str:
    """Why the trace has no payload for ``step``, from what the recording was asked to keep and
    what it reported dropping; and what to do about it."""
    wanted, policy = stored_by_policy(rec, step, tape)
    counters = (rec.attrs.get("end") or {}).get("counters") or {}
    dropped = int(counters.get("blobs_dropped", 0))
    damaged = int(rec.attrs.get("payload_missing", 0))
    what = "a taped kernel's result" if tape else "a collective"
    flag = "--tape-payloads" if tape else "--payloads"
    head = f"the trace holds no payload for {what} of step {step}"
    if policy.startswith("window:") and not damaged:
        return f"{head}: {window_hint(rec, step, policy)}"
    if wanted and dropped:
        return (
            f"{head}: the recording kept payloads for {policy} but dropped {dropped} of them "
            f"({int(counters.get('blob_bytes_dropped', 0)) / 1e6:.1f} MB; the disk was full or the "
            "in-memory bound (--max-pending-bytes) was reached). Replay steps whose payloads were kept, "
            "or record again with more free space, a higher bound or fewer payload steps"
        )
    if wanted and damaged:
        return f"{head}: {damaged} stored payloads were lost to spool damage (see `fsdp-replay inspect`)"
    if wanted:
        return f"{head}, although the recording kept payloads for {policy}"
    if not tape and StepSet.parse(policy).empty:
        return (
            f"{head}: the trace was recorded with --payloads none, so no rank of it can be replayed alone. "
            f"{all_ranks_hint(rec)}, or record with --payloads all or steps:SPEC to replay a rank alone"
        )
    kept = kept_end(policy, restore_step)
    through = f", or replay no further than step {kept} (--to-step {kept})" if kept is not None else ""
    if kept is None and (later := _later_kept(rec, policy, step)) is not None:
        through = f", or replay the steps it kept: --from-step {later}"
    return (
        f"{head}: the recording kept payloads for {policy}; an isolated replay of steps "
        f"{restore_step}.. needs the payloads of those steps (record with {flag} all or "
        f"steps:{restore_step}-...{through})"
    )


def _later_kept(rec: RankRecord, policy: str, step: int) -> int | None:
    """The first kept step after ``step`` that a replay can start from: a snapshot at or before it
    whose kept run reaches it (the recorder snapshots the first step of each range)."""
    try:
        steps = StepSet.parse(policy)
    except ConfigError:
        return None
    for lo in sorted({lo for lo, _hi in steps.ranges if lo > step}):
        snap = rec.snapshot_at_or_before(lo)
        end = steps.kept_through(int(snap["step"])) if snap is not None else None
        if end is None or end >= lo:  # None: an open range from the snapshot, which reaches lo
            return lo
    return None


def kept_end(policy: str, start: int) -> int | None:
    """The last step of a ``steps:`` payload policy's unbroken run of kept steps from ``start``;
    None when that run has no end (all, a window, an open range) or ``start`` was not kept."""
    try:
        end = StepSet.parse(policy).kept_through(start)
    except ConfigError:
        return None
    return end if end is not None and end >= start else None


def window_hint(rec: RankRecord, step: int, policy: str) -> str:
    """Why a flight recorder's trace (``--payloads window:N``) has no payload for ``step``: it
    wrote payloads only for the steps of its dumps (a failure's window), and which those are."""
    every = rec.attrs.get("flight_dumps") or []
    dumps = [d for d in every if int(d["first_step"]) <= int(d["last_step"])]
    counters = (rec.attrs.get("end") or {}).get("counters") or {}
    held_dropped = int(counters.get("flight_blobs_dropped", 0))
    if every and not dumps:
        d = every[-1]
        return (
            f"the flight recorder ({policy}) caught a failure ({d['reason']}) but held no complete "
            f"window to write: {d['detail']}. {all_ranks_hint(rec)}, or record again with a larger "
            "--window-bytes"
        )
    if not dumps:
        return (
            f"the recording held payloads in memory ({policy}) and wrote none: the run did not fail "
            f"while it was recorded, so no rank of it can be replayed alone. {all_ranks_hint(rec)}, or "
            "record with --payloads all or steps:SPEC to replay healthy steps alone"
        )
    spans = ", ".join(f"{d['first_step']}..{d['last_step']} ({d['reason']})" for d in dumps)
    inside = [d for d in dumps if int(d["first_step"]) <= step <= int(d["last_step"])]
    if not inside:
        first = min(int(d["first_step"]) for d in dumps)
        return (
            f"the recording held payloads in memory ({policy}) and wrote them only for the steps "
            f"of its dumps: {spans}; step {step} is in none. Replay those steps "
            f"(--from-step {first})"
        )
    dropped = sum(int(d.get("dropped", 0)) for d in inside)
    if dropped or held_dropped:
        return (
            f"the flight recorder's dump of steps {spans} left out {dropped or held_dropped} payloads "
            "it had dropped while holding them (its memory bound --window-bytes, or no room in the "
            "GPU's payload ring --payload-ring-bytes: `fsdp-replay inspect` says which); record "
            "again with a higher bound"
        )
    return (
        f"step {step} is inside the flight recorder's dump of steps {spans}, yet this payload was not written"
    )


def check_parameters(
    rec: RankRecord, opt: torch.optim.Optimizer, exp: Any, base: dict[str, Any], names: list[str]
) -> list[Finding]:
    """The step's micro-step count and every parameter's fingerprint after the optimizer step."""
    found: list[Finding] = []
    if exp.micro_steps != base["micro"]:
        detail = f"{base['micro']} backward passes in this step; recorded {exp.micro_steps}"
        found.append(Finding(Divergence(kind="micro_steps", **base, detail=detail)))
    params = capture.optimizer_params(opt)
    locals_ = [capture.local(p).detach() for p in params]
    batched = fingerprint_many(locals_)  # the recorder's own path: one read-back on a GPU
    for i, (p, (efp, _enf, algo)) in enumerate(zip(params, exp.params, strict=False)):
        got, _nf, got_algo = batched[i]
        fp = value(got) if got_algo == algo else value(fingerprint(locals_[i], algo)[0])
        if fp != efp:
            d = Divergence(
                kind="parameters",
                **base,
                tensor=names[i],
                expected_fp=efp,
                actual_fp=fp,
                magnitude=param_magnitude(rec, base["step"], i, p),
                detail="parameters after the optimizer step differ",
            )
            found.append(Finding(d))
            break
    return found


def param_magnitude(rec: RankRecord, step: int, index: int, p: torch.Tensor) -> dict[str, Any] | None:
    snap = rec.snapshots.get(step + 1)
    if not snap or snap.get("payload", -1) < 0:
        return None
    state = rec.snapshot_state(int(snap["payload"]))
    return magnitude(state["optimizers"][0]["params"][index], capture.local(p))


def module_finding(
    expected: list[tuple[int, str, str, int, str]],
    idx: int,
    name: str,
    kind: str,
    fp: int,
    base: dict[str, Any],
) -> Finding | None:
    """Module call ``idx`` of the step (``name``'s output or output gradient) against the record."""
    if idx >= len(expected):
        return None
    _micro, ename, ekind, efp, _ealgo = expected[idx]
    if (ename, ekind) == (name, kind) and efp == fp:
        return None
    same_place = (ename, ekind) == (name, kind)
    direction = "output" if kind == "fwd" else "output gradient"
    detail = (
        f"the earliest module whose {direction} differs: {name}"
        if same_place
        else f"module call #{idx} is {name} ({kind}); recorded {ename} ({ekind}): the program took another path"
    )
    d = Divergence(
        kind="module",
        **base,
        tensor=f"{name} ({direction})",
        expected_fp=efp if same_place else None,
        actual_fp=fp if same_place else None,
        detail=detail,
        modules=[name],
    )
    return Finding(d)


def thread_note(rec: RankRecord) -> str | None:
    """What a different intra-op thread count than recorded means, or None when they agree."""
    recorded = (rec.meta.get("threads") or {}).get("intra_op")
    now = torch.get_num_threads()
    if recorded is None or recorded == now:
        return None
    return (
        f"intra-op threads: recorded {recorded}, replay {now}. CPU kernels split reductions by thread, "
        "so float results can differ in the last bits: set OMP_NUM_THREADS to the recorded value"
    )
