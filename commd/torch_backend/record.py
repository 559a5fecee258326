"""Record a job's ops as PARAM comms traces (``COMMD_RECORD=DIR``, ``commd launch --record DIR``).

Every op a rank submits through the ``commd`` backend becomes one entry of
``DIR/rank<R>.json`` (``commd.protocol.param_trace``): its op, sizes, splits, dtype,
group, root or peer, when the call started and how long it took; every ``wait()`` on
its work becomes a ``wait`` entry with the time it blocked; every optimizer step
advances the entries' ``step``.  So ``commd replay DIR`` can issue the same ops, in the
same groups, with the same overlap and the same compute gaps, through commd's lanes,
Gloo or MPI, without the model.

Recording costs one flag test per op when it is off.  The file is rewritten when a
group of the rank is destroyed and at exit, atomically.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from commd.kernels.reduce import DTYPE_NAMES
from commd.protocol.param_trace import DTYPES, CommEntry, rank_path, write_rank
from commd.runtime import ConfigError
from commd.torch_backend.reduce_ops import reduce_op

ENV = "COMMD_RECORD"

log = logging.getLogger("commd.record")

#: commd's dtype names (``kernels.reduce``) as PARAM's (``param_trace.DTYPES``, read the other way).
_PARAM_NAMES = {name: param for param, name in DTYPES.items()}


def _dtype(tensor: torch.Tensor) -> str:
    return _dtype_name(tensor.dtype)


def _dtype_name(dtype: torch.dtype) -> str:
    name = _PARAM_NAMES.get(DTYPE_NAMES.get(dtype, ""))
    if name is None:
        raise _Unrecordable(f"dtype {dtype}")
    return name


class _Unrecordable(Exception):
    """An op the trace format cannot describe (it is left out, and said once in the log)."""


def group_id(torch_name: str) -> int:
    """A group's ``pg_id``: torch's group name when it is a number (torch numbers groups in creation
    order, on every rank alike), else a stable hash of the name."""
    return int(torch_name) if torch_name.isdecimal() and len(torch_name) < 10 else zlib.crc32(torch_name.encode())


class Recorder:
    """One rank's trace being recorded."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.entries: list[CommEntry] = []
        self.groups: dict[int, tuple[int, ...]] = {}
        self.rank: int | None = None
        self.origin = time.perf_counter_ns()
        self.next_req = 0
        self.step = 0
        self.stepping: int | None = None  # id() of the optimizer whose steps count
        self.skipped: set[str] = set()
        self.lock = threading.Lock()

    # ---- ops -----------------------------------------------------------------
    def enter(self) -> tuple[int, int]:
        return len(self.entries), time.perf_counter_ns()

    def leave(self, name: str, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mark: tuple[int, int],
              work: Any) -> None:
        """The op ``name`` of ``group`` returned ``work``: its entries, unless ops it called were recorded
        (a coalesced op records the ops it is made of)."""
        before, started = mark
        if len(self.entries) != before:
            self._tag(work, before)
            return
        extract = _EXTRACT.get(name)
        if extract is None:
            return
        try:
            shapes = extract(group, *args, **kwargs)
        except Exception as exc:  # the op is already submitted: recording must never take its work away
            if name not in self.skipped:
                self.skipped.add(name)
                log.warning("%s: %s cannot be recorded as a PARAM trace entry (%s); left out", ENV, name, exc)
            return
        ranks = tuple(group.global_ranks)
        pg = group_id(group.group_name)
        ended = time.perf_counter_ns()
        with self.lock:
            if self.rank is None:
                self.rank = ranks[group.rank()]
            self.groups.setdefault(pg, ranks)
            for i, shape in enumerate(shapes):
                self.entries.append(CommEntry(
                    req=self.next_req, pg_id=pg, global_ranks=ranks, start_ns=started - self.origin,
                    duration_ns=(ended - started) if i == 0 else 0, step=self.step, **shape))
                self.next_req += 1
        self._tag(work, before)

    def _tag(self, work: Any, first: int) -> None:
        """The requests ``work`` completes: the entries recorded since ``first``."""
        reqs = [e.req for e in self.entries[first:] if e.req is not None and e.comms != "wait"]
        if reqs and work is not None:
            work.record_reqs = reqs

    def waited(self, reqs: list[int], started: int, ended: int) -> None:
        with self.lock:
            for i, req in enumerate(reqs):
                self.entries.append(CommEntry(comms="wait", req=req, start_ns=started - self.origin,
                                              duration_ns=(ended - started) if i == 0 else 0, step=self.step))

    def optimizer_stepped(self, optimizer: Any) -> None:
        """A step boundary: the first optimizer seen stepping (a model with several steps each alike)."""
        if self.stepping is None:
            self.stepping = id(optimizer)
        if id(optimizer) == self.stepping:
            self.step += 1

    # ---- the file -------------------------------------------------------------
    def save(self) -> Path | None:
        if self.rank is None:
            return None
        with self.lock:
            head = [CommEntry(comms="init", pg_id=pg, global_ranks=ranks) for pg, ranks in sorted(self.groups.items())]
            entries = head + list(self.entries)
        path = rank_path(self.directory, self.rank)
        try:
            write_rank(path, entries)
        except OSError as exc:
            log.error("%s: cannot write %s: %s", ENV, path, exc.strerror or exc)
            return None
        return path


