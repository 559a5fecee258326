"""DSL program files: run one as msccl-tools would, and compile every program it builds.

The file runs with ``sys.argv`` set to its arguments, its ``XML()``/``Check()`` output
captured, and the ``msccl`` import names pointing at this package's DSL, so programs
written for msccl-tools compile unmodified.  Whatever the file raises is a ProgramError
naming the file.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import types
from collections.abc import Iterator, Sequence

from commd.algorithms import dsl
from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm


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
        if parent and not hasattr(mods[parent], child):  # never hide a DSL name (``chunk``) behind a module
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


def run_file(path: str | os.PathLike[str], argv: Sequence[str] = ()) -> list[dsl.MSCCLProgram]:
    """Run a DSL program file with arguments ``argv``; every program it builds, in order (not yet compiled)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ProgramError("no such program file", source=path)
    saved_argv = sys.argv
    sys.argv = [path, *argv]
    out = io.StringIO()
    collected: list[dsl.MSCCLProgram] = []
    try:
        with dsl.collecting() as collected, _as_msccl(), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except ProgramError as exc:
        raise ProgramError(exc.reason, source=f"{path}: {exc.source}", rank=exc.rank,
                           threadblock=exc.threadblock, step=exc.step) from exc
    except SystemExit as exc:
        if exc.code not in (0, None):
            said = out.getvalue().strip().splitlines()[-1:] or [""]
            raise ProgramError(f"the program exited with {exc.code!r}: {said[0][:300]}", source=path) from None
    except Exception as exc:  # noqa: BLE001 - a user's program may raise anything; it is refused, named
        raise ProgramError(f"the program raised {type(exc).__name__}: {exc}", source=path) from exc
    finally:
        sys.argv = saved_argv
    if not collected:
        raise ProgramError("the file builds no MSCCLProgram", source=path)
    for prog in collected:
        prog.source = f"{path}: {prog.name}"
    return collected


def compile_file(path: str | os.PathLike[str], argv: Sequence[str] = ()) -> list[Algorithm]:
    """Run a DSL program file with arguments ``argv``; the IR of every program it builds, in order."""
    return [prog.compile() for prog in run_file(path, argv)]
