"""Seeded random programs of ops for the deadlock stress test.

Every rank builds the same program from the seed: a list of ops of every
kind on random groups (world and random subsets spanning random nodes), with
random sizes, dtypes, roots, lanes and (for tcp-lane all-reduces) library programs.  Each rank submits its ops
asynchronously in program order, sleeping at random points (its own seeded
stream, so ranks drift apart), then waits on its handles in a random order
and checks every result against a NumPy reference it computes itself.  Every program ends with a
loop that repeats, then deviates, then repeats again: the fabric's schedule path in the mix.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from commd.client import ops

KINDS = ["allreduce", "reduce", "broadcast", "allgather", "gather", "scatter", "reduce_scatter", "alltoall",
         "barrier", "sendrecv"]
DTYPES = [np.float32, np.float64, np.int32, np.int64]
#: The library's all-reduce programs a tcp-lane all-reduce may name (beside the lane's own algorithm).
ALGORITHMS = ["oneshot", "twoshot", "halving_doubling", "ring"]
#: Codecs a tcp-lane broadcast may name (bf16 for float32 only; the small integers stay exact in it).
CODECS = ["lossless", "bf16"]
#: A compressed broadcast's elements: past the 1 MiB below which ops run uncompressed.
CODEC_N = 300_000


@dataclass
class Op:
    index: int
    kind: str
    group: str
    members: list[int]
    n: int
    dtype: Any
    lane: str | None
    root: int = 0
    reduce_op: str = "sum"
    counts: list[int] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)
    src: int = 0
    dst: int = 0
    algo: str | None = None  # an all-reduce's program (its hint; groups within one node ignore it)
    codec: str | None = None  # a broadcast's codec (groups within one node ignore it)
    arena: bool = False  # the buffer lives in the client's arena (zero copy) rather than being copied
    twice: bool = False  # all-reduce the same buffer twice in a row (program order across a fused set)
    drain: bool = False  # wait for every op submitted before this one first (a loop starts after them)


def make_groups(seed: int, world: int) -> dict[str, list[int]]:
    rng = random.Random(seed * 31 + 7)
    groups = {"world": list(range(world))}
    for i in range(3):
        size = rng.randint(2, world)
        members = rng.sample(range(world), size)  # random order: group ranks differ from global ranks
        groups[f"s{i}"] = members
    return groups


def make_program(seed: int, world: int, lanes: list[str], length: int) -> tuple[dict[str, list[int]], list[Op]]:
    rng = random.Random(seed)
    algo_rng = random.Random(seed * 7919 + 3)  # its own stream: the programs of a seed stay what they were
    codec_rng = random.Random(seed * 104729 + 5)  # likewise
    groups = make_groups(seed, world)
    program = []
    for i in range(length):
        kind = rng.choice(KINDS)
        name = rng.choice(sorted(groups))
        members = groups[name]
        k = len(members)
        n = rng.choice([0, 1, 3, 17, 1000, 20_000, 70_000])
        dtype = rng.choice(DTYPES)
        lane = rng.choice([*lanes, None])
        op = Op(i, kind, name, members, n, dtype, lane, root=rng.randrange(k))
        if kind in ("allreduce", "reduce", "reduce_scatter"):
            op.reduce_op = rng.choice(["sum", "max", "min"])
        if kind in ("allgather", "gather", "scatter", "reduce_scatter"):
            op.counts = [rng.randint(0, max(1, n // k)) for _ in range(k)]
        if kind == "alltoall":
            op.splits = [[rng.randint(0, max(1, n // (k * k))) for _ in range(k)] for _ in range(k)]
        if kind == "sendrecv":
            op.src, op.dst = rng.sample(range(k), 2)
        if kind == "allreduce" and lane in (None, "tcp"):  # (a program runs on the tcp lane only)
            op.algo = algo_rng.choice([None, *ALGORITHMS])
        if kind == "broadcast" and lane in (None, "tcp"):  # (so does a codec)
            choices = [c for c in CODECS if c != "bf16" or dtype == np.float32]
            op.codec = codec_rng.choice([None, None, *choices])
            if op.codec is not None:
                op.n = CODEC_N
        program.append(op)
        if kind == "allreduce" and rng.random() < 0.5:
            # a burst of small all-reduces like one op (group, dtype, reduce op, lane): what fusion fuses
            for _ in range(rng.randint(2, 8)):
                small = Op(len(program), kind, name, members, rng.randint(1, 300), dtype, lane,
                           reduce_op=op.reduce_op, arena=rng.random() < 0.5, twice=rng.random() < 0.25,
                           algo=op.algo)
                program.append(small)
    program += _loop(random.Random(seed * 15485863 + 11), groups["world"])
    for index, op in enumerate(program):
        op.index = index
    return groups, program


def _loop(rng: random.Random, world: list[int]) -> list[Op]:
    """The program's tail: a training loop's step (a few all-reduces and broadcasts on the world
    group) repeated, so that the fabric's schedule path takes it (fabric/scheduled.py), with one
    step that deviates mid-stream (another size) and the loop again after it.  Its own random
    stream: the ops before it stay what each seed always made."""
    # (all-reduces past the fusion threshold: a burst of small ones is fused, and fused sets never
    # form a schedule; broadcasts of any size)
    step = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["allreduce", "broadcast"])
        n = 20_000 if kind == "allreduce" else rng.choice([1, 17, 1000, 20_000])
        step.append((kind, n, rng.choice(DTYPES), rng.randrange(len(world)), rng.choice([None, "tcp"])))
    deviate_at = rng.randint(4, 6)
    ops_: list[Op] = []
    for repeat in range(14):
        for k, (kind, n, dtype, root, lane) in enumerate(step):
            size = n + 1 if repeat == deviate_at and k == len(step) - 1 else n
            ops_.append(Op(0, kind, "world", world, size, dtype, lane, root=root, drain=not ops_))
    return ops_


def _data(op: Op, grank: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(op.index * 1009 + grank)
    return rng.integers(-9, 9, n).astype(op.dtype)


def _reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    stack = np.stack(arrays) if arrays else np.zeros(0)
    return {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}[op].astype(arrays[0].dtype)


def _submit(client: Any, op: Op, me: int) -> tuple[Any, Any, np.ndarray | None]:
    """Submit this rank's part of ``op``; returns (handle, output tensor, expected output or None)."""
    g = op.members.index(me)
    k = len(op.members)
    kw = {"group": op.group, "lane": op.lane, "timeout": 120}
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a).copy())  # noqa: E731
    if op.kind == "allreduce":
        kw["algo"] = op.algo
        buf = t(_data(op, g, op.n))
        if op.arena:
            buf = client.empty(op.n, buf.dtype).copy_(buf)
        want = _reduce([_data(op, r, op.n) for r in range(k)], op.reduce_op)
        handle = ops.all_reduce(client, buf, op.reduce_op, **kw)
        if op.twice:  # the second sees the first's result: sum doubles k-fold, max/min stay
            handle = ops.all_reduce(client, buf, op.reduce_op, **kw)
            want = _reduce([want] * k, op.reduce_op)
        return handle, buf, want
    if op.kind == "reduce":
        buf = t(_data(op, g, op.n))
        want = _reduce([_data(op, r, op.n) for r in range(k)], op.reduce_op) if g == op.root else _data(op, g, op.n)
        return ops.reduce(client, buf, op.root, op.reduce_op, **kw), buf, want
    if op.kind == "broadcast":
        buf = t(_data(op, g, op.n))
        return ops.broadcast(client, buf, op.root, **kw, compression=op.codec), buf, _data(op, op.root, op.n)
    if op.kind in ("allgather", "gather"):
        inp = t(_data(op, g, op.counts[g]))
        full = np.concatenate([_data(op, r, op.counts[r]) for r in range(k)])
        if op.kind == "allgather":
            out = torch.empty(sum(op.counts), dtype=inp.dtype)
            return ops.all_gather(client, out, inp, op.counts, **kw), out, full
        out = torch.empty(sum(op.counts), dtype=inp.dtype) if g == op.root else None
        return ops.gather(client, out, inp, op.root, op.counts, **kw), out, full if g == op.root else None
    if op.kind == "scatter":
        src = _data(op, op.root, sum(op.counts))
        out = torch.empty(op.counts[g], dtype=torch.from_numpy(src).dtype)
        start = sum(op.counts[:g])
        inp = t(src) if g == op.root else None
        return ops.scatter(client, out, inp, op.root, op.counts, **kw), out, src[start : start + op.counts[g]]
    if op.kind == "reduce_scatter":
        inp = t(_data(op, g, sum(op.counts)))
        out = torch.empty(op.counts[g], dtype=inp.dtype)
        total = _reduce([_data(op, r, sum(op.counts)) for r in range(k)], op.reduce_op)
        start = sum(op.counts[:g])
        handle = ops.reduce_scatter(client, out, inp, op.reduce_op, op.counts, **kw)
        return handle, out, total[start : start + op.counts[g]]
    if op.kind == "alltoall":
        inp = t(_data(op, g, sum(op.splits[g])))
        splits_out = [op.splits[j][g] for j in range(k)]
        out = torch.empty(sum(splits_out), dtype=inp.dtype)
        pieces = []
        for j in range(k):
            src = _data(op, j, sum(op.splits[j]))
            off = sum(op.splits[j][:g])
            pieces.append(src[off : off + op.splits[j][g]])
        return ops.all_to_all(client, out, inp, op.splits[g], splits_out, **kw), out, np.concatenate(pieces)
    if op.kind == "barrier":
        return ops.barrier(client, **kw), None, None
    # sendrecv: one pair of the group; a unique tag per op
    if g == op.src:
        return ops.send(client, t(_data(op, g, op.n)), op.dst, tag=op.index, **kw), None, None
    if g == op.dst:
        buf = torch.empty(op.n, dtype=torch.from_numpy(_data(op, 0, 0)).dtype)
        return ops.recv(client, buf, op.src, tag=op.index, **kw), buf, _data(op, op.src, op.n)
    return None, None, None


