"""All-reduce of sparse COO tensors, as torch's Gloo backend does it: gather everyone's entries, sum.

The daemon moves flat buffers only, so a sparse all-reduce is two all-gathers:

1. every rank's *description* (a fixed-size int64 vector: dtype, sparse and dense
   sizes, nnz of its coalesced tensor, and any problem with its own call), which
   the call waits for; then each rank checks that all agree, so a non-SUM op, a
   different shape or dtype on any rank fails every rank with the same clear
   error (a rank that passed a dense tensor instead fails the daemon's agreement
   check of this gather, on every rank too);
2. everyone's indices and values as bytes, ``counts`` sized from the nnz of step 1,
   whose completion sums them (one ``coalesce``) and copies the coalesced sum into
   the input tensor in place, as Gloo does.

Both submissions happen inside the call, in program order with the group's other
ops; only the second runs asynchronously, so even with ``async_op=True`` the call
returns only once every rank has made it (or the op timed out).  CUDA tensors' entries
travel through host memory.  Only ReduceOp.SUM is defined (as on Gloo).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from commd.client.connection import Client
from commd.client.errors import CommdError, MismatchError
from commd.client.handle import Handle
from commd.kernels.reduce import TORCH_DTYPES

#: The reduce ops a sparse all-reduce may be asked for, by commd name (their index travels); only SUM works.
OP_NAMES = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
#: The dtypes a sparse tensor's values may have (their index travels).
DTYPES = tuple(TORCH_DTYPES.values())
#: Most dimensions (sparse + dense) a sparse tensor here may have (Gloo takes 4 + 4).
MAX_DIMS = 16
#: First word of every description: a peer's buffer without it took part in some other all-gather.
MAGIC = 0x5350415253450001

# description layout
_MAGIC, _PROBLEM, _OP, _DTYPE, _SPARSE_DIM, _DENSE_DIM, _NNZ, _NDIM = range(8)
_SIZES = 8
DESCRIPTION_WORDS = _SIZES + MAX_DIMS

# what can be wrong with one rank's own call (the description says which)
OK, NOT_SUM, NOT_COO, TOO_MANY_DIMS, BAD_DTYPE, NOT_ONE_TENSOR = range(6)
_PROBLEMS = {
    NOT_SUM: "only ReduceOp.SUM is supported for sparse tensors (as on Gloo)",
    NOT_COO: "only sparse COO tensors (or dense ones on every rank) can be all-reduced",
    TOO_MANY_DIMS: f"a sparse tensor may have at most {MAX_DIMS} dimensions",
    BAD_DTYPE: f"a sparse tensor's dtype must be one of {[str(d) for d in DTYPES]}",
    NOT_ONE_TENSOR: "a sparse all_reduce takes exactly one tensor",
}


def is_sparse_call(tensors: list[torch.Tensor]) -> bool:
    """Whether an all-reduce of ``tensors`` takes the sparse path (any tensor not strided)."""
    return any(t.layout != torch.strided for t in tensors)


@dataclass(frozen=True)
class Description:
    """One rank's sparse all-reduce as the others see it."""

    problem: int
    op: int
    dtype: int
    sparse_dim: int
    dense_dim: int
    nnz: int
    sizes: tuple[int, ...]

    @classmethod
    def read(cls, words: list[int]) -> Description | None:
        """The description in ``words``, or None when they are not one (a peer ran another all-gather)."""
        ndim = words[_NDIM]
        if words[_MAGIC] != MAGIC or not 0 <= ndim <= MAX_DIMS:
            return None
        return cls(words[_PROBLEM], words[_OP], words[_DTYPE], words[_SPARSE_DIM], words[_DENSE_DIM],
                   words[_NNZ], tuple(words[_SIZES : _SIZES + ndim]))

    def words(self) -> torch.Tensor:
        out = torch.zeros(DESCRIPTION_WORDS, dtype=torch.int64)
        out[_MAGIC], out[_PROBLEM], out[_OP], out[_DTYPE] = MAGIC, self.problem, self.op, self.dtype
        out[_SPARSE_DIM], out[_DENSE_DIM], out[_NNZ], out[_NDIM] = (
            self.sparse_dim, self.dense_dim, self.nnz, len(self.sizes))
        out[_SIZES : _SIZES + len(self.sizes)] = torch.tensor(self.sizes, dtype=torch.int64)
        return out

    def shape_text(self) -> str:
        dtype = DTYPES[self.dtype] if 0 <= self.dtype < len(DTYPES) else "?"
        return f"{dtype} of size {list(self.sizes)} with {self.sparse_dim} sparse dimension(s)"

    def payload_bytes(self) -> int:
        """Bytes of this rank's indices and values (its share of the second all-gather)."""
        dense = math.prod(self.sizes[self.sparse_dim :])
        return self.nnz * (self.sparse_dim * 8 + dense * DTYPES[self.dtype].itemsize)


def describe(tensors: list[torch.Tensor], op: str) -> tuple[Description, torch.Tensor | None]:
    """This rank's description and its coalesced tensor (None when its call has a problem)."""
    op_index = OP_NAMES.index(op) if op in OP_NAMES else -1
    tensor = tensors[0] if tensors else None
    problem = OK
    if len(tensors) != 1 or tensor is None:
        problem = NOT_ONE_TENSOR
    elif tensor.layout != torch.sparse_coo:
        problem = NOT_COO
    elif tensor.dim() > MAX_DIMS:
        problem = TOO_MANY_DIMS
    elif tensor.dtype not in DTYPES:
        problem = BAD_DTYPE
    elif op != "sum":
        problem = NOT_SUM
    if problem != OK or tensor is None:
        return Description(problem, op_index, -1, 0, 0, 0, ()), None
    coalesced = tensor.detach().coalesce()
    return Description(OK, op_index, DTYPES.index(tensor.dtype), tensor.sparse_dim(), tensor.dense_dim(),
                       coalesced.values().shape[0], tuple(tensor.shape)), coalesced


