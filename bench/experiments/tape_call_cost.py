"""Where one taped call's host time goes (the tape's step cost, bench_tape.py, is its host time on a
host-bound step): the pieces of ``TapeRecorder.taped`` for the cuDNN attention backward's three
outputs at the reference size, timed apart, each as host CPU microseconds per call (median of
rounds, min-max). The outputs are strided as the real ones are (views of one packed
(batch, seq, 3, heads, head_dim) gradient), or contiguous.

    python bench/experiments/tape_call_cost.py [--calls 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fsdp_replay.agent.fingerprint import fingerprint_many, fused

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_tape import Tape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tape_fp_cost import resolve


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    packed = torch.randn(16, 512, 3, 16, 64, device="cuda").to(torch.bfloat16)
    strided = [packed[:, :, i].transpose(1, 2) for i in range(3)]  # (16, 16, 512, 64), strided
    contiguous = [t.contiguous() for t in strided]
    assert not strided[0].is_contiguous()
    kernel = fused._get()
    assert kernel, "Triton does not run here"
    fps_s, fps_c = fingerprint_many(strided), fingerprint_many(contiguous)
    resolve(fps_s)
    resolve(fps_c)
    assert [f[0].value() for f in fps_s] == [f[0].value() for f in fps_c]

    # the launch alone, as fused.launch makes it (arguments prepared once)
    host_row = torch.zeros(16, dtype=torch.int64, pin_memory=True)
    stream = torch.cuda.current_stream().cuda_stream
    acc, count = fused._scratch_of(contiguous[0].device, stream)
    largs: list[Any] = []
    ends, blocks = [], 0
    for t in contiguous:
        n = t.numel() * t.element_size() // 4
        largs += [t.data_ptr(), n, 2, *fused._CONTIGUOUS]
        blocks += -(-n // fused._WORDS)
        ends.append(blocks)
    largs += [host_row.data_ptr(), 0, 0, *fused._CONTIGUOUS]
    ends.append(blocks)
    compiled = kernel[(blocks,)](acc, count, host_row.data_ptr(), *largs, *ends[:3], **fused._OPTIONS)
    torch.cuda.synchronize()
    jit_row = host_row.clone()
    direct = [acc, count, host_row.data_ptr(), *largs, *ends[:3], fused._ROWS, 1024]
    direct_ok = True
    try:
        host_row.zero_()
        compiled[(blocks, 1, 1)](*direct)
        torch.cuda.synchronize()
        direct_ok = torch.equal(host_row, jit_row)
    except Exception as e:
        print(f"direct launch failed: {e!r}")
        direct_ok = False
    print(f"direct launch equals the JIT launch: {direct_ok}")

    def event() -> Any:
        e = torch.cuda.Event(blocking=True)
        e.record()
        return e

    tmp = tempfile.TemporaryDirectory(prefix="tape-call-")
    tape = Tape(Path(tmp.name))

    def taped(outs: list[torch.Tensor]) -> Any:
        return tape.recorder.taped("aten::_scaled_dot_product_cudnn_attention_backward", lambda: tuple(outs))

    ways: dict[str, Any] = {
        "fingerprint_many, contiguous": lambda: fingerprint_many(contiguous),
        "fingerprint_many, strided": lambda: fingerprint_many(strided),
        "3x .contiguous() of the strided (what session 10 did)": lambda: [t.contiguous() for t in strided],
        "JIT launch alone": lambda: kernel[(blocks,)](
            acc, count, host_row.data_ptr(), *largs, *ends[:3], **fused._OPTIONS
        ),
        "event create + record": event,
        "taped hook, strided outputs": lambda: taped(strided),
        "taped hook, contiguous outputs": lambda: taped(contiguous),
    }
    if direct_ok:
        ways["direct launch (CompiledKernel)"] = lambda: compiled[(blocks, 1, 1)](*direct)
    host: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, f in ways.items():
            kept = []
            torch.cuda.synchronize()
            c0 = time.thread_time()
            for _ in range(args.calls):
                kept.append(f())
            c1 = time.thread_time()
            for got in kept:
                if isinstance(got, list) and got and isinstance(got[0], tuple):
                    resolve(got)
            torch.cuda.synchronize()
            tape.writer.flush(60)
            host[name].append((c1 - c0) / args.calls * 1e6)
    tape.close()
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.calls} calls x {args.rounds} rounds"
    )
    print("| piece | host CPU us/call (median, min-max) |")
    print("|---|---:|")
    for name, h in host.items():
        print(f"| {name} | {statistics.median(h):.1f} ({min(h):.1f}-{max(h):.1f}) |")


if __name__ == "__main__":
    main()
