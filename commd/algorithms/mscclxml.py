"""MSCCL's XML on disk ⇄ the IR: strict reading of files from outside, writing in msccl-tools' layout.

A file is foreign input that commd will run, so the reader refuses anything it does not
understand (unknown elements or attributes, text between elements, integers that are not
plain integers, ids that skip or repeat) with a :class:`ProgramError` naming the file, the
rank (``<gpu id>``), threadblock and step, the attribute and the line.  It checks syntax and
types only: whether peers, offsets and chunk counts make sense is the checker's work, on the
IR.  Hostile files are refused before they reach the parser: a DOCTYPE or ENTITY declaration
(entity expansion), and anything over :data:`MAX_BYTES`.

The reader streams through expat rather than building an ElementTree, so memory stays
proportional to the IR, and every refusal can name its line.

The writer produces the layout msccl-tools writes (one element per line, two-space
indentation, attributes in MSCCL's order), so a file read and written again is the same
file, and files move both ways between commd and the MSCCL ecosystem.  One exception:
``coll="reduce_scatter"`` (the SCCL-era runtime's and older msccl-tools' spelling) is read
as the IR's ``reducescatter`` and written so, the newer runtime's spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from xml.parsers import expat

from commd.algorithms.errors import ProgramError
from commd.algorithms.ir import (
    BUFFERS,
    Algorithm,
    Rank,
    Step,
    StepType,
    Threadblock,
    collective_name,
    collective_spellings,
)

#: The largest file the reader accepts (bytes of a file; characters of a string).
MAX_BYTES = 64 * 1024 * 1024

#: MSCCL's protocols (``proto``), spelled as the runtime compares them.
PROTOCOLS = ("Simple", "LL", "LL128")

#: Attributes per element, in the order MSCCL writes them (and the writer does).
ALGO_ATTRIBUTES = ("name", "proto", "nchannels", "nchunksperloop", "ngpus", "coll", "inplace")
#: The newer runtimes' optional ``<algo>`` attributes (absent in older files).
ALGO_OPTIONAL_ATTRIBUTES = ("outofplace", "minBytes", "maxBytes")
GPU_ATTRIBUTES = ("id", "i_chunks", "o_chunks", "s_chunks")
TB_ATTRIBUTES = ("id", "send", "recv", "chan")
STEP_ATTRIBUTES = ("s", "type", "srcbuf", "srcoff", "dstbuf", "dstoff", "cnt", "depid", "deps", "hasdep")

#: The one child element each element may have (``<step>`` has none).
_CHILD = {None: "algo", "algo": "gpu", "gpu": "tb", "tb": "step", "step": None}

_INT32_MAX = 2**31 - 1  # the runtime holds ids, counts and offsets in C ints
_INT64_MAX = 2**63 - 1  # minBytes/maxBytes are byte counts
_MAX_NAME = 1024
_INTEGER = re.compile(r"-?[0-9]{1,20}")
_DECLARATION = re.compile(r"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)


def load(path: str | os.PathLike[str]) -> Algorithm:
    """Read an MSCCL XML file; refusals name ``path``."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise ProgramError(_too_big(size, "bytes"), source=source)
            data = f.read(MAX_BYTES + 1)  # a file whose size stat does not tell (a pipe) is bounded here
    except OSError as e:
        raise ProgramError(f"cannot read the file: {e.strerror or e}", source=source) from None
    if len(data) > MAX_BYTES:
        raise ProgramError(_too_big(len(data), "bytes"), source=source)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ProgramError(f"not UTF-8 text (byte {e.start})", source=source) from None
    return loads(text, source=source)


def loads(text: str, source: str = "<string>") -> Algorithm:
    """Read MSCCL XML from a string; refusals name ``source``."""
    if not isinstance(text, str):
        raise ProgramError(f"expected XML text, got {type(text).__name__}", source=source)
    if len(text) > MAX_BYTES:
        raise ProgramError(_too_big(len(text), "characters"), source=source)
    declaration = _DECLARATION.search(text)
    if declaration:
        line = text.count("\n", 0, declaration.start()) + 1
        raise ProgramError(f"a <!{declaration.group(1).upper()}> declaration is refused: commd does not expand "
                           f"entities in program files (line {line})", source=source)
    return _Reader(source).parse(text)


