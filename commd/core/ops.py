"""The op model: what one rank asked for (Submission, BufferRef), the op-kind sets,
and what a matched op is (ReadyOp) — shared by matching, negotiation and execution."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from commd.protocol.cuda import CudaRef

ROOTED = frozenset({"reduce", "broadcast", "gather", "scatter"})
REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})
COUNTED = frozenset({"allgather", "gather", "scatter", "reduce_scatter"})
#: Op kinds whose inter-node phase can run compressed (the ``codec`` field).
COMPRESSED_KINDS = frozenset({"broadcast", "allgather", "allreduce"})
#: Ops smaller than this (an all-gather: its whole output) run uncompressed whatever their codec:
#: coding costs more than it saves.  The coordinator releases no codec below it; execution checks again.
COMPRESS_MIN_BYTES = 1 << 20
#: Dtypes whose sums and products round: the result depends on the order the operands are combined in.
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "complex64", "complex128"})
#: Reduce ops (the client's and the lanes') that add or multiply.
ROUNDING_OPS = frozenset({"sum", "avg", "premul_sum", "product"})


def order_sensitive(dtype: str, reduce_op: str | None) -> bool:
    """Whether reducing ``dtype`` with ``reduce_op`` may give other bits in another order.

    Float addition and multiplication round at every step, so ``(a+b)+c`` and ``a+(b+c)`` can
    differ in the last bits; commd's lanes promise every node bit-identical results (DDP's
    replicas must not drift apart), so such an op must reduce in one order on every node.
    Integer sums and products wrap modulo 2^n and min, max, band, bor and bxor are exact:
    any order gives the same bits.  The one place this rule is written (program selection
    uses it to keep order-dependent programs off the ops that need it)."""
    return reduce_op in ROUNDING_OPS and dtype in FLOAT_DTYPES


@dataclass(slots=True)
class BufferRef:
    """A client buffer: a range of one of its segments, or inline bytes."""

    nbytes: int
    segment: int = -1
    offset: int = 0
    inline: bytearray | None = None
    cuda: CudaRef | None = None
    #: A client's staging block (a copy of one of its ordinary tensors), not its own arena tensor.
    staged: bool = False


@dataclass(slots=True)
class Submission:
    """One rank's validated request for one op."""

    client_id: int
    op_id: int
    group: str
    group_rank: int
    group_size: int
    seq: int
    kind: str
    dtype: str
    count: int = 0
    reduce_op: str = "sum"
    root: int = 0
    peer: int = -1
    tag: int = 0
    scale: float = 1.0
    counts: list[int] | None = None
    splits_in: list[int] | None = None
    splits_out: list[int] | None = None
    buffers: dict[str, BufferRef] = field(default_factory=dict)
    timeout: float = 30.0
    submitted_at: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    on_gpu: bool = False
    #: Lane hint ("" = let the scheduler choose); part of the agreed fields.
    lane: str = ""
    #: Algorithm hint (a program's catalogue name, "" = let the scheduler choose); agreed too.
    algo: str = ""
    #: The op's codec field, agreed too: a ``commd.codecs`` choice ("NAME" or "NAME/per-hop"), ""
    #: (the daemons may choose a lossless codec), "auto" (any codec) or "none" (never compressed).
    codec: str = ""
    #: For a send forwarded from another node: that node (the sender is not a local client).
    origin: int = -1
    #: The fields every member must agree on, for a cheap equality check.
    signature: tuple = ()


class MatchError(Exception):
    """Raised with the submissions that must all receive the same error."""

    def __init__(self, message: str, code: str, subs: list[Submission]) -> None:
        super().__init__(message)
        self.code = code
        self.subs = subs


@dataclass
class ReadyOp:
    """A matched op: one submission per participating group rank."""

    kind: str
    group: str
    seq: int
    subs: list[Submission]
    first_at: float
    ready_at: float = field(default_factory=time.monotonic)

    nbytes: int = -1
    on_gpu: bool = False
    lane: str = "local"  # the lane that ran its inter-node phase ("local": none)
    algo: str = ""  # the program that ran it ("": the lane's own algorithm)
    codec: str = ""  # the codec choice the coordinator released ("": uncompressed)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = max(sub.nbytes for sub in self.subs)
        self.on_gpu = any(sub.on_gpu for sub in self.subs)

    def describe(self) -> str:
        if self.kind in ("send", "recv"):
            return f"send/recv on group '{self.group}'"
        return f"{self.kind} #{self.seq} on group '{self.group}'"
