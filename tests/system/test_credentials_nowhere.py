"""Credentials planted everywhere a recording looks appear nowhere the tool writes.

One real recording (one gloo rank under torchrun, two steps) with every form of
``tests/credential_forms.py`` planted: in its environment, on its command line, in the message
of the exception it dies of, and in the source lines a stack dump shows (the program asks for a
dump of its own state while it waits in a call whose line holds credentials). Then ``inspect``
(text and JSON), ``nan --json``, ``desync --json``, a replay (with the same environment and
command line: its notes, report.json and report.txt) and ``fsdp-replay job`` render. Every byte is
searched: each file of the run folder (spools, attach markers, run.json, the trace's files, the
replay's report), every zarr array and blob decoded and every attribute, and each command's
stdout and stderr (less the program's own traceback, which Python prints, not the tool).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from credential_forms import ARGV_FORMS, ENV_FORMS, NEEDLES, TEXT_FORMS
from harness import CLI, child_env, run, torchrun_cmd

from fsdp_replay.trace import redact_key, schema
from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
KEYED = re.compile(r"<redacted:hmac-sha256:[0-9a-f]{16}>")

PROGRAM = """
import os
import sys
import time

import torch
import torch.distributed as dist


def wait_for_dump(run, **_credentials):
    answered({ARG1})


def answered(run, **_credentials):
    from fsdp_replay.trace.dump_request import AnswerWatch, write_request

    watch = AnswerWatch(run, write_request(run, "planted").id)
    deadline = time.monotonic() + 60
    while 0 not in watch.answers and time.monotonic() < deadline:
        time.sleep(0.1)
        watch.poll()
    watch.close()


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        loss = model(torch.ones(8, 4)).sum()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    run = os.environ.get("FSDP_REPLAY_OUT")
    if run:  # recording: a dump of this process's stacks, while this line is on them
        wait_for_dump(run, {ARG0})
    raise RuntimeError({MESSAGE!r})


main()
"""


def _program(folder: Path) -> Path:
    source = [f for f in TEXT_FORMS if "source line" in f.name]
    message = [f for f in TEXT_FORMS if "source line" not in f.name]
    assert source and message
    assert len(source) == 2  # one on each of two frames' lines (a line is kept up to 160 characters)
    text = PROGRAM.replace("{ARG0}", f"c={source[0].text!r}").replace("{ARG1}", f"run, c={source[1].text!r}")
    text = text.replace("{MESSAGE!r}", repr("; ".join(f.text for f in message)))
    folder.mkdir()
    path = folder / "program.py"
    path.write_text(text)
    return path


def _without_the_programs_traceback(output: str) -> str:
    """The command's output less what Python prints for an uncaught exception (from "Traceback" to
    the exception's line, each behind torch's "[rank0]: " in the program): the program's and
    torchrun's own, not the tool's."""
    kept, skipping = [], False
    for line in output.splitlines():
        bare = re.sub(r"^\[rank\d+\]: ", "", line)
        skipping = skipping or bare.startswith("Traceback (most recent call last):")
        if not skipping:
            kept.append(line)
        elif re.match(r"[A-Za-z_][\w.]*(: |$)", bare):  # the exception's line ends it
            skipping = False
    return "\n".join(kept)


def _zarr_bytes(trace: Path) -> list[tuple[str, bytes]]:
    """Every array of the trace decoded (columns, payload and snapshot blobs), and every group's
    and array's attributes."""
    out: list[tuple[str, bytes]] = []
    root = zarr.open_group(str(trace), mode="r")
    out.append(("attrs /", json.dumps(root.attrs.asdict(), default=str).encode()))
    arrays = 0
    for name, node in root.members(max_depth=None):
        out.append((f"attrs {name}", json.dumps(node.attrs.asdict(), default=str).encode()))
        if isinstance(node, zarr.Array):
            values = np.asarray(node[...])
            blob = (
                "\n".join(map(str, values.ravel())).encode()
                if values.dtype.kind in "OUT"
                else values.tobytes()
            )
            out.append((f"array {name}", blob))
            arrays += 1
    assert arrays > 20, "the walk found the trace's arrays"
    return out


def test_planted_credentials_appear_nowhere(tmp_path: Path) -> None:
    program = _program(tmp_path / "program")
    out = tmp_path / "run"
    env = child_env(**{k: v for f in ENV_FORMS for k, v in f.env.items()})
    args = [a for f in ARGV_FORMS for a in f.argv]
    outputs: dict[str, str] = {}

    rec = run(
        [*CLI, "record", "--out", str(out), "--keep-spool", "--", *torchrun_cmd(1, program, *args)],
        env=env,
        check=False,
    )
    assert rec.returncode == 1 and (out / schema.TRACE_DIR).is_dir(), rec.stderr[-3000:]
    outputs["record"] = rec.stdout + rec.stderr

    for name, cmd in {
        "inspect": ["inspect", str(out)],
        "inspect --json": ["inspect", str(out), "--json"],
        "nan --json": ["nan", str(out), "--json"],
        "desync --json": ["desync", str(out), "--json"],
        "job": [
            "job",
            str(out),
            "--rank",
            "0",
            "--dry-run",
            "--image",
            "registry.example/ml/train:1",
            "-n",
            "ml",
        ],
    }.items():
        proc = run([*CLI, *cmd], env=env, check=False)
        assert proc.returncode in (0, 1), f"{name}: {proc.stderr[-3000:]}"
        outputs[name] = proc.stdout + proc.stderr
    # what the recording kept, redacted: the stack dump's lines, the exception, argv and env
    rank = Trace.open(str(out / schema.TRACE_DIR)).rank(0)
    lines = [f[3] for d in rank.attrs["state_dumps"] for t in d["threads"] for f in t["frames"]]
    planted = [line for line in lines if line.startswith(("wait_for_dump(", "answered("))]
    assert len(planted) == 2 and all(KEYED.search(line) for line in planted), lines
    assert KEYED.search(rank.attrs["end"]["exception"]), rank.attrs["end"]
    assert KEYED.fullmatch(rank.meta["env"]["REDIS_PW"]) and KEYED.search(" ".join(rank.meta["argv"]))

    replay = run(
        [
            *CLI,
            "replay",
            str(out),
            "--report",
            str(out / "replay"),
            "--",
            sys.executable,
            str(program),
            *args,
        ],
        env=env,
        check=False,
    )
    outputs["replay"] = replay.stdout + replay.stderr
    report = json.loads((out / "replay" / "report.json").read_text())
    assert report["status"] == "bit-exact", outputs["replay"][-3000:]
    assert "from your environment: the recorded value" in replay.stderr  # the key told them apart

    assert (out / redact_key.KEY_FILE).is_file() and not list((out / schema.TRACE_DIR).rglob("*.key"))

    leaks: list[str] = []

    def search(where: str, blob: bytes) -> None:
        leaks.extend(f"{n!r} in {where}" for n in NEEDLES if n.encode() in blob)

    files = 0
    for root, _dirs, names in os.walk(out):  # symlinks (.agent-path) are not followed
        for name in names:
            path = Path(root) / name
            if not path.is_symlink():
                search(str(path.relative_to(out)), path.read_bytes())
                files += 1
    assert files > 30
    for where, blob in _zarr_bytes(out / schema.TRACE_DIR):
        search(where, blob)
    for name, text in outputs.items():
        search(f"{name}'s output", _without_the_programs_traceback(text).encode())
    assert not leaks, "\n".join(leaks)