def _from_environment() -> Recorder | None:
    raw = os.environ.get(ENV, "")
    if not raw:
        return None
    directory = Path(raw).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{ENV}={raw!r}: cannot create the trace directory: {exc.strerror or exc}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{ENV}={raw!r}: the trace directory is not writable")
    return Recorder(directory.absolute())


#: The recorder of this process (None: not recording; the one test an op pays).
active: Recorder | None = None
_started = False


def start_from_environment() -> None:
    """Called when the process's first commd group is made: $COMMD_RECORD checked (ConfigError naming it),
    the recorder started, the optimizer hook and the exit hook installed."""
    global active, _started
    if _started:
        return
    _started = True
    active = _from_environment()
    if active is None:
        return
    recorder = active
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda optimizer, _args, _kwargs: recorder.optimizer_stepped(optimizer))
    atexit.register(recorder.save)


def save() -> Path | None:
    """Write this rank's trace now (a group was destroyed); None when not recording."""
    return active.save() if active is not None else None


# ---- what each op records -------------------------------------------------------
def _reduce(opts: Any) -> str:
    return reduce_op(opts.reduceOp) if opts is not None else "sum"


def _global(group: Any, rank: int) -> int:
    return int(group.global_ranks[rank])


def _all_reduce(group: Any, tensors: list[torch.Tensor], opts: Any = None) -> list[dict[str, Any]]:
    if any(t.is_sparse for t in tensors):
        raise _Unrecordable("sparse tensors")
    return [dict(comms="all_reduce", in_msg_size=t.numel(), out_msg_size=t.numel(), dtype=_dtype(t),
                 reduce_op=_reduce(opts)) for t in tensors]


def _all_reduce_coalesced(group: Any, tensors: list[torch.Tensor], opts: Any = None) -> list[dict[str, Any]]:
    by_dtype: dict[torch.dtype, int] = {}
    for t in tensors:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel()
    return [dict(comms="all_reduce", in_msg_size=n, out_msg_size=n, dtype=_dtype_name(d),
                 reduce_op=_reduce(opts)) for d, n in by_dtype.items()]


def _reduce_op(group: Any, tensors: list[torch.Tensor], opts: Any) -> list[dict[str, Any]]:
    t = tensors[0]
    return [dict(comms="reduce", in_msg_size=t.numel(), out_msg_size=t.numel(), dtype=_dtype(t),
                 reduce_op=_reduce(opts), root=_global(group, opts.rootRank))]


def _reduce_scatter(group: Any, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                    opts: Any) -> list[dict[str, Any]]:
    out = outputs[0]
    return [dict(comms="reduce_scatter", in_msg_size=sum(p.numel() for p in inputs[0]), out_msg_size=out.numel(),
                 dtype=_dtype(out), reduce_op=_reduce(opts))]


def _reduce_scatter_tensor(group: Any, output: torch.Tensor, input: torch.Tensor, opts: Any) -> list[dict[str, Any]]:
    return [dict(comms="reduce_scatter_base", in_msg_size=input.numel(), out_msg_size=output.numel(),
                 dtype=_dtype(output), reduce_op=_reduce(opts))]


