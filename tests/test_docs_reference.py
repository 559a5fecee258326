"""The reference pages (docs/reference/) are what docs/gen_reference.py makes of the code, every
COMMD_* environment variable the source names is documented (``commd.runtime.ENVIRONMENT``), and the
layering rules the architecture overview lists are the ones tests/test_layering.py enforces."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from commd.runtime import ENVIRONMENT

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "docs" / "gen_reference.py"
OVERVIEW = ROOT / "docs" / "architecture" / "index.md"
VARIABLE = re.compile(r"COMMD_[A-Z0-9_]+")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    return _load("gen_reference", GENERATOR)


@pytest.fixture(scope="module")
def pages(generator: ModuleType) -> dict[str, str]:
    return generator.generate()


def test_reference_pages_are_current(generator: ModuleType, pages: dict[str, str]) -> None:
    """The checked-in pages equal what the code generates (``docs/gen_reference.py --check`` exits 0)."""
    stale = generator.stale_pages(pages)
    assert not stale, f"stale reference pages {stale}: run .venv/bin/python docs/gen_reference.py"
    assert generator.main(["--check"]) == 0


def test_check_names_a_stale_page(generator: ModuleType, pages: dict[str, str], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A page that differs from the code, or is missing, is named."""
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "metrics.md").write_text(pages["metrics.md"] + "edited by hand\n")
    (tmp_path / "errors.md").unlink()
    monkeypatch.setattr(generator, "REFERENCE", tmp_path)
    assert generator.stale_pages(pages) == ["docs/reference/metrics.md", "docs/reference/errors.md"]


def _source_without_the_table() -> str:
    """Every module of commd/, with ENVIRONMENT's own definition left out (it names every variable)."""
    texts = []
    for path in sorted((ROOT / "commd").rglob("*.py")):
        text = path.read_text()
        if path == ROOT / "commd" / "runtime.py":
            tree = ast.parse(text)
            table = next(node for node in tree.body if isinstance(node, ast.AnnAssign)
                         and isinstance(node.target, ast.Name) and node.target.id == "ENVIRONMENT")
            text = text.replace(ast.get_source_segment(text, table) or "", "")
        texts.append(text)
    return "\n".join(texts)


def test_every_environment_variable_is_documented() -> None:
    """Each COMMD_* name in the source has a one-line description (``COMMD_METRICS_*``: some variable of
    that prefix), and the table names no variable the source does not."""
    named = set(VARIABLE.findall(_source_without_the_table()))
    prefixes = {name for name in named if name.endswith("_")}
    missing = sorted(named - prefixes - ENVIRONMENT.keys())
    assert not missing, f"add these to commd.runtime.ENVIRONMENT: {missing}"
    assert all(any(documented.startswith(p) for documented in ENVIRONMENT) for p in prefixes), prefixes
    unused = sorted(ENVIRONMENT.keys() - named)
    assert not unused, f"commd.runtime.ENVIRONMENT documents variables nothing reads: {unused}"
    bad = sorted(name for name, text in ENVIRONMENT.items() if not text.strip() or "\n" in text)
    assert not bad, f"variables without a one-line description: {bad}"


def test_the_settings_page_lists_every_variable(pages: dict[str, str]) -> None:
    for name in ENVIRONMENT:
        assert f"| `{name}` |" in pages["settings.md"], name


def _folders(text: str) -> set[str]:
    """The commd folders and modules named in ``text`` (`` `lanes/` `` -> lanes, `` `runtime.py` `` -> runtime)."""
    return {name.removesuffix(".py") for name in re.findall(r"`(\w+)(?:/|\.py)`", text)}


def test_the_overview_lists_the_layering_rules_the_test_enforces() -> None:
    """docs/architecture/index.md's rules name the same folders as tests/test_layering.py's tables."""
    layering = _load("layering_rules", ROOT / "tests" / "test_layering.py")
    text = OVERVIEW.read_text()
    rules = " ".join(text[text.index("## Layering rules"):].split())  # one line: items wrap
    base = re.search(r"1\. (.*?) import only each other", rules)
    assert base is not None and _folders(base.group(1)) == layering.BASE
    forbidden = {layer: _folders(targets) for layer, targets in
                 re.findall(r"`(\w+)/` never imports (.*?)(?:\.|:)(?: |$)", rules)}
    assert forbidden == layering.FORBIDDEN
    client = re.search(r"5\. (.*?) import only (.*?) \(", rules)
    assert client is not None
    assert _folders(client.group(1)) == layering.CLIENT_SIDE
    assert _folders(client.group(2)) == layering.CLIENT_ALLOWED
    leaves = re.search(r"nothing imports (.*?) but themselves", rules)
    assert leaves is not None and _folders(leaves.group(1)) == layering.TOP_ONLY
    assert f"`commd/daemon/` has at most {layering.DAEMON_MAX_LINES} lines" in rules
