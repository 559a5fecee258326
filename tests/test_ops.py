"""Every op × dtype × reduce op × buffer layout × group, against NumPy references.

Starting processes is the expensive part on a small machine, so for each
world size ONE daemon and ONE set of worker processes run the whole case
list (a module-scoped fixture); the tests below then slice the per-case
results by op kind, layout, group and so on, so a failure still names
exactly which cases broke.

Each worker regenerates every member's input deterministically from the
case id, computes the expected result with NumPy (in float64 / int64 /
complex128) and compares its own output, so nothing here is hard-coded.
"""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import textwrap
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DaemonProcess, WorkerContext, WorkerFailed, Workers, new_job, shm_files

pytestmark = pytest.mark.timeout(110)

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = ("int8", "uint8", "int32", "int64")
DTYPES = (*FLOATS, *INTS, "bool", "complex64")
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
REDUCING = ("allreduce", "reduce", "reduce_scatter")
SCALE = 0.25  # premul_sum factor (a power of two: exact in every float dtype)
OP_TIMEOUT = 20.0  # per-op wait bound inside the workers

TORCH = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool, "complex64": torch.complex64,
}
# (rtol, atol) for results accumulated in the dtype itself: a few roundings of
# values of magnitude <= 8 (inputs lie in [-2, 2], at most 3 ranks).
TOLERANCE = {
    "float16": (4e-3, 1e-2),
    "bfloat16": (3e-2, 8e-2),
    "float32": (1e-5, 1e-5),
    "float64": (1e-12, 1e-12),
    "complex64": (1e-5, 1e-5),
}

#: Buffer layouts.  Per rank and role each resolves to "arena" (client.empty,
#: zero-copy), "plain" (ordinary tensor: inline if <= 4096 bytes, else staged)
#: or "strided" (non-contiguous view).  Mixed layouts vary it by rank and role.
SMALL, BIG, HUGE = 24, 4500, 300_000  # elements per rank: inline-sized, > 4096 bytes, > 1 MiB
LAYOUTS = {
    "arena": (("arena",), 1000),
    "inline": (("plain",), SMALL),
    "staged": (("plain",), BIG),
    "strided": (("strided",), SMALL),
    "strided_big": (("strided",), BIG),
    "mixed_small": (("arena", "strided", "plain"), SMALL),
    "mixed_big": (("arena", "strided", "plain"), BIG),
    "huge_arena": (("arena",), HUGE),
    "huge_staged": (("plain",), HUGE),
}
BASIC_LAYOUTS = ("arena", "inline", "staged", "strided", "strided_big", "mixed_small", "mixed_big")


def reduction_defined(op: str, dtype: str) -> bool:
    """Which (reduce op, dtype) pairs make sense (torch/Gloo semantics)."""
    if op in ("band", "bor", "bxor"):
        return dtype in INTS or dtype == "bool"
    if op in ("avg", "premul_sum"):
        return dtype in FLOATS or dtype == "complex64"
    if op in ("min", "max"):
        return dtype != "complex64"
    return True


def groups_for(world: int) -> dict[str, list[int]]:
    """Groups every run registers: reversed order, a strict subset, a singleton."""
    if world == 2:
        return {"world": [0, 1], "rev": [1, 0], "solo": [1]}
    return {"world": [0, 1, 2], "rev": [2, 1, 0], "pair": [2, 0], "solo": [1]}


@dataclass(frozen=True)
class Case:
    """One op to run; every member of ``group`` runs it, others skip it."""

    kind: str
    dtype: str
    layout: str
    op: str = "sum"
    group: str = "world"
    root: int = 0  # group rank
    variant: str = "even"

    @property
    def cid(self) -> str:
        return f"{self.kind}/{self.dtype}/{self.op}/{self.layout}/{self.group}/root{self.root}/{self.variant}"

    @property
    def expect_error(self) -> bool:
        return self.kind in REDUCING and not reduction_defined(self.op, self.dtype)


