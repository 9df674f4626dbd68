"""The tape's C++ hook (``agent/cxx/_tape.cpp``, #12): stacked on the Python tape, it records the
taped calls of steps that store no payloads, and its records become the events the Python tape
writes. On the CPU it takes a user's op (``--tape-ops``), fingerprinted with the native core; on
CUDA the fused kernel, launched through the driver (the GPU test below)."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint
from fsdp_replay.agent.record_tape import TapeRecorder
from fsdp_replay.agent.tape import agent_work, start_tape
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.trace import schema

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("gcc") is None, reason="needs gcc and g++ to build the hook"
)

OP = "fsdpr_cxx_tape_test::mix"
_LIB = torch.library.Library("fsdpr_cxx_tape_test", "DEF")
_LIB.define("mix(Tensor x) -> Tensor")
_LIB.impl("mix", lambda x: (x * 3 + 1).cumsum(-1), "CPU")
_LIB.impl("mix", lambda x: (x * 3 + 1).cumsum(-1), "CUDA")


class _Events:
    """A writer that keeps the events (the tensors' values are not stored in these tests)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)


@pytest.fixture(scope="module")
def library() -> str:
    from fsdp_replay.agent.cxx import tape

    return str(tape.build())


def _recorder(tmp: Path, library: str, **env: str) -> tuple[TapeRecorder, _Events, Any, Any]:
    from fsdp_replay.agent.cxx.tape import NativeTape

    config = RecordConfig.from_env(
        {
            "FSDP_REPLAY_OUT": str(tmp),
            "FSDP_REPLAY_PAYLOADS": "none",
            "FSDP_REPLAY_TAPE_PAYLOADS": "none",
            **env,
        }
    )
    state = AgentState(payload_now=False)
    events = _Events()
    state.writer = events  # type: ignore[assignment]

    def fail(where: str, e: BaseException) -> None:
        raise AssertionError(f"{where}: {e!r}")

    rec = TapeRecorder(config, state, TensorRecorder(config, state), lambda: events, fail)  # type: ignore[arg-type, return-value]
    native = NativeTape(library)
    op_tape, why = start_tape(rec, OP, fail, native)
    assert op_tape is not None, why
    assert not op_tape.native_error, op_tape.native_error
    rec.native = native
    rec.sync_native()
    return rec, events, native, op_tape


def _values(ev: dict[str, Any]) -> list[tuple[Any, Any, str]]:
    def v(x: Any) -> Any:
        return x.value() if hasattr(x, "value") else x

    return [(v(t.fp), v(t.nonfinite), t.algo) for t in ev["tensors"]]


def test_a_users_op_on_the_cpu_is_recorded_in_cxx_with_the_python_tapes_fingerprints(
    tmp_path: Path, library: str
) -> None:
    rec, events, native, op_tape = _recorder(tmp_path, library)
    try:
        x = torch.randn(64, 300)
        outs = [torch.ops.fsdpr_cxx_tape_test.mix(x * i) for i in range(3)]
        with agent_work():  # the agent's own call: not taped
            torch.ops.fsdpr_cxx_tape_test.mix(x)
        torch.use_deterministic_algorithms(True)
        try:  # deterministic mode: not taped
            torch.ops.fsdpr_cxx_tape_test.mix(x)
        finally:
            torch.use_deterministic_algorithms(False)
        native.state.fast = 0  # a step that stores payloads: the Python kernel records the call
        outs.append(torch.ops.fsdpr_cxx_tape_test.mix(x * 7))
        assert len(events.events) == 1 and events.events[0]["seq"] == 3
        native.state.fast = 1
        native.state.small_limit = 1 << 20  # outputs this small keep their bytes: left to Python
        native.state.step, native.state.micro = 4, 1
        outs.append(torch.ops.fsdpr_cxx_tape_test.mix(x * 9))
        assert native.state.calls == 4 and native.state.deferred == 1
        rec.drain_native()
    finally:
        op_tape.uninstall()
    by_seq = {ev["seq"]: ev for ev in events.events}
    assert sorted(by_seq) == [0, 1, 2, 3, 4]  # one numbering for both paths
    for seq, out in enumerate(outs):
        ev = by_seq[seq]
        assert ev["type"] == schema.EV_KERNEL_OP and ev["op"] == OP
        fp, nf, algo = fingerprint(out)
        assert _values(ev) == [(fp, nf, algo)], seq
        assert ev["tensors"][0].shape == [64, 300] and ev["tensors"][0].dtype == "float32"
    assert (by_seq[4]["step"], by_seq[4]["micro"]) == (4, 1)
    # uninstalled: the op's own kernel again, and nothing recorded
    n = len(events.events)
    torch.ops.fsdpr_cxx_tape_test.mix(x)
    assert len(events.events) == n and native.drain() == []


@pytest.mark.gpu
def test_taped_cuda_calls_are_fingerprinted_by_the_fused_kernel_launched_from_cxx(
    tmp_path: Path, library: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsdp_replay.agent.fingerprint import fused

    if not fused.available():
        pytest.skip("no Triton: the hook leaves CUDA calls to Python")
    rec, events, native, op_tape = _recorder(tmp_path, library)
    kept: list[torch.Tensor] = []
    try:
        x = torch.randn(4096, 256, device="cuda")
        kept.append(torch.ops.fsdpr_cxx_tape_test.mix(x))  # Python's: compiles, then arms the hook
        assert native.cuda, rec.native_note
        for i in range(3):
            kept.append(torch.ops.fsdpr_cxx_tape_test.mix(x[:, : 100 + i]))
        dst = torch.zeros(1000, 64, device="cuda")
        idx = torch.randperm(1000, device="cuda")[:500]
        kept.append(dst.index_add(0, idx, torch.randn(500, 64, device="cuda")))
        # the cuDNN attention backward: dq, dk, dv are strided views of one buffer, read in place
        q, k, v = (
            torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        assert q.grad is not None and k.grad is not None and v.grad is not None
        calls = native.state.calls
        rec.drain_native()
        torch.cuda.synchronize()
    finally:
        op_tape.uninstall()
    assert native.state.deferred == 0 and not native.state.failed, native.error()
    by_op: dict[str, list[dict[str, Any]]] = {}
    for ev in sorted(events.events, key=lambda e: e["seq"]):
        by_op.setdefault(ev["op"], []).append(ev)
    mixes = by_op[OP]
    assert len(mixes) == 4 and calls >= 5
    for ev, out in zip(mixes, kept[:4], strict=True):
        assert _values(ev) == [(fingerprint(out, schema.FP_LIN64)[0].value(), False, schema.FP_LIN64)]
    (ia,) = by_op["aten::index_add"]
    assert _values(ia)[0][0] == fingerprint(kept[4], schema.FP_LIN64)[0].value()
    attn = [ev for op, evs in by_op.items() if "attention_backward" in op for ev in evs]
    assert len(attn) == 1, sorted(by_op)
    want = [fingerprint(g, schema.FP_LIN64)[0].value() for g in (q.grad, k.grad, v.grad)]
    assert [fp for fp, _, _ in _values(attn[0])][:3] == want


@pytest.mark.gpu
@pytest.mark.parametrize("sm_copy", [0, 1], ids=["memcpy", "sm-copy"])
def test_kept_cuda_outputs_land_in_pinned_memory_as_they_were_at_the_call(
    tmp_path: Path, library: str, sm_copy: int
) -> None:
    """The flight recorder's steps (``keep``): the hook copies each CUDA output on the device
    and from there to pinned memory on a side stream; the bytes are the output's at the call even
    when the program writes it in place right after; past ``keep_limit`` bytes in flight a call's
    outputs are not kept, and the record says so. With ``keep_sm`` (``FSDP_REPLAY_SM_COPY``) the
    device copy is a kernel on the SMs. An output that is not whole 32-bit words (a bfloat16 output
    of three elements) is left to Python (deferred, its clone taken), as the fused fingerprint
    kernel reads words."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from fsdp_replay.agent.fingerprint import fused

    if not fused.available():
        pytest.skip("no Triton: the hook leaves CUDA calls to Python")
    rec, _events, native, op_tape = _recorder(tmp_path, library)
    try:
        x = torch.randn(2048, 300, device="cuda")
        native.state.fast = 0  # the Python kernel's call: compiles, then arms the hook (this
        torch.ops.fsdpr_cxx_tape_test.mix(x)  # NativeTape: the library's CUDA path may be on already)
        assert native.cuda, rec.native_note
        rec.sync_native()
        rec.drain_native()
        native.state.keep, native.state.keep_limit, native.state.keep_sm = 1, 64 << 20, sm_copy
        native.state.small_limit = -1  # no output left to Python for its size (the 6 bytes below)
        kept, dropped = native.state.kept, native.state.keep_dropped  # the process's counters
        wants, outs = [], []
        inputs = [x[:, : 200 + i] * i for i in range(4)] + [x[:1, :3].bfloat16()]  # 6 bytes: not words
        for inp in inputs:
            out = torch.ops.fsdpr_cxx_tape_test.mix(inp)
            wants.append(out.clone())
            out.add_(1)  # in place, right after: the kept bytes are the call's
            outs.append(out)
        records = native.drain()
        assert [r.kept for r in records] == [1] * 4 + [0], [r.kept for r in records]
        odd = records.pop()
        assert odd.slot == -1  # deferred: Python's, the bytes cloned at the call
        (clone,) = native.take(odd.seq)
        assert torch.equal(clone, wants.pop())
        for r, want in zip(records, wants, strict=True):
            hosts, ready = native.kept(r.seq, r.ready)
            ready.synchronize()
            assert ready.query()
            assert len(hosts) == 1 and hosts[0].is_pinned() and hosts[0].dtype == torch.uint8
            got = hosts[0].view(want.dtype).view(want.shape)
            assert torch.equal(got, want.cpu())
            native.rows(r.slot, r.event)  # frees the fingerprint's slot, as the writer does
        native.state.keep_wait = 0  # --when-full drop: past the bound a call is not kept
        native.state.keep_limit = x.numel() * 4 - 1  # less than one output: not kept, said so
        torch.ops.fsdpr_cxx_tape_test.mix(x)
        (r,) = native.drain()
        native.rows(r.slot, r.event)
        assert r.kept == 2 and native.state.keep_dropped == dropped + 1 and native.state.kept == kept + 4
        torch.cuda.synchronize()
        native.state.keep_limit = 64 << 20
        torch.ops.fsdpr_cxx_tape_test.mix(x[:, :10])  # reaps the landed device copies first
        (r,) = native.drain()
        hosts, ready = native.kept(r.seq, r.ready)
        ready.synchronize()
        assert native.state.keep_live == x[:, :10].numel() * 4, native.state.keep_live
        # back-pressure (--when-full wait): past the bound a call waits for the copies in flight
        # to land, and is kept; one larger than the bound is kept alone
        native.state.keep_wait, native.state.keep_limit = 1, x.numel() * 4 + 1
        waits = native.state.keep_waits
        torch.cuda._sleep(200_000_000)  # the program's stream busy: the copies stay in flight
        for _ in range(3):
            out = torch.ops.fsdpr_cxx_tape_test.mix(x)
        native.state.keep_limit = x.numel() * 4 - 1
        torch.ops.fsdpr_cxx_tape_test.mix(x)
        records = native.drain()
        assert [r.kept for r in records] == [1] * 4, [r.kept for r in records]
        assert native.state.keep_waits >= waits + 1 and native.state.keep_wait_ns > 0
        for r in records:
            hosts, ready = native.kept(r.seq, r.ready)
            ready.synchronize()
            assert torch.equal(hosts[0].view(out.dtype).view(out.shape), out.cpu())
            native.rows(r.slot, r.event)
        assert native.state.keep_dropped == dropped + 1
    finally:
        op_tape.uninstall()
    assert not native.state.failed, native.error()


@pytest.mark.gpu
def test_kept_outputs_land_in_pooled_pinned_blocks_reused_only_once_let_go_and_copied(
    tmp_path: Path, library: str
) -> None:
    """The kept outputs' pinned blocks come from the hook's own pool (torch's caching host
    allocator made a new cudaHostAlloc for about one kept output in fifteen on the H200): a
    block comes back when its tensor dies and is handed out again, with no new allocation, once
    the copy into it is done; a block still held, or let go while its copy is still queued (the
    program's stream held back by a sleep kernel), is not, and a new one is allocated."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from fsdp_replay.agent.fingerprint import fused

    if not fused.available():
        pytest.skip("no Triton: the hook leaves CUDA calls to Python")
    rec, _events, native, op_tape = _recorder(tmp_path, library)
    x = torch.randn(1024, 1000, device="cuda")  # 4,096,000 bytes: a 4 MiB block
    block = 1 << 22

    def keep(inp: torch.Tensor) -> tuple[torch.Tensor, Any, torch.Tensor]:
        out = torch.ops.fsdpr_cxx_tape_test.mix(inp)
        want = out.clone()
        (r,) = native.drain()
        assert r.kept == 1, r.kept
        native.rows(r.slot, r.event)
        (host,), ready = native.kept(r.seq, r.ready)
        return host, ready, want

    def landed(host: torch.Tensor, ready: Any, want: torch.Tensor) -> bool:
        ready.synchronize()
        return bool(torch.equal(host.view(want.dtype).view(want.shape), want.cpu()))

    try:
        native.state.fast = 0  # the Python kernel's call first: compiles, then arms the hook
        torch.ops.fsdpr_cxx_tape_test.mix(x)
        assert native.cuda, rec.native_note
        rec.sync_native()
        rec.drain_native()
        native.state.keep, native.state.keep_limit, native.state.small_limit = 1, 256 << 20, -1
        allocs, reuses, nbytes = native.state.host_allocs, native.state.host_reuses, native.state.host_bytes
        host, ready, want = keep(x)
        assert host.is_pinned() and landed(host, ready, want)
        assert native.state.host_allocs == allocs + 1 and native.state.host_bytes == nbytes + block
        del host, ready  # let go, its copy done: the next keep of that size reuses it
        host, ready, want = keep(x * 2)
        assert landed(host, ready, want)
        assert (native.state.host_allocs, native.state.host_reuses) == (allocs + 1, reuses + 1)
        held = (host, ready, want)  # still held: the next keep needs a block of its own
        host, ready, want = keep(x * 3)
        assert landed(host, ready, want) and landed(*held)
        assert native.state.host_allocs == allocs + 2 and native.state.host_bytes == nbytes + 2 * block
        del held
        torch.cuda.synchronize()
        # both free now; hold the program's stream back so that a copy stays queued
        torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's clock
        out = torch.ops.fsdpr_cxx_tape_test.mix(x * 4)
        (r,) = native.drain()
        (pending,), pending_ready = native.kept(r.seq, r.ready)
        later = [(r.slot, r.event)]
        assert r.kept == 1 and not pending_ready.query()
        del host, ready, pending  # every block back; the one just taken still being copied into
        assert native.state.host_reuses == reuses + 2  # the x * 4 keep reused one free block
        out2 = torch.ops.fsdpr_cxx_tape_test.mix(x * 5)  # still behind the sleep
        (r2,) = native.drain()
        (host2,), ready2 = native.kept(r2.seq, r2.ready)
        assert native.state.host_reuses == reuses + 3  # the other free block, not the pending one
        out3 = torch.ops.fsdpr_cxx_tape_test.mix(x * 6)
        (r3,) = native.drain()
        (host3,), ready3 = native.kept(r3.seq, r3.ready)
        assert not pending_ready.query(), "the sleep ended too soon for the test to mean anything"
        assert native.state.host_allocs == allocs + 3  # the pending block was not handed out
        assert landed(host2, ready2, out2) and landed(host3, ready3, out3)
        pending_ready.synchronize()
        for slot, event in [*later, (r2.slot, r2.event), (r3.slot, r3.event)]:
            native.rows(slot, event)
        del out
    finally:
        op_tape.uninstall()
    assert not native.state.failed, native.error()


_EXIT_WITH_KEPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import test_cxx_tape as t
rec, _events, native, op_tape = t._recorder(t.Path(sys.argv[2]), sys.argv[3])
x = torch.randn(512, 300, device="cuda")
native.state.fast = 0
torch.ops.fsdpr_cxx_tape_test.mix(x)
rec.sync_native()
rec.drain_native()
native.state.keep, native.state.keep_limit = 1, 64 << 20
for i in range(3):
    torch.ops.fsdpr_cxx_tape_test.mix(x * i)
torch.ops.fsdpr_cxx_tape_test.mix(x[:1, :3].bfloat16())  # deferred: a clone held
assert native.state.kept == 3, native.state.kept
sys.exit(3)  # the kept copies, the clone and the scratch still held: the process's end frees them
"""


@pytest.mark.gpu
def test_a_process_that_exits_holding_kept_and_deferred_cuda_outputs_keeps_its_exit_status(
    tmp_path: Path, library: str
) -> None:
    """The hook's tensors (kept copies, deferred clones, the fused kernel's scratch) are never
    destroyed at the process's exit: freed after the CUDA context is gone they aborted the
    process (134) and lost the program's own exit status."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from fsdp_replay.agent.fingerprint import fused

    if not fused.available():
        pytest.skip("no Triton: the hook leaves CUDA calls to Python")
    import subprocess
    import sys

    here = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_WITH_KEPT, here, str(tmp_path), library],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "terminate called" not in done.stderr, done.stderr[-3000:]


@pytest.mark.gpu
def test_under_cupti_the_hook_marks_its_own_launches_and_a_refused_mark_turns_it_off(
    tmp_path: Path, library: str
) -> None:
    """While CUPTI traces (``mark``), each CUDA call the hook records pushes the agent's id on
    CUPTI's external correlation stack around the hook's own launches and pops it after, through
    the functions Python gives (here ctypes stand-ins that count); a refused push turns the hook
    off (``fast`` 0, ``mark_errors``), so the next call goes to the Python kernel."""
    if not torch.cuda.is_available():
        pytest.skip("gpu: no CUDA device")
    from fsdp_replay.agent.fingerprint import fused

    if not fused.available():
        pytest.skip("no Triton: the hook leaves CUDA calls to Python")
    calls: list[tuple[str, int, int]] = []
    refuse = [False]

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64)
    def push(kind: int, ext: int) -> int:
        calls.append(("push", kind, ext))
        return 1 if refuse[0] else 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))
    def pop(kind: int, _last: Any) -> int:
        calls.append(("pop", kind, 0))
        return 0

    rec, _events, native, op_tape = _recorder(tmp_path, library)
    st = native.state
    try:
        x = torch.randn(512, 300, device="cuda")
        st.fast = 0  # the Python kernel's call: compiles, then arms the hook (see the keep test)
        torch.ops.fsdpr_cxx_tape_test.mix(x)
        assert native.cuda, rec.native_note
        rec.sync_native()
        rec.drain_native()
        st.mark_push = ctypes.cast(push, ctypes.c_void_p).value
        st.mark_pop = ctypes.cast(pop, ctypes.c_void_p).value
        st.mark_kind, st.mark_id, st.mark = 7, 1 << 63, 1
        marks, calls_before = st.marks, st.calls
        for _ in range(3):
            torch.ops.fsdpr_cxx_tape_test.mix(x)
        records = native.drain()
        assert len(records) == 3 and st.calls == calls_before + 3 and st.marks == marks + 3
        assert calls == [("push", 7, 1 << 63), ("pop", 7, 0)] * 3, calls
        for r in records:
            native.rows(r.slot, r.event)
        refuse[0] = True
        torch.ops.fsdpr_cxx_tape_test.mix(x)  # refused: this call's launches go unmarked, said so
        assert st.mark_errors == 1 and st.fast == 0 and calls[-1] == ("push", 7, 1 << 63)
        for r in native.drain():
            native.rows(r.slot, r.event)
        n = len(calls)
        torch.ops.fsdpr_cxx_tape_test.mix(x)  # the Python kernel's now: no push from the hook
        assert len(calls) == n and st.calls == calls_before + 4
    finally:
        st.mark = 0
        st.mark_errors = 0
        op_tape.uninstall()
    assert not st.failed, native.error()


def test_with_keep_a_cpu_call_goes_to_python_which_holds_cpu_outputs(tmp_path: Path, library: str) -> None:
    """The hook keeps only CUDA outputs: on a flight-recorder step (``keep``) a CPU call's outputs
    are cloned for the Python path, which fingerprints them at the drain (and holds their bytes)."""
    rec, events, native, op_tape = _recorder(tmp_path, library)
    try:
        native.state.keep, native.state.keep_limit = 1, 1 << 20
        st = native.state
        before = (st.calls, st.deferred, st.kept)  # the library's counters are the process's
        x = torch.randn(64, 300)
        out = torch.ops.fsdpr_cxx_tape_test.mix(x)
        assert (st.calls, st.deferred, st.kept) == (before[0] + 1, before[1] + 1, before[2])
        rec.drain_native()
    finally:
        op_tape.uninstall()
    (ev,) = events.events
    assert _values(ev) == [fingerprint(out)]
