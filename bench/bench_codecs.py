"""The collector's throughput by blob codec, on payloads recorded from a real run.

    python bench/bench_codecs.py --steps 20 --reps 3

Records the reference workload once with every payload kept (``fsdp-replay record --payloads all
--snapshot-every 5 --no-collect -- torchrun --nproc_per_node 2 examples/train_fsdp.py --cpu``: the
FSDP2 all-gather outputs and reduce-scatter inputs, fp32; the batches, int64 tokens; RNG states;
state snapshots, torch.save archives), or takes ``--spool RUN`` recorded before. Then collects that
same spool into a new trace with each codec ``trace/store.py`` offers (``BLOB_CODECS``), in
``--reps`` repetitions with the codecs in a rotated order, each collection in a fresh process:
its CPU time (all threads: zarr's I/O loop, blosc's) and wall time around ``collect`` alone, then
every blob read back whole (what a replay does). Throughput is the spool's payload bytes (raw)
over the CPU seconds: MB/s per core, the figure that matters for a sidecar sharing a node with
training; the ratio is the bytes the blobs take in the store over their raw bytes, per kind of
payload too (the kind from the events that name each blob). The codecs alone are measured too,
on the same bytes (numcodecs' Blosc and Zstd with the parameters of ``BLOB_CODECS``, 4 MiB chunks
as ``BLOB_CHUNK``, one thread): what each costs per byte once payloads are large enough that the
per-blob work of the store (an array made, written and marked complete) no longer dominates.
Writes ``--results`` (markdown, with the command) and the numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import EXAMPLE, REPO, machine_info, portable_command, run_env, version_of

from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.schema import blob_path, digest_of
from fsdp_replay.trace.store import BLOB_CHUNK, BLOB_CODECS, DEFAULT_BLOB_CODEC

CHILD = r"""
import json, resource, sys, time
import numpy as np, zarr
from fsdp_replay.trace.collect import collect

spool, trace, codec = sys.argv[1:4]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

c0, t0 = cpu(), time.perf_counter()
report = collect(spool, trace, blob_codec=codec)
c1, t1 = cpu(), time.perf_counter()
assert not report.damaged, [r.damage for r in report.ranks]
root = zarr.open_group(trace, mode="r")
n = 0
for _, g in root["blobs"].groups():
    for _, arr in g.arrays():
        n += len(np.asarray(arr[:]).tobytes())
c2, t2 = cpu(), time.perf_counter()
print(json.dumps({"collect_cpu": c1 - c0, "collect_wall": t1 - t0, "read_cpu": c2 - c1,
                  "read_wall": t2 - t1, "read_bytes": n,
                  "blobs_written": sum(r.blobs_written for r in report.ranks)}))
