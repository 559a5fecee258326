"""The programs one daemon can run: the built-in library's and the user's files, each checked first.

A program is chosen by name (an op's ``algo`` hint or an ``[[algorithms]]`` rule) and the
release carries its name and content hash, so every node of the op runs the same bytes of
program.  The catalogue is what turns a name into an :class:`~commd.algorithms.ir.Algorithm`
on each node: library programs are compiled per node count on first use and cached; the
files of an ``algorithms_dir`` (``NAME.xml``, with ``NAME.xml.post.json`` or
``NAME.post.json`` for a ``coll="custom"`` file) are read and checked once, at load.  A file
the reader or the checker refuses is never run: it is kept, with its reason, in
:attr:`Catalog.refused` (logged, and listed by ``commd status``).

The hash is the sha256 of the program's XML as ``mscclxml.dumps`` writes it, so a library
program and the file it would be written to have the same hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import Algorithm

log = logging.getLogger("commd.algorithms")

#: The environment variable naming the directory of user programs (the flag and the config key win).
ENV_DIR = "COMMD_ALGORITHMS_DIR"
#: Op kinds a program can run, and the collective (the IR's ``coll``) it must be for.  AllToNext
#: has no collective of MSCCL's own: its programs are ``custom`` ones whose postcondition is
#: AllToNext's (see :func:`is_alltonext`).
COLL_FOR_KIND = {"allreduce": "allreduce", "allgather": "allgather", "alltoall": "alltoall", "alltonext": "custom"}
#: Lane dtypes NumPy cannot hold (the interpreter works on NumPy views of the lane's buffer).
NO_NUMPY_DTYPES = frozenset({"bfloat16"})
#: Where a program came from when it is the library's.
LIBRARY = "library"
#: User files larger than this are refused unread (a program is a few hundred KiB at most).
MAX_FILE_BYTES = 16 << 20


@dataclass(frozen=True)
class Program:
    """A checked program under its catalogue name: ``digest`` is the sha256 hex of its XML."""

    name: str
    algo: Algorithm
    digest: str
    source: str  # LIBRARY, or the file's path
    #: Whether it is an AllToNext program (a ``custom`` one whose postcondition says so).
    alltonext: bool = False


@dataclass(frozen=True)
class Refusal:
    """A user file that will never run, and why (the reader's or the checker's words)."""

    name: str
    source: str
    reason: str


@dataclass(frozen=True)
class Tools:
    """The stages the catalogue uses (the reader, the checker, the library): swappable for tests."""

    dumps: Callable[[Algorithm], str]
    load: Callable[[Path], Algorithm]
    check: Callable[[Algorithm, Any, str], None]
    postcondition: Callable[[Algorithm, Path | None, str], Any]
    library_get: Callable[[str, int], Algorithm]
    library_names: Callable[[], list[str]]
    #: A ``custom`` library program's postcondition (what its sidecar would say), by name and node count.
    library_post: Callable[[str, int], Any] | None = None


def default_tools() -> Tools:
    """The real stages (imported here, not at module level: a daemon that never uses a program
    pays nothing for them)."""
    from commd.algorithms import checker, mscclxml, postcondition

    def post(algo: Algorithm, sidecar: Path | None, source: str) -> Any:
        return postcondition.for_algorithm(algo, sidecar, source=source)

    def library_post(name: str, nranks: int) -> Any:
        from commd.algorithms import library

        doc = library.sidecar(name, nranks)
        if doc is None:
            return None
        doc = {key: value for key, value in doc.items() if key != "file"}  # (it names no file of ours)
        return postcondition.parse_sidecar(doc, f"library program {name!r}")

    library_get, library_names = _library()
    return Tools(dumps=mscclxml.dumps, load=mscclxml.load,
                 check=lambda algo, p, source: checker.check(algo, p, source=source),
                 postcondition=post, library_get=library_get, library_names=library_names,
                 library_post=library_post)


def _library() -> tuple[Callable[[str, int], Algorithm], Callable[[], list[str]]]:
    """The built-in library's ``get`` and ``names``; without it (a build that lacks the DSL) user
    files still run, and asking for a library program says why there is none."""
    try:
        from commd.algorithms import library
    except ImportError as exc:
        missing = f"the built-in library cannot be loaded: {exc}"
        log.warning("algorithms: %s", missing)

        def unavailable(name: str, nranks: int) -> Algorithm:
            raise ProgramError(missing, source=f"library program {name!r}")

        return unavailable, list
    return library.get, library.names


def digest_of(algo: Algorithm, dumps: Callable[[Algorithm], str]) -> str:
    """The program's content hash: sha256 of its XML."""
    return hashlib.sha256(dumps(algo).encode()).hexdigest()