def build_cases(world: int) -> list[Case]:
    """The case list for one world size (the same list in every worker)."""
    cases: list[Case] = []
    roots = itertools.cycle(range(world))
    for kind, dtype, op, layout in itertools.product(REDUCING, DTYPES, REDUCE_OPS, BASIC_LAYOUTS):
        if not reduction_defined(op, dtype) and layout not in ("inline", "arena"):
            continue  # the error comes from validation; two layouts suffice
        variant = "uneven" if kind == "reduce_scatter" and layout in ("inline", "mixed_big") else "even"
        cases.append(Case(kind, dtype, layout, op, root=next(roots) if kind == "reduce" else 0, variant=variant))
    for dtype, layout in itertools.product(DTYPES, BASIC_LAYOUTS):
        root = next(roots)
        cases.append(Case("broadcast", dtype, layout, root=root))
        for kind in ("allgather", "gather", "scatter"):
            for variant in ("even", "uneven", "zero"):
                cases.append(Case(kind, dtype, layout, root=root, variant=variant))
        for variant in ("even", "uneven", "zero"):
            cases.append(Case("alltoall", dtype, layout, variant=variant))
        for variant in ("ring", "anysource", "tags", "fanin"):
            cases.append(Case("sendrecv", dtype, layout, variant=variant))
    for dtype in DTYPES:  # output aliasing input in one arena (torch's in-place forms)
        cases.append(Case("allgather", dtype, "arena", variant="inplace"))
        cases.append(Case("reduce_scatter", dtype, "arena", variant="inplace"))
    for layout in ("huge_arena", "huge_staged"):  # > one 1 MiB kernel block, off the inline path
        for dtype in ("float32", "int64", "complex64"):
            cases.append(Case("allreduce", dtype, layout))
        cases.append(Case("allgather", "float32", layout, variant="uneven"))
    cases.append(Case("reduce_scatter", "float32", "huge_arena"))
    cases.append(Case("alltoall", "float64", "huge_staged", variant="uneven"))
    cases.append(Case("barrier", "uint8", "inline"))
    # Subgroups: strict subsets and reordered members, interleaved with world ops
    # so that non-members run other work (a singleton group) meanwhile.
    for group in groups_for(world):
        if group == "world":
            continue
        size = len(groups_for(world)[group])
        for layout in ("arena", "mixed_big"):
            cases.append(Case("allreduce", "float32", layout, "sum", group))
            cases.append(Case("allreduce", "int32", layout, "max", group))
            cases.append(Case("allreduce", "float64", layout, "avg", group))
            cases.append(Case("reduce", "float32", layout, "product", group, root=size - 1))
            cases.append(Case("broadcast", "int64", layout, group=group, root=size - 1))
            cases.append(Case("allgather", "float16", layout, group=group, variant="uneven"))
            cases.append(Case("gather", "int8", layout, group=group, root=size - 1, variant="uneven"))
            cases.append(Case("scatter", "bfloat16", layout, group=group, root=size - 1, variant="uneven"))
            cases.append(Case("reduce_scatter", "float32", layout, "sum", group, variant="uneven"))
            cases.append(Case("alltoall", "complex64", layout, group=group, variant="uneven"))
            if size > 1:
                cases.append(Case("sendrecv", "float32", layout, group=group, variant="ring"))
                cases.append(Case("sendrecv", "int32", layout, group=group, variant="anysource"))
            cases.append(Case("barrier", "uint8", layout, group=group))
            cases.append(Case("allreduce", "float32", layout, "sum", variant=f"after-{group}"))  # world again
    assert len({c.cid for c in cases}) == len(cases), "case ids must be unique"
    return cases


# ---- inputs, buffers and references (run inside the workers) ---------------
def _rng(case: Case, *salt: object) -> np.random.Generator:
    # zlib.crc32, not hash(): string hashing differs between processes.
    return np.random.default_rng(zlib.crc32("|".join(map(str, (case.cid, *salt))).encode()))


