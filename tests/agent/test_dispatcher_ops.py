"""The collective ops the agent takes at the dispatcher (``fsdp_replay/trace/ops.py``), against the
ones the installed torch registers: CI checks torch 2.13, ``scripts/compat-torch.sh`` the other
claimed versions. A torch that adds a collective op, renames one, or renames an argument the
agent reads tensors from fails here instead of recording without it.

``python tests/agent/test_dispatcher_ops.py`` prints the comparison as a Markdown table (the
compat script puts it in its results file).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_replay.agent.collectives import CollectiveCall, CollectiveInterceptor, tensor_roles
from fsdp_replay.trace import ops

# The namespaces whose ops talk to a process group: the c10d ops take one as an argument, the
# functional and DTensor ones its name.
NAMESPACES = ("c10d", ops.FUNCTIONAL_NAMESPACE, "_dtensor")
# Tensor arguments that carry no data: a barrier's tensor only says which device to use.
NO_DATA_ARGS = {("barrier", "tensor"), ("monitored_barrier_", "tensor")}


def _label(namespace: str, name: str) -> str:
    return name if namespace == "c10d" else f"{namespace}.{name}"


def registered() -> dict[str, Any]:
    """Every collective op this torch registers: trace name -> its default overload."""
    found = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, rest = qualified.partition("::")
        if namespace not in NAMESPACES:
            continue
        overload = getattr(getattr(getattr(torch.ops, namespace), rest.split(".")[0]), "default", None)
        if overload is None:
            continue
        args = overload._schema.arguments
        if namespace == "c10d":
            collective = any("ProcessGroup" in str(a.type) for a in args)
        else:
            collective = any(a.name == "group_name" for a in args)
        if collective:
            found[_label(namespace, rest.split(".")[0])] = overload
    return found


def unread_tensor_args(name: str, overload: Any, functional: bool) -> list[str]:
    """Tensor arguments of the op's schema that the agent's kernel would not read."""
    schema = overload._schema
    read = {
        a for a, _ in tensor_roles(name.rsplit(".", 1)[-1], [a.name for a in schema.arguments], functional)
    }
    out = []
    for a in schema.arguments:
        if not str(a.type).startswith("Tensor") or a.name in read or (name, a.name) in NO_DATA_ARGS:
            continue
        if functional and a.name == "out":  # the result, which the kernel takes as the outputs
            continue
        out.append(a.name)
    return out


class _Counting:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def active(self) -> bool:
        return True

    def run(self, call: CollectiveCall, real: Any) -> Any:
        self.seen.append(call.op)
        return real()


def taken_by_the_agent() -> list[str]:
    interceptor = CollectiveInterceptor(_Counting(), lambda what, e: None)
    interceptor.install()
    try:
        return list(interceptor.ops)
    finally:
        interceptor.uninstall()


def test_every_collective_op_of_this_torch_is_taken_or_said_why_not() -> None:
    unknown = sorted(set(registered()) - set(ops.BY_NAME) - set(ops.NOT_TAKEN))
    assert not unknown, (
        f"torch {torch.__version__} registers collective ops trace/ops.py does not know: {unknown}"
    )


def test_the_agent_takes_every_listed_op_this_torch_has() -> None:
    have = registered()
    expected = {op.name for op in ops.OPS if op.name in have}
    assert expected, "no listed op is registered: the namespaces or the registry lookup changed"
    assert expected <= set(taken_by_the_agent())


def test_the_agent_reads_every_tensor_argument_of_the_ops_it_takes() -> None:
    have = registered()
    unread = {
        op.name: args
        for op in ops.OPS
        if op.name in have and (args := unread_tensor_args(op.name, have[op.name], op.functional))
    }
    assert not unread, (
        f"torch {torch.__version__}: tensor arguments the agent's kernels would not record: {unread}"
    )


def test_an_op_said_to_reach_a_taken_op_does() -> None:
    """DTensor's shard-dim all-to-all goes through the process group's alltoall_base, which the
    agent takes with its input and output (one gloo rank is enough to see the path; the
    point-to-point ones need two)."""
    if not hasattr(torch.ops, "_dtensor") or not hasattr(torch.ops._dtensor, "shard_dim_alltoall"):
        return
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    calls: list[CollectiveCall] = []

    class Keeping(_Counting):
        def run(self, call: CollectiveCall, real: Any) -> Any:
            calls.append(call)
            return super().run(call, real)

    interceptor = CollectiveInterceptor(Keeping(), lambda what, e: None)
    interceptor.install()
    try:
        t = torch.arange(8.0).reshape(2, 4)
        name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        out = torch.ops._c10d_functional.wait_tensor(torch.ops._dtensor.shard_dim_alltoall(t, 0, 1, name))
        assert torch.equal(out, t)
    finally:
        interceptor.uninstall()
        dist.destroy_process_group()
    assert [c.op for c in calls] == ["alltoall_base_"]
    assert len(calls[0].inputs) == 1 and len(calls[0].outputs) == 1
    assert torch.equal(calls[0].outputs[0].reshape(t.shape), t)


def markdown() -> str:
    have = registered()
    taken = set(taken_by_the_agent())
    lines = [
        f"## Collective dispatcher ops: torch {torch.__version__} against fsdp_replay/trace/ops.py",
        "",
        f"{len(have)} collective ops registered ({', '.join(NAMESPACES)} namespaces); "
        f"{len(taken)} taken by the agent's kernels.",
        "",
        "| op | registered | in ops.py | taken | tensor arguments not read | its group_name argument |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(set(have) | set(ops.BY_NAME) | set(ops.NOT_TAKEN)):
        info = ops.BY_NAME.get(name)
        listed = (
            "yes" if info else (f"not taken: {ops.NOT_TAKEN[name]}" if name in ops.NOT_TAKEN else "**no**")
        )
        unread = (
            ", ".join(unread_tensor_args(name, have[name], info.functional)) if info and name in have else ""
        )
        group = ""
        if name in have:
            group = ", ".join(
                f"{a.name}: {a.type}" for a in have[name]._schema.arguments if a.name == "group_name"
            )
        lines.append(
            f"| `{name}` | {'yes' if name in have else 'no'} | {listed} | "
            f"{'yes' if name in taken else 'no'} | {unread} | {group} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())
