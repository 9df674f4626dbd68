"""Writes bench/results/compat-torch-VERSION.md for scripts/compat-torch.sh.

Every run of the script leaves its JUnit XML (and what it was: command, date, load, duration, exit)
in the virtualenv's compat/runs/; the results file is made from all of them, each test with its
latest result, so a partial re-run (the files a fix touched) replaces only the rows it ran. Tests
that failed in an earlier run and pass in a later one are listed with the earlier message.
Run with the compat virtualenv's Python (it reads torch's version from it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Result:
    file: str
    name: str
    outcome: str  # passed, failed, skipped
    seconds: float
    message: str
    run: str


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()


def wheels(log: Path) -> list[tuple[str, float]]:
    """(wheel, MB) of what pip installed for torch: downloaded, taken from its cache, or a local file."""
    found = []
    for line in log.read_text().splitlines() if log.exists() else []:
        m = re.search(r"(?:Downloading|Using cached) (\S+\.whl) \(([\d.]+) (kB|MB|GB)\)", line)
        if m:
            scale = {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[m.group(3)]
            found.append((m.group(1).rsplit("/", 1)[-1], float(m.group(2)) * scale))
            continue
        m = re.search(r"Processing (\S+\.whl)", line)
        if m and os.path.exists(m.group(1)):
            found.append((os.path.basename(m.group(1)), os.path.getsize(m.group(1)) / 1e6))
    return found


def tree_gb(path: Path) -> float:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total / 1e9


def results_of(xml: Path, run: str) -> list[Result]:
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):  # module.Class -> module
            parts.pop()
        file = "/".join(parts) + ".py"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            outcome, msg = "failed", (bad.get("message") or "") + "\n" + (bad.text or "")
        elif skip is not None:
            outcome, msg = "skipped", skip.get("message") or ""
        else:
            outcome, msg = "passed", ""
        out.append(Result(file, case.get("name", "?"), outcome, float(case.get("time", 0)), msg.strip(), run))
    return out


def scrub(text: str) -> str:
    """The text without this machine's paths: the checkout, pytest's temp folders, Python's."""
    text = text.replace(str(Path.cwd()), "<repo>")
    text = re.sub(r"/\S*?/pytest-of-[^/\s]+/pytest-\d+", "<pytest-tmp>", text)
    for prefix in (sys.base_prefix, os.path.expanduser("~")):
        if len(prefix) > 1:
            text = text.replace(prefix, "<python>" if prefix == sys.base_prefix else "~")
    return text


