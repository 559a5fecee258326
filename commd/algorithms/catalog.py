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
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import BITWISE, Algorithm

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
#: Node 0 sends its user programs to every member with its config (the control channel's frames
#: stay well below their 16 MiB bound): at most this many bytes of XML and sidecars in all.
MAX_SHARED_BYTES = 8 << 20
#: The lane's own algorithm, as tuning tables, benchmarks and status counts name it: no file may.
NATIVE = "native"
#: Where a program received with node 0's config says it came from.
FROM_NODE0 = "node 0"


@dataclass(frozen=True)
class Program:
    """A checked program under its catalogue name: ``digest`` is the sha256 hex of its XML."""

    name: str
    algo: Algorithm
    digest: str
    source: str  # LIBRARY, the file's path, or FROM_NODE0
    post_text: str | None = None  # a custom program's sidecar (JSON), travels with it
    #: Whether it is an AllToNext program (a ``custom`` one whose postcondition says so).
    alltonext: bool = False
    #: The checker's determinism class (``ir.BITWISE`` or ``ir.ORDER_DEPENDENT``): selection keeps an
    #: order-dependent program off ops that need bit-identical results (``core.ops.order_sensitive``).
    determinism: str = BITWISE


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
    #: Raises the checker's refusal, or returns the program's determinism class (None: ``ir.BITWISE``).
    check: Callable[[Algorithm, Any, str], str | None]
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
                 check=lambda algo, p, source: checker.check(algo, p, source=source).kind,
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
                if name == NATIVE:
                    raise ProgramError(f"{NATIVE!r} names the lane's own algorithm (in hints, rules, tuning tables "
                                       "and benchmarks); rename the file", source=str(path))
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
        determinism = self.tools.check(algo, post, str(path)) or BITWISE
        post_text = sidecar.read_text() if sidecar is not None and algo.coll == "custom" else None
        return Program(name, algo, digest_of(algo, self.tools.dumps), str(path), post_text,
                       is_alltonext(algo, post), determinism)

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

    # ---- travelling with node 0's config ---------------------------------------------------
    def shared(self) -> dict[str, dict[str, str | None]]:
        """This node's accepted user programs as node 0 sends them to the members (name → XML and
        sidecar); a program that would take the total past MAX_SHARED_BYTES stays home, said in the log."""
        assert self.tools is not None
        out: dict[str, dict[str, str | None]] = {}
        total = 0
        for name, program in sorted(self.files.items()):
            xml = self.tools.dumps(program.algo)
            size = len(xml) + len(program.post_text or "")
            if total + size > MAX_SHARED_BYTES:
                log.warning("algorithms: %s (%d bytes) is not sent to the other nodes: the programs sent with "
                            "the config are bounded to %d bytes; nodes without their own copy cannot run it",
                            program.source, size, MAX_SHARED_BYTES)
                continue
            total += size
            out[name] = {"xml": xml, "post": program.post_text}
        return out

    def adopt(self, programs: Any) -> None:
        """Node 0's user programs, received with its config: each is read and checked here too; one this
        node lacks is added; one whose copy here differs is refused here (both hashes in the reason, in
        ``commd status``), so neither copy runs and an op that names it fails on every node."""
        if programs is None:
            return
        if not isinstance(programs, dict):
            log.warning("algorithms: node 0's programs are not a mapping; none adopted")
            return
        from commd.algorithms import checker, mscclxml, postcondition

        for name, entry in programs.items():
            where = f"{FROM_NODE0}'s {name}.xml"
            try:
                if not isinstance(name, str) or not 0 < len(name) <= 255 or not isinstance(entry, dict) \
                        or not isinstance(entry.get("xml"), str) or not isinstance(entry.get("post"), str | None):
                    raise ProgramError("a program sent with the config must be a name with its XML text "
                                       "and its sidecar (or none)", source=f"{FROM_NODE0}'s programs")
                algo = mscclxml.loads(entry["xml"], source=where)
                post = (postcondition.parse_sidecar(json.loads(entry["post"]), where) if entry["post"] is not None
                        else None)
                determinism = checker.check(algo, post, source=where).kind
            except (ProgramError, ValueError) as exc:
                self.files.pop(str(name), None)
                self._refuse(str(name), where, str(exc))
                continue
            digest = digest_of(algo, mscclxml.dumps)
            mine = self.files.get(name)
            if mine is None:
                self.files[name] = Program(name, algo, digest, FROM_NODE0, entry["post"], is_alltonext(algo, post),
                                           determinism)
            elif mine.digest != digest:
                del self.files[name]
                self._refuse(name, mine.source, f"this node's copy (sha256 {short(mine.digest)}) differs from "
                                                f"node 0's (sha256 {short(digest)}); neither runs on this node")

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
            determinism = self.tools.check(algo, post, source) or BITWISE
        except (ProgramError, ValueError) as exc:
            log.warning("algorithms: %s cannot be used: %s", source, exc)
            return f"{source} cannot be used: {exc}"
        return Program(name, algo, digest_of(algo, self.tools.dumps), LIBRARY, alltonext=is_alltonext(algo, post),
                       determinism=determinism)

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
            "files": {name: {"path": p.source, "sha256": p.digest, "coll": p.algo.coll, "nodes": p.algo.ngpus,
                             "determinism": p.determinism}
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
