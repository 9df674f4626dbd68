"""The recorded batches served to the replayed program's DataLoaders: no dataset, no workers.

A replay needs the batches the recorded rank consumed, not the data they came from: where the
trace holds a loader's batches (their bytes, for the steps the replay verifies), the program's
``iter(loader)`` gets a :class:`ServedIterator` instead of torch's own. It is a
``_BaseDataLoaderIter`` (its ``__init__`` draws the base seed as torch's does, and the sampler's
indices are drawn as a real iterator draws them: ``prefetch_factor * num_workers`` up front with
workers, then one per batch), so the sampler, the epoch ends and the process's RNG advance as they
did; but no worker starts and the dataset is never read. A batch is the recorded structure with
the recorded tensors (a copy each: the program may write into its batch). Where the recording saw
the fetch change the process's RNG (a dataset or collate function drawing random numbers in the
main process), the recorded state after the fetch is set (``rng`` of the batch row).

Before the restored snapshot (fast-forward, ``fastforward.py``) the batch's values do not
matter: the recorded bytes where the trace has them, zeros (the same shapes and dtypes)
otherwise; the model may compute on them (its first steps, or a step whose model meets inputs of
a new shape).

A loader whose batches the trace lacks for the verified steps (a payload window that leaves them
out) runs as recorded: torch's own iterator, its batches compared with the record
(``feed.recorded_batch``), which needs the data where the replay runs.
"""

from __future__ import annotations

import collections
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import dataloader

from fsdp_replay.agent import capture
from fsdp_replay.agent.tape import agent_work
from fsdp_replay.replayer.expected import ExpectedTensor, RankRecord, torch_dtype

DATA_MODES = ("auto", "recorded", "live")


class Unservable(Exception):
    """A recorded batch cannot be rebuilt (an object the recording kept only as its repr)."""


def _class(path: str | None) -> type | None:
    """``module:qualname`` -> the class (the replay runs the recorded program: it imports); a
    class it cannot name (one defined inside a function) is Unservable."""
    if not path:
        return None
    module, _, qual = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise Unservable(f"the batch's class {path} cannot be imported here ({e})") from None
    if not isinstance(obj, type):
        raise Unservable(f"{path} is not a class")
    return obj


def decode_structure(x: Any, leaves: list[torch.Tensor]) -> Any:
    """The inverse of ``agent.batches.encode_structure``: the batch with its tensors put back."""
    if "T" in x:
        return leaves[x["T"]]
    if "v" in x:
        return x["v"]
    if "n" in x:
        try:
            named_cls = _class(x.get("c"))
        except Unservable:  # a namedtuple class defined in a function: one of the same fields
            named_cls = None
        name, fields, items = x["n"]
        values = [decode_structure(v, leaves) for v in items]
        return (named_cls or collections.namedtuple(name, fields))(*values)
    cls = _class(x.get("c"))
    if "d" in x:
        items = [(decode_structure(k, leaves), decode_structure(v, leaves)) for k, v in x["d"]]
        return cls(items) if cls is not None else dict(items)
    if "l" in x:
        items_l = [decode_structure(v, leaves) for v in x["l"]]
        return cls(items_l) if cls is not None else items_l
    if "t" in x:
        items_t = tuple(decode_structure(v, leaves) for v in x["t"])
        return cls(items_t) if cls is not None else items_t
    raise Unservable(f"the recording kept a {x.get('o', 'value')!r} in the batch only as its text")


def _decodable(structure: Any) -> bool:
    try:
        decode_structure(structure, _AnyLeaves())
    except Exception:
        return False
    return True


class _AnyLeaves(list[Any]):
    def __getitem__(self, i: Any) -> Any:
        return None