def excerpt(text: str, head: int = 12, tail: int = 30) -> str:
    """The message's start and the traceback's end, where the error is."""
    lines = scrub(text).splitlines()
    lines = [line[:400] + (" ..." if len(line) > 400 else "") for line in lines]
    if len(lines) <= head + tail:
        return "\n".join(lines)
    return "\n".join([*lines[:head], f"... ({len(lines) - head - tail} lines)", *lines[-tail:]])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--results", type=Path, required=True)
    ap.add_argument("--run", type=Path, required=True, help="this run's files, without suffix")
    ap.add_argument("--load", required=True)
    ap.add_argument("--timeout", type=int, default=300, help="each test process's hang guard, seconds")
    ap.add_argument("--seconds", type=int, required=True)
    ap.add_argument("--exit", type=int, required=True)
    ap.add_argument("args", nargs="*", help="the arguments the script was given after the version")
    a = ap.parse_args()

    meta = {
        "command": " ".join(["scripts/compat-torch.sh", a.version, *a.args]),
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "load": a.load,
        "seconds": a.seconds,
        "exit": a.exit,
        "timeout": a.timeout,
        "commit": git("rev-parse", "--short", "HEAD")
        + ("+uncommitted" if git("status", "--porcelain", "--", "fsdp_replay", "tests") else ""),
    }
    if not a.run.with_suffix(".json").exists():  # (a second call for the same run only rewrites the file)
        a.run.with_suffix(".json").write_text(json.dumps(meta) + "\n")

    runs = sorted(p.with_suffix("") for p in (a.work / "runs").glob("*.json"))
    metas = {r.name: json.loads(r.with_suffix(".json").read_text()) for r in runs}
    latest: dict[tuple[str, str], Result] = {}
    fixed: dict[tuple[str, str], Result] = {}
    for r in runs:
        if not r.with_suffix(".xml").exists():
            continue
        for res in results_of(r.with_suffix(".xml"), r.name):
            key = (res.file, res.name)
            before = latest.get(key)
            if before is not None and before.outcome == "failed" and res.outcome == "passed":
                fixed[key] = before
            elif res.outcome == "failed":
                fixed.pop(key, None)
            latest[key] = res

    import torch

    out: list[str] = []
    w = out.append
    counts = {k: sum(1 for r in latest.values() if r.outcome == k) for k in ("passed", "failed", "skipped")}
    w(f"# Compatibility tier: torch {a.version}")
    w("")
    w(
        "Made by `scripts/compat-torch.sh` (what it installs and which tests it runs: the script's "
        "header). Each test's latest result; the runs that gave them are listed below."
    )
    w("")
    cuda = torch.version.cuda
    w(
        f"- torch {torch.__version__} ({'a CUDA ' + cuda + ' build, run on CPU' if cuda else 'CPU build'}; "
        f"gloo), Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cores"
    )
    whl = wheels(a.work / "pip-torch.log")
    if whl:
        big = ", ".join(f"{n.split('-')[0]} {s:.0f} MB" for n, s in sorted(whl, key=lambda x: -x[1])[:5])
        w(
            f"- installing torch=={a.version} and numpy: {len(whl)} wheels, {sum(s for _, s in whl) / 1e3:.2f} GB "
            f"(largest: {big}); the virtualenv holds {tree_gb(Path(sys.prefix)):.1f} GB with the test extras"
        )
    left = a.work / "extras-left-out.txt"
    left_out = left.read_text().split("\n") if left.exists() else []
    w(
        f"- test extras left out (they do not install next to torch {a.version}): "
        f"{', '.join(x for x in left_out if x) or 'none, all installed'}"
    )
    w(
        f"- **{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped** "
        "(failed counts errors in a fixture too)"
    )
    w("")
    w(
        "| run | command | commit | date | load average before (1, 5, 15 min) | duration "
        "| a test process's time limit | pytest exit |"
    )
    w("|---|---|---|---|---|---:|---:|---:|")
    for i, r in enumerate(runs, 1):
        m = metas[r.name]
        w(
            f"| {i} | `{m['command']}` | {m.get('commit', '?')} | {m['date']} | {m['load']} | "
            f"{m['seconds'] // 60} min {m['seconds'] % 60} s | {m.get('timeout', 300)} s | {m['exit']} |"
        )
    w("")
    index = {r.name: i for i, r in enumerate(runs, 1)}
    w("| file | passed | failed | skipped | seconds | run |")
    w("|---|---:|---:|---:|---:|---|")
    for file in sorted({r.file for r in latest.values()}):
        rs = [r for r in latest.values() if r.file == file]
        n = {k: sum(1 for r in rs if r.outcome == k) for k in ("passed", "failed", "skipped")}
        which = ", ".join(str(index[x]) for x in sorted({r.run for r in rs}))
        w(
            f"| `{file}` | {n['passed']} | {n['failed']} | {n['skipped']} | "
            f"{sum(r.seconds for r in rs):.0f} | {which} |"
        )
    w("")
    for title, outcome in (("Failures", "failed"), ("Skips", "skipped")):
        rs = [r for r in latest.values() if r.outcome == outcome]
        w(f"## {title}")
        w("")
        if not rs:
            w("None.")
            w("")
        for r in rs:
            w(f"### `{r.file}::{r.name}` (run {index[r.run]})")
            w("")
            w("```")
            w(excerpt(r.message))
            w("```")
            w("")
    if fixed:
        w("## Failed in an earlier run, passed in a later one")
        w("")
        for (file, name), r in fixed.items():
            w(f"### `{file}::{name}` (failed in run {index[r.run]})")
            w("")
            w("```")
            w(excerpt(r.message, 8, 20))
            w("```")
            w("")
    ops = a.work / "ops.md"
    if ops.exists():
        w(ops.read_text().rstrip())
    a.results.write_text("\n".join(out) + "\n")
    print(f"wrote {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
