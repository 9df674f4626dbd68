"""Build and run the replay of one rank: the command, its environment, and the checks before it.

The recorded command is the rank's own ``python script args`` (argv, cwd and the recorded
environment from the trace, less the machine's own variables), run as a single process with the agent in replay mode.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError, ReplayMismatchError, TraceFormatError
from fsdp_replay.trace import command, redact, schema
from fsdp_replay.trace.command import recorded_argv
from fsdp_replay.trace.numerics import KEY_ENV, NCCL_ENV
from fsdp_replay.trace.reader import Trace

# Recorded variables that must not be carried into the replay: the old launch's rendezvous, files
# it wrote to, the device choice (--device decides), and the agent's own.
_DROP_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",  # torchrun's per-run error file: a replay never writes the job's files
    "TORCHELASTIC_USE_AGENT_STORE",  # there is no torchrun agent store to connect to
    "CUDA_VISIBLE_DEVICES",
    "FSDP_REPLAY_",
    "PYTHONPATH",
)
# The launcher's variables (torchrun/elastic, SLURM, Open MPI, PMI): carried as recorded, so a
# framework that reads them (Lightning, accelerate, HF) computes the rank, world and local rank
# it computed in the recording. Set by the replay when the recording lacks them (a plain
# `python script.py` that calls init_process_group with explicit ranks).
_NUMERICS_ENV = frozenset({*KEY_ENV, *NCCL_ENV, "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONHASHSEED"})
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


PathMap = list[tuple[str, str]]


def path_map(meta: dict[str, Any], cwd: str | None, pairs: str | None) -> PathMap:
    """Where the recorded run's paths are here: ``--map OLD=NEW,...`` as given, and the recorded
    working directory, which stands at ``--cwd`` (default: where it was, if it exists here, else
    the current directory). Longest OLD first."""
    if cwd and not os.path.isdir(cwd):
        raise ConfigError(f"--cwd {cwd}: no such folder here (it stands for the recorded working directory)")
    out: PathMap = []
    for item in (pairs or "").split(","):
        if not item.strip():
            continue
        old, sep, new = item.partition("=")
        if not sep or not os.path.isabs(old) or not new:
            raise ConfigError(f"--map {item!r}: give OLD=NEW with OLD an absolute path the recording used")
        out.append((os.path.normpath(old), os.path.abspath(new)))
    recorded = meta.get("cwd")
    if recorded:
        here = os.path.abspath(cwd) if cwd else (recorded if os.path.isdir(recorded) else os.getcwd())
        if os.path.normpath(here) != os.path.normpath(recorded):
            out.append((os.path.normpath(recorded), os.path.normpath(here)))
    return sorted(out, key=lambda p: len(p[0]), reverse=True)


def mapped(path: str, pairs: PathMap) -> str:
    """``path`` as it is here (unchanged outside the mapped folders)."""
    for old, new in pairs:
        if path == old or path.startswith(old + os.sep):
            return new + path[len(old) :]
    return path


def _mapped_arg(arg: str, pairs: PathMap) -> str:
    """An argument of the recorded command line, with a path of a mapped folder mapped
    (``/old/x`` and ``--flag=/old/x``)."""
    if os.path.isabs(arg):
        return mapped(arg, pairs)
    key, sep, value = arg.partition("=")
    if sep and key.startswith("-") and os.path.isabs(value):
        return f"{key}={mapped(value, pairs)}"
    return arg


def replay_command(
    meta: dict[str, Any],
    override: list[str],
    pairs: PathMap | None = None,
    *,
    trusted: bool = False,
    notes: list[str] | None = None,
) -> tuple[list[str], str]:
    """The command that replays the rank, and its working directory. A command given after ``--``
    is the user's. The recorded one is data from the trace: it runs only as a Python interpreter
    of this machine on a script (or ``-m`` module) with interpreter options from a known list
    (``trace/command.py``); anything else needs ``trusted`` (``--trust-trace``)."""
    pairs = pairs or []
    if override:
        return override, os.getcwd()
    # The interpreter's own command line: `python -m pkg.mod`, `-u`, and a wrapper that rewrote
    # sys.argv before running the script are replayed as they were started.
    argv = recorded_argv(meta)
    if not argv:
        raise TraceFormatError("the trace does not record this rank's command line; give one after --")
    if schema.has_redacted(" ".join(argv)):
        raise ReplayMismatchError(
            "the recorded command line had credentials, which the trace does not keep; "
            "give the command after -- (e.g. -- python train.py --token ...)"
        )
    parsed = command.parse(argv)
    exe = meta.get("executable")
    if trusted:
        exe = exe if isinstance(exe, str) and os.path.exists(exe) else sys.executable
    else:
        if parsed.problems:
            raise ReplayMismatchError(command.refusal(parsed.problems))
        python = command.interpreter(exe)
        if python is None and notes is not None:
            notes.append(
                f"the trace names {str(exe)[:80]!r} as the interpreter, which is not a Python interpreter: "
                f"the replay runs {sys.executable}"
            )
        exe = python if python is not None and os.path.isfile(python) else sys.executable
        argv = parsed.argv
    cwd = mapped(meta.get("cwd") or os.getcwd(), pairs)
    if not os.path.isdir(cwd):
        cwd = os.getcwd()
    return [exe, *(_mapped_arg(a, pairs) for a in argv)], cwd


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_script(
    meta: dict[str, Any],
    command_line: list[str],
    cwd: str,
    pairs: PathMap | None = None,
    modules: list[dict[str, Any]] | None = None,
    *,
    force: bool = False,
    trusted: bool = False,
) -> None:
    """Refuse when the script on disk is not the one recorded (by sha256), or a local module the
    recorded program imported (from its folder) differs or is missing. A recorded command whose
    script the record does not identify runs only ``trusted``; ``force`` runs a changed script."""
    pairs = pairs or []
    moved = " (give the recorded folders' place here with --cwd or --map OLD=NEW)"
    recorded_script = meta.get("script")
    script: dict[str, Any] = recorded_script if isinstance(recorded_script, dict) else {}
    recorded = script.get("sha256")
    if not isinstance(recorded, str) or not recorded:
        if not trusted:
            raise ReplayMismatchError(
                command.refusal(["a script the record does not identify (no sha256)"], "the trace")
            )
        return
    recorded_path = mapped(str(script["path"]), pairs) if script.get("path") else None
    parsed = command.parse(command_line[1:])
    path: Path | None = None
    if recorded_path and Path(recorded_path).is_file():
        path = Path(recorded_path)
    elif parsed.script:
        path = Path(cwd, parsed.script)
    if path is None:
        raise ReplayMismatchError(f"the recorded script {script.get('path')} is not here{moved}")
    if not path.is_file():
        raise ReplayMismatchError(f"the recorded script {script.get('path')} is not at {path}{moved}")
    if parsed.module is not None and not trusted and not _module_file(parsed.module, path):
        raise ReplayMismatchError(
            f"the trace's command line runs module {parsed.module}, which is not its recorded script "
            f"{script.get('path')}: "
            + command.refusal(["a module the record does not identify"], "the trace")
        )
    checks = [(path, recorded)]
    if parsed.script and Path(cwd, parsed.script).resolve() != path.resolve():
        # a wrapper started first (it rewrote sys.argv and ran the script): the record names it too
        named = script.get("started")
        started: dict[str, Any] = named if isinstance(named, dict) else {}
        first = Path(cwd, parsed.script)
        if (
            started.get("sha256")
            and Path(mapped(str(started.get("path")), pairs)).resolve() == first.resolve()
        ):
            checks.append((first, str(started["sha256"])))
        elif not trusted:
            raise ReplayMismatchError(
                f"the trace's command line starts {parsed.script}, which the record does not identify (its "
                f"script is {script.get('path')}): "
                + command.refusal(["a file the record does not identify"], "the trace")
            )
    if not trusted:
        for file, _ in checks:
            if _installed(file):
                raise ReplayMismatchError(
                    f"the trace's command line runs {file}, a module installed with this interpreter, not a "
                    "program of the recording's own: " + command.refusal(["an installed module"], "the trace")
                )
    if force:
        return
    for file, sha in checks:
        if not file.is_file():
            raise ReplayMismatchError(f"the recorded program's file {file} is not here{moved}")
        digest = _sha256(file)
        if digest != sha:
            raise ReplayMismatchError(
                f"{file} is not the script that was recorded (sha256 {digest[:12]}… != recorded "
                f"{sha[:12]}…): a replay of other code cannot be verified; pass --force to replay "
                "anyway"
            )
    for mod in modules or []:
        here = Path(mapped(str(mod["path"]), pairs))
        if not mod.get("sha256"):
            continue
        if not here.is_file():
            raise ReplayMismatchError(
                f"the program imported its module {mod['name']} from {mod['path']}, which is not at {here}{moved}"
            )
        if _sha256(here) != mod["sha256"]:
            raise ReplayMismatchError(
                f"{here} (module {mod['name']}) is not the one the recorded program imported (sha256 differs): "
                "a replay of other code cannot be verified; pass --force to replay anyway"
            )


def _module_file(module: str, path: Path) -> bool:
    """Whether ``python -m module`` runs the file at ``path`` (``pkg/mod.py``, ``pkg/mod/__main__.py``)."""
    parts = module.split(".")
    tail = Path(*parts)
    return path.parts[-len(parts) :] == (*tail.parts[:-1], f"{parts[-1]}.py") or path.parts[
        -len(parts) - 1 :
    ] == (*tail.parts, "__main__.py")


def _installed(file: Path) -> bool:
    """Whether ``file`` belongs to the interpreter's own library or its installed packages: a
    command that runs one (``python -m pip install ...``) is not a training program's own."""
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    here = os.path.realpath(file)
    return any(os.path.commonpath([here, os.path.realpath(r)]) == os.path.realpath(r) for r in roots if r)


