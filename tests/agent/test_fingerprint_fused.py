"""The one-launch lin64 of a taped op's outputs (``fingerprint/fused.py``, a Triton kernel).

On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the
variable is read when the kernel is defined), against the numpy reference of lin64 and an exact
count of non-finite elements; the ``gpu`` test runs it compiled, through ``fingerprint_many``.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_many, fused
from fsdp_replay.agent.fingerprint.pending import Pending
from fsdp_replay.trace import fingerprint as ref

HAS_TRITON = importlib.util.find_spec("triton") is not None

# Each case: a list of tensors (at most fused.MAX_TENSORS) built from a seeded generator `g`. Sizes
# cross a program's 8 rows of 1024 words and end in partial rows; the values plant non-finite
# elements in every float kind, and int32 extremes that wrap the int64 sums.
CASES = textwrap.dedent(
    """
    import torch
    g = torch.Generator().manual_seed(7)
    def planted(t, where, value):
        t = t.clone()
        t.view(-1)[list(where)] = value
        return t
    big = torch.full((9000,), 2**31 - 1, dtype=torch.int32)
    CASES = {
        "f32 across programs": [torch.randn(8 * 1024 + 7, 3, generator=g)],
        "bf16 inf and nan in both halves of a word": [
            planted(torch.randn(20002, generator=g).to(torch.bfloat16), [4, 5, 20001], float("inf")),
            planted(torch.randn(2048, generator=g).to(torch.bfloat16), [1], float("nan")),
        ],
        "f16 and f64": [
            planted(torch.randn(1023, 2, generator=g).to(torch.float16), [0, 2045], float("-inf")),
            planted(torch.randn(1025, generator=g, dtype=torch.float64), [1024], float("nan")),
            torch.randn(5, generator=g, dtype=torch.float64),
        ],
        "integers wrap, empty and tiny": [
            big, torch.empty(0), torch.tensor([-(2**31)], dtype=torch.int32),
            torch.randint(-(2**62), 2**62, (3000,), generator=g, dtype=torch.int64),
        ],
        "complex, uint8 and a transposed view": [
            planted(torch.randn(300, generator=g, dtype=torch.complex64), [3], complex(float("nan"), 0)),
            torch.randint(0, 255, (4096,), generator=g, dtype=torch.uint8),
            torch.randn(64, 48, generator=g).t(),
        ],
        "finite values whose float sum overflows": [torch.full((4096,), 3e38)],
        # read in place (no contiguous copy): the attention backward's dq, dk, dv (views of one
        # packed gradient), a slice that starts inside its storage, a broadcast (stride 0), and
        # float64 rows (the non-finite rule reads the odd words)
        "strided views read in place": [
            *[p.transpose(1, 2) for p in planted(
                torch.randn(2, 40, 3, 4, 64, generator=g).to(torch.bfloat16), [7, 9001], float("nan")
            ).unbind(2)][:2],
            torch.randn(9, 70, 33, generator=g)[1:8:2, 3:, 1:31],
            torch.randn(1, 5, 1, 16, generator=g).expand(3, 5, 700, 16),
        ],
        "float64 rows and views the kernel copies": [
            planted(torch.randn(50, 40, 6, generator=g, dtype=torch.float64), [11, 12], float("inf"))[:, 5:, 2:],
            torch.randn(2, 3, 4, 5, 6, generator=g).permute(1, 0, 3, 2, 4),  # four row dimensions
            torch.randn(30, 7, generator=g).to(torch.bfloat16)[:, :3],  # rows of 3 halves: no words
        ],
    }
    """
)

CHECK = textwrap.dedent(
    """
    import json, sys
    import torch
    from fsdp_replay.agent.fingerprint import fused
    from fsdp_replay.trace.fingerprint import combine_lin64, lin64

    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def nonfinite(t):
        if t.is_complex():
            t = torch.view_as_real(t)
        return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0

    def rows_of(tensors):
        host = torch.full((fused.MAX_TENSORS, 4), -1, dtype=torch.int64)
        return host.tolist() if fused.launch(tensors, host.data_ptr()) else None

    out = {}
    for name, tensors in CASES.items():
        rows = rows_of(tensors)
        assert rows is not None, name
        got = [(combine_lin64(s, a, b, len(raw(t))), bad) for t, (s, a, b, bad) in zip(tensors, rows)]
        assert rows_of(tensors) == rows, name  # the kernel left its sums zero for the next launch
        out[name] = [got, [(lin64(raw(t)), nonfinite(t)) for t in tensors]]
    # where the kernel does not apply: the caller's torch path
    refused = {
        "five tensors": [torch.zeros(4)] * 5,
        "not whole words": [torch.zeros(3, dtype=torch.bfloat16)],
        "a dtype without a bit rule": [torch.zeros(8, dtype=torch.float8_e4m3fn)],
        "two devices": [torch.zeros(4), torch.zeros(4, device="meta")],
    }
    out["refused"] = [k for k, v in refused.items() if rows_of(v) is not None]
    assert rows_of([torch.empty(0)]) == [[0] * 4] * fused.MAX_TENSORS  # nothing to launch
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the test extra installs it)")
def test_the_kernel_computes_lin64_and_counts_nonfinite_elements_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", CASES + CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout)
    assert out.pop("refused") == []
    for name, (got, want) in out.items():
        assert got == want, name
    # the overflow case: finite elements, so not flagged (the torch path's float sum would flag it)
    assert out["finite values whose float sum overflows"][0][0][1] == 0


