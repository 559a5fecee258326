"""The torch.distributed backend "commd": a ProcessGroup that submits to the node daemon.

``import commd`` (or torch's backend autoloading through the ``torch.backends``
entry point) registers it, after which ``dist.init_process_group("commd")``
works with any init method.  The first group created in a process
bootstraps: ranks agree on a job name through the group's store, the first
local process starts the node daemon, and every process connects its client,
reading the job secret from the daemon's private job directory (the secret
never goes into the store, which others may be able to read).  Later groups (``new_group``) reuse that client.

List-shaped torch ops (``all_gather`` into a list, ``scatter`` from a list...)
are flattened into one contiguous buffer on submission and split back on
completion, so the daemon only ever sees flat buffers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.futures import Future

from commd.client import ops
from commd.client.connection import Client
from commd.client.errors import CommdError, ConnectError
from commd.client.handle import Handle
from commd.client.spawn import ensure_daemon
from commd.memory.budget import check_environment
from commd.runtime import ConfigError, JobPaths, secret_from_environment
from commd.torch_backend import BACKEND_NAME, record
from commd.torch_backend.monitored import monitored_barrier_on
from commd.torch_backend.profiling import profiled
from commd.torch_backend.reduce_ops import reduce_op, reduce_op_name
from commd.torch_backend.ring_ops import open_ring, ring_all_reduce
from commd.torch_backend.sparse import all_reduce_sparse, is_sparse_call
from commd.torch_backend.store import read_from_ranks

_STORE_PREFIX = "commd/"
#: How long rank 0 keeps the store up for the other ranks to read a failed secret check.
_VERDICT_READ_S = 10.0
#: How long an auto-started multi-node daemon may wait for the other nodes' daemons.
_RENDEZVOUS_S = 300.0

_client: Client | None = None
_client_lock = threading.Lock()
#: The store the job's first commd group was made with: every rank of the job shares it, a
#: replacement process too (``job_store``).
_job_store: dist.Store | None = None
#: The commd name of the next group made (``named_group``); None: derived from torch's name.
_next_group_name: str | None = None
_group_generations: dict[str, int] = {}


def current_client() -> Client:
    """The process's connected client (after ``init_process_group("commd")``)."""
    if _client is None:
        raise CommdError("no commd client: call dist.init_process_group('commd') first")
    return _client


