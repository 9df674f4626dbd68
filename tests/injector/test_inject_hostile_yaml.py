"""``fsdp-replay inject -f`` on hostile YAML: an alias bomb, a recursive alias, absurd nesting, an
oversized file and bytes that are not UTF-8 are refused at once with exit 3 and a message naming the
file and the bound; manifests that use anchors the usual way still work. Real processes, a time budget."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from injector_support import AGENT_IMAGE, REPO, SIDECAR_IMAGE

from fsdp_replay.injector import cli

FAST_S = 3.0  # interpreter start included; the unbounded bomb ran for minutes


def inject(*args: str, stdin: bytes | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_replay.injector.cli", "inject", *args],
        input=stdin,
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=30,
    )
    text = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode())
    return text, time.monotonic() - start


def billion_laughs(levels: int = 9) -> str:
    """The classic: each level a list of nine aliases of the one before (9**9 strings, in 350 bytes)."""
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in itertools.pairwise("abcdefghijklmnop"[:levels]):
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + "\n"


def refused(proc: subprocess.CompletedProcess[str], elapsed: float, *needles: str) -> None:
    assert proc.returncode == cli.EXIT_BAD_INPUT, proc.stderr
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr


def test_alias_bomb_file_is_refused_fast(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size < 1100
    proc, elapsed = inject("-f", str(path))
    refused(proc, elapsed, str(path), f"more than {cli.MAX_ALIASED_NODES} nodes")


def test_alias_bomb_on_stdin_and_spread_over_documents() -> None:
    proc, elapsed = inject("-f", "-", stdin=billion_laughs().encode())
    refused(proc, elapsed, "<stdin>", str(cli.MAX_ALIASED_NODES))
    # Each document well under the bound, the stream over it: the count runs over the stream.
    small = billion_laughs(levels=4)  # 8,289 nodes through aliases
    proc, elapsed = inject("-f", "-", stdin="---\n".join([small] * 20).encode())
    refused(proc, elapsed, str(cli.MAX_ALIASED_NODES))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("a: &a [1, *a]\n", "refers to a node that holds it"),
        ("a: &a {b: *a}\n", "refers to a node that holds it"),
        ("[" * 5000 + "]" * 5000 + "\n", f"nested deeper than {cli.MAX_YAML_DEPTH} levels"),
        ("a:\n" + "".join(f"{'  ' * i}- b:\n" for i in range(1, 400)), "nested deeper"),
    ],
    ids=["recursive-list", "recursive-map", "deep-flow", "deep-block"],
)
def test_recursion_and_depth_are_refused(text: str, needle: str) -> None:
    proc, elapsed = inject("-f", "-", stdin=text.encode())
    refused(proc, elapsed, needle)


def test_oversized_and_undecodable_input_are_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:
        f.truncate(cli.MAX_MANIFEST_BYTES + 1)  # sparse: zero bytes, never read past the bound
    proc, elapsed = inject("-f", str(big))
    refused(proc, elapsed, str(big), f"larger than {cli.MAX_MANIFEST_BYTES} bytes")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("metadata: {name: caf\u00e9}\n".encode("latin-1"))
    proc, elapsed = inject("-f", str(latin1))
    refused(proc, elapsed, str(latin1), "is not UTF-8")


def test_anchors_used_the_usual_way_still_work(tmp_path: Path) -> None:
    """A shared env list and a merge key: written out in full (no anchors in the output)."""
    manifest = """
apiVersion: v1
kind: Pod
metadata:
  name: anchored
  namespace: ml
  annotations: {fsdp-replay.io/record: "true"}
spec:
  restartPolicy: Never
  containers:
    - &trainer
      name: trainer
      image: registry.example/ml/train:1.0
      env: &env [{name: A, value: "1"}, {name: B, value: "2"}]
    - <<: *trainer
      name: evaluator
      env: *env
"""
    path = tmp_path / "anchored.yaml"
    path.write_text(manifest)
    proc, _ = inject("-f", str(path), "--agent-image", AGENT_IMAGE, "--sidecar-image", SIDECAR_IMAGE)
    assert proc.returncode == 0, proc.stderr
    assert "&" not in proc.stdout and "*" not in proc.stdout
    pod = yaml.safe_load(proc.stdout)
    trainer, evaluator = pod["spec"]["containers"][:2]
    assert evaluator["image"] == trainer["image"]
    for container in (trainer, evaluator):
        names = [e["name"] for e in container["env"]]
        assert names[:2] == ["A", "B"] and "FSDP_REPLAY_MODE" in names