def test_without_triton_or_when_disabled_the_caller_takes_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused, "_kernel", None)
    monkeypatch.setenv(fused.ENV_DISABLE, "0")
    assert not fused.launch([torch.zeros(4)], torch.zeros(16, dtype=torch.int64).data_ptr())
    assert fused._kernel is False
    # fingerprint_many on the CPU never reaches the kernel: the native core or sk64 per tensor
    assert [algo for _, _, algo in fingerprint_many([torch.zeros(4), torch.ones(3)])] == [
        fingerprint(torch.zeros(4))[2],
        fingerprint(torch.ones(3))[2],
    ]


# -- CUDA -----------------------------------------------------------------------------------------
def _resolve(v: Any) -> Any:
    return v.value() if isinstance(v, Pending) else v


@pytest.mark.gpu
def test_fingerprint_many_of_a_taped_calls_outputs_takes_one_launch_on_cuda() -> None:
    namespace: dict[str, Any] = {}
    exec(CASES, namespace)  # the cases above, built on the CPU
    assert fused.available(), "Triton should run on the GPU machine"
    free = len(fused._slots.free) if fused._slots is not None else fused.SLOTS  # other tests' may be taken
    for name, cpu in namespace["CASES"].items():
        tensors = [t.cuda() for t in cpu]
        many = fingerprint_many(tensors)
        launched = fused.lin64_fused(tensors)
        assert launched is not None, name
        rows, event = launched
        event.synchronize()  # the kernel wrote the rows into pinned host memory
        for t, c, (fp, nf, algo), (s, a, b, bad) in zip(tensors, cpu, many, rows.get(), strict=False):
            raw = c.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            assert algo == "lin64"
            assert _resolve(fp) == ref.lin64(raw) == ref.combine_lin64(s, a, b, len(raw)), (name, t.dtype)
            x = torch.view_as_real(c) if c.is_complex() else c
            count = int((~torch.isfinite(x)).sum()) if x.is_floating_point() else 0
            assert (bad, _resolve(nf)) == (count, count > 0), (name, t.dtype)
            # the per-tensor path gives the same value (a replay recomputes it that way)
            assert _resolve(fingerprint(t, "lin64")[0]) == _resolve(fp)
    # every slot read was given back
    assert fused._slots is not None and len(fused._slots.free) == free
    # after the first (Triton's JIT entry point), the launches above called the compiled kernel
    assert fused._direct, "the direct launch of the compiled kernel was given up (see the log)"