def values(case: Case, group_rank: int, n: int, salt: str = "in") -> torch.Tensor:
    """Deterministic input of ``group_rank``: any rank can recompute any other's."""
    rng = _rng(case, group_rank, n, salt)
    dtype = case.dtype
    if dtype in FLOATS:
        return torch.from_numpy(rng.uniform(-2, 2, n)).to(TORCH[dtype])
    if dtype == "complex64":
        return torch.from_numpy(rng.uniform(-2, 2, n) + 1j * rng.uniform(-2, 2, n)).to(torch.complex64)
    if dtype == "bool":
        return torch.from_numpy(rng.random(n) < 0.5)
    info = np.iinfo(dtype)
    reducing = case.kind in REDUCING
    if reducing and case.op == "product":  # |x|^3 must fit in the dtype
        lo, hi = (0, 5) if dtype == "uint8" else (-5, 5)
    elif reducing and case.op in ("sum", "avg", "premul_sum"):  # sums of 3 must fit
        lo, hi = {"int8": (-40, 40), "uint8": (0, 80), "int32": (-10**8, 10**8), "int64": (-10**17, 10**17)}[dtype]
    else:
        lo, hi = int(info.min), int(info.max)
    return torch.from_numpy(rng.integers(lo, hi, n, dtype=np.int64, endpoint=True).astype(dtype))


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor widened to float64 / complex128 / int64 (bool stays bool) for comparison."""
    if t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return t.to(torch.float64).numpy()
    if t.dtype in (torch.complex64, torch.complex128):
        return t.to(torch.complex128).numpy()
    if t.dtype == torch.bool:
        return t.clone().numpy()
    return t.to(torch.int64).numpy()


def reference_reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """op over ranks in wide precision; bool follows Gloo (SUM/MAX=or, PRODUCT/MIN=and)."""
    x = np.stack(arrays)
    if x.dtype == np.bool_:
        if op in ("sum", "max", "bor"):
            return x.any(axis=0)
        if op in ("product", "min", "band"):
            return x.all(axis=0)
        return np.logical_xor.reduce(x, axis=0)
    reducers: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "sum": lambda a: a.sum(axis=0),
        "avg": lambda a: a.mean(axis=0),
        "premul_sum": lambda a: a.sum(axis=0) * SCALE,
        "product": lambda a: a.prod(axis=0),
        "min": lambda a: a.min(axis=0),
        "max": lambda a: a.max(axis=0),
        "band": lambda a: np.bitwise_and.reduce(a, axis=0),
        "bor": lambda a: np.bitwise_or.reduce(a, axis=0),
        "bxor": lambda a: np.bitwise_xor.reduce(a, axis=0),
    }
    return reducers[op](x)


def compare(what: str, got: torch.Tensor, want: np.ndarray, dtype: str) -> str | None:
    """None if ``got`` matches ``want`` (exactly, or within the dtype's tolerance)."""
    have = as_numpy(got).reshape(-1)
    want = np.asarray(want).reshape(-1)
    if have.shape != want.shape:
        return f"{what}: shape {have.shape} != expected {want.shape}"
    if dtype in TOLERANCE:
        rtol, atol = TOLERANCE[dtype]
        bad = ~np.isclose(have, want, rtol=rtol, atol=atol)
    else:
        bad = have != want
    if not bad.any():
        return None
    i = int(np.flatnonzero(bad)[0])
    return f"{what}: {int(bad.sum())}/{bad.size} elements differ, first at [{i}]: got {have[i]!r}, want {want[i]!r}"


def buffer_kind(layout: str, group_rank: int, role: str) -> str:
    kinds = LAYOUTS[layout][0]
    return kinds[(group_rank + (role == "out")) % len(kinds)]


def place(client: Any, kind: str, data: torch.Tensor) -> torch.Tensor:
    """``data`` copied into a buffer of the given kind (arena / plain / strided)."""
    n = data.numel()
    if kind == "arena":
        t = client.empty(n, data.dtype)
    elif kind == "strided":
        t = torch.empty((n, 2), dtype=data.dtype)[:, 1]
        assert n < 2 or not t.is_contiguous()
    else:
        t = torch.empty(n, dtype=data.dtype)
    t.copy_(data)
    return t


def counts_for(variant: str, size: int, unit: int) -> list[int]:
    if variant in ("uneven", "inplace_uneven"):
        return [unit + 7 * i for i in range(size)]
    if variant == "zero" and size > 1:
        return [0 if i == 1 else unit + 3 * i for i in range(size)]
    return [unit] * size


def splits_for(variant: str, size: int, unit: int) -> list[list[int]]:
    """splits[i][j]: elements group rank i sends to group rank j."""
    if variant == "uneven":
        return [[max(1, unit // 2 + 3 * i + 5 * j) for j in range(size)] for i in range(size)]
    if variant == "zero":
        return [[0 if (i + j) % 2 == 0 else unit + i + j for j in range(size)] for i in range(size)]
    return [[unit] * size for _ in range(size)]


def offsets(counts: list[int]) -> list[int]:
    return [sum(counts[:i]) for i in range(len(counts))]


# ---- one runner per op kind: returns None on success, else what went wrong --
@dataclass
class Env:
    """Everything one rank needs to run one case."""

    client: Any
    case: Case
    members: list[int]
    me: int  # group rank
    unit: int
    runtime_dir: str

    @property
    def size(self) -> int:
        return len(self.members)

    def kind(self, role: str) -> str:
        return buffer_kind(self.case.layout, self.me, role)

    def junk(self, n: int) -> torch.Tensor:
        return values(self.case, self.me, n, "junk")


def _kw(env: Env) -> dict[str, Any]:
    return {"group": env.case.group, "timeout": OP_TIMEOUT}


def _reduce_kw(env: Env) -> dict[str, Any]:
    scale = SCALE if env.case.op == "premul_sum" else None
    return {"op": env.case.op, "scale": scale, **_kw(env)}


def run_allreduce(env: Env) -> str | None:
    from commd.client import ops

    inputs = [values(env.case, g, env.unit) for g in range(env.size)]
    buf = place(env.client, env.kind("buf"), inputs[env.me])
    ops.all_reduce(env.client, buf, **_reduce_kw(env)).wait(OP_TIMEOUT)
    return compare("allreduce", buf, reference_reduce([as_numpy(x) for x in inputs], env.case.op), env.case.dtype)


def run_reduce(env: Env) -> str | None:
    from commd.client import ops

    inputs = [values(env.case, g, env.unit) for g in range(env.size)]
    buf = place(env.client, env.kind("buf"), inputs[env.me])
    ops.reduce(env.client, buf, env.case.root, **_reduce_kw(env)).wait(OP_TIMEOUT)
    if env.me != env.case.root:
        return None  # non-root buffers are unspecified after a reduce
    return compare("reduce", buf, reference_reduce([as_numpy(x) for x in inputs], env.case.op), env.case.dtype)


def run_broadcast(env: Env) -> str | None:
    from commd.client import ops

    data = values(env.case, env.case.root, env.unit)
    buf = place(env.client, env.kind("buf"), data if env.me == env.case.root else env.junk(env.unit))
    ops.broadcast(env.client, buf, env.case.root, **_kw(env)).wait(OP_TIMEOUT)
    return compare("broadcast", buf, as_numpy(data), env.case.dtype)


def run_allgather(env: Env) -> str | None:
    from commd.client import ops

    counts = counts_for(env.case.variant, env.size, env.unit)
    inputs = [values(env.case, g, counts[g]) for g in range(env.size)]
    want = np.concatenate([as_numpy(x) for x in inputs])
    if env.case.variant == "inplace":  # input is this rank's slice of the output
        out = place(env.client, "arena", env.junk(sum(counts)))
        at = offsets(counts)[env.me]
        inp = out[at : at + counts[env.me]]
        inp.copy_(inputs[env.me])
    else:
        out = place(env.client, env.kind("out"), env.junk(sum(counts)))
        inp = place(env.client, env.kind("in"), inputs[env.me])
    ops.all_gather(env.client, out, inp, counts, **_kw(env)).wait(OP_TIMEOUT)
    return compare("allgather out", out, want, env.case.dtype) or compare(
        "allgather input (must be unchanged)", inp, as_numpy(inputs[env.me]), env.case.dtype
    )


def run_gather(env: Env) -> str | None:
    from commd.client import ops

    counts = counts_for(env.case.variant, env.size, env.unit)
    inputs = [values(env.case, g, counts[g]) for g in range(env.size)]
    inp = place(env.client, env.kind("in"), inputs[env.me])
    is_root = env.me == env.case.root
    out = place(env.client, env.kind("out"), env.junk(sum(counts))) if is_root else None
    ops.gather(env.client, out, inp, env.case.root, counts, **_kw(env)).wait(OP_TIMEOUT)
    if out is None:
        return compare("gather input (must be unchanged)", inp, as_numpy(inputs[env.me]), env.case.dtype)
    return compare("gather out", out, np.concatenate([as_numpy(x) for x in inputs]), env.case.dtype)


def run_scatter(env: Env) -> str | None:
    from commd.client import ops

    counts = counts_for(env.case.variant, env.size, env.unit)
    parts = [values(env.case, g, counts[g], "part") for g in range(env.size)]
    is_root = env.me == env.case.root
    inp = place(env.client, env.kind("in"), torch.cat(parts)) if is_root else None
    out = place(env.client, env.kind("out"), env.junk(counts[env.me]))
    ops.scatter(env.client, out, inp, env.case.root, counts, **_kw(env)).wait(OP_TIMEOUT)
    return compare("scatter out", out, as_numpy(parts[env.me]), env.case.dtype)


def run_reduce_scatter(env: Env) -> str | None:
    from commd.client import ops

    counts = counts_for(env.case.variant, env.size, env.unit)
    total, at = sum(counts), offsets(counts)[env.me]
    inputs = [values(env.case, g, total) for g in range(env.size)]
    if env.case.variant == "inplace":  # output is this rank's chunk of its own input
        inp = place(env.client, "arena", inputs[env.me])
        out = inp[at : at + counts[env.me]]
    else:
        inp = place(env.client, env.kind("in"), inputs[env.me])
        out = place(env.client, env.kind("out"), env.junk(counts[env.me]))
    ops.reduce_scatter(env.client, out, inp, counts=counts, **_reduce_kw(env)).wait(OP_TIMEOUT)
    want = reference_reduce([as_numpy(x)[at : at + counts[env.me]] for x in inputs], env.case.op)
    return compare("reduce_scatter out", out, want, env.case.dtype)


def run_alltoall(env: Env) -> str | None:
    from commd.client import ops

    splits = splits_for(env.case.variant, env.size, env.unit)
    me = env.me
    inputs = [values(env.case, g, sum(splits[g])) for g in range(env.size)]
    want = np.concatenate(
        [as_numpy(inputs[i])[offsets(splits[i])[me] : offsets(splits[i])[me] + splits[i][me]] for i in range(env.size)]
    )
    splits_in = splits[me]
    splits_out = [splits[i][me] for i in range(env.size)]
    inp = place(env.client, env.kind("in"), inputs[me])
    out = place(env.client, env.kind("out"), env.junk(sum(splits_out)))
    ops.all_to_all(env.client, out, inp, splits_in, splits_out, **_kw(env)).wait(OP_TIMEOUT)
    return compare("alltoall out", out, want, env.case.dtype) or compare(
        "alltoall input (must be unchanged)", inp, as_numpy(inputs[me]), env.case.dtype
    )


def run_sendrecv(env: Env) -> str | None:
    """ring: send right, receive from left; anysource: the same with src=-1;
    tags: three messages, received out of order by tag (FIFO within a tag);
    fanin: every rank sends to group rank 0, which receives them all from any source."""
    from commd.client import ops

    case, me, size, n = env.case, env.me, env.size, env.unit
    if size < 2:
        return None
    right, left = (me + 1) % size, (me - 1) % size

    def msg(src: int, label: str) -> torch.Tensor:
        return values(case, src, n, f"msg-{label}")

    kw = _kw(env)
    problems: list[str | None] = []
    if case.variant in ("ring", "anysource"):
        out = place(env.client, env.kind("out"), env.junk(n))
        src = place(env.client, env.kind("in"), msg(me, "ring"))  # must outlive the send
        h_send = ops.send(env.client, src, right, tag=3, **kw)
        h_recv = ops.recv(env.client, out, -1 if case.variant == "anysource" else left, tag=3, **kw)
        h_send.wait(OP_TIMEOUT)
        h_recv.wait(OP_TIMEOUT)
        problems.append(compare("recv", out, as_numpy(msg(left, "ring")), case.dtype))
        if h_recv.src != left:
            problems.append(f"recv reports source {h_recv.src}, expected {left}")
    elif case.variant == "tags":
        srcs = {label: place(env.client, env.kind("in"), msg(me, label)) for label in ("a1", "b", "a2")}
        sends = [ops.send(env.client, srcs[label], right, tag=tag, **kw) for label, tag in (("a1", 1), ("b", 2), ("a2", 1))]
        outs = {label: place(env.client, env.kind("out"), env.junk(n)) for label in ("b", "a1", "a2")}
        recvs = {label: ops.recv(env.client, outs[label], left, tag=tag, **kw)
                 for label, tag in (("b", 2), ("a1", 1), ("a2", 1))}
        for h in [*sends, *recvs.values()]:
            h.wait(OP_TIMEOUT)
        for label, out in outs.items():
            problems.append(compare(f"recv tag message {label}", out, as_numpy(msg(left, label)), case.dtype))
    elif case.variant == "fanin":
        if me == 0:
            outs = [place(env.client, env.kind("out"), env.junk(n)) for _ in range(size - 1)]
            handles = [ops.recv(env.client, out, -1, tag=9, **kw) for out in outs]
            sources = []
            for h, out in zip(handles, outs, strict=True):
                h.wait(OP_TIMEOUT)
                sources.append(h.src)
                if h.src is None or not 0 < h.src < size:
                    problems.append(f"any-source recv reports source {h.src}")
                else:
                    problems.append(compare(f"recv from {h.src}", out, as_numpy(msg(h.src, "fanin")), case.dtype))
            if sorted(s for s in sources if s is not None) != list(range(1, size)):
                problems.append(f"any-source recvs got sources {sources}, expected each of 1..{size - 1} once")
        else:
            src = place(env.client, env.kind("in"), msg(me, "fanin"))
            ops.send(env.client, src, 0, tag=9, **kw).wait(OP_TIMEOUT)
    return "; ".join(p for p in problems if p) or None


def run_barrier(env: Env) -> str | None:
    """Everyone's marker file exists after the barrier: nobody left it early."""
    from commd.client import ops

    marker = Path(env.runtime_dir) / f"barrier-{zlib.crc32(env.case.cid.encode())}-{{}}"
    Path(str(marker).format(env.me)).touch()
    ops.barrier(env.client, **_kw(env)).wait(OP_TIMEOUT)
    missing = [g for g in range(env.size) if not Path(str(marker).format(g)).exists()]
    return f"left the barrier before group ranks {missing} entered it" if missing else None


RUNNERS: dict[str, Callable[[Env], str | None]] = {
    "allreduce": run_allreduce, "reduce": run_reduce, "broadcast": run_broadcast,
    "allgather": run_allgather, "gather": run_gather, "scatter": run_scatter,
    "reduce_scatter": run_reduce_scatter, "alltoall": run_alltoall, "sendrecv": run_sendrecv,
    "barrier": run_barrier,
}


def run_case(env: Env) -> str | None:
    """Run one case; undefined reductions must fail with RequestError instead."""
    from commd.client.errors import RequestError

    if not env.case.expect_error:
        return RUNNERS[env.case.kind](env)
    try:
        RUNNERS[env.case.kind](env)
    except RequestError as exc:
        if env.case.dtype not in str(exc):
            return f"RequestError does not name the dtype: {exc}"
        return None
    return f"{env.case.op} on {env.case.dtype} did not raise RequestError"


def ops_worker(ctx: WorkerContext, cases: list[Case], groups: dict[str, list[int]]) -> dict[str, str | None]:
    """Run every case this rank takes part in; report per-case errors (None = passed)."""
    from commd.client.errors import CommTimeoutError

    # Automatic cyclic GC can run inside Arena.allocate and deadlock it (see
    # test_arena_gc_during_allocate_does_not_deadlock); collect between cases instead.
    gc.disable()
    client = ctx.connect(groups={k: v for k, v in groups.items() if k != "world"})
    gc.collect()
    gc.freeze()  # keeps the periodic collections below cheap
    results: dict[str, str | None] = {}
    hung = None
    for i, case in enumerate(cases):
        if i % 64 == 0:
            gc.collect()
        members = groups[case.group]
        if ctx.rank not in members:
            continue
        if hung is not None:  # the ranks are out of step now; don't wait 20 s per case
            results[case.cid] = f"not run: an earlier case timed out ({hung})"
            continue
        env = Env(client, case, members, members.index(ctx.rank), LAYOUTS[case.layout][1], ctx.runtime_dir)
        try:
            results[case.cid] = run_case(env)
        except CommTimeoutError:
            hung = case.cid
            results[case.cid] = traceback.format_exc(limit=4)
        except Exception:
            results[case.cid] = traceback.format_exc(limit=4)
    client.close()
    return results


# ---- the runs and the tests --------------------------------------------------
@dataclass
class OpRun:
    """Per-case outcomes of one world size's run, sliced by the tests below."""

    world: int
    cases: list[Case]
    ran: dict[str, set[int]]  # case id -> ranks that reported it
    failures: dict[str, list[str]]

    def check(self, select: Callable[[Case], bool]) -> None:
        """Every selected case ran on all its members and passed."""
        chosen = [c for c in self.cases if select(c)]
        assert chosen, "no case selected"
        groups = groups_for(self.world)
        not_run = [c.cid for c in chosen if self.ran.get(c.cid, set()) != set(groups[c.group])]
        failed = {c.cid: self.failures[c.cid] for c in chosen if c.cid in self.failures}
        report = "\n".join(f"{cid}:\n  " + "\n  ".join(errs) for cid, errs in list(failed.items())[:15])
        assert not not_run, f"cases never run: {not_run[:10]}"
        assert not failed, f"{len(failed)}/{len(chosen)} cases failed on {self.world} ranks:\n{report}"


@pytest.fixture(scope="module", params=[pytest.param(2, id="2ranks"),  # 3 ranks: make test-extended
                                        pytest.param(3, id="3ranks", marks=pytest.mark.extended)])
def op_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> OpRun:
    """One daemon and one set of workers per world size run the whole case list."""
    world = request.param
    runtime_dir = tmp_path_factory.mktemp("rt")
    job = new_job()
    cases = build_cases(world)
    daemon = DaemonProcess.start(runtime_dir, job, op_timeout=30)
    workers = Workers(ops_worker, world, job, runtime_dir, (cases, groups_for(world)))
    try:
        workers.start()
        daemon.wait_ready()
        per_rank = workers.join(timeout=95)
    except WorkerFailed as exc:
        raise AssertionError(f"{exc}\n--- daemon log ---\n{daemon.log_tail()}") from None
    finally:
        workers.close()
        daemon.stop()
    ran: dict[str, set[int]] = {}
    failures: dict[str, list[str]] = {}
    for rank, results in sorted(per_rank.items()):
        for cid, error in results.items():
            ran.setdefault(cid, set()).add(rank)
            if error:
                failures.setdefault(cid, []).append(f"rank {rank}: {error}")
    return OpRun(world, cases, ran, failures)


@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_op_kind_matches_numpy(op_run: OpRun, kind: str) -> None:
    """Each op kind over every dtype, reduce op, layout and group matches the reference."""
    op_run.check(lambda c: c.kind == kind and not c.expect_error)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_per_dtype(op_run: OpRun, dtype: str) -> None:
    """Every defined reduce op on this dtype, for allreduce, reduce and reduce_scatter."""
    op_run.check(lambda c: c.kind in REDUCING and c.dtype == dtype and not c.expect_error)


def test_undefined_reductions_raise_request_error(op_run: OpRun) -> None:
    """Bitwise on float/complex, avg/premul on int/bool, min/max on complex: RequestError on every rank."""
    op_run.check(lambda c: c.expect_error)
    undefined = {(c.op, c.dtype) for c in op_run.cases if c.expect_error}
    assert {("band", "float32"), ("avg", "int32"), ("max", "complex64"), ("premul_sum", "bool")} <= undefined


@pytest.mark.parametrize(
    "layout", sorted(LAYOUTS)
)
def test_buffer_layouts(op_run: OpRun, layout: str) -> None:
    """Arena (zero-copy), inline (<= 4096 B), staged (> 4096 B), strided, mixed and > 1 MiB buffers."""
    op_run.check(lambda c: c.layout == layout and not c.expect_error)


def test_uneven_and_zero_counts(op_run: OpRun) -> None:
    """Counted ops and all-to-all with per-rank sizes that differ or are zero."""
    op_run.check(lambda c: c.variant in ("uneven", "zero"))


def test_inplace_aliasing(op_run: OpRun) -> None:
    """all_gather_into_tensor / reduce_scatter_tensor with input and output sharing memory."""
    op_run.check(lambda c: c.variant == "inplace")


def test_subgroups(op_run: OpRun) -> None:
    """Subsets and reordered groups run while non-members do other work."""
    op_run.check(lambda c: c.group != "world")


def test_point_to_point_any_source_and_tags(op_run: OpRun) -> None:
    """recv(src=-1) reports the sender; tags select messages; FIFO order within a tag."""
    op_run.check(lambda c: c.kind == "sendrecv" and c.variant in ("anysource", "tags", "fanin"))


# ---- one client used from several threads ---------------------------------------
@pytest.mark.timeout(90)
def test_threads_sharing_a_client(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """Several threads submit and wait on one client at once (each on its own group, so the
    ranks agree on the order); every result is right and nothing is lost or stuck."""
    import threading

    from commd.client import ops

    clients = [connect(r, 2) for r in range(2)]
    threads, rounds = 4, 40
    for k in range(threads):
        for c in clients:
            c.register_group(f"thread{k}", [0, 1])
    errors: list[str] = []

    def run(k: int) -> None:
        try:
            for i in range(rounds):
                n = 8 if i % 2 else 3000  # inline and staged
                tensors = [torch.full((n,), float(k * 1000 + i + r)) for r in range(2)]
                handles = [ops.all_reduce(c, t, group=f"thread{k}") for c, t in zip(clients, tensors, strict=True)]
                for h in reversed(handles):
                    h.wait(20)
                want = float(2 * (k * 1000 + i) + 1)
                if not all(bool((t == want).all()) for t in tensors):
                    errors.append(f"thread {k} round {i}: got {[t[0].item() for t in tensors]}, want {want}")
        except Exception as exc:  # reported below with the thread's name
            errors.append(f"thread {k}: {exc!r}")

    workers = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a thread is stuck"
    assert not errors, "\n".join(errors[:10])


# ---- minimal reproductions of client-side bugs ----------------------------------
@pytest.mark.timeout(60)
def test_noncontiguous_inline_input_is_sent_intact(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """A small strided view (sent inline, as bytes in the message) must arrive unchanged."""
    from commd.client import ops

    clients = [connect(r, 2) for r in range(2)]
    views = [(torch.arange(64, dtype=torch.float64).view(32, 2) * (r + 1))[:, 0] for r in range(2)]
    assert not views[0].is_contiguous()
    expected = views[0] + views[1]
    handles = [ops.all_reduce(c, v) for c, v in zip(clients, views, strict=True)]
    for h in handles:
        h.wait(10)
    for rank, view in enumerate(views):
        assert torch.equal(view, expected), f"rank {rank}: got {view[:4].tolist()}..., want {expected[:4].tolist()}..."



@pytest.mark.timeout(60)
def test_arena_gc_during_allocate_does_not_deadlock(job: str) -> None:
    """Blocks reachable only through reference cycles are freed by the cyclic GC, which
    may run inside Arena.allocate; that must not deadlock (it hangs whole training runs)."""
    code = textwrap.dedent(
        f"""
        import gc
        from commd.memory.arena import Arena
        arena = Arena("commd-{job}-gc", 1 << 20)
        gc.set_threshold(1)  # collect at (nearly) every allocation: deterministic
        try:
            class Node:
                pass
            for _ in range(200):
                node = Node()
                node.cycle = node
                node.block = arena.allocate(256)
                del node
        finally:
            for segment in arena.segments:
                segment.close_fd()
        print("ok")
        """
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("Arena.allocate deadlocked when the cyclic GC freed a block inside it")
    finally:
        for name in shm_files(job):
            Path("/dev/shm", name).unlink(missing_ok=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.timeout(60)
def test_pending_send_keeps_its_arena_buffer_alive(daemon: DaemonProcess, connect: Callable[..., Any]) -> None:
    """The handle of a pending op must keep its zero-copy buffer alive: Python frees
    tensors implicitly, so the caller cannot be expected to hold them until completion."""
    from commd.client import ops

    receiver, sender = connect(0, 2), connect(1, 2)
    data = torch.arange(256, dtype=torch.float32)

    def submit() -> Any:
        buf = sender.empty(256, torch.float32)
        buf.copy_(data)
        return ops.send(sender, buf, 0)  # only the handle survives this call

    handle = submit()
    reused = sender.empty(256, torch.float32)  # first fit: the block `buf` had, if it was freed
    reused.fill_(-1)
    out = torch.zeros(256)
    ops.recv(receiver, out, 1).wait(10)
    handle.wait(10)
    assert torch.equal(out, data), f"received {out[:4].tolist()}..., sent {data[:4].tolist()}..."