def short(digest: str) -> str:
    """A hash as messages print it (16 hex digits tell programs apart in practice)."""
    return digest[:16]


def resolve_dir(flag: str | None, config_value: str | None) -> Path | None:
    """The algorithms directory: the ``--algorithms-dir`` flag, else ``COMMD_ALGORITHMS_DIR``,
    else the config's ``algorithms_dir``; None if none is given.  ValueError unless it is a
    readable directory (a typo must not silently leave the user's programs out)."""
    given = flag or os.environ.get(ENV_DIR) or config_value
    if not given:
        return None
    path = Path(given).expanduser()
    if not path.is_dir():
        raise ValueError(f"algorithms directory {given!r} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"algorithms directory {given!r} is not readable")
    return path


@dataclass
class Catalog:
    """This daemon's programs by name: the library's (compiled per node count) and ``directory``'s files."""

    directory: Path | None = None
    tools: Tools | None = None
    files: dict[str, Program] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)
    _compiled: dict[tuple[str, int], Program | str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.tools is None:
            self.tools = default_tools()
        if self.directory is not None:
            self._load_directory(Path(self.directory))

    # ---- loading ------------------------------------------------------------------------
    def _load_directory(self, directory: Path) -> None:
        library = set(self._library_names())
        for path in sorted(directory.glob("*.xml")):
            name = path.stem
            try:
                if name in library:
                    raise ProgramError(f"its name shadows the library's program {name!r}; rename the file",
                                       source=str(path))
                self.files[name] = self._load_file(name, path)
            except (ProgramError, OSError, ValueError) as exc:  # (a stage that did not know the file's name)
                self._refuse(name, str(path), str(exc) if str(path) in str(exc) else f"{path}: {exc}")
        log.info("algorithms: %d user program(s) from %s%s", len(self.files), directory,
                 f", {len(self.refused)} refused" if self.refused else "")

    def _load_file(self, name: str, path: Path) -> Program:
        assert self.tools is not None
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ProgramError(f"{size} bytes is more than a program may have ({MAX_FILE_BYTES})", source=str(path))
        algo = self.tools.load(path)
        sidecar = next((p for p in (path.with_name(path.name + ".post.json"), path.with_suffix(".post.json"))
                        if p.is_file()), None)
        if algo.coll == "custom" and sidecar is None:
            raise ProgramError(f"coll=\"custom\" needs its postcondition in {path.name}.post.json", source=str(path))
        post = self.tools.postcondition(algo, sidecar, str(path))
        self.tools.check(algo, post, str(path))
        return Program(name, algo, digest_of(algo, self.tools.dumps), str(path), is_alltonext(algo, post))

    def _refuse(self, name: str, source: str, reason: str) -> None:
        self.refused.append(Refusal(name, source, reason))
        log.warning("algorithms: refused %s: %s", source, reason)

    def _library_names(self) -> list[str]:
        assert self.tools is not None
        try:
            return list(self.tools.library_names())
        except Exception as exc:  # a broken library must not take the user's files down with it
            log.warning("algorithms: the library cannot list its programs: %s", exc)
            return []

    # ---- lookup -------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Every name a hint or rule may use: the library's, then the accepted files'."""
        return self._library_names() + sorted(self.files)

    def get(self, name: str, nnodes: int) -> Program | str:
        """The program ``name`` for ``nnodes`` nodes, or why there is none."""
        if name in self.files:
            return self.files[name]
        refused = [r for r in self.refused if r.name == name]
        if refused:
            return f"algorithm {name!r} was refused at load: {refused[0].reason}"
        if name not in self._library_names():
            return f"unknown algorithm {name!r} (known: {', '.join(self.names()) or 'none'})"
        key = (name, nnodes)
        with self._lock:  # the coordinator and the lane worker may ask at once
            cached = self._compiled.get(key)
            if cached is None:
                cached = self._compiled[key] = self._compile(name, nnodes)
        return cached

    def _compile(self, name: str, nnodes: int) -> Program | str:
        assert self.tools is not None
        source = f"library program {name!r} for {nnodes} nodes"
        try:
            algo = self.tools.library_get(name, nnodes)
            given = self.tools.library_post(name, nnodes) if algo.coll == "custom" and self.tools.library_post else None
            post = self.tools.postcondition(algo, given, source)
            self.tools.check(algo, post, source)
        except (ProgramError, ValueError) as exc:
            log.warning("algorithms: %s cannot be used: %s", source, exc)
            return f"{source} cannot be used: {exc}"
        return Program(name, algo, digest_of(algo, self.tools.dumps), LIBRARY, is_alltonext(algo, post))

    def runnable(self, name: str, kind: str, nnodes: int, dtype: str, op: str | None) -> Program | str:
        """The program ``name`` if it can run a ``kind`` op of ``dtype`` (reduced with the lane op
        ``op``) on ``nnodes`` nodes; else the reason it cannot, naming the program."""
        coll = COLL_FOR_KIND.get(kind)
        if coll is None:
            return f"algorithm {name!r} cannot run {kind}: programs run {', '.join(sorted(COLL_FOR_KIND))} only"
        found = self.get(name, nnodes)
        if isinstance(found, str):
            return found
        algo = found.algo
        if algo.coll != coll:
            return f"algorithm {name!r} is a {algo.coll} program, not {coll}"
        if algo.ngpus != nnodes:
            return f"algorithm {name!r} is written for {algo.ngpus} nodes, the op spans {nnodes}"
        if kind == "alltonext" and not found.alltonext:
            return (f"algorithm {name!r} is a custom program whose postcondition is not AllToNext's "
                    "(rank r's output = rank r - 1's input, chunk for chunk)")
        if kind == "allreduce" and op is None:
            return f"algorithm {name!r} needs a reduce op"
        if kind == "allreduce" and dtype in NO_NUMPY_DTYPES:  # (an all-to-all moves bytes)
            return f"algorithm {name!r} cannot run {dtype}: programs run on NumPy arrays, which have no {dtype}"
        return found

    def status(self) -> dict[str, Any]:
        """For ``commd status``: the names on offer, the user files accepted and refused."""
        return {
            "directory": str(self.directory) if self.directory is not None else None,
            "library": self._library_names(),
            "files": {name: {"path": p.source, "sha256": p.digest, "coll": p.algo.coll, "nodes": p.algo.ngpus}
                      for name, p in sorted(self.files.items())},
            "refused": [{"name": r.name, "path": r.source, "reason": r.reason} for r in self.refused],
        }


def is_alltonext(algo: Algorithm, post: Any) -> bool:
    """Whether ``algo`` computes AllToNext: a ``custom`` program in which every rank has one input
    and one output of ``nchunksperloop`` chunks, and whose postcondition ``post`` says exactly that
    rank r's output chunk c is rank r - 1's input chunk c, for every r ≥ 1 and c (rank 0's output
    unspecified).  Only such a program may run an ``alltonext`` op: the op's layout is the node's
    whole buffer in and out."""
    if algo.coll != "custom" or algo.ngpus < 2 or post is None:
        return False
    k = algo.nchunksperloop
    if any(r.i_chunks != k or r.o_chunks != k for r in algo.ranks):
        return False
    expect = getattr(post, "expect", None)
    if not isinstance(expect, Mapping):
        return False
    want = {(r, "o", c): frozenset({(r - 1, "i", c)}) for r in range(1, algo.ngpus) for c in range(k)}
    return {tuple(slot): frozenset(tuple(s) for s in sources) for slot, sources in expect.items()} == want


@dataclass(frozen=True)
class Chosen:
    """What a node hands its lane for a released op: the release's program name and hash, and
    this node's own program under that name (None, with ``missing`` saying why, if it has none).

    The lane compares every node's hash with the release's before it runs a step, so a node
    whose copy differs fails the op on every node instead of running another program."""

    name: str
    digest: str
    program: Program | None
    missing: str = ""

    @classmethod
    def lookup(cls, catalog: Catalog | None, name: str, digest: str, nnodes: int) -> Chosen:
        """This node's program for a release naming ``name`` with ``digest``."""
        if catalog is None:
            return cls(name, digest, None, "this daemon has no algorithm catalogue")
        found = catalog.get(name, nnodes)
        if isinstance(found, str):
            return cls(name, digest, None, found)
        return cls(name, digest, found)

    @property
    def local_digest(self) -> str:
        """This node's hash for the name ('' when it has no such program)."""
        return self.program.digest if self.program is not None else ""