@pytest.mark.gpu
def test_many_calls_on_two_streams_keep_their_sums_apart() -> None:
    """Each stream has its own sums: calls queued on two streams at once, then read, give each
    call its own tensor's values."""
    assert fused.available()
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(4096, 257, device="cuda", generator=g) for _ in range(16)]
    want = [ref.lin64(x.cpu().numpy().tobytes()) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got: list[Any] = []
    for i, x in enumerate(xs):
        s = streams[i % 2]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            got.append(fingerprint_many([x]))
    torch.cuda.synchronize()
    assert [_resolve(fps[0][0]) for fps in got] == want


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the test extra installs it)")
def test_the_kernel_compiles_for_hopper_with_the_arguments_launch_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the interpreter cannot see: Triton types each integer argument by its value (i32 or
    i64), and the compiled kernel must take those types; compiled here for sm_90 (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from fsdp_replay.agent.fingerprint._fused_kernel import lin64_kernel

    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    class Capture:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kw: seen.append((args, kw))

    monkeypatch.setattr(fused, "_kernel", Capture())
    monkeypatch.setattr(fused, "_direct", None)
    monkeypatch.setattr(fused, "_scratch_of", lambda device, stream: ("acc", "count"))
    host = torch.zeros(16, dtype=torch.int64)
    for tensors in (
        [torch.zeros(3000)],
        [torch.zeros(3000, dtype=torch.bfloat16)] * 3,
        [torch.zeros(8)] * 4,
        [torch.empty(0), torch.zeros(8)],  # an empty tensor's address can be 0
        [torch.zeros(2, 40, 3, 4, 64, dtype=torch.bfloat16)[:, :, i].transpose(1, 2) for i in range(3)],
    ):
        assert fused.launch(tensors, host.data_ptr())
    names = list(inspect.signature(lin64_kernel.fn).parameters)
    signatures = set()
    for args, kw in seen:
        sig = {"acc": "*i64", "count": "*i32"}
        for name, value in zip(names[2:], args[2:], strict=False):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        constexprs = {k: v for k, v in kw.items() if k in names}
        sig |= dict.fromkeys(constexprs, "constexpr")
        signatures.add(tuple(sig.items()))
    assert len(signatures) == 1, signatures  # one compiled kernel serves every call
    sig = dict(signatures.pop())
    options = {k: v for k, v in seen[0][1].items() if k not in names}
    compiled = compile(
        ASTSource(fn=lin64_kernel, signature=sig, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    assert "atom.global" in compiled.asm["ptx"]


def _words_in_layout_order(t: torch.Tensor, layout: tuple[int, ...]) -> list[int]:
    """The words the kernel reads for ``t`` in this layout, in its order (``_one``'s addresses)."""
    w, d1, d2, s0, s1, s2 = layout
    storage = torch.frombuffer(bytearray(t.untyped_storage()), dtype=torch.int32)
    first = t.storage_offset() * t.element_size() // 4
    out = []
    for o in range(t.numel() * t.element_size() // 4):
        r, c = divmod(o, w)
        r1, i2 = divmod(r, d2)
        i0, i1 = divmod(r1, d1)
        out.append(int(storage[first + i0 * s0 + i1 * s1 + i2 * s2 + c]))
    return out


def test_a_strided_view_is_read_in_place_where_its_rows_are_whole_words() -> None:
    g = torch.Generator().manual_seed(3)
    packed = torch.randn(2, 40, 3, 4, 64, generator=g).to(torch.bfloat16)
    read = {
        "attention gradient (batch, heads, seq, dim)": packed[:, :, 1].transpose(1, 2),
        "a slice inside its storage": torch.randn(9, 70, 33, generator=g)[1:8:2, 3:, 1:31],
        "a broadcast": torch.randn(1, 5, 1, 16, generator=g).expand(3, 5, 7, 16),
        "float64 rows": torch.randn(50, 40, 6, generator=g, dtype=torch.float64)[:, 5:, 2:],
    }
    for name, t in read.items():
        layout = fused._layout(t)
        assert layout is not None, name
        want = t.contiguous().reshape(-1).view(torch.uint8).view(torch.int32).tolist()
        assert _words_in_layout_order(t, layout) == want, name
    assert fused._layout(packed[:, :, 0].transpose(1, 2)) == (32, 4, 40, 40 * 3 * 4 * 32, 32, 3 * 4 * 32)
    copied = {
        "four row dimensions": torch.randn(2, 3, 4, 5, 6).permute(1, 0, 3, 2, 4),
        "the last dimension strided": torch.randn(64, 48).t(),
        "rows of 3 halves": torch.randn(30, 7).to(torch.bfloat16)[:, :3],
    }
    for name, t in copied.items():
        assert fused._layout(t) is None, name
