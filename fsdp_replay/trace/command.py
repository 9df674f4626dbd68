"""What a rank's recorded command line runs, read as data: the interpreter, its options, and the
script (or module) it starts.

A trace is untrusted input, and its ``rank_start`` names the interpreter and command line the
replay starts. A replay therefore runs only a Python interpreter of the machine it runs on, with
interpreter options from a known list, on a script (``python script.py`` or ``python -m module``)
that the record identifies by sha256; code on the command line (``-c``), standard input or
options outside the list need the user's explicit ``replay --trust-trace``. Used by the replayer
(``replayer/launch.py``) and by the replay Job (``injector/job.py``): one reading, one rule.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

# python, python3, python3.12, python3.13t (free-threaded), pypy3 is not torch's
_PYTHON_NAME_RE: Final = re.compile(r"python(?:\d+(?:\.\d+)*t?)?")
# Interpreter options without a value that change nothing a replay must fear (the replayed
# program ran with them): unbuffered, no .pyc, optimize, isolated/safe path, quiet, ...
_PLAIN_FLAGS: Final = frozenset("bBdEIOPqRsSuvx")
# Options that take a value (``-X dev``, ``-W error``; also written ``-Xdev``, ``-Werror``).
_VALUE_OPTIONS: Final = frozenset({"-X", "-W"})
_LONG_VALUE_OPTIONS: Final = frozenset({"--check-hash-based-pycs"})
_MODULE_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
TRUST_FLAG: Final = "--trust-trace"


@dataclass(slots=True)
class RecordedCommand:
    """``python [options] (script | -m module) args`` as recorded, parsed without running it."""

    options: list[str] = field(default_factory=list)
    script: str | None = None  # the script argument as given (relative to the recorded cwd)
    module: str | None = None  # ``-m module``
    args: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what a replay does not run untrusted

    @property
    def argv(self) -> list[str]:
        """The command line without the interpreter."""
        target = ["-m", self.module] if self.module is not None else [self.script] if self.script else []
        return [*self.options, *target, *self.args]


def parse(argv: Sequence[str]) -> RecordedCommand:
    """The recorded ``orig_argv[1:]`` (what followed the interpreter), split into interpreter
    options, the script or module, and the program's arguments."""
    out = RecordedCommand()
    rest = [str(a) for a in argv]
    while rest and rest[0].startswith("-") and rest[0] != "-":
        opt = rest.pop(0)
        if opt == "-m":
            if not rest or not _MODULE_RE.fullmatch(rest[0]):
                out.problems.append(f"-m without a module name ({(rest or [''])[0][:60]!r})")
                return out
            out.module = rest.pop(0)
            out.args = rest
            return out
        if opt == "--":
            break
        if opt in _VALUE_OPTIONS or opt in _LONG_VALUE_OPTIONS:
            if not rest:
                out.problems.append(f"interpreter option {opt} without its value")
                return out
            out.options += [opt, rest.pop(0)]
            continue
        if opt.startswith(("--check-hash-based-pycs=",)) or (opt[:2] in _VALUE_OPTIONS and len(opt) > 2):
            out.options.append(opt)
            continue
        if opt.startswith("-c") or ("c" in opt[1:] and not opt.startswith("--")):
            out.problems.append("code given on the command line (-c)")
            return out
        if opt.startswith("--") or not set(opt[1:]) <= _PLAIN_FLAGS:
            out.problems.append(f"interpreter option {opt[:40]!r}")
            return out
        out.options.append(opt)
    if not rest or rest[0] == "-":
        out.problems.append("a program read from standard input")
        return out
    out.script = rest[0]
    out.args = rest[1:]
    return out


def recorded_argv(meta: Mapping[str, Any]) -> list[str]:
    """What followed the interpreter on the rank's recorded command line (the interpreter's own
    ``orig_argv`` when the agent had it: ``python -u``, ``-m pkg.mod``; else ``sys.argv``)."""
    orig = meta.get("orig_argv")
    if isinstance(orig, list) and orig:
        return [str(a) for a in orig[1:]]
    argv = meta.get("argv")
    return [str(a) for a in argv] if isinstance(argv, list) else []


def is_python(path: str) -> bool:
    """Whether ``path`` names a Python interpreter (by its name and, for a link such as a
    virtualenv's ``bin/python``, the name of what it points to)."""
    names = {os.path.basename(path)}
    try:
        names.add(os.path.basename(os.path.realpath(path)))
    except (OSError, ValueError):
        return False
    return all(_PYTHON_NAME_RE.fullmatch(n) for n in names)


def interpreter(recorded: object) -> str | None:
    """The recorded interpreter where it is an absolute path to a Python interpreter (the
    replay's machine may not have it; the replay then uses its own); ``None`` otherwise."""
    if not isinstance(recorded, str) or not os.path.isabs(recorded) or "\x00" in recorded:
        return None
    return recorded if is_python(recorded) else None


def refusal(problems: Sequence[str], where: str = "the trace's command line") -> str:
    """The message of a refused recorded command: what it holds, and the two ways on."""
    return (
        f"{where} holds {'; '.join(problems)}: a replay runs only a Python interpreter of this machine on "
        "a script whose sha256 the record holds, so nothing from a trace runs as code; give the command "
        f"after -- (e.g. -- python train.py ...), or pass {TRUST_FLAG} for a trace you made yourself"
    )
