"""What a collective must leave in each output chunk, as data the checker can compare against.

A postcondition maps an output slot — (rank, buffer, chunk index) — to the set of initial
chunks whose value it must end up holding: one source means a copy, several mean their
reduction with the op's reduce operator (each source exactly once).  The built-in
collectives derive theirs from the program's header (R = ``ngpus``, C = ``nchunksperloop``);
a ``coll="custom"`` program states its own in a sidecar ``FILE.post.json`` next to the XML.

The chunk-count rules live here too (:func:`shape_problems`): the same arithmetic that says
where each result goes says how many chunks each buffer must have.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import BUFFERS, COLLECTIVES, Algorithm

#: A sidecar larger than this is refused before it is parsed (the program files' limit too).
MAX_SIDECAR_BYTES = 64 * 1024 * 1024


class ChunkRef(NamedTuple):
    """One chunk of one rank's buffer: a slot of the final state, or a value of the initial one."""

    rank: int
    buf: str
    index: int

    def short(self) -> str:
        return f"r{self.rank}.{self.buf}{self.index}"


@dataclass(frozen=True)
class Postcondition:
    """Per output slot, the initial chunks it must hold: one (a copy) or several (their reduction).

    Slots not listed are unspecified.  ``sidecar`` is the file it came from, if any.
    """

    expect: Mapping[ChunkRef, frozenset[ChunkRef]]
    sidecar: str | None = None
    named_file: str | None = field(default=None, compare=False)  # the sidecar's "file" field

    def __iter__(self) -> Iterator[tuple[ChunkRef, frozenset[ChunkRef]]]:
        return iter(self.expect.items())

    def __len__(self) -> int:
        return len(self.expect)

    def validate(self, algo: Algorithm, source: str = "<program>") -> None:
        """Refuse slots or sources that do not exist in ``algo`` (ranks, buffers, chunk indices)."""
        where = self.sidecar or source
        checked: set[frozenset[ChunkRef]] = set()
        for slot, sources in self.expect.items():
            _check_ref(algo, slot, "output slot", where)
            if not sources:
                raise ProgramError(f"{slot.short()}: empty list of sources", source=where, rank=slot.rank)
            if sources in checked:
                continue
            checked.add(sources)
            for src in sources:
                if src.buf == "s":
                    raise ProgramError(f"{slot.short()}: source {src.short()} is a scratch chunk, which has no "
                                       "initial value", source=where, rank=slot.rank)
                _check_ref(algo, src, f"source of {slot.short()}", where)


def _check_ref(algo: Algorithm, ref: ChunkRef, what: str, where: str) -> None:
    if ref.buf not in BUFFERS:
        raise ProgramError(f"{what}: buffer {ref.buf!r} is not one of {', '.join(BUFFERS)}", source=where)
    if not 0 <= ref.rank < len(algo.ranks):
        raise ProgramError(f"{what} {ref.short()}: rank {ref.rank} outside 0..{len(algo.ranks) - 1}", source=where)
    have = algo.ranks[ref.rank].chunks(ref.buf)
    if not 0 <= ref.index < have:
        raise ProgramError(f"{what} {ref.short()}: index {ref.index} outside buffer {ref.buf!r} of "
                           f"{have} chunks", source=where, rank=ref.rank)


# --- the built-in collectives -------------------------------------------------------------------