def dumps(algo: Algorithm) -> str:
    """The program as MSCCL XML, in msccl-tools' layout; optional attributes only when not None."""
    where = algo.name if isinstance(algo.name, str) else "<program>"
    head = [("name", _text(algo.name, where)), ("proto", _text(algo.proto, where)),
            ("nchannels", _int(algo.nchannels, where)), ("nchunksperloop", _int(algo.nchunksperloop, where)),
            ("ngpus", _int(algo.ngpus, where)), ("coll", _text(algo.coll, where)),
            ("inplace", _flag(algo.inplace, where))]
    if algo.outofplace is not None:
        head.append(("outofplace", _flag(algo.outofplace, where)))
    if algo.min_bytes is not None:
        head.append(("minBytes", _int(algo.min_bytes, where)))
    if algo.max_bytes is not None:
        head.append(("maxBytes", _int(algo.max_bytes, where)))
    lines = [_open("algo", head, empty=False, depth=0)]
    for rank in algo.ranks:
        gpu = [("id", _int(rank.id, where)), ("i_chunks", _int(rank.i_chunks, where)),
               ("o_chunks", _int(rank.o_chunks, where)), ("s_chunks", _int(rank.s_chunks, where))]
        lines.append(_open("gpu", gpu, empty=not rank.threadblocks, depth=1))
        for tb in rank.threadblocks:
            attrs = [("id", _int(tb.id, where)), ("send", _int(tb.send, where)), ("recv", _int(tb.recv, where)),
                     ("chan", _int(tb.chan, where))]
            lines.append(_open("tb", attrs, empty=not tb.steps, depth=2))
            for step in tb.steps:
                if not isinstance(step.type, StepType):
                    raise ProgramError(f"step type {step.type!r} is not a StepType", source=where, rank=rank.id,
                                       threadblock=tb.id, step=step.s)
                attrs = [("s", _int(step.s, where)), ("type", step.type.value),
                         ("srcbuf", _text(step.srcbuf, where)), ("srcoff", _int(step.srcoff, where)),
                         ("dstbuf", _text(step.dstbuf, where)), ("dstoff", _int(step.dstoff, where)),
                         ("cnt", _int(step.cnt, where)), ("depid", _int(step.depid, where)),
                         ("deps", _int(step.deps, where)), ("hasdep", _flag(step.hasdep, where))]
                lines.append(_open("step", attrs, empty=True, depth=3))
            if tb.steps:
                lines.append("    </tb>")
        if rank.threadblocks:
            lines.append("  </gpu>")
    lines.append("</algo>")
    return "\n".join(lines) + "\n"


def dump(algo: Algorithm, path: str | os.PathLike[str]) -> None:
    """Write the program to ``path`` as MSCCL XML."""
    Path(path).write_text(dumps(algo), encoding="utf-8")


# -- writing ---------------------------------------------------------------------------------------

def _open(tag: str, attrs: list[tuple[str, str]], *, empty: bool, depth: int) -> str:
    body = " ".join(f'{key}="{_escape(value)}"' for key, value in attrs)
    return f"{'  ' * depth}<{tag} {body}{'/>' if empty else '>'}"


def _escape(value: str) -> str:
    """Escape an attribute value so that a parser reads back exactly ``value`` (newlines included)."""
    return (value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("\n", "&#10;").replace("\r", "&#13;").replace("\t", "&#9;"))


def _int(value: object, where: str) -> str:
    if type(value) is not int:
        raise ProgramError(f"expected an integer in the IR, got {value!r}", source=where)
    return str(value)