"""


def payload_kinds(spool_root: Path) -> dict[str, tuple[str, int]]:
    """digest -> (kind, raw bytes) of every blob in the spool; the kind from the events naming it."""
    kinds: dict[str, tuple[str, int]] = {}
    for _rank, folder in spool.spool_ranks(spool_root).items():
        digests: dict[int, str] = {}
        for rec in spool.read_rank(folder):
            if rec.kind == schema.KIND_BLOB:
                d = digest_of(rec.raw)
                digests[int(rec.obj["blob"])] = d
                kinds.setdefault(d, ("other", rec.raw.nbytes))
                continue
            ev, kind, blobs = rec.obj, None, []
            if ev.get("type") == "rank_start":
                digests = {}
            elif ev.get("type") == "coll":
                kind, blobs = "collective outputs (fp32)", [t[6] for t in ev["tensors"]]
            elif ev.get("type") == "batch":
                kind, blobs = "batches (int64 tokens)", [t[6] for t in ev["tensors"]]
                for b in [ev["rng"]] if "rng" in ev else []:  # the RNG states after the fetch
                    d = digests.get(int(b))
                    if d is not None and kinds[d][0] == "other":
                        kinds[d] = ("RNG states", kinds[d][1])
            elif ev.get("type") == "rng":
                kind, blobs = "RNG states", [ev["states"]["blob"]]
            elif ev.get("type") == "snapshot":
                kind, blobs = "snapshots (torch.save)", [ev["blob"]]
            for b in blobs:
                d = digests.get(int(b))
                if kind is not None and d is not None and kinds[d][0] == "other":
                    kinds[d] = (kind, kinds[d][1])
    return kinds


def payload_bytes(spool_root: Path) -> dict[str, bytes]:
    """digest -> bytes of every distinct blob of the spool."""
    out: dict[str, bytes] = {}
    for folder in spool.spool_ranks(spool_root).values():
        for rec in spool.read_rank(folder):
            if rec.kind == schema.KIND_BLOB:
                out.setdefault(digest_of(rec.raw), bytes(rec.raw))
    return out


def codec_alone(blobs: list[bytes], reps: int) -> dict[str, dict[str, float]]:
    """Per codec: CPU seconds to encode and to decode every blob (4 MiB chunks), and the ratio."""
    import numcodecs
    import numpy as np
    from numcodecs import Blosc, Zstd

    numcodecs.blosc.set_nthreads(1)
    shuffle = Blosc.SHUFFLE
    codecs: dict[str, Any] = {
        "blosc-lz4": Blosc(cname="lz4", clevel=5, shuffle=shuffle),
        "blosc-zstd1": Blosc(cname="zstd", clevel=1, shuffle=shuffle),
        "zstd1": Zstd(level=1),
        "zstd3": Zstd(level=3),
        "zstd9": Zstd(level=9),
    }
    chunks = [b[i : i + BLOB_CHUNK] for b in blobs for i in range(0, len(b), BLOB_CHUNK)]
    # blosc shuffles by the element size: 4 bytes, as the trace's BloscCodec(typesize=4)
    views = [np.frombuffer(c[: len(c) - len(c) % 4], dtype=np.float32) for c in chunks]
    out: dict[str, dict[str, float]] = {}
    for name, codec in codecs.items():
        enc_s, dec_s = [], []
        for _ in range(reps):
            t0 = time.process_time()
            encoded = [codec.encode(v) for v in views]
            t1 = time.process_time()
            for e in encoded:
                codec.decode(e)
            dec_s.append(time.process_time() - t1)
            enc_s.append(t1 - t0)
        out[name] = {
            "encode_cpu_s": statistics.median(enc_s),
            "decode_cpu_s": statistics.median(dec_s),
            "ratio": sum(len(e) for e in encoded) / sum(v.nbytes for v in views),
        }
    return out


def stored_bytes(trace: Path, digest: str) -> int:
    folder = trace / blob_path(digest)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def record(out: Path, steps: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "fsdp_replay",
        "record",
        "--out",
        str(out),
        "--no-collect",
        "--payloads",
        "all",
        "--snapshot-every",
        "5",
        "--",
        str(Path(sys.executable).with_name("torchrun")),
        "--standalone",
        "--nproc_per_node=2",
        str(EXAMPLE),
        "--cpu",
        "--steps",
        str(steps),
    ]
    proc = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"recording failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="steps of the recorded run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--codecs", default=",".join(BLOB_CODECS))
    p.add_argument("--spool", help="a run folder recorded before (its spool/ is collected)")
    p.add_argument("--workdir", help="where the traces go (default: a temporary folder)")
    p.add_argument("--results", default=str(REPO / "bench" / "results" / "codecs.md"))
    a = p.parse_args()
    codecs = a.codecs.split(",")
    started, load_before = time.time(), os.getloadavg()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-codecs-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        run = Path(a.spool) if a.spool else work / "run"
        if not a.spool:
            record(run, a.steps)
        spool_root = run / schema.SPOOL_DIR
        spool_bytes = sum(f.stat().st_size for f in spool_root.rglob("seg-*"))
        kinds = payload_kinds(spool_root)
        raw = sum(n for _, n in kinds.values())
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in codecs}
        ratios: dict[str, dict[str, float]] = {}
        for rep in range(a.reps):
            for codec in codecs[rep % len(codecs) :] + codecs[: rep % len(codecs)]:
                trace = work / f"trace-{codec}"
                shutil.rmtree(trace, ignore_errors=True)
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, str(spool_root), str(trace), codec],
                    capture_output=True,
                    text=True,
                    timeout=1800,
                    env=run_env(),
                )
                if proc.returncode != 0:
                    sys.exit(f"{codec}: collect failed:\n{proc.stderr[-3000:]}")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                if r["read_bytes"] != raw:
                    sys.exit(f"{codec}: read back {r['read_bytes']} bytes, the spool holds {raw}")
                runs[codec].append(r)
                if codec not in ratios:  # the stored sizes, per kind (the same each repetition)
                    by_kind: dict[str, list[int]] = {}
                    for d, (kind, n) in kinds.items():
                        s = by_kind.setdefault(kind, [0, 0])
                        s[0] += n
                        s[1] += stored_bytes(trace, d)
                    ratios[codec] = {k: s[1] / max(s[0], 1) for k, s in by_kind.items()}
                    ratios[codec]["all"] = sum(s[1] for s in by_kind.values()) / raw
                shutil.rmtree(trace, ignore_errors=True)
        alone = codec_alone(list(payload_bytes(spool_root).values()), max(a.reps, 3))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    m = machine_info()
    mb = raw / 1e6
    summary = {
        c: {
            "collect_cpu_s": statistics.median(r["collect_cpu"] for r in rs),
            "collect_wall_s": statistics.median(r["collect_wall"] for r in rs),
            "read_cpu_s": statistics.median(r["read_cpu"] for r in rs),
            "collect_cpu_range": [min(r["collect_cpu"] for r in rs), max(r["collect_cpu"] for r in rs)],
            "read_cpu_range": [min(r["read_cpu"] for r in rs), max(r["read_cpu"] for r in rs)],
            "ratio": ratios[c]["all"],
        }
        for c, rs in runs.items()
    }
    doc = {
        "command": portable_command(),
        "date": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": m,
        "zarr": version_of("zarr"),
        "numcodecs": version_of("numcodecs"),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "spool_bytes": spool_bytes,
        "payload_bytes": raw,
        "blobs": len(kinds),
        "kinds": {
            k: sum(n for kk, n in kinds.values() if kk == k) for k in sorted({k for k, _ in kinds.values()})
        },
        "default": DEFAULT_BLOB_CODEC,
        "runs": runs,
        "ratios": ratios,
        "summary": summary,
        "codec_alone": alone,
    }
    Path(a.results).with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    kinds_line = ", ".join(f"{k} {n / 1e6:.1f} MB" for k, n in doc["kinds"].items())
    lines = [
        "# The collector's throughput by blob codec, on recorded payloads",
        "",
        f"- Produced by: `{doc['command']}` (in the repository root)",
        f"- Date: {doc['date']} (took {time.time() - started:.0f} s)",
        f"- Machine: {m['nproc']} CPUs ({m['cpus_usable']} usable), {m['cpu_model']}; {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, zarr {doc['zarr']}, numcodecs {doc['numcodecs']}, "
        f"fsdp-replay {m['fsdp_replay']}, commit {m['git_commit']}",
        f"- Load average before / after: {[round(x, 2) for x in load_before]} / "
        f"{[round(x, 2) for x in doc['load_after']]}",
        f"- Spool: 2 ranks, {spool_bytes / 1e6:.1f} MB; {len(kinds)} distinct payloads, {mb:.1f} MB raw: "
        f"{kinds_line}",
        f"- {a.reps} collections per codec, codecs in a rotated order, each in a fresh process; the figures are the "
        "medians (min-max for the CPU time)",
        "",
        "| codec | stored / raw | collect CPU s | collect MB/s per core | collect wall s | read CPU s | read MB/s per core |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c, s in summary.items():
        lo, hi = s["collect_cpu_range"]
        rlo, rhi = s["read_cpu_range"]
        lines.append(
            f"| {c}{' (default)' if c == DEFAULT_BLOB_CODEC else ''} | {s['ratio']:.3f} | "
            f"{s['collect_cpu_s']:.2f} ({lo:.2f}-{hi:.2f}) | {mb / s['collect_cpu_s']:.0f} | "
            f"{s['collect_wall_s']:.2f} | {s['read_cpu_s']:.2f} ({rlo:.2f}-{rhi:.2f}) | {mb / s['read_cpu_s']:.0f} |"
        )
    lines += ["", "Stored / raw by kind of payload:", ""]
    kinds_sorted = sorted(doc["kinds"])
    lines += ["| codec | " + " | ".join(kinds_sorted) + " |", "|---|" + "---:|" * len(kinds_sorted)]
    for c in summary:
        lines.append(f"| {c} | " + " | ".join(f"{ratios[c].get(k, 0):.3f}" for k in kinds_sorted) + " |")
    lines += [
        "",
        "The codecs alone, on the same payload bytes (one thread, 4 MiB chunks, medians of "
        f"{max(a.reps, 3)} passes):",
        "",
        "| codec | compressed / raw | encode MB/s per core | decode MB/s per core |",
        "|---|---:|---:|---:|",
    ]
    for c, r in alone.items():
        lines.append(
            f"| {c} | {r['ratio']:.3f} | {mb / r['encode_cpu_s']:.0f} | {mb / r['decode_cpu_s']:.0f} |"
        )
    lines.append("")
    Path(a.results).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