def all_reduce_sparse(client: Client, group: str, size: int, tensors: list[torch.Tensor], op: str,
                      submit_fields: Callable[[], dict[str, Any]]) -> Handle:
    """All-reduce the sparse ``tensors[0]`` (SUM) into itself; the handle completes once it holds the sum.

    ``submit_fields``: the group's op fields (timeout, lane), called just before each submission.
    Raises ValueError at once when this rank's own call is invalid (after telling its peers, whose
    handles fail); every failure involving the peers reaches this rank through the handle."""
    mine, coalesced = describe(tensors, op)
    table = torch.empty(size * DESCRIPTION_WORDS, dtype=torch.int64)
    exchange = _all_gather(client, group, table, mine.words(), [DESCRIPTION_WORDS] * size, submit_fields())
    try:
        exchange.wait()
        failure: CommdError | None = None
    except CommdError as exc:
        failure = type(exc)(f"sparse all_reduce: the ranks could not exchange their tensors' shapes (every "
                            f"rank of the group must pass a sparse COO tensor to this all_reduce): {exc}")
    if mine.problem != OK:
        raise ValueError(f"all_reduce: {_PROBLEMS[mine.problem]}" + (
            f", got {OP_NAMES[mine.op].upper()}" if mine.problem == NOT_SUM and mine.op >= 0 else ""))
    if failure is not None:
        return _settled(client, group, tensors, failure)
    read = [Description.read(table[r * DESCRIPTION_WORDS : (r + 1) * DESCRIPTION_WORDS].tolist())
            for r in range(size)]
    disagreement = _disagreement(read)
    if disagreement is not None or coalesced is None:
        return _settled(client, group, tensors, MismatchError(f"sparse all_reduce: {disagreement}"))
    everyone = [d for d in read if d is not None]
    counts = [d.payload_bytes() for d in everyone]
    gathered = torch.empty(sum(counts), dtype=torch.uint8)
    target = tensors[0]
    return _all_gather(client, group, gathered, _payload(coalesced), counts, submit_fields(), result=tensors,
                       after=lambda: _sum_into(target, gathered, everyone))


def _all_gather(client: Client, group: str, output: torch.Tensor, input: torch.Tensor, counts: list[int],
                fields: dict[str, Any], result: Any = None, after: Callable[[], None] | None = None) -> Handle:
    return client.submit("allgather", group, {"in": (input, "in"), "out": (output, "out")}, input.dtype,
                         result=result, after=after, counts=counts, timeout=fields.get("timeout"),
                         lane=fields.get("lane"))


def _disagreement(everyone: list[Description | None]) -> str | None:
    """What keeps the ranks' descriptions from making one sparse all-reduce, or None."""
    strangers = [r for r, d in enumerate(everyone) if d is None]
    if strangers:
        return f"rank(s) {strangers} ran a different all-gather at this place, not a sparse all_reduce"
    described = [d for d in everyone if d is not None]
    problems = [f"rank {r}: {_PROBLEMS.get(d.problem, f'problem {d.problem}')}"
                for r, d in enumerate(described) if d.problem != OK]
    if problems:
        return "; ".join(problems)
    shapes = {(d.dtype, d.sparse_dim, d.sizes) for d in described}
    if len(shapes) > 1:
        return ("the ranks' sparse tensors differ in dtype, size or sparse dimensions: "
                + "; ".join(f"rank {r}: {d.shape_text()}" for r, d in enumerate(described)))
    return None


def _payload(coalesced: torch.Tensor) -> torch.Tensor:
    """This rank's indices then values, as one flat byte tensor on the CPU."""
    indices = coalesced.indices().to("cpu", torch.int64).contiguous().reshape(-1)
    values = coalesced.values().cpu().contiguous().reshape(-1)
    return torch.cat([indices.view(torch.uint8), values.view(torch.uint8)])


def _sum_into(target: torch.Tensor, gathered: torch.Tensor, everyone: list[Description]) -> None:
    """Every rank's entries from ``gathered``, summed (coalesced), copied into ``target``."""
    first = everyone[0]
    dtype, sparse_dim, sizes = DTYPES[first.dtype], first.sparse_dim, first.sizes
    dense = sizes[sparse_dim:]
    indices, values, offset = [], [], 0
    for d in everyone:
        n_index = d.nnz * sparse_dim * 8
        n_value = d.nnz * math.prod(dense) * dtype.itemsize
        indices.append(gathered[offset : offset + n_index].clone().view(torch.int64).view(sparse_dim, d.nnz))
        offset += n_index
        values.append(gathered[offset : offset + n_value].clone().view(dtype).view(d.nnz, *dense))
        offset += n_value
    total = torch.sparse_coo_tensor(torch.cat(indices, dim=1), torch.cat(values), sizes, dtype=dtype).coalesce()
    with torch.no_grad():
        target.copy_(total.to(target.device))


def _settled(client: Client, group: str, result: Any, error: CommdError) -> Handle:
    """A handle already failed with ``error`` (no op is left to run)."""
    handle = Handle(client, 0, "allreduce", group, time.monotonic(), result=result)
    handle.fail(error)
    return handle