def _check_done(op: Op, handle: Any, out: Any, want: np.ndarray | None, seed: int) -> None:
    """Wait for one op and check its result against NumPy."""
    handle.wait(180)
    if want is not None:
        got = out.numpy()
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(
                f"seed {seed} op {op.index} {op.kind} on {op.group} lane {op.lane} algo {op.algo} codec {op.codec} "
                f"n={op.n}: got {got[:6]} want {want[:6]}"
            )


def run_programs(ctx: Any, seeds: list[int], lanes: list[str], length: int, max_delay_ms: float) -> list[str]:
    """Worker: run every seeded program; return one line per program."""
    lines = []
    client = None
    for seed in seeds:
        groups, program = make_program(seed, ctx.world_size, lanes, length)
        if client is None:
            client = ctx.connect()
        for name, members in groups.items():
            if name != "world" and ctx.rank in members:
                client.register_group(f"{name}.{seed}", members)
        rng = random.Random(seed * 1_000_003 + ctx.rank)
        pending = []
        count = 0
        started = time.monotonic()
        for op in program:
            if op.drain:
                rng.shuffle(pending)
                for done in pending:
                    _check_done(*done, seed=seed)
                count += len(pending)
                pending = []
            if ctx.rank not in op.members:
                continue
            if op.group != "world":
                op.group = f"{op.group}.{seed}"
            if rng.random() < 0.2:
                time.sleep(rng.random() * max_delay_ms / 1000)
            handle, out, want = _submit(client, op, ctx.rank)
            if handle is not None:
                pending.append((op, handle, out, want))
        rng.shuffle(pending)
        for done in pending:
            _check_done(*done, seed=seed)
            count += 1
        lines.append(f"seed {seed}: {count} ops ok in {time.monotonic() - started:.1f}s")
    if client is not None:
        client.close()
    return lines
