"""Call the real libnccl's host API through ctypes with known, distinct arguments.

Run as a subprocess by the eBPF tests: ``python nccl_calls.py LIBNCCL [--wait-stdin] [--repeat N]``.
Without a GPU every call fails cleanly: collectives get a communicator that is a zeroed buffer
(NCCL's CommCheck rejects it: "corrupted comm object", ncclInvalidArgument), creation calls fail
at CUDA initialization, and Destroy/Abort get NULL. It prints one JSON object: its pid and tid,
the libnccl version, and per call the arguments passed and the value returned (or "absent" for a
function this version does not export).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import threading
import time

PTR, INT, SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class Config(ctypes.Structure):
    """The head of ncclConfig_t (up to commName); NCCL reads only what ``size`` says exists.

    A config this short would make a real init read defaults for the rest; here the call fails
    at CUDA initialization before reading it, and the probe only needs the head."""

    _fields_ = [
        ("size", SIZE),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", INT),
        ("cgaClusterSize", INT),
        ("minCTAs", INT),
        ("maxCTAs", INT),
        ("netName", ctypes.c_char_p),
        ("splitShare", INT),
        ("trafficClass", INT),
        ("commName", ctypes.c_char_p),
    ]


COMM_NAME = b"pg-7:fsdp_shard"
UID_BYTES = bytes((i * 37 + 11) % 256 for i in range(128))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--wait-stdin", action="store_true", help="print 'ready', wait for a line, then call")
    ap.add_argument(
        "--repeat", type=int, default=1, help="only call ncclAllReduce this many times (count = index), timed"
    )
    args = ap.parse_args()
    lib = ctypes.CDLL(args.lib)
    version = INT()
    assert lib.ncclGetVersion(ctypes.byref(version)) == 0
    comm_buf = ctypes.create_string_buffer(1 << 20)  # zeros: a "corrupted" communicator
    comm = ctypes.addressof(comm_buf)
    out_comm = ctypes.c_void_p(0)
    uid = UniqueId()
    ctypes.memmove(ctypes.addressof(uid), UID_BYTES, 128)
    config = Config()
    config.size, config.magic, config.version = ctypes.sizeof(Config), 0xCAFEBEEF, version.value
    config.commName = COMM_NAME
    if args.wait_stdin:
        print("ready", flush=True)
        sys.stdin.readline()

    calls: list[dict[str, object]] = []

    def call(
        name: str,
        argtypes: list[object],
        values: list[object],
        ret_ok: tuple[int, ...] | None,
        *,
        shown: list[int | None] | None = None,
        sentinel: int | None = None,
    ) -> None:
        """Call ``name``; ``shown``: the arguments as JSON (a by-value struct as None);
        ``sentinel``: preset the out-communicator to it and report what it holds afterwards."""
        if not hasattr(lib, name):  # not in this NCCL version (ncclAlltoAll before 2.28)
            calls.append({"name": name, "absent": True})
            return
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, INT
        if sentinel is not None:
            out_comm.value = sentinel
        ret = fn(*values)
        assert ret_ok is None or ret in ret_ok, f"{name} returned {ret}"
        entry: dict[str, object] = {"name": name, "args": values if shown is None else shown, "ret": ret}
        if sentinel is not None:
            entry["new_comm"] = out_comm.value or 0
        calls.append(entry)

    rate = 0.0
    if args.repeat > 1:
        fn = lib.ncclAllReduce
        fn.argtypes, fn.restype = [PTR, PTR, PTR, INT, INT, PTR, PTR], INT
        t0 = time.perf_counter()
        for i in range(args.repeat):
            fn(0x1000, 0x2000, i, 7, 0, comm, 0x7777)
        rate = args.repeat / (time.perf_counter() - t0)
    else:
        # Every value distinct, so a value in the wrong slot is noticed.
        call(
            "ncclAllReduce",
            [PTR, PTR, SIZE, INT, INT, PTR, PTR],
            [0x1110, 0x1120, 1001, 7, 2, comm, 0x11170],
            (4,),
        )
        call(
            "ncclReduceScatter",
            [PTR, PTR, SIZE, INT, INT, PTR, PTR],
            [0x2210, 0x2220, 2002, 9, 3, comm, 0x22270],
            (4,),
        )
        call("ncclAllGather", [PTR, PTR, SIZE, INT, PTR, PTR], [0x3310, 0x3320, 3003, 4, comm, 0x33360], (4,))
        call(
            "ncclBroadcast",
            [PTR, PTR, SIZE, INT, INT, PTR, PTR],
            [0x4410, 0x4420, 4004, 6, 5, comm, 0x44470],
            (4,),
        )
        call(
            "ncclReduce",
            [PTR, PTR, SIZE, INT, INT, INT, PTR, PTR],
            [0x5510, 0x5520, 5005, 8, 1, 6, comm, 0x55580],
            (4,),
        )
        call("ncclSend", [PTR, SIZE, INT, INT, PTR, PTR], [0x6610, 6006, 2, 11, comm, 0x66660], (4,))
        call("ncclRecv", [PTR, SIZE, INT, INT, PTR, PTR], [0x7710, 7007, 3, 12, comm, 0x77760], (4,))
        call("ncclAlltoAll", [PTR, PTR, SIZE, INT, PTR, PTR], [0x8810, 0x8820, 8008, 5, comm, 0x88860], (4,))
        call("ncclBcast", [PTR, SIZE, INT, INT, PTR, PTR], [0x9910, 9009, 1, 13, comm, 0x99960], (4,))
        call("ncclGroupStart", [], [], (0,))
        call("ncclGroupEnd", [], [], (0,))
        # No CUDA driver: the creation calls fail at CUDA initialization (ncclUnhandledCudaError),
        # after entry. The out-communicator is preset, so the probe's read of it at return can
        # be compared with what it holds then, whatever NCCL did with it.
        out = ctypes.addressof(out_comm)
        cfg = ctypes.addressof(config)
        call(
            "ncclCommInitRankConfig",
            [PTR, INT, UniqueId, INT, PTR],
            [out, 4, uid, 3, cfg],
            None,
            shown=[out, 4, None, 3, cfg],
            sentinel=0xC0FFEE00,
        )
        call("ncclCommInitRank", [PTR, INT, UniqueId, INT], [out, 6, uid, 5], None, shown=[out, 6, None, 5],
             sentinel=0xC0FFEF00)  # fmt: skip
        call("ncclCommInitAll", [PTR, INT, PTR], [out, 2, None], None, sentinel=0xC0FFF000)
        # A negative int (color) must come back sign-extended; NULL parent: fails cleanly. 2.32
        # acts on a non-NULL *newcomm when a split fails (crashes on a sentinel): preset NULL.
        call("ncclCommSplit", [PTR, INT, INT, PTR, PTR], [None, -5, 9, out, cfg], (1, 4), sentinel=0)
        call("ncclCommFinalize", [PTR], [None], (0, 4))
        call("ncclCommAbort", [PTR], [None], (0, 4))
        call("ncclCommDestroy", [PTR], [None], (0, 4))
    print(
        json.dumps(
            {
                "pid": __import__("os").getpid(),
                "tid": threading.get_native_id(),
                "version": version.value,
                "comm": comm,
                "comm_name": COMM_NAME.decode(),
                "uid_hex": UID_BYTES.hex(),
                "calls": calls,
                "repeat_rate": rate,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