class BatchServer:
    """Decides per DataLoader iterator whether its batches come from the trace, and builds them."""

    def __init__(
        self,
        rec: RankRecord,
        mode: str,
        verify_from: int,
        verify_to: int,
        content: Callable[[int, bool], str],  # recorded step, bytes missing -> "bytes" | "zeros"
        notes: list[str],
        record_ended: Callable[[str], None] | None = None,  # a truncated record: the replay stops
    ) -> None:
        self.rec = rec
        self.record_ended = record_ended
        self.mode = mode
        self.verify_from = verify_from
        self.verify_to = verify_to
        self.content = content
        self.notes = notes
        self.next_batch = 0  # the program's next batch, counted over all its iterators
        self.next_ordinal = 0  # the next iterator's number, as the recording numbered them
        self.served = 0
        self.live_loaders: list[int] = []
        self.by_loader: dict[int, list[int]] = collections.defaultdict(list)
        for n, b in enumerate(rec.batches):
            self.by_loader[int(b["loader"])].append(n)
        self._original: Callable[..., Any] | None = None

    def past_the_end(self, n: int, map_style: bool) -> None:
        """The program asks for batch ``n``, past the recorded ones: where the record was cut
        (a killed run) the replay ends there, with what it verified; an iterable dataset of a
        whole record ended where the recording's did; anything else is a replay defect."""
        if self.record_ended is not None:
            died = str((self.rec.attrs.get("end") or {}).get("exception") or "")
            hint = (
                "; the recorded rank died in a DataLoader worker loading it: --data live runs the "
                "program's own DataLoader, which may raise it again"
                if "DataLoader worker" in died
                else ""
            )
            self.record_ended(f"before batch {n} (the recording holds {len(self.rec.batches)}){hint}")
        if not map_style:
            raise StopIteration
        from fsdp_replay.errors import TraceIncompleteError

        raise TraceIncompleteError(
            f"the program asks for batch {n}; the recording holds {len(self.rec.batches)}"
        )

    def beyond_a_cut_record(self, ordinal: int) -> None:
        """A cut record (a killed or interrupted run) whose every batch the program has consumed,
        asked for an iterator it never drew from: the program is past where the recording stopped,
        and the replay ends there rather than run the program's own data pipeline."""
        if self.record_ended is None or self.next_batch < len(self.rec.batches):
            return
        if ordinal > max(self.by_loader, default=-1):
            self.record_ended(
                f"at DataLoader iterator #{ordinal}, after its last batch ({len(self.rec.batches)} recorded)"
            )

    # -- installation ----------------------------------------------------------------------
    def install(self) -> None:
        if self.mode == "live":
            return
        original = dataloader.DataLoader._get_iterator
        self._original = original
        server = self

        def _get_iterator(loader: Any) -> Any:
            ordinal = server.next_ordinal
            server.beyond_a_cut_record(ordinal)
            why = server.unservable(ordinal)
            if why is None:
                server.next_ordinal += 1
                return ServedIterator(loader, server, ordinal)
            if server.mode == "recorded":
                from fsdp_replay.errors import ReplayMismatchError

                raise ReplayMismatchError(f"--data recorded: DataLoader iterator #{ordinal}: {why}")
            server.next_ordinal += 1
            server.live_loaders.append(ordinal)
            server.notes.append(
                f"DataLoader iterator #{ordinal} runs the program's own data pipeline ({why}): the "
                "replay needs its data where it runs"
            )
            return original(loader)

        dataloader.DataLoader._get_iterator = _get_iterator  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._original is not None:
            dataloader.DataLoader._get_iterator = self._original  # type: ignore[method-assign]
            self._original = None

    # -- decisions -------------------------------------------------------------------------
    def unservable(self, ordinal: int) -> str | None:
        """Why iterator ``ordinal``'s batches cannot all be served from the trace (None: they can)."""
        rows = self.by_loader.get(ordinal)
        if not rows:
            return "the recording has no batch of it"
        for n in rows:
            b = self.rec.batches[n]
            if not _decodable(b["structure"]):
                return f"its batch {n} holds an object the recording kept only as text"
            step = int(b["step"])
            verified = step >= self.verify_from and (self.verify_to < 0 or step <= self.verify_to)
            if verified and any(t.payload < 0 for t in b["tensors"]):
                return f"the trace does not hold the bytes of its batch {n} (step {step})"
        return None

    # -- batches ---------------------------------------------------------------------------
    def batch(self, n: int) -> Any:
        b = self.rec.batches[n]
        how = self.content(int(b["step"]), any(t.payload < 0 for t in b["tensors"]))
        leaves = [self._tensor(t, how) for t in b["tensors"]]
        self.served += 1
        return decode_structure(b["structure"], leaves)

    def _tensor(self, t: ExpectedTensor, how: str) -> torch.Tensor:
        device = _device(t.device)
        if how == "bytes" or t.payload >= 0:
            return self.rec.tensor(t).to(device).clone()
        with torch._C._DisableTorchDispatch():  # below the fast-forward's dispatch mode: real zeros
            return torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device)

    def rng_after(self, n: int) -> None:
        """Set the process's RNG to what the recorded fetch of batch ``n`` left it at, if it changed it."""
        row = int(self.rec.batches[n].get("rng", -1))
        if row >= 0:
            capture.set_rng_state(capture.decode_rng(self.rec.blob(row)))


def _device(name: str) -> torch.device:
    if name.startswith("cuda") and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ServedIterator(dataloader._BaseDataLoaderIter):
    """Iterates a DataLoader as recorded (module docstring): indices drawn, batches from the trace."""

    def __init__(self, loader: Any, server: BatchServer, ordinal: int) -> None:
        super().__init__(loader)  # the base seed and the sampler: as torch's own iterators draw them
        self._server = server
        self._ordinal = ordinal
        self._map_style = self._dataset_kind == dataloader._DatasetKind.Map
        self._ahead = (loader.prefetch_factor or 2) * self._num_workers if self._num_workers else 0
        self._rows = list(server.by_loader.get(ordinal, []))
        self._pos = 0
        self._prefetch()

    def _prefetch(self) -> None:
        # torch's multi-process iterator sends prefetch_factor * num_workers indices to its
        # workers when it starts (and refills one per batch): the sampler draws then.
        self._pending: collections.deque[Any] = collections.deque()
        self._exhausted = False
        for _ in range(self._ahead):
            self._draw()

    def _draw(self) -> None:
        if self._exhausted:
            return
        try:
            self._pending.append(self._next_index())
        except StopIteration:
            self._exhausted = True

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._rows = list(self._server.by_loader.get(self._ordinal, []))
        self._pos = 0
        self._prefetch()

    def __next__(self) -> Any:
        # as the recorder's DataLoader hook runs the fetch: the data pipeline's ops are not the
        # program's (neither taped nor op-checked)
        with agent_work():
            return self._next()

    def _next(self) -> Any:
        server = self._server
        n = server.next_batch
        if self._map_style:
            if not self._pending:
                self._draw()
            if not self._pending:
                raise StopIteration
            self._pending.popleft()
            if self._ahead:
                self._draw()
        if n >= len(server.rec.batches):
            server.past_the_end(n, self._map_style)
        if not self._map_style and int(server.rec.batches[n]["loader"]) != self._ordinal:
            raise StopIteration  # an iterable dataset: it ended where the recording's did
        server.next_batch += 1
        self._num_yielded += 1
        batch = server.batch(n)
        server.rng_after(n)
        return batch

    def __del__(self) -> None:  # nothing to shut down: no worker ever started
        pass
