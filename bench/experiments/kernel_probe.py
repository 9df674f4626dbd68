"""Probe for the C++ kernel plan (docs/architecture.md): build kernel_probe.cpp into
bench/experiments/kernel_probe.so (see README.md), then run this from the repository root."""

import ctypes
import os
import warnings

import torch
import torch.distributed as dist

LIB = "bench/experiments/kernel_probe.so"

warnings.simplefilter("ignore")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29559")
dist.init_process_group("gloo", rank=0, world_size=1)

# A Python kernel at Autograd, as the agent registers its own.
py: list[int] = []
lib = torch.library.Library("c10d", "IMPL")
op = torch.ops.c10d._allgather_base_.default


def kernel(*args: object) -> object:
    py.append(1)
    with torch._C._AutoDispatchBelowAutograd():
        return op._handle.redispatch_boxed(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)


lib.impl("_allgather_base_", kernel, "Autograd")
torch.ops.load_library(LIB)  # registers fsdpr_probe::pg_of
c = ctypes.CDLL(LIB)
c.probe_install.restype = ctypes.c_void_p
c.probe_last.restype = ctypes.c_int64
c.probe_uninstall.argtypes = [ctypes.c_void_p]


def all_gather() -> None:
    out, inp = torch.zeros(8), torch.arange(8.0)
    dist.all_gather_into_tensor(out, inp, async_op=True).wait()
    assert torch.equal(out, inp)


all_gather()
print("before install: cxx", c.probe_calls(), "py", len(py))
handle = c.probe_install()
all_gather()
print("installed: cxx", c.probe_calls(), "py", len(py))
so = torch.ops.fsdpr_probe.pg_of(c.probe_last())
pg = dist.ProcessGroup.unbox(so)
print(
    "pg_of:",
    type(so).__name__,
    type(pg).__name__,
    pg is dist.group.WORLD,
    pg == dist.group.WORLD,
    pg.size(),
    pg.rank(),
    dist.get_backend(pg),
)
c.probe_uninstall(handle)
all_gather()
print("uninstalled: cxx", c.probe_calls(), "py", len(py))
handle = c.probe_install()
all_gather()
print("reinstalled: cxx", c.probe_calls(), "py", len(py))
c.probe_uninstall(handle)