class CommdWork(dist._Work):
    """torch Work over a commd Handle (or several, completed together)."""

    def __init__(self, handles: list[Handle], result: Any) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        self._future: Future | None = None
        #: The recorded requests this work completes (``record.py``; empty when not recording).
        self.record_reqs: list[int] = []

    @property
    def handles(self) -> list[Handle]:
        """The commd handles this work completes with (coalesced ops join several works' handles)."""
        return self._handles

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Until every op has finished (each is bounded by its own timeout), then the first op's error
        if any failed: nothing of the work still writes into the caller's tensors once this returns or
        raises, unless ``timeout`` passes first (CommTimeoutError, the work still running)."""
        if record.active is not None and self.record_reqs:
            started = time.perf_counter_ns()
            try:
                return self._wait(timeout)
            finally:
                record.active.waited(self.record_reqs, started, time.perf_counter_ns())
        return self._wait(timeout)

    def _wait(self, timeout: timedelta | None) -> bool:
        deadline = None
        if timeout is not None and timeout != timedelta(0):
            deadline = time.monotonic() + timeout.total_seconds()
        first: CommdError | None = None
        for handle in self._handles:
            try:
                handle.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except CommdError as exc:
                if not handle.is_completed():
                    raise  # the caller's timeout passed
                first = first or exc
        if first is not None:
            raise first
        return True

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def is_success(self) -> bool:
        return self.is_completed() and all(h.exception() is None for h in self._handles)

    def exception(self) -> BaseException | None:
        for handle in self._handles:
            if handle.exception() is not None:
                return handle.exception()
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        self.wait()
        src = self._handles[-1].src
        return -1 if src is None else src

    def get_future(self) -> Future:
        """A future completed with the result, or failed with the op's error.

        torch's Python ``Future.set_exception`` only stores the exception as a value that
        ``value()`` re-raises; to C++ (DDP's reducer waits on this future there) such a
        future looks successful.  A callback that raises marks the chained future as
        failed in C++ too, so every callback here reads its parent's value, which raises
        the op's error.  Waiting on the future then raises a plain RuntimeError, as torch
        reports any callback's failure ("Got the following error when running the callback:
        MismatchError: ..."): torch keeps only the text.  ``wait()`` and ``exception()`` give the
        typed error (a ``torch.distributed.DistBackendError``).
        """
        if self._future is None:
            futures = [h.get_future() for h in self._handles]
            if len(futures) == 1:
                self._future = futures[0].then(lambda done: (done.value(), self._result)[1])
            else:
                self._future = torch.futures.collect_all(futures).then(
                    lambda all_done: ([f.value() for f in all_done.value()], self._result)[1]
                )
        return self._future


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0].reshape(-1) if tensors[0].is_contiguous() else tensors[0].contiguous().reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_into(flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    offset = 0
    for out in outputs:
        n = out.numel()
        out.copy_(flat[offset : offset + n].view(out.shape))
        offset += n


#: The ops whose inter-node phase a program can run, as ``Options(algo={op: name})`` names them.
ALGO_OPS = ("all_reduce", "all_gather", "all_to_all", "alltonext")


class Options:
    """``pg_options`` for ``init_process_group("commd", pg_options=...)`` / ``new_group``.

    ``lane``: the inter-node lane for this group's ops ("tcp", "gloo", "mpi",
    "nccl"); None lets the daemons' rules decide per op.  ``algo``: the program that
    runs this group's all-reduces between nodes (on the tcp lane), or a mapping from op
    (``ALGO_OPS``: all_reduce, all_gather, all_to_all, alltonext) to the program for that op;
    None: the rules decide.  ``compression``: a codec (``commd.codecs``) for the group's broadcasts,
    all-gathers and all-reduces between nodes; "auto": the daemons choose, lossy codecs too; "none":
    never compressed; None: $COMMD_COMPRESSION, else the daemons may choose a lossless codec.
    """

    def __init__(self, lane: str | None = None, algo: str | Mapping[str, str] | None = None,
                 compression: str | None = None) -> None:
        from commd.protocol.schema import LANE_NAMES

        if lane is not None and lane not in LANE_NAMES:
            raise ValueError(f"unknown lane {lane!r}; known: {list(LANE_NAMES)}")
        algos = dict(algo) if isinstance(algo, Mapping) else {"all_reduce": algo} if algo is not None else {}
        for op, name in algos.items():
            if op not in ALGO_OPS:
                raise ValueError(f"algo for {op!r}: programs run the ops {list(ALGO_OPS)} only")
            if not isinstance(name, str) or not name:
                raise ValueError(f"algo must be an algorithm's name, got {name!r} for {op}")
        self.lane = lane
        #: The program per op (``ALGO_OPS``); ``algo``: the all-reduces' (None: the rules decide).
        self.algos = algos
        self.algo = algos.get("all_reduce")
        #: The codec of this group's broadcasts, all-gathers and all-reduces between nodes (None:
        #: $COMMD_COMPRESSION, else the daemons may choose a lossless one); "auto": the daemons may
        #: choose any codec, lossy ones too; "none": never compressed.
        self.compression = checked_codec(compression, "compression")


def checked_codec(name: str | None, what: str) -> str | None:
    """``name`` if it is a codec's (``commd.codecs``), "auto" or "none"; ValueError naming ``what`` and
    the codecs otherwise."""
    if name is None or name == "":
        return None
    from commd.codecs import CodecError, get
    from commd.protocol.schema import CODEC_AUTO, NO_CODEC

    if name in (CODEC_AUTO, NO_CODEC):
        return name
    try:
        return get(name).name
    except CodecError as exc:
        raise ValueError(f"{what}: {exc}; or {CODEC_AUTO!r} (the daemons choose, lossy codecs too) or "
                         f"{NO_CODEC!r} (never compressed)") from None


def compression_from_environment() -> str | None:
    """$COMMD_COMPRESSION: the codec between nodes for groups that name none."""
    return checked_codec(os.environ.get("COMMD_COMPRESSION"), "COMMD_COMPRESSION")


class ProcessGroupCommd(dist.ProcessGroup):
    """A torch ProcessGroup whose ops run in the commd node daemon."""

    def __init__(
        self, client: Client, name: str, rank: int, size: int, timeout: float | None, torch_name: str,
        lane: str | None = None, algo: str | Mapping[str, str] | None = None, compression: str | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """``timeout``: this group's op timeout in seconds, None for the client's (see ``op_timeout_s``).
        ``global_ranks``: the job's rank of each group rank (None: the group is the whole job)."""
        super().__init__(rank, size)
        self.global_ranks = list(range(size)) if global_ranks is None else list(global_ranks)
        self._client = client
        self._name = name
        self._torch_name = torch_name
        self._timeout = timeout
        self._lane = lane
        #: The program per op (``ALGO_OPS`` names), as ``Options(algo=)`` gave it.
        self._algos: dict[str, str] = Options(algo=algo).algos if algo is not None else {}
        self._algo = self._algos.get("all_reduce")
        #: The codec of this group's ops between nodes (for the dtypes it takes; others go uncompressed).
        self._compression = checked_codec(compression, "compression")
        self.ring: Any = None  # the group's exchange ring (ring_ops.py), set by _create

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._torch_name = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        """torch's name of this group (destroy_process_group looks it up)."""
        return self._torch_name

    @property
    def commd_group(self) -> str:
        return self._name

    @property
    def op_timeout(self) -> float:
        """Seconds this group's ops may wait for their ranks (the group's timeout, else the client's)."""
        return self._timeout or self._client.op_timeout

    def set_op_timeout(self, seconds: float) -> None:
        """Give the group's later ops ``seconds`` to wait for their ranks.  ``new_group``'s timeout is
        both how long the group's creation waits for its ranks and its op timeout; commd.ft builds
        its groups with a short wait and then gives them the job's op timeout."""
        if not seconds > 0:
            raise ValueError(f"an op timeout must be > 0 seconds, not {seconds!r}")
        self._timeout = float(seconds)
        if self.ring is not None:
            self.ring.op_timeout = float(seconds)

    def _kw(self) -> dict[str, Any]:
        """Every daemon op's options; called just before it is submitted (``_to_daemon``)."""
        self._to_daemon()
        return {"group": self._name, "timeout": self._timeout, "lane": self._lane}

    def _to_daemon(self) -> None:
        """An op is about to go to the daemon: ring ops ahead of it finish first.  (The client counts
        each collective in the ring as it numbers it: ``Client.on_numbered``.)"""
        if self.ring is not None:
            if self.ring.pending:
                self.ring.drain()
            self.ring.flush_trace()

    def _work(self, handles: Handle | list[Handle], result: Any) -> CommdWork:
        return CommdWork(handles if isinstance(handles, list) else [handles], result)

    # ---- coalescing ---------------------------------------------------------
    def start_batch(self) -> None:
        """From now on this group's ops leave together, as one message to the daemon, at ``end_batch``.

        Each op still returns its own work; waiting on one before the end sends what the batch holds
        so far (the client never blocks on an op it still holds).  A batch left open is sent first."""
        self._client.hold(self._name)

    def end_batch(self) -> CommdWork:
        """Send the batch; one work covering each of its ops (its first error, every API)."""
        return CommdWork(self._client.release(self._name), None)

    def _start_coalescing(self, device: torch.device) -> None:
        """torch's ``_coalescing_manager(group, device)`` (NCCL-style batching) begins: a batch."""
        self.start_batch()

    def _end_coalescing(self, device: torch.device) -> CommdWork:
        """torch's ``_coalescing_manager(group, device)`` ends: the batch's one work."""
        return self.end_batch()

    @contextlib.contextmanager
    def _one_message(self) -> Iterator[None]:
        """Ops submitted inside leave as one message (they join a batch already open)."""
        if self._client.holding(self._name):
            yield
            return
        self.start_batch()
        try:
            yield
        finally:
            self.end_batch()

    # ---- reductions ---------------------------------------------------
    @profiled("all_reduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CommdWork:
        if is_sparse_call(tensors):  # sparse COO: gathered and summed (sparse.py), as on Gloo
            op_name = reduce_op_name(opts.reduceOp) if opts is not None else "sum"
            handle = all_reduce_sparse(self._client, self._name, self.size(), tensors, op_name, self._kw)
            return self._work(handle, tensors)
        op = reduce_op(opts.reduceOp) if opts is not None else "sum"
        if self.ring is not None and len(tensors) == 1 and not self._client.holding(self._name):
            handle = ring_all_reduce(self._client, self.ring, tensors[0], op, self._timeout, tensors)
            if handle is not None:
                return CommdWork([handle], tensors)
        handles = [ops.all_reduce(self._client, t, op, **self._kw(), algo=self._algo,
                                  compression=None if self._algo else self._codec_for(t)) for t in tensors]
        return self._work(handles, tensors)

    @profiled("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> CommdWork:
        if is_sparse_call(tensors):
            raise ValueError("all_reduce_coalesced takes dense tensors only; all_reduce sparse ones one by one")
        op = reduce_op(opts.reduceOp) if opts is not None else "sum"
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        handles = []
        self._to_daemon()
        with self._one_message():
            for group in by_dtype.values():
                flat = _flatten(group)
                handle = self._client.submit(
                    "allreduce", self._name, {"buf": (flat, "inout")}, flat.dtype,
                    after=lambda flat=flat, group=group: _unflatten_into(flat, group),
                    count=flat.numel(), op=op, timeout=self._timeout,
                )
                handles.append(handle)
        return self._work(handles, tensors)

    @profiled("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> CommdWork:
        op = reduce_op(opts.reduceOp)
        handle = ops.reduce(self._client, tensors[0], opts.rootRank, op, **self._kw())
        return self._work(handle, tensors)

    @profiled("reduce_scatter")
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> CommdWork:
        out, parts = outputs[0], inputs[0]
        counts = [p.numel() for p in parts]
        if counts[self.rank()] != out.numel():
            raise ValueError(
                f"reduce_scatter: output holds {out.numel()} elements, input part {self.rank()} {counts[self.rank()]}"
            )
        handle = ops.reduce_scatter(
            self._client, out, _flatten(parts), reduce_op(opts.reduceOp), counts, **self._kw()
        )
        return self._work(handle, outputs)

    @profiled("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> CommdWork:
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"reduce_scatter_tensor: input holds {input.numel()} elements, expected "
                f"{self.size()} x {output.numel()}"
            )
        handle = ops.reduce_scatter(
            self._client, output, input, reduce_op(opts.reduceOp), None, **self._kw()
        )
        return self._work(handle, output)

    @profiled("reduce_scatter_tensor_coalesced")
    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any) -> CommdWork:
        with self._one_message():
            works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._work([h for w in works for h in w.handles], outputs)

    # ---- data movement --------------------------------------------------
    @profiled("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> CommdWork:
        handles = [ops.broadcast(self._client, t, opts.rootRank, **self._kw(), compression=self._codec_for(t))
                   for t in tensors]
        return self._work(handles, tensors)

    def _gather_codec(self, tensor: torch.Tensor) -> str | None:
        """An all-gather's codec: the group's, unless an all-gather program runs it (programs do not
        compress yet)."""
        return None if self._algos.get("all_gather") else self._codec_for(tensor)

    def _codec_for(self, tensor: torch.Tensor) -> str | None:
        """The group's codec if it takes ``tensor``'s dtype, else nothing (a model's integer buffers:
        the daemons' default, a lossless codec where rules or the table choose one); "auto" and
        "none" as they are (the daemons fit an automatic choice to the dtype)."""
        if self._compression is None:
            return None
        from commd.codecs import get
        from commd.kernels.reduce import DTYPE_NAMES
        from commd.protocol.schema import CODEC_AUTO, NO_CODEC

        if self._compression in (CODEC_AUTO, NO_CODEC):
            return self._compression
        return self._compression if DTYPE_NAMES.get(tensor.dtype) in get(self._compression).dtypes else None

    @profiled("all_gather")
    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> CommdWork:
        outs, inp = outputs[0], inputs[0]
        if len(outs) != self.size():
            raise ValueError(f"all_gather needs {self.size()} output tensors, got {len(outs)}")
        counts = [o.numel() for o in outs]
        self._to_daemon()
        flat = torch.empty(sum(counts), dtype=inp.dtype)
        handle = self._client.submit(
            "allgather", self._name, {"in": (inp, "in"), "out": (flat, "out")}, inp.dtype,
            result=outputs, after=lambda: _unflatten_into(flat, outs), counts=counts,
            timeout=self._timeout, lane=self._lane, algo=self._algos.get("all_gather"), codec=self._gather_codec(inp),
        )
        return self._work(handle, outputs)

    @profiled("all_gather_coalesced")
    def allgather_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> CommdWork:
        """``outputs[r][i]`` receives rank r's ``inputs[i]``."""
        if len(outputs) != self.size() or any(len(per_rank) != len(inputs) for per_rank in outputs):
            raise ValueError(
                f"all_gather_coalesced needs {self.size()} output lists of {len(inputs)} tensors"
            )
        handles = []
        with self._one_message():
            for i, inp in enumerate(inputs):
                handles += self.allgather([[per_rank[i] for per_rank in outputs]], [inp], opts).handles
        return self._work(handles, outputs)

    @profiled("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CommdWork:
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"all_gather_into_tensor: output holds {output.numel()} elements, expected "
                f"{self.size()} x {input.numel()}"
            )
        handle = ops.all_gather(self._client, output, input, None, **self._kw(), algo=self._algos.get("all_gather"),
                                compression=self._gather_codec(input))
        return self._work(handle, output)

    _allgather_base = all_gather_single

    def alltonext(self, output: torch.Tensor, input: torch.Tensor) -> CommdWork:
        """AllToNext on this group (``commd.alltonext``): rank r's ``output`` = rank r - 1's ``input``."""
        handle = ops.alltonext(self._client, output, input, **self._kw(), algo=self._algos.get("alltonext"))
        return self._work(handle, output)

    @profiled("all_gather_into_tensor_coalesced")
    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> CommdWork:
        handles = []
        with self._one_message():
            for out, inp in zip(outputs, inputs, strict=True):
                handles += self.all_gather_single(out, inp, opts).handles
        return self._work(handles, outputs)

    @profiled("gather")
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> CommdWork:
        inp, root = inputs[0], opts.rootRank
        if self.rank() == root:
            outs = outputs[0]
            counts = [o.numel() for o in outs]
            self._to_daemon()
            flat = torch.empty(sum(counts), dtype=inp.dtype)
            handle = self._client.submit(
                "gather", self._name, {"in": (inp, "in"), "out": (flat, "out")}, inp.dtype,
                result=outputs, after=lambda: _unflatten_into(flat, outs), counts=counts,
                root=root, timeout=self._timeout,
            )
        else:
            counts = [inp.numel()] * self.size()
            handle = ops.gather(self._client, None, inp, root, counts, **self._kw())
        return self._work(handle, outputs)

    @profiled("scatter")
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> CommdWork:
        out, root = outputs[0], opts.rootRank
        if self.rank() == root:
            parts = inputs[0]
            counts = [p.numel() for p in parts]
            handle = ops.scatter(self._client, out, _flatten(parts), root, counts, **self._kw())
        else:
            handle = ops.scatter(self._client, out, None, root, [out.numel()] * self.size(), **self._kw())
        return self._work(handle, outputs)

    @profiled("all_to_all")
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> CommdWork:
        self._to_daemon()
        flat_out = torch.empty(sum(o.numel() for o in outputs), dtype=inputs[0].dtype)
        handle = self._client.submit(
            "alltoall", self._name, {"in": (_flatten(inputs), "in"), "out": (flat_out, "out")},
            inputs[0].dtype, result=outputs, after=lambda: _unflatten_into(flat_out, outputs),
            splits_in=[t.numel() for t in inputs], splits_out=[o.numel() for o in outputs],
            timeout=self._timeout, lane=self._lane, algo=self._algos.get("all_to_all"),
        )
        return self._work(handle, outputs)

    @profiled("all_to_all_single")
    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: Any = None,
    ) -> CommdWork:
        n = self.size()
        in_row = input.numel() // input.shape[0] if input.dim() and input.shape[0] else 0
        out_row = output.numel() // output.shape[0] if output.dim() and output.shape[0] else 0
        in_rows = list(input_split_sizes) or [input.shape[0] // n] * n if input.dim() else [0] * n
        out_rows = list(output_split_sizes) or [output.shape[0] // n] * n if output.dim() else [0] * n
        if not input_split_sizes and input.dim() and input.shape[0] % n:
            raise ValueError(f"all_to_all_single: input dim 0 ({input.shape[0]}) not divisible by {n}")
        if not output_split_sizes and output.dim() and output.shape[0] % n:
            raise ValueError(f"all_to_all_single: output dim 0 ({output.shape[0]}) not divisible by {n}")
        if input.dim() == 0 or output.dim() == 0:
            in_rows, out_rows, in_row, out_row = [input.numel() // n] * n, [output.numel() // n] * n, 1, 1
        handle = ops.all_to_all(
            self._client, output, input, [r * in_row for r in in_rows], [r * out_row for r in out_rows],
            **self._kw(), algo=self._algos.get("all_to_all"),
        )
        return self._work(handle, output)

    alltoall_base = all_to_all_single

    # ---- point to point ---------------------------------------------------
    @profiled("send")
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> CommdWork:
        handle = ops.send(self._client, tensors[0], dst, tag, **self._kw())
        return self._work(handle, tensors)

    @profiled("recv")
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> CommdWork:
        handle = ops.recv(self._client, tensors[0], src, tag, **self._kw())
        return self._work(handle, tensors)

    @profiled("recv_anysource")
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> CommdWork:
        return self.recv(tensors, -1, tag)

    @profiled("barrier")
    def barrier(self, opts: Any = None) -> CommdWork:
        return self._work(ops.barrier(self._client, **self._kw()), None)

    def barrier_within(self, timeout: float) -> CommdWork:
        """A barrier that fails after ``timeout`` seconds (not the group's), naming the ranks that did not arrive
        (``monitored_barrier``)."""
        return self._work(ops.barrier(self._client, **{**self._kw(), "timeout": timeout}), None)

    def monitored_barrier(self, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
        """torch's ``ProcessGroup.monitored_barrier`` for this group: ``commd.monitored_barrier``.

        torch's C++ method looks for a C++ backend for CPU, which a Python group has not, and
        fails with "No backend type associated with device type cpu"; Gloo's groups answer it.
        """
        monitored_barrier_on(self, timeout, wait_all_ranks)

    def shutdown(self) -> None:
        """Called by destroy_process_group; the process's client stays for other groups."""
        record.save()
        if self.ring is not None:
            self._client.on_numbered(self._name, None)
            self.ring.close()

    def __repr__(self) -> str:
        return f"ProcessGroupCommd(group={self._name!r}, rank={self.rank()}, size={self.size()})"


# ---- bootstrap -------------------------------------------------------------
def _job_daemon_provided(paths: JobPaths) -> bool:
    """The job's daemon was started for it (`commd launch`, a cluster prologue): use it, never spawn one.

    A prologue's daemon may still be starting (forming its fabric) or have failed:
    the Client then waits for it or reports why it failed.
    """
    return paths.daemon_pid() is not None or paths.start_in_progress() or paths.start_error() is not None


def _agree(store: dist.Store, rank: int, key: str, make: Any) -> str:
    """Rank 0 proposes a value through the store; everyone returns the agreed one."""
    full = _STORE_PREFIX + key
    if rank == 0:
        store.set(full, make())
    return read_from_ranks(store, lambda _: full, [0], f"the agreed value of {key!r}")[0].decode()


def node_name() -> str:
    return os.environ.get("COMMD_NODE") or socket.gethostname()


def _placement(store: dist.Store, rank: int, size: int, round_: int) -> list[str]:
    """Every rank's node name, through the store."""
    store.set(f"{_STORE_PREFIX}host.{round_}/{rank}", node_name())
    names = read_from_ranks(store, lambda r: f"{_STORE_PREFIX}host.{round_}/{r}", range(size), "their node name")
    return [name.decode() for name in names]


def _local_rank(nodes: list[str], rank: int) -> int:
    env_local = os.environ.get("LOCAL_RANK")
    if env_local and env_local.isdigit():
        return int(env_local)
    return [r for r, n in enumerate(nodes) if n == nodes[rank]].index(rank)


def _fabric_args(nodes: list[str], rank: int) -> list[str]:
    """Daemon flags for an auto-started daemon of a multi-node job: rendezvous on the job's store."""
    names = list(dict.fromkeys(nodes))  # node ranks in order of their first rank
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ConnectError(
            f"this job spans nodes {names}: starting commd daemons needs MASTER_ADDR and MASTER_PORT "
            "(torchrun / env://) or `commd launch --nnodes`"
        )
    return ["--nnodes", str(len(names)), "--node-rank", str(names.index(nodes[rank])),
            "--rendezvous", f"{addr}:{port}", "--join-store", "--node-name", nodes[rank]]


def _check_fabric_secret(store: dist.Store, rank: int, size: int, round_: int) -> None:
    """A job on several nodes: every rank must have the secret its daemons share (never in the store).

    Each rank publishes only whether it has a usable one, so a missing or
    broken COMMD_SECRET / COMMD_SECRET_FILE fails every rank at once, naming
    the ranks, instead of leaving the other nodes' daemons waiting.
    """
    try:
        problem = "ok" if secret_from_environment() else "neither COMMD_SECRET nor COMMD_SECRET_FILE is set"
    except ConfigError as exc:
        problem = str(exc)
    store.set(f"{_STORE_PREFIX}secret_check.{round_}/{rank}", problem)
    checks = read_from_ranks(store, lambda r: f"{_STORE_PREFIX}secret_check.{round_}/{r}", range(size),
                             "whether they have the job's secret")
    problems = {r: check.decode() for r, check in enumerate(checks)}
    bad = {r: p for r, p in problems.items() if p != "ok"}
    if bad:
        # Rank 0 usually hosts the store: it waits (briefly) until every rank has read the
        # verdict, so nobody meets a vanished store instead of the reason.
        read = store.add(f"{_STORE_PREFIX}secret_check_read.{round_}", 1)
        deadline = time.monotonic() + _VERDICT_READ_S
        while rank == 0 and read < size and time.monotonic() < deadline:
            time.sleep(0.01)
            read = store.add(f"{_STORE_PREFIX}secret_check_read.{round_}", 0)
        raise ConnectError(
            "this job spans several nodes, so its commd daemons need the same secret on every node: set "
            "COMMD_SECRET, or COMMD_SECRET_FILE to a file only you can read (mode 0600), for every rank "
            "(commd never sends it through the store, which anyone reaching its port can read); "
            + "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items()))
        )


def _private_store_file(store: dist.Store) -> None:
    """A file:// store's file (job name, placement) is made readable by us alone, if it is ours."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.FileStore):
        return
    try:
        st = os.stat(store.path)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(store.path, 0o600)
    except OSError:
        pass  # gone already (the last user removed it) or not ours: nothing of ours to protect


_bootstraps = 0


def op_timeout_s(timeout: timedelta | None) -> float | None:
    """The op timeout a process group's ``timeout`` asks for, or None to leave it to commd.

    torch hands every backend a timeout, its default (30 min) when the user gave none, so
    only a different value is taken as the user's choice.  None lets the client decide:
    ``COMMD_OP_TIMEOUT`` in the process's environment, else the daemon's ``--op-timeout``
    (its ``COMMD_OP_TIMEOUT``, default 30 s).
    """
    if timeout is None or timeout == default_pg_timeout or timeout <= timedelta(0):
        return None
    return timeout.total_seconds()


def _bootstrap(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Client:
    """Connect this process to its node daemon for the job the store defines.

    Keys carry the count of earlier bootstraps in this process, so a job that
    destroys and re-creates its default group over the same store never reads
    the previous round's values (every rank bootstraps equally often).
    """
    global _client, _bootstraps
    check_environment()  # a bad setting fails here, before any daemon is started
    record.start_from_environment()
    round_ = _bootstraps
    _bootstraps += 1
    _private_store_file(store)
    launched_job = os.environ.get("COMMD_JOB")
    launched = bool(launched_job) and _job_daemon_provided(JobPaths.for_job(launched_job))
    if launched:
        job = launched_job  # started by `commd launch` or a prologue: the secret is in the job dir
    else:
        job = _agree(store, rank, f"job.{round_}", lambda: f"job-{uuid.uuid4().hex[:16]}")
    nodes = _placement(store, rank, size, round_)
    local_rank = _local_rank(nodes, rank)
    multi_node = len(set(nodes)) > 1
    if multi_node and not launched:
        _check_fabric_secret(store, rank, size, round_)
    with _client_lock:
        if _client is not None:
            if _client.paths.job == job and _client.rank == rank and not _client._closed:
                return _client
            _client.close()
            _client = None
        paths = JobPaths.for_job(job)
        if not launched:
            # The daemon makes the secret (or takes COMMD_SECRET / COMMD_SECRET_FILE from our
            # environment) and keeps it in the 0600 job directory, where the client reads it.
            if multi_node:
                ensure_daemon(paths, extra_args=_fabric_args(nodes, rank), timeout=_RENDEZVOUS_S)
            else:
                ensure_daemon(paths)
        _client = Client(
            rank, size, local_rank=local_rank, job=job,
            op_timeout=op_timeout_s(timeout),
            nodes=nodes if multi_node else None,
        )
        return _client


def create_group(dist_opts: Any, backend_opts: Any) -> ProcessGroupCommd:
    """torch's factory for a \"commd\" group (``registration`` hands it on): the first one bootstraps the client."""
    store = dist_opts.store
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    global_ranks = list(dist_opts.global_ranks_in_group or range(size))
    global _job_store
    if not dist.is_initialized() or _client is None:
        client = _bootstrap(store, rank, size, timeout)
        _job_store = store
    else:
        client = _client
    base = str(dist_opts.group_id or "default")
    if _next_group_name is not None and _job_store is not None:
        name = f"n{_next_group_name}"
        store = dist.PrefixStore(f"{_STORE_PREFIX}named/{_next_group_name}/", _job_store)
    else:
        generation = _group_generations.get(base, 0)
        _group_generations[base] = generation + 1
        name = f"g{base}.{generation}".replace(" ", "_")[:200]
    client.register_group(name, global_ranks)
    lane = getattr(backend_opts, "lane", None) if isinstance(backend_opts, Options) else None
    algo = backend_opts.algos if isinstance(backend_opts, Options) else None
    compression = backend_opts.compression if isinstance(backend_opts, Options) else None
    group = ProcessGroupCommd(client, name, rank, size, op_timeout_s(timeout), base, lane, algo,
                              compression or compression_from_environment(), global_ranks)
    # a group with a program runs its all-reduces through the coordinator (which releases the
    # program), never through a bridged ring, as a group with a lane does
    group.ring = open_ring(client, store, name, rank, size, global_ranks, op_timeout_s(timeout),
                           lane or ("tcp" if algo and "all_reduce" in algo else None))
    return group


def job_store() -> dist.Store:
    """The store every rank of the job shares (the one its default group was made with), for
    agreements beyond the groups' ops, such as commd.ft's membership."""
    if _job_store is None:
        raise RuntimeError("no commd group has been made in this process: call init_process_group('commd') first")
    return _job_store


@contextlib.contextmanager
def named_group(name: str) -> Iterator[None]:
    """The commd group that ``dist.new_group`` makes inside this block is called ``name``, on
    every rank that makes it, and agrees through its own part of the job's store.

    torch names a group made with ``use_local_synchronization`` after its ranks *and the number
    of groups the process already has*, so a replacement process and the ranks that went on
    without it would name one group differently, and never meet."""
    global _next_group_name
    if not name or len(name) > 120 or not all(c.isalnum() or c in "._-" for c in name):
        raise ValueError(f"a group name must be 1-120 letters, digits, '.', '_' or '-', not {name!r}")
    if _next_group_name is not None:
        raise RuntimeError(f"named_group({name!r}) inside named_group({_next_group_name!r})")
    _next_group_name = name
    try:
        yield
    finally:
        _next_group_name = None


def _close_client() -> None:
    global _client
    if _client is not None:
        try:
            _client.close()
        finally:
            _client = None


atexit.register(_close_client)


def monitored_barrier(group: Any = None, timeout: timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
    """``commd.monitored_barrier``: torch's ``dist.monitored_barrier`` (Gloo only) for commd groups.

    ``group``: None (the default group) or a commd process group; see
    ``monitored.monitored_barrier_on`` for ``timeout`` and ``wait_all_ranks``.  A rank outside
    ``group`` warns and returns, as torch's does."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        warnings.warn(f"Running monitored_barrier on global rank {dist.get_rank()} which does not belong to the given "
                      "group.", stacklevel=2)
        return
    commd_group(group, "commd's monitored_barrier").monitored_barrier(timeout, wait_all_ranks)


def alltonext(send: torch.Tensor, recv: torch.Tensor, group: Any = None, async_op: bool = False) -> CommdWork | None:
    """AllToNext (``commd.alltonext``): rank r's ``recv`` = rank r - 1's ``send``; rank 0's ``recv``
    is left as it was, the last rank's ``send`` goes nowhere.  Every rank of ``group`` calls it
    with the same count and dtype (else each fails with a MismatchError).

    ``group``: None (the default process group), a torch process group of the commd backend,
    or a commd group's name (on this process's client).  The group's ``Options(algo=
    {"alltonext": name})`` picks the program between nodes.  Returns the work when ``async_op``,
    else waits and returns None."""
    if isinstance(group, str):
        handle = ops.alltonext(current_client(), recv, send, group=group)
        work = CommdWork([handle], recv)
    else:
        work = commd_group(group, "alltonext").alltonext(recv, send)
    if async_op:
        return work
    work.wait()
    return None


def commd_group(group: Any, what: str) -> ProcessGroupCommd:
    """The commd process group ``group`` is (None: the default group); ValueError naming the op ``what``
    if it is none.  (torch hands out the backend's own ProcessGroup object for a backend that makes one.)"""
    if group is None:
        if not dist.is_initialized():
            raise CommdError("no default process group: call dist.init_process_group('commd') first")
        group = dist.group.WORLD
    if isinstance(group, ProcessGroupCommd):
        return group
    raise ValueError(f"{what} runs on commd process groups only, not on {group!r}")


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    """``dist.batch_isend_irecv`` whose ops reach the daemon as one message on a commd group.

    torch 2.13 batches only for groups whose type is exactly ``ProcessGroup`` (NCCL's way); a
    commd group is a Python subclass of it, so torch's own function sends the ops one message
    each (still correct: no op blocks another).  Here they run between ``start_batch`` and
    ``end_batch`` and, as torch returns for NCCL, the result is a list of one work covering the
    whole batch.  On any other group this is torch's own ``batch_isend_irecv``.
    """
    if not isinstance(p2p_op_list, list) or not p2p_op_list:
        raise ValueError("batch_isend_irecv needs a non-empty list of torch.distributed.P2POp")
    if not all(isinstance(op, dist.P2POp) for op in p2p_op_list):
        raise ValueError("batch_isend_irecv: every item must be a torch.distributed.P2POp")
    group = p2p_op_list[0].group
    if any(op.group is not group for op in p2p_op_list):
        raise ValueError("batch_isend_irecv: all ops need to use the same group")
    pg = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if not isinstance(pg, ProcessGroupCommd):
        return dist.batch_isend_irecv(p2p_op_list)
    pg.start_batch()
    try:
        for op in p2p_op_list:
            peer = {"group_dst": op.group_peer} if op.op is dist.isend else {"group_src": op.group_peer}
            op.op(op.tensor, group=op.group, tag=op.tag, **peer)
    finally:
        work = pg.end_batch()
    return [work]
