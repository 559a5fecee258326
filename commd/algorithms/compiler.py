"""The compiler's driver: a DSL program through every stage to the IR, and DSL program files run to collect theirs.

trace (``dsl``) → ``dag`` → ``fusion`` → ``schedule`` → ``instances`` → ``lower``.
``compile_file`` runs a program file as msccl-tools would (its ``XML()`` and ``Check()``
output captured, ``sys.argv`` set to its arguments) with the ``msccl`` import names
pointing at this package, so msccl-tools programs compile unmodified.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import types
from collections.abc import Iterator, Sequence

from commd.algorithms import dag as dag_stage
from commd.algorithms import dsl, fusion, instances, lower, schedule
from commd.algorithms.collectives import Buffer
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import COLLECTIVES, Algorithm


def _io_chunks(prog: dsl.MSCCLProgram, dag: dag_stage.Dag) -> list[tuple[int, int]]:
    """Each rank's (input, output) chunk counts for one instance.

    A built-in collective declares them (an aliased in-place buffer has none of its own);
    a custom one has what its steps touch, as MSCCL writes it.
    """
    coll = prog.collective
    used: dict[tuple[int, str], int] = {}
    for ins in dag.all():
        for s in (ins.src, ins.dst):
            if s is not None and s.buffer in ("i", "o"):
                used[(s.rank, s.buffer)] = max(used.get((s.rank, s.buffer), 0), s.end)
    counts = []
    for r in range(prog.num_ranks):
        if getattr(coll, "ir_name", "custom") == "custom":
            counts.append((used.get((r, "i"), 0), used.get((r, "o"), 0)))
            continue
        i_alias = coll.get_buffer_index(r, Buffer.input, 0)[0] == Buffer.output
        o_alias = coll.get_buffer_index(r, Buffer.output, 0)[0] == Buffer.input
        bufs = prog.buffers[r]
        counts.append((0 if i_alias else len(bufs.get(Buffer.input) or []),
                       0 if o_alias else len(bufs.get(Buffer.output) or [])))
    return counts


def compile_program(prog: dsl.MSCCLProgram) -> Algorithm:
    """``prog`` lowered to the IR."""
    coll = getattr(prog.collective, "ir_name", "custom")
    if coll not in COLLECTIVES:
        raise ProgramError(f"collective {coll!r} is not one of {', '.join(COLLECTIVES)}", source=prog.source)
    if not prog.trace:
        raise ProgramError("the program moves no chunks", source=prog.source)
    dag = dag_stage.build(prog.trace, prog.num_ranks)
    io_chunks = _io_chunks(prog, dag)
    if prog.instr_fusion:
        fusion.fuse(dag)
    sched = schedule.assign(dag, prog.source, prog.threadblock_policy is dsl.ThreadblockPolicy.manual)
    schedule.order(dag, sched, prog.source)
    extents = instances.scratch_extents(sched)
    sizes = {(r, b): n for r, (i, o) in enumerate(io_chunks) for b, n in (("i", i), ("o", o))}
    sched = instances.replicate(sched, prog.instances, sizes, prog.interleaved_replication)
    k = prog.instances
    return lower.lower(sched, name=prog.name, coll=coll, inplace=bool(prog.collective.inplace), proto=prog.protocol,
                       io_chunks=[(i * k, o * k) for i, o in io_chunks], extents=extents, instances=k)


compile = compile_program  # noqa: A001 - the name the package's users call


def _msccl_modules() -> dict[str, types.ModuleType]:
    """Stand-ins for msccl-tools' import names, all pointing at this package's DSL."""
    mods = {}
    for name in ("msccl", "msccl.language", "msccl.language.collectives", "msccl.topologies",
                 "msccl.topologies.distributed", "msccl.collectives", "msccl.language.ir",
                 "msccl.language.buffer", "msccl.language.chunk"):
        mod = types.ModuleType(name)
        mod.__dict__.update({k: getattr(dsl, k) for k in dsl.__all__})
        mod.__all__ = list(dsl.__all__)  # type: ignore[attr-defined]
        mods[name] = mod
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


@contextlib.contextmanager
def _as_msccl() -> Iterator[None]:
    saved = {name: sys.modules.get(name) for name in _msccl_modules()}
    sys.modules.update(_msccl_modules())
    try:
        yield
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod


def compile_file(path: str | os.PathLike[str], argv: Sequence[str] = ()) -> list[Algorithm]:
    """Run a DSL program file with arguments ``argv``; the IR of every program it builds, in order."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ProgramError("no such program file", source=path)
    saved_argv = sys.argv
    sys.argv = [path, *argv]
    out = io.StringIO()
    collected: list[dsl.MSCCLProgram] = []
    try:
        with dsl.collecting() as collected, _as_msccl(), contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except ProgramError as exc:
        raise ProgramError(exc.reason, source=f"{path}: {exc.source}", rank=exc.rank,
                           threadblock=exc.threadblock, step=exc.step) from exc
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise ProgramError(f"the program exited with {exc.code!r}: {out.getvalue()[-500:]}", source=path) from None
    except Exception as exc:  # noqa: BLE001 - a user's program may raise anything; it is refused, named
        raise ProgramError(f"the program raised {type(exc).__name__}: {exc}", source=path) from exc
    finally:
        sys.argv = saved_argv
    if not collected:
        raise ProgramError("the file builds no MSCCLProgram", source=path)
    algos = []
    for prog in collected:
        prog.source = f"{path}: {prog.name}"
        algos.append(prog.compile())
    return algos
