"""The code blocks of the documentation's pages and what each one's annotation asks of it.

tests/test_docs.py runs them; this module only reads markdown, so that a page's mistakes (an
unknown annotation, a shell block nobody said what to do with) are found before anything runs.
The rules are the ones at the top of tests/test_docs.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

#: Fence languages, by the rule that applies (aliases share their canonical name's rule).
LANGUAGE_ALIASES = {"py": "python", "python3": "python", "bash": "sh", "shell": "sh"}
RUNNABLE = frozenset({"python", "sh", "console"})
PARSED = frozenset({"toml", "xml", "json"})
SHOWN = frozenset({"text"})
KNOWN = RUNNABLE | PARSED | SHOWN

_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
_NOTE = re.compile(r"^<!--\s*test:\s*(?P<body>.*?)\s*-->$")
_ANY_NOTE = re.compile(r"<!--\s*test:")
_PROMPT = re.compile(r"^(?:\$|#) ")


class PageError(ValueError):
    """A page breaks the conventions (the message names the page and line)."""


@dataclass(frozen=True)
class Block:
    """One fenced block: where it opens, its language, its annotation and its text."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str  # canonical language ('' when the fence names none)
    directive: str  # '', 'run', 'slow', 'no-run', 'launch' or 'file'
    arg: str  # launch: N; file: NAME; no-run: REASON
    text: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether `make test` runs it (slow blocks run only under -m slow)."""
        if self.directive in ("no-run", "file", "slow"):
            return False
        return self.lang == "python" or self.directive == "run"

    @property
    def slow(self) -> bool:
        return self.directive == "slow"

    def shell_script(self) -> str:
        """What bash runs: an sh block as it is; a console block's prompted lines ("$ " or "# "),
        with their backslash continuations, or the whole block when no line has a prompt."""
        if self.lang != "console":
            return self.text
        lines = self.text.splitlines()
        if not any(_PROMPT.match(line) for line in lines):
            return self.text
        out: list[str] = []
        continued = False
        for line in lines:
            if continued:
                out.append(line)
            elif _PROMPT.match(line):
                out.append(line[2:])
            else:
                continue
            continued = line.rstrip().endswith("\\")
        return "\n".join(out) + "\n"


def _directive(note: str, where: str) -> tuple[str, str]:
    """('run' | 'slow' | 'no-run' | 'launch' | 'file', argument) of an annotation's body."""
    word, _, rest = note.partition(" ")
    rest = rest.strip()
    if word in ("run", "slow"):
        if rest:
            raise PageError(f"{where}: '<!-- test: {word} -->' takes no argument, got {rest!r}")
        return word, ""
    if word == "no-run":
        if len(rest.split()) < 2:
            raise PageError(f"{where}: '<!-- test: no-run REASON -->' needs a reason that says why "
                            f"(e.g. 'needs two real nodes'), got {rest!r}")
        return word, rest
    if word == "launch":
        if not rest.isdigit() or int(rest) < 1:
            raise PageError(f"{where}: '<!-- test: launch N -->' needs a number of ranks >= 1, got {rest!r}")
        return word, rest
    if word == "file":
        name = PurePosixPath(rest)
        if not rest or name.is_absolute() or ".." in name.parts:
            raise PageError(f"{where}: '<!-- test: file NAME -->' needs a relative file name inside the page's "
                            f"directory, got {rest!r}")
        return word, rest
    raise PageError(f"{where}: unknown annotation '<!-- test: {note} -->' "
                    "(run, slow, no-run REASON, launch N or file NAME)")


def _check(block: Block) -> None:
    """Refuse an annotation that does not fit the block's language, and a block no rule covers."""
    where, lang, directive = block.where, block.lang, block.directive
    if directive == "launch" and lang != "python":
        raise PageError(f"{where}: 'launch N' is for python blocks, not {lang or 'a fence without a language'}")
    if directive == "run" and lang not in ("sh", "console"):
        raise PageError(f"{where}: 'run' is for sh and console blocks (python blocks run anyway)")
    if directive == "slow" and lang not in RUNNABLE:
        raise PageError(f"{where}: 'slow' is for python, sh and console blocks, not {lang or 'no language'}")
    if lang in ("sh", "console") and not directive:
        raise PageError(f"{where}: a {lang} block needs '<!-- test: run -->', '<!-- test: slow -->' or "
                        "'<!-- test: no-run REASON -->' on the line before its fence")
    if lang not in KNOWN and directive not in ("no-run", "file"):
        raise PageError(f"{where}: the fence's language {lang or '(none)'!r} has no rule: use one of "
                        f"{', '.join(sorted(KNOWN))} ('text' for output), or say '<!-- test: no-run REASON -->'")


def parse_page(path: Path, name: str) -> list[Block]:
    """Every fenced block of the markdown file ``path`` (``name``: how failures name the page)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    used_notes: set[int] = set()
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        info = opened["info"].strip().lstrip("{").rstrip("}").strip()
        lang = info.split()[0].lstrip(".").lower() if info else ""
        lang = LANGUAGE_ALIASES.get(lang, lang)
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = i + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        if end == len(lines):
            raise PageError(f"{name}:{i + 1}: the fence opened here is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        directive, arg = "", ""
        if i > 0:
            note = _NOTE.match(lines[i - 1].strip())
            if note:
                directive, arg = _directive(note["body"], f"{name}:{i}")
                used_notes.add(i - 1)
        block = Block(name, i + 1, lang, directive, arg, "\n".join(body) + "\n")
        _check(block)
        blocks.append(block)
        i = end + 1
    for number, line in enumerate(lines):
        if _ANY_NOTE.search(line) and number not in used_notes and not _inside(number, blocks):
            raise PageError(f"{name}:{number + 1}: a '<!-- test: ... -->' annotation must be on the line just "
                            "before a fence (and be the whole line)")
    return blocks


def _inside(number: int, blocks: list[Block]) -> bool:
    """Whether 0-based line ``number`` lies inside one of ``blocks`` (an annotation shown as an example)."""
    return any(b.line <= number < b.line + b.text.count("\n") + 1 for b in blocks)
