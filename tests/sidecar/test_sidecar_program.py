"""The BPF program text, the record layout and the argument locations: no root, no bcc needed."""

from __future__ import annotations

import ctypes
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_support import REPO, find_libnccl

from fsdp_replay.sidecar.ebpf import nccl, programs, records
from fsdp_replay.sidecar.ebpf.signatures import INT, STRUCT, Param, Signature, locate, struct_digest


def test_record_has_no_padding_and_matches_the_field_list() -> None:
    offset = 0
    for f in records.FIELDS:
        assert getattr(records.Record, f.name).offset == offset, f.name
        offset += ctypes.sizeof(records._CTYPES[f.ctype]) * f.count
    assert offset == records.RECORD_SIZE == ctypes.sizeof(records.Record) == 176
    text = records.c_struct()
    for f in records.FIELDS:
        assert re.search(rf"\b{f.ctype} {f.name}(\[{f.count}\])?;", text), f.name


def test_c_struct_compiles_to_the_ctypes_layout(tmp_path: Path) -> None:
    """gcc on x86-64 lays these types out like clang's BPF target: the generated asserts hold."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdint.h>\n"
        "typedef uint64_t u64; typedef int64_t s64; typedef uint32_t u32; typedef int32_t s32;\n"
        f"{records.c_struct()}\n{records.c_layout_asserts()}\n"
    )
    proc = subprocess.run([gcc, "-fsyntax-only", "-std=c11", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # And the asserts are not vacuous: a wrong size is rejected.
    src.write_text(src.read_text().replace(f"== {records.RECORD_SIZE},", f"== {records.RECORD_SIZE + 8},"))
    assert subprocess.run([gcc, "-fsyntax-only", "-std=c11", str(src)], capture_output=True).returncode != 0


def test_stack_arguments_follow_the_x86_64_abi() -> None:
    on_stack = {s.name: s.stack_params for s in nccl.API}
    assert on_stack["ncclAllReduce"] == ("stream",)
    assert on_stack["ncclReduceScatter"] == ("stream",)
    assert on_stack["ncclBroadcast"] == ("stream",)
    assert on_stack["ncclReduce"] == ("comm", "stream")
    for six in ("ncclAllGather", "ncclSend", "ncclRecv", "ncclAlltoAll", "ncclCommShrink"):
        assert on_stack[six] == (), six
    # The 128-byte ncclUniqueId goes in memory and takes no register: rank in rdx, config in rcx.
    sig = nccl.by_name("ncclCommInitRankConfig")[0]
    assert [(loc.register, loc.stack_offset, loc.size_bytes) for loc in sig.locations] == [
        (0, None, 8),
        (1, None, 8),
        (None, 8, 128),
        (2, None, 8),
        (3, None, 8),
    ]
    (reduce,) = nccl.by_name("ncclReduce")
    assert [loc.stack_offset for loc in reduce.locations[-2:]] == [8, 16]
    # A struct before stack integers pushes them past its size.
    locs = locate([Param(f"a{i}") for i in range(6)] + [Param("s", STRUCT, 24), Param("x", INT)])
    assert [(loc.stack_offset, loc.size_bytes) for loc in locs[6:]] == [(8, 24), (32, 8)]


def test_program_reads_the_stack_and_filters_by_pid() -> None:
    probes = nccl.by_name(
        "ncclAllReduce", "ncclReduce", "ncclAllGather", "ncclCommInitRankConfig", "ncclGroupEnd"
    )
    text = programs.build_program(probes)
    assert records.c_struct() in text and records.c_layout_asserts() in text
    assert "BPF_HASH(fr_pids, u32, u8, 4096);" in text
    assert "if (!fr_pids.lookup(&tgid))" in text
    assert "BPF_RINGBUF_OUTPUT(fr_events, 1024);" in text
    assert "BPF_HASH(fr_inflight, struct fr_key, struct fr_record, 16384);" in text
    # the helper reads 8 bytes above the return address: PT_REGS_SP(ctx) + offset
    assert "bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + offset))" in text

    def body(func: str) -> str:
        return text.split(f"int {func}(struct pt_regs *ctx)")[1].split("\n}\n")[0]

    all_reduce, reduce, all_gather, init, group_end = (programs.event_func(i) for i in range(5))
    assert "r->args[6] = fr_stack_u64(ctx, 8, r);  /* stream: [sp+8] */" in body(all_reduce)
    assert "r->args[4] = (u64)(s64)(s32)PT_REGS_PARM5(ctx);  /* op */" in body(all_reduce)
    assert "r->args[6] = fr_stack_u64(ctx, 8, r);  /* comm: [sp+8] */" in body(reduce)
    assert "r->args[7] = fr_stack_u64(ctx, 16, r);  /* stream: [sp+16] */" in body(reduce)
    assert "fr_stack" not in body(all_gather)
    assert "r->args[5] = (u64)PT_REGS_PARM6(ctx);  /* stream */" in body(all_gather)
    init_body = body(init)
    assert "u64 w[16] = {};" in init_body and "(PT_REGS_SP(ctx) + 8)" in init_body
    assert "r->args[3] = (u64)(s64)(s32)PT_REGS_PARM3(ctx);  /* rank */" in init_body
    assert "r->args[4] = (u64)PT_REGS_PARM4(ctx);  /* config */" in init_body
    assert "fr_read_config(r, r->args[4]);" in init_body
    assert "fr_read_new_comm(r, r->args[0]);" in body(programs.return_func(3))
    assert "r->args" not in body(group_end)
    assert text.count("int fr_return_") == 5


def test_program_options() -> None:
    probes = nccl.by_name("ncclAllReduce")
    unfiltered = programs.build_program(probes, pid_filter=False)
    assert "fr_pids" not in unfiltered and "no pid filter" in unfiltered
    entry_only = programs.build_program(probes, returns=False)
    assert "fr_inflight" not in entry_only and "fr_return_" not in entry_only
    assert "r->kind = FR_KIND_ENTRY;" in entry_only
    perf = programs.build_program(probes, transport="perf")
    assert "BPF_PERF_OUTPUT(fr_events);" in perf and "perf_submit(ctx, r, sizeof(*r))" in perf
    with pytest.raises(ValueError, match="power of two"):
        programs.build_program(probes, ringbuf_pages=1000)
    with pytest.raises(ValueError, match="listed twice"):
        programs.build_program(probes * 2)
    with pytest.raises(ValueError, match="no functions"):
        programs.build_program([])
    with pytest.raises(ValueError, match="transport"):
        programs.build_program(probes, transport="pipe")


def test_signature_validation() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        Param("id", STRUCT, 16)
    with pytest.raises(ValueError, match="kind"):
        Param("x", "float")
    with pytest.raises(ValueError, match="holds 8"):
        Signature("f", tuple(Param(f"a{i}") for i in range(9)))
    with pytest.raises(ValueError, match="not one of its parameters"):
        Signature("f", (Param("a"),), config_param="b")
    assert Signature("f").symbols == ("f",)
    assert nccl.by_name("ncclSend")[0].symbols == ("ncclSend", "pncclSend")
    with pytest.raises(ValueError, match="ncclBogus"):
        nccl.by_name("ncclBogus")


def test_struct_digest_is_word_fnv1a() -> None:
    assert struct_digest(b"") == 0xCBF29CE484222325
    one = struct_digest((1).to_bytes(8, "little"))
    assert one == ((0xCBF29CE484222325 ^ 1) * 0x100000001B3) & (2**64 - 1)
    a, b = bytes(range(128)), bytes(range(1, 129))
    assert struct_digest(a) != struct_digest(b)
    with pytest.raises(ValueError):
        struct_digest(b"abc")


def test_print_bpf_prints_the_program() -> None:
    out = io.StringIO()
    assert programs.print_bpf(["ncclAllReduce", "ncclGroupStart"], out=out) == 0
    text = out.getvalue()
    assert text == programs.build_program(nccl.by_name("ncclAllReduce", "ncclGroupStart"))
    everything = io.StringIO()
    programs.print_bpf(out=everything)
    assert everything.getvalue().count("int fr_entry_") == len(nccl.API)


def test_sidecar_imports_neither_bcc_nor_torch() -> None:
    code = (
        "import sys\n"
        "import fsdp_replay.sidecar, fsdp_replay.sidecar.discovery, fsdp_replay.sidecar.procfs\n"
        "import fsdp_replay.sidecar.ebpf.probe, fsdp_replay.sidecar.ebpf.programs\n"
        "import fsdp_replay.sidecar.ebpf.elf, fsdp_replay.sidecar.ebpf.nccl, fsdp_replay.sidecar.ebpf.events\n"
        "bad = [m for m in ('bcc', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_only_the_sidecar_imports_bcc() -> None:
    pattern = re.compile(r"^\s*(import bcc|from bcc\b)", re.M)
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "fsdp_replay").rglob("*.py")
        if pattern.search(p.read_text()) and "sidecar" not in p.parts
    ]
    assert offenders == []


def test_nccl_exports_each_api_twice_at_one_address() -> None:
    from fsdp_replay.sidecar.ebpf import elf

    lib = find_libnccl()
    if lib is None:
        pytest.skip("the nvidia-nccl-cu13 wheel is not installed")
    names = [s for sig in nccl.API for s in sig.symbols]
    syms = elf.function_symbols(lib, names)
    for sig in nccl.API:
        weak, strong = (syms.get(s) for s in sig.symbols)
        if weak is None and strong is None:
            continue  # not in this version
        assert weak is not None and strong is not None, sig.name
        assert (weak.binding, strong.binding) == ("weak", "global"), sig.name
        assert weak.address == strong.address, sig.name


def test_init_rank_config_abi_in_the_real_library() -> None:
    """The callee's code: rank read from edx, config from rcx, &commId = rbp+16 = entry rsp+8."""
    objdump = shutil.which("objdump")
    lib = find_libnccl()
    if objdump is None or lib is None:
        pytest.skip("needs objdump (binutils) and the nvidia-nccl-cu13 wheel")
    from fsdp_replay.sidecar.ebpf import elf

    sym = elf.function_symbols(lib, ["pncclCommInitRankConfig"])["pncclCommInitRankConfig"]
    asm = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", f"--start-address={sym.address:#x}",
         f"--stop-address={sym.address + sym.size_bytes:#x}", str(lib)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    prologue = asm.split("call")[0]
    assert "push   %rbp" in prologue and "mov    %rsp,%rbp" in prologue
    assert re.search(r"mov\s+%edx,%[er]\w+", prologue), "rank (4th C argument) is not taken from edx"
    assert re.search(r"mov\s+%rcx,%r\w+", prologue), "config (5th C argument) is not taken from rcx"
    assert re.search(r"mov\s+%esi,", prologue), "nranks is not taken from esi"
    assert "lea    0x10(%rbp)," in asm, "the by-value commId is not addressed at rbp+16 (entry rsp+8)"