def _broadcast(group: Any, tensors: list[torch.Tensor], opts: Any) -> list[dict[str, Any]]:
    return [dict(comms="broadcast", in_msg_size=t.numel(), out_msg_size=t.numel(), dtype=_dtype(t),
                 root=_global(group, opts.rootRank)) for t in tensors]


def _all_gather(group: Any, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                opts: Any = None) -> list[dict[str, Any]]:
    inp = inputs[0]
    return [dict(comms="all_gather", in_msg_size=inp.numel(), out_msg_size=sum(o.numel() for o in outputs[0]),
                 dtype=_dtype(inp))]


def _all_gather_tensor(group: Any, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> list[dict[str, Any]]:
    return [dict(comms="all_gather_base", in_msg_size=input.numel(), out_msg_size=output.numel(),
                 dtype=_dtype(input))]


def _gather(group: Any, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> list[dict[str, Any]]:
    inp = inputs[0]
    return [dict(comms="gather", in_msg_size=inp.numel(), out_msg_size=inp.numel() * group.size(), dtype=_dtype(inp),
                 root=_global(group, opts.rootRank))]


def _scatter(group: Any, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> list[dict[str, Any]]:
    out = outputs[0]
    return [dict(comms="scatter", in_msg_size=out.numel() * group.size(), out_msg_size=out.numel(), dtype=_dtype(out),
                 root=_global(group, opts.rootRank))]


def _all_to_all(group: Any, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                opts: Any = None) -> list[dict[str, Any]]:
    ins, outs = [t.numel() for t in inputs], [t.numel() for t in outputs]
    return [dict(comms="all_to_allv", in_msg_size=sum(ins), out_msg_size=sum(outs), dtype=_dtype(inputs[0]),
                 in_split=tuple(ins), out_split=tuple(outs))]


def _all_to_all_single(group: Any, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                       input_split_sizes: list[int], opts: Any = None) -> list[dict[str, Any]]:
    n = group.size()

    def splits(tensor: torch.Tensor, rows: list[int]) -> tuple[int, ...]:
        if tensor.dim() == 0 or not rows:
            return tuple([tensor.numel() // n] * n)
        row = tensor.numel() // tensor.shape[0] if tensor.shape[0] else 0
        return tuple(r * row for r in rows)

    ins, outs = splits(input, list(input_split_sizes)), splits(output, list(output_split_sizes))
    even = not input_split_sizes and not output_split_sizes
    return [dict(comms="all_to_all" if even else "all_to_allv", in_msg_size=sum(ins), out_msg_size=sum(outs),
                 dtype=_dtype(input), in_split=ins, out_split=outs)]


def _send(group: Any, tensors: list[torch.Tensor], dst: int, tag: int) -> list[dict[str, Any]]:
    t = tensors[0]
    return [dict(comms="send", in_msg_size=t.numel(), out_msg_size=t.numel(), dtype=_dtype(t),
                 src_rank=_global(group, group.rank()), dst_rank=_global(group, dst))]


def _recv(group: Any, tensors: list[torch.Tensor], src: int, tag: int) -> list[dict[str, Any]]:
    if src < 0:
        raise _Unrecordable("a receive from any source names no peer")
    t = tensors[0]
    return [dict(comms="recv", in_msg_size=t.numel(), out_msg_size=t.numel(), dtype=_dtype(t),
                 src_rank=_global(group, src), dst_rank=_global(group, group.rank()))]


def _barrier(group: Any, opts: Any = None) -> list[dict[str, Any]]:
    return [dict(comms="barrier")]


#: The backend's op names (``profiling.profiled``) and their entries.
_EXTRACT: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "all_reduce": _all_reduce, "all_reduce_coalesced": _all_reduce_coalesced, "reduce": _reduce_op,
    "reduce_scatter": _reduce_scatter, "reduce_scatter_tensor": _reduce_scatter_tensor, "broadcast": _broadcast,
    "all_gather": _all_gather, "all_gather_into_tensor": _all_gather_tensor, "gather": _gather,
    "scatter": _scatter, "all_to_all": _all_to_all, "all_to_all_single": _all_to_all_single, "send": _send,
    "recv": _recv, "barrier": _barrier,
}
