"""The compiler's driver: a DSL program through every stage to the IR.

trace (``dsl``) → ``dag`` → ``fusion`` → ``schedule`` → ``instances`` → ``lower``.  The
program is taken as what it records (its trace, collective, buffers and options), so the
stages never import the language itself.
"""

from __future__ import annotations

from typing import Any

from commd.algorithms import dag as dag_stage
from commd.algorithms import fusion, instances, lower, schedule
from commd.algorithms.collectives import Buffer
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm, collective_name, collective_spellings
from commd.algorithms.trace import ThreadblockPolicy


def _io_chunks(prog: Any, dag: dag_stage.Dag) -> list[tuple[int, int]]:
    """Each rank's (input, output) chunk counts for one instance.

    A built-in collective declares them (an aliased in-place buffer has none of its own), so
    does a :class:`~commd.algorithms.collectives.Custom` one; a collective subclassed
    MSCCLang's way has what its steps touch, as MSCCL writes it.
    """
    coll = prog.collective
    used: dict[tuple[int, str], int] = {}
    for ins in dag.all():
        for s in (ins.src, ins.dst):
            if s is not None and s.buffer in ("i", "o"):
                used[(s.rank, s.buffer)] = max(used.get((s.rank, s.buffer), 0), s.end)
    counts = []
    for r in range(prog.num_ranks):
        if hasattr(coll, "declared_chunks"):
            i, o = coll.declared_chunks(r)
            counts.append((max(i, used.get((r, "i"), 0)), max(o, used.get((r, "o"), 0))))
            continue
        if getattr(coll, "ir_name", "custom") == "custom":
            counts.append((used.get((r, "i"), 0), used.get((r, "o"), 0)))
            continue
        i_alias = coll.get_buffer_index(r, Buffer.input, 0)[0] == Buffer.output
        o_alias = coll.get_buffer_index(r, Buffer.output, 0)[0] == Buffer.input
        bufs = prog.buffers[r]
        counts.append((0 if i_alias else len(bufs.get(Buffer.input) or []),
                       0 if o_alias else len(bufs.get(Buffer.output) or [])))
    return counts


def _check_interleaving(prog: Any) -> None:
    """Refuse interleaved instances over refs that cut the same chunks differently.

    Interleaving keeps each ref contiguous (MSCCL's rule: chunk j of a ref of size k moves to
    ``j·instances + i·k``), which places a chunk consistently only if every ref touching it
    has the same start and size; otherwise the instances would read each other's data.
    """
    cuts: dict[tuple[int, str], set[tuple[int, int]]] = {}
    for op in prog.trace:
        for s in (op.src, op.dst):
            if s.buffer in ("i", "o"):
                cuts.setdefault((s.rank, s.buffer), set()).add((s.index, s.size))
    for (rank, buf), refs in sorted(cuts.items()):
        ordered = sorted(refs)
        for (a, n), (b, m) in zip(ordered, ordered[1:], strict=False):
            if b < a + n:
                raise ProgramError(f"interleaved instances of refs [{a}, {a + n}) and [{b}, {b + m}) of buffer "
                                   f"{buf!r} would mix the instances' chunks; give them the same cut, or use "
                                   f"interleaved_replication=False", source=prog.source, rank=rank)


def compile_program(prog: Any) -> Algorithm:
    """``prog`` lowered to the IR."""
    named = getattr(prog.collective, "ir_name", "custom")
    coll = collective_name(named) if isinstance(named, str) else None  # (a user's collective may say reduce_scatter)
    if coll is None:
        raise ProgramError(f"collective {named!r} is not one of {collective_spellings()}", source=prog.source)
    if not prog.trace:
        raise ProgramError("the program moves no chunks", source=prog.source)
    if prog.instances > 1 and prog.interleaved_replication:
        _check_interleaving(prog)
    dag = dag_stage.build(prog.trace, prog.num_ranks)
    io_chunks = _io_chunks(prog, dag)
    if prog.instr_fusion:
        fusion.fuse(dag)
    sched = schedule.assign(dag, prog.source, prog.threadblock_policy is ThreadblockPolicy.manual)
    schedule.order(dag, sched, prog.source)
    extents = instances.scratch_extents(sched)
    sizes = {(r, b): n for r, (i, o) in enumerate(io_chunks) for b, n in (("i", i), ("o", o))}
    sched = instances.replicate(sched, prog.instances, sizes, prog.interleaved_replication)
    k = prog.instances
    return lower.lower(sched, name=prog.name, coll=coll, inplace=bool(prog.collective.inplace), proto=prog.protocol,
                       io_chunks=[(i * k, o * k) for i, o in io_chunks], extents=extents, instances=k)


compile = compile_program  # noqa: A001 - the name the package's users call