def check_torch(meta: dict[str, Any]) -> None:
    recorded = (meta.get("versions") or {}).get("torch")
    try:
        here = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return
    if recorded and recorded.split("+")[0] != here.split("+")[0]:
        raise ReplayMismatchError(
            f"the trace was recorded with torch {recorded}; this machine has torch {here}: kernels differ between "
            "versions, so bits would too; pass --force to replay anyway"
        )


def replay_env(
    meta: dict[str, Any],
    rank: int,
    world: int,
    device: str | None,
    notes: list[str] | None = None,
    pairs: PathMap | None = None,
    *,
    trusted: bool = False,
    redact_key: str = "",
) -> dict[str, str]:
    """The replayed rank's environment: the recorded one (a path of a mapped folder mapped),
    except where the caller's own environment sets a variable to another value: an explicit
    choice wins, and ``notes`` says so. Variables that load code (``schema.ENV_LOADS_CODE``)
    come from the trace only when ``trusted``. A redacted variable is the caller's own, if set;
    with the run's key (``redact_key``) the notes say whether it is the recorded value. A note
    never shows the value of a variable that has a secret name or a secret-looking value."""
    pairs = pairs or []
    refused: list[str] = []
    env = dict(os.environ)
    for k in list(env):  # this shell's own launch (a replay started inside a job) is not the recorded one
        if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_"):
            del env[k]
    recorded = meta.get("env") or {}
    mine_wins: list[tuple[str, str, str]] = []
    keyed: dict[bool, list[str]] = {True: [], False: []}
    for k, v in recorded.items():
        if schema.has_redacted(v) and not k.startswith(_DROP_ENV) and k in os.environ:
            same = redact.same_value(k, os.environ[k], v, redact_key)
            if same is not None:
                keyed[same].append(k)
        if schema.has_redacted(v) or k.startswith(_DROP_ENV):
            continue
        if k in schema.ENV_MACHINE or k.startswith(schema.ENV_MACHINE_PREFIXES):
            continue  # the machine's and the shell's own: the replay's, wherever it runs
        if not trusted and (k in schema.ENV_LOADS_CODE or k.startswith(schema.ENV_LOADS_CODE_PREFIXES)):
            if os.environ.get(k) != v:
                refused.append(k)
            continue
        v = mapped(v, pairs) if os.path.isabs(v) else v
        mine = os.environ.get(k)
        if mine is not None and mine != v and k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_"):
            mine_wins.append((k, mine, v))
            continue
        env[k] = v
    if refused and notes is not None:
        notes.append(
            f"{', '.join(sorted(refused)[:12])}: the trace sets {'these variables' if len(refused) > 1 else 'this variable'}, "
            "which make a process load code; a replay does not take them from a trace (--trust-trace does)"
        )
    # the ones that change numerics first (a thread count, the replay key's variables)
    mine_wins.sort(key=lambda x: (x[0] not in _NUMERICS_ENV, x[0]))
    if notes is not None:
        notes += [_differs(k, m, v) for k, m, v in mine_wins[:8]]
        if keyed[True]:
            notes.append(
                f"{', '.join(sorted(keyed[True]))} from your environment: the recorded value (the recording "
                "redacted it; its keyed hash matches)"
            )
        if keyed[False]:
            notes.append(
                f"{', '.join(sorted(keyed[False]))} from your environment is used and differs from the recorded "
                "run's (the recording redacted it; its keyed hash does not match)"
            )
        if len(mine_wins) > 8:
            rest = [k for k, _, _ in mine_wins[8:]]
            notes.append(
                f"{len(rest)} more variables from your environment differ from the recording's and were used: "
                + ", ".join(rest[:40])
                + (" ..." if len(rest) > 40 else "")
            )
    env["RANK"], env["WORLD_SIZE"] = str(rank), str(world)
    env.setdefault("LOCAL_RANK", str(meta.get("local_rank", 0) or 0))
    env.setdefault("LOCAL_WORLD_SIZE", "1")
    # The fake process group needs no rendezvous; these only keep env:// parsing happy.
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"})
    if device and device.startswith("cuda") and env.get("LOCAL_RANK", "0") != "0":
        # One visible GPU: a program that picks cuda:LOCAL_RANK must find it at index 0.
        if notes is not None:
            notes.append(
                f"LOCAL_RANK=0 (recorded {env['LOCAL_RANK']}): --device {device} is the only GPU the replay sees"
            )
        env["LOCAL_RANK"] = "0"
    elif (
        not device
        and env["LOCAL_RANK"] != "0"
        and (meta.get("versions") or {}).get("cuda")
        and notes is not None
    ):
        notes.append(
            f"LOCAL_RANK={env['LOCAL_RANK']} as recorded; on a machine with fewer GPUs pass --device cuda:0"
        )
    threads = (meta.get("threads") or {}).get("intra_op")
    if threads and "OMP_NUM_THREADS" not in (meta.get("env") or {}):
        mine = os.environ.get("OMP_NUM_THREADS")
        if mine is None:
            env["OMP_NUM_THREADS"] = str(threads)
        elif mine != str(threads) and notes is not None:
            notes.append(
                f"OMP_NUM_THREADS={mine} from your environment is used; the recorded run used {threads} intra-op threads"
            )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device and device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = visible_device(device.partition(":")[2] or "0")
    return env