def _flag(value: object, where: str) -> str:
    if type(value) is not bool:
        raise ProgramError(f"expected a bool in the IR, got {value!r}", source=where)
    return "1" if value else "0"


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ProgramError(f"expected a string in the IR, got {value!r}", source=where)
    return value


def _shown(value: str, limit: int = 40) -> str:
    """A value from the file as an error message quotes it: repr'd, and cut short."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"


def _too_big(size: int, unit: str) -> str:
    return f"{size} {unit} is over the {MAX_BYTES // (1024 * 1024)} MiB limit on program files"


# -- reading ---------------------------------------------------------------------------------------

class _Reader:
    """One pass of expat over a document, building the IR element by element.

    Each handler validates its element as it opens, so a refusal knows the rank,
    threadblock and step it is in, and the parser's current line.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.parser = expat.ParserCreate()
        self.parser.buffer_text = True
        self.parser.StartElementHandler = self._start
        self.parser.EndElementHandler = self._end
        self.parser.CharacterDataHandler = self._text
        self.parser.StartDoctypeDeclHandler = self._doctype  # refused earlier too; never let one through
        self.parser.EntityDeclHandler = self._entity
        self.stack: list[str] = []
        self.head: dict[str, Any] = {}  # <algo>'s fields, as Algorithm takes them
        self.ranks: list[Rank] = []
        self.threadblocks: list[Threadblock] = []
        self.steps: list[Step] = []
        self.gpu: tuple[int, int, int, int] | None = None  # id, i_chunks, o_chunks, s_chunks
        self.tb: tuple[int, int, int, int] | None = None  # id, send, recv, chan
        self.rank_id: int | None = None
        self.tb_id: int | None = None
        self.step_id: int | None = None
        self.result: Algorithm | None = None

    def parse(self, text: str) -> Algorithm:
        try:
            self.parser.Parse(text, True)
        except expat.ExpatError as e:
            raise ProgramError(f"malformed XML: {expat.ErrorString(e.code)} (line {e.lineno}, column {e.offset + 1})",
                               source=self.source) from None
        assert self.result is not None  # expat refuses a document without a root, and the root must be <algo>
        return self.result

    # -- refusals

    def _fail(self, reason: str) -> ProgramError:
        return ProgramError(f"{reason} (line {self.parser.CurrentLineNumber})", source=self.source,
                            rank=self.rank_id, threadblock=self.tb_id, step=self.step_id)

    def _doctype(self, *_: object) -> None:
        raise self._fail("a <!DOCTYPE> declaration is refused")

    def _entity(self, *_: object) -> None:
        raise self._fail("an <!ENTITY> declaration is refused")

    # -- structure

    def _start(self, tag: str, attrs: dict[str, str]) -> None:
        parent = self.stack[-1] if self.stack else None
        allowed = _CHILD[parent]
        if tag != allowed:
            if allowed is None:
                raise self._fail(f"<{tag}> inside <{parent}>: <{parent}> has no child elements")
            inside = f" inside <{parent}>" if parent else " as the root"
            raise self._fail(f"unknown element <{tag}>{inside}: only <{allowed}> may appear there")
        self.stack.append(tag)
        getattr(self, f"_start_{tag}")(attrs)

    def _end(self, tag: str) -> None:
        self.stack.pop()
        getattr(self, f"_end_{tag}")()

    def _text(self, data: str) -> None:
        if data.strip():
            raise self._fail(f"text {_shown(data.strip())} inside <{self.stack[-1]}>: MSCCL files carry only elements")

    # -- elements

    def _start_algo(self, attrs: dict[str, str]) -> None:
        self._attributes("algo", attrs, ALGO_ATTRIBUTES, ALGO_OPTIONAL_ATTRIBUTES)
        name = attrs["name"]
        if not name or len(name) > _MAX_NAME or not name.isprintable():
            raise self._fail(f"<algo> attribute name={_shown(name)} must be 1..{_MAX_NAME} printable characters")
        proto = attrs["proto"]
        if proto not in PROTOCOLS:
            raise self._fail(f"<algo> attribute proto={_shown(proto)} is not one of MSCCL's protocols {', '.join(PROTOCOLS)}")
        coll = collective_name(attrs["coll"])  # (one spelling from here on)
        if coll is None:
            raise self._fail(f"<algo> attribute coll={_shown(attrs['coll'])} is not a known collective "
                             f"({collective_spellings()})")
        self.head = {
            "name": name, "proto": proto, "coll": coll,
            "nchannels": self._integer("algo", attrs, "nchannels", 1),
            "nchunksperloop": self._integer("algo", attrs, "nchunksperloop", 1),
            "ngpus": self._integer("algo", attrs, "ngpus", 1),
            "inplace": self._boolean("algo", attrs, "inplace"),
            "outofplace": self._boolean("algo", attrs, "outofplace") if "outofplace" in attrs else None,
            "min_bytes": self._integer("algo", attrs, "minBytes", 0, _INT64_MAX) if "minBytes" in attrs else None,
            "max_bytes": self._integer("algo", attrs, "maxBytes", 0, _INT64_MAX) if "maxBytes" in attrs else None,
        }

    def _end_algo(self) -> None:
        ngpus = self.head["ngpus"]
        if len(self.ranks) < ngpus:
            missing = len(self.ranks) if len(self.ranks) == ngpus - 1 else f"{len(self.ranks)}..{ngpus - 1}"
            raise self._fail(f"ngpus={ngpus} but <gpu id> {missing} missing")
        self.result = Algorithm(ranks=tuple(self.ranks), **self.head)

    def _start_gpu(self, attrs: dict[str, str]) -> None:
        gpu_id = self.rank_id = self._identify("gpu", attrs, "id")
        self._attributes("gpu", attrs, GPU_ATTRIBUTES)
        assert gpu_id is not None  # a missing id was refused just above
        expected = len(self.ranks)
        ngpus = self.head["ngpus"]
        if gpu_id < expected:
            raise self._fail(f"duplicate <gpu id={gpu_id}>")
        if gpu_id > expected:
            raise self._fail(f"<gpu id={gpu_id}> out of order: expected id={expected} (gpu ids are 0..ngpus-1 in order)")
        if gpu_id >= ngpus:
            raise self._fail(f"<gpu id={gpu_id}> is outside 0..{ngpus - 1} (ngpus={ngpus})")
        self.gpu = (gpu_id, self._integer("gpu", attrs, "i_chunks", 0), self._integer("gpu", attrs, "o_chunks", 0),
                    self._integer("gpu", attrs, "s_chunks", 0))
        self.threadblocks = []

    def _end_gpu(self) -> None:
        assert self.gpu is not None
        gpu_id, i_chunks, o_chunks, s_chunks = self.gpu
        self.ranks.append(Rank(id=gpu_id, i_chunks=i_chunks, o_chunks=o_chunks, s_chunks=s_chunks,
                               threadblocks=tuple(self.threadblocks)))
        self.gpu = None
        self.rank_id = None

    def _start_tb(self, attrs: dict[str, str]) -> None:
        tb_id = self.tb_id = self._identify("tb", attrs, "id")
        self._attributes("tb", attrs, TB_ATTRIBUTES)
        assert tb_id is not None  # a missing id was refused just above
        expected = len(self.threadblocks)
        if tb_id < expected:
            raise self._fail(f"duplicate <tb id={tb_id}>")
        if tb_id > expected:
            raise self._fail(f"<tb id={tb_id}> out of order: expected id={expected} (tb ids are 0..n-1 in order)")
        self.tb = (tb_id, self._integer("tb", attrs, "send", -1), self._integer("tb", attrs, "recv", -1),
                   self._integer("tb", attrs, "chan", 0))
        self.steps = []

    def _end_tb(self) -> None:
        assert self.tb is not None
        tb_id, send, recv, chan = self.tb
        self.threadblocks.append(Threadblock(id=tb_id, send=send, recv=recv, chan=chan, steps=tuple(self.steps)))
        self.tb = None
        self.tb_id = None

    def _start_step(self, attrs: dict[str, str]) -> None:
        s = self.step_id = self._identify("step", attrs, "s")
        self._attributes("step", attrs, STEP_ATTRIBUTES)
        assert s is not None  # a missing id was refused just above
        expected = len(self.steps)
        if s < expected:
            raise self._fail(f"duplicate <step s={s}>")
        if s > expected:
            raise self._fail(f"<step s={s}> out of order: expected s={expected} (steps are 0..n-1 in order)")
        try:
            step_type = StepType(attrs["type"])
        except ValueError:
            known = ", ".join(t.value for t in StepType)
            raise self._fail(f"<step> attribute type={_shown(attrs['type'])} is not a known step type ({known})") from None
        lowest_offset = -1 if step_type is StepType.NOP else 0  # msccl-tools writes nop's unused offsets as -1
        srcbuf = self._buffer(attrs, "srcbuf")
        srcoff = self._integer("step", attrs, "srcoff", lowest_offset)
        dstbuf = self._buffer(attrs, "dstbuf")
        dstoff = self._integer("step", attrs, "dstoff", lowest_offset)
        cnt = self._integer("step", attrs, "cnt", 0)
        depid = self._integer("step", attrs, "depid", -1)
        deps = self._integer("step", attrs, "deps", -1)
        if (depid == -1) != (deps == -1):
            raise self._fail(f"<step> attributes depid={depid} and deps={deps}: both -1 (no dependency) or both set")
        hasdep = self._boolean("step", attrs, "hasdep")
        self.steps.append(Step(s=s, type=step_type, srcbuf=srcbuf, srcoff=srcoff, dstbuf=dstbuf, dstoff=dstoff,
                               cnt=cnt, depid=depid, deps=deps, hasdep=hasdep))

    def _end_step(self) -> None:
        self.step_id = None

    # -- attributes

    def _identify(self, tag: str, attrs: dict[str, str], key: str) -> int | None:
        """The element's id, read first so that every later refusal names it (None while absent)."""
        return self._integer(tag, attrs, key, 0) if key in attrs else None

    def _attributes(self, tag: str, attrs: dict[str, str], required: tuple[str, ...],
                    optional: tuple[str, ...] = ()) -> None:
        if len(attrs) == len(required) and all(key in attrs for key in required):
            return  # the common case: exactly the required ones
        unknown = [key for key in attrs if key not in required and key not in optional]
        if unknown:
            raise self._fail(f"<{tag}> has unknown attribute{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(unknown)}: commd does not run what it does not understand")
        missing = [key for key in required if key not in attrs]
        if missing:
            raise self._fail(f"<{tag}> lacks attribute{'s' if len(missing) > 1 else ''} {', '.join(missing)}")

    def _integer(self, tag: str, attrs: dict[str, str], key: str, low: int, high: int = _INT32_MAX) -> int:
        text = attrs[key]
        if not _INTEGER.fullmatch(text):
            raise self._fail(f"<{tag}> attribute {key}={_shown(text)} is not an integer")
        value = int(text)
        if value < low:
            bound = "-1 or ≥ 0" if low == -1 else f"≥ {low}"
            raise self._fail(f"<{tag}> attribute {key}={value} must be {bound}")
        if value > high:
            raise self._fail(f"<{tag}> attribute {key}={value} is over {high}")
        return value

    def _boolean(self, tag: str, attrs: dict[str, str], key: str) -> bool:
        text = attrs[key]
        if text not in ("0", "1"):
            raise self._fail(f"<{tag}> attribute {key}={_shown(text)} must be 0 or 1")
        return text == "1"

    def _buffer(self, attrs: dict[str, str], key: str) -> str:
        text = attrs[key]
        if text not in BUFFERS:
            raise self._fail(f"<step> attribute {key}={_shown(text)} is not a buffer ({', '.join(BUFFERS)})")
        return text