def shape_problems(algo: Algorithm, source: str = "<program>") -> list[ProgramError]:
    """Every way the buffers' chunk counts disagree with the collective and the rank count."""
    out: list[ProgramError] = []
    if algo.coll not in COLLECTIVES:
        return [ProgramError(f"unknown collective {algo.coll!r} (known: {', '.join(COLLECTIVES)})", source=source)]
    nranks, c = len(algo.ranks), algo.nchunksperloop
    if nranks < 1 or c < 1:
        return [ProgramError(f"needs at least one rank and one chunk per loop (ranks={nranks}, "
                             f"nchunksperloop={c})", source=source)]
    for rank in algo.ranks:
        for buf in BUFFERS:
            if rank.chunks(buf) < 0:
                out.append(ProgramError(f"{buf}_chunks={rank.chunks(buf)} is negative", source=source, rank=rank.id))
    if algo.coll == "custom" or out:
        return out
    if algo.coll in ("allgather", "reducescatter", "alltoall") and c % nranks:
        buf = "o_chunks" if algo.coll == "allgather" else "i_chunks"
        have = algo.ranks[0].chunks(buf[0])
        return [ProgramError(f"{algo.coll} over {nranks} ranks: {buf}={have} (nchunksperloop={c}) is not a "
                             f"multiple of the rank count {nranks} (each rank owns {buf[0]}[r·k …], k = chunks "
                             "per rank)", source=source)]
    if algo.coll == "alltoall" and algo.inplace:
        return [ProgramError("in-place alltoall is not supported: it needs distinct input and output buffers",
                             source=source)]
    want = _shape(algo.coll, algo.inplace, c, c // nranks)
    for rank in algo.ranks:
        for buf, n in zip(("i", "o"), want, strict=True):
            if rank.chunks(buf) != n:
                kind = "in-place" if algo.inplace else "out-of-place"
                out.append(ProgramError(f"{kind} {algo.coll} over {nranks} ranks with nchunksperloop={c} needs "
                                        f"{buf}_chunks={n}, got {rank.chunks(buf)}", source=source, rank=rank.id))
    return out


def _shape(coll: str, inplace: bool, c: int, k: int) -> tuple[int, int]:
    """(i_chunks, o_chunks) every rank must have."""
    if coll == "allgather":
        return (0, c) if inplace else (k, c)
    if coll == "reducescatter":
        return (c, 0) if inplace else (c, k)
    if coll == "alltoall":
        return (c, c)
    return (c, 0) if inplace else (c, c)  # allreduce, broadcast


def builtin(algo: Algorithm) -> Postcondition:
    """The postcondition of a built-in collective (its shape must already be right)."""
    nranks, c = len(algo.ranks), algo.nchunksperloop
    k = c // nranks
    ranks = range(nranks)
    res = "i" if algo.inplace else "o"
    expect: dict[ChunkRef, frozenset[ChunkRef]] = {}
    if algo.coll == "allreduce":
        sums = [frozenset(ChunkRef(q, "i", j) for q in ranks) for j in range(c)]  # shared: checked once each
        for r in ranks:
            for j in range(c):
                expect[ChunkRef(r, res, j)] = sums[j]
    elif algo.coll == "allgather":
        for r in ranks:
            for q in ranks:
                for j in range(k):
                    src = ChunkRef(q, "o", q * k + j) if algo.inplace else ChunkRef(q, "i", j)
                    expect[ChunkRef(r, "o", q * k + j)] = frozenset((src,))
    elif algo.coll == "reducescatter":
        for r in ranks:
            for j in range(k):
                slot = ChunkRef(r, "i", r * k + j) if algo.inplace else ChunkRef(r, "o", j)
                expect[slot] = frozenset(ChunkRef(q, "i", r * k + j) for q in ranks)
    elif algo.coll == "alltoall":
        for r in ranks:
            for q in ranks:
                for j in range(k):
                    expect[ChunkRef(r, "o", q * k + j)] = frozenset((ChunkRef(q, "i", r * k + j),))
    elif algo.coll == "broadcast":
        for r in ranks:
            for j in range(c):
                expect[ChunkRef(r, res, j)] = frozenset((ChunkRef(0, "i", j),))
    else:
        raise ValueError(f"no built-in postcondition for {algo.coll!r}")
    return Postcondition(expect)


def sidecar_path(xml_path: str | Path) -> Path:
    """Where the sidecar of ``FILE.xml`` lives: ``FILE.post.json`` beside it."""
    p = Path(xml_path)
    return p.with_name((p.stem if p.suffix == ".xml" else p.name) + ".post.json")


def for_algorithm(algo: Algorithm, sidecar: str | Path | Postcondition | None = None, *,
                  source: str | Path = "<program>") -> Postcondition:
    """The postcondition ``algo`` must establish, validated against its buffers.

    A custom program needs ``sidecar`` (a path or a loaded postcondition); when it is None
    and ``source`` names an XML file, the sidecar is looked for beside it.  A built-in
    collective's own postcondition is used unless ``sidecar`` gives another.
    """
    source = str(source)
    problems = shape_problems(algo, source)
    if problems:
        raise problems[0]
    if algo.coll != "custom" and sidecar is None:
        return builtin(algo)  # right by construction once the shape is
    if sidecar is None:
        if source.startswith("<") or not Path(source).is_file():
            raise ProgramError("a custom collective needs its postcondition: a sidecar FILE.post.json beside its "
                               "file, or one given", source=source)
        path = sidecar_path(source)
        if not path.is_file():
            raise ProgramError(f"a custom collective needs its postcondition sidecar {path}, which does not exist",
                               source=source)
        sidecar = path
    post = sidecar if isinstance(sidecar, Postcondition) else load_sidecar(sidecar)
    if post.named_file is not None and not source.startswith("<") and Path(source).name != post.named_file:
        raise ProgramError(f"sidecar {post.sidecar} describes {post.named_file!r}, not {Path(source).name!r}",
                           source=source)
    post.validate(algo, source)
    return post


# --- the sidecar ----------------------------------------------------------------------------------


def load_sidecar(path: str | Path) -> Postcondition:
    """Read and validate ``FILE.post.json`` (its structure; ranges are checked by ``for_algorithm``)."""
    where = str(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_SIDECAR_BYTES + 1)
        if len(data) > MAX_SIDECAR_BYTES:
            raise ProgramError(f"over the {MAX_SIDECAR_BYTES // (1024 * 1024)} MiB limit on sidecar files",
                               source=where)
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProgramError(f"cannot read the postcondition sidecar: {exc}", source=where) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProgramError(f"not JSON: {exc}", source=where) from None
    return parse_sidecar(doc, where)


def parse_sidecar(doc: Any, where: str = "<sidecar>") -> Postcondition:
    """Validate a decoded sidecar document into a postcondition."""
    if not isinstance(doc, dict):
        raise ProgramError("a sidecar is a JSON object with an 'expect' list", source=where)
    unknown = set(doc) - {"file", "meaning", "expect"}
    if unknown:
        raise ProgramError(f"unknown sidecar fields {sorted(unknown)} (known: file, meaning, expect)", source=where)
    named = doc.get("file")
    if named is not None and not isinstance(named, str):
        raise ProgramError("'file' must be a string", source=where)
    if not isinstance(doc.get("meaning", ""), str):
        raise ProgramError("'meaning' must be a string", source=where)
    entries = doc.get("expect")
    if not isinstance(entries, list):
        raise ProgramError("'expect' must be a list of entries", source=where)
    expect: dict[ChunkRef, frozenset[ChunkRef]] = {}
    for n, entry in enumerate(entries):
        what = f"expect[{n}]"
        if not isinstance(entry, dict) or set(entry) != {"rank", "buf", "index", "from"}:
            raise ProgramError(f"{what} must be an object with exactly rank, buf, index and from", source=where)
        slot = _ref(entry, what, where)
        if slot in expect:
            raise ProgramError(f"{what}: output slot {slot.short()} is listed twice", source=where, rank=slot.rank)
        expect[slot] = _sources(entry["from"], f"{what}.from", where)
    return Postcondition(expect, sidecar=where, named_file=named)


def _sources(raw: Any, what: str, where: str) -> frozenset[ChunkRef]:
    items: Iterable[Any] = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and not raw:
        raise ProgramError(f"{what} is an empty list", source=where)
    out: set[ChunkRef] = set()
    for n, item in enumerate(items):
        label = f"{what}[{n}]" if isinstance(raw, list) else what
        if not isinstance(item, dict) or set(item) != {"rank", "buf", "index"}:
            raise ProgramError(f"{label} must be an object with exactly rank, buf and index", source=where)
        ref = _ref(item, label, where)
        if ref in out:
            raise ProgramError(f"{label}: source {ref.short()} is listed twice (a reduction takes each once)",
                               source=where)
        out.add(ref)
    return frozenset(out)


def _ref(obj: dict[str, Any], what: str, where: str) -> ChunkRef:
    rank, buf, index = obj["rank"], obj["buf"], obj["index"]
    for name, value in (("rank", rank), ("index", index)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProgramError(f"{what}.{name} must be a non-negative integer, got {value!r}", source=where)
    if buf not in BUFFERS:
        raise ProgramError(f"{what}.buf must be one of {', '.join(BUFFERS)}, got {buf!r}", source=where)
    return ChunkRef(rank, buf, index)