def _differs(k: str, mine: str, recorded: str) -> str:
    """The note for variable ``k`` whose value here is not the recorded one: both values, unless
    the name or either value is secret-looking (then only that it differs)."""
    secret = redact.secret_name(k) or any(redact.redact_value(v) != v for v in (mine, recorded))
    if secret:
        return f"{k} from your environment is used; it differs from the recorded run's"
    return redact.scrub_text(f"{k}={mine} from your environment is used; the recorded run had {k}={recorded}")


def visible_device(index: str) -> str:
    """``--device cuda:N``'s GPU as ``CUDA_VISIBLE_DEVICES`` names it: N counts the GPUs this
    shell sees (``torch.cuda`` numbering), so under ``CUDA_VISIBLE_DEVICES=2,3`` cuda:1 is "3"."""
    mine = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if mine and index.isdigit() and int(index) < len(mine):
        return mine[int(index)]
    return index


def report_dir(trace_url: str, who: str, from_step: int) -> Path:
    base = Path(trace_url).parent if "://" not in trace_url else Path.cwd()
    return base / "replays" / f"{who.replace(' ', '-')}-from-{from_step}-{time.strftime('%Y%m%d-%H%M%S')}"


# Interpreter options that take a value (``python -X dev -W error script.py``).
_INTERPRETER_VALUE_OPTIONS = frozenset({"-X", "-W", "--check-hash-based-pycs"})


def all_ranks_command(command: list[str], world: int) -> list[str]:
    """The recorded ``python [options] script args`` (or ``-m module``) as a torchrun of ``world``
    local processes; the interpreter's own options (``-u``, ``-X dev``) stay the interpreter's."""
    exe, *rest = command
    options: list[str] = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        opt = rest.pop(0)
        options.append(opt)
        if opt in _INTERPRETER_VALUE_OPTIONS and rest:
            options.append(rest.pop(0))
    run = [exe, *options, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    if rest and rest[0] == "-m":
        return [*run, "-m", *rest[1:]]
    return [*run, *rest]


def rank_meta(trace: Trace, rank: int) -> dict[str, Any]:
    """The start record of ``rank`` (what the replay launches from)."""
    meta = trace.rank(rank).meta
    if not meta:
        raise TraceFormatError(f"rank {rank} has no start record", path=trace.url)
    return meta
