"""The layering rules of docs/architecture/index.md, read from the source with ``ast`` (nothing is imported).

Every module under ``commd/`` is parsed; every ``import`` / ``from ... import``
is collected wherever it stands: at module level, inside functions (lazy
imports), and under ``if TYPE_CHECKING:``.

Which imports count where:

* The layer rules (1-5, 7b) count every import, TYPE_CHECKING ones included:
  a type annotation naming a daemon class from lanes/ is a dependency on the
  daemon all the same, even if it is never executed.
* The cycle rule (7a) counts every import too: module-level, lazy
  (function-level) and TYPE_CHECKING ones.  A lazy import still couples two
  modules both ways, and a TYPE_CHECKING import that closes a loop is a cycle
  hidden from the interpreter, not removed (a Protocol names what a module
  needs of another without importing it).  It also counts the import that
  torch makes: ``import torch`` runs the ``torch.backends`` entry point
  (pyproject.toml) through torch's backend autoloading, so every module that
  imports torch imports that module too.  A loop through it is what broke
  ``from commd.client import Client`` in a fresh interpreter.
* Rule 6 (privacy) counts every import and every attribute access.

Imports by name at run time (``importlib.import_module``) are not seen: the
command table of ``cli/main.py`` (a leaf, which may import anything) and the
lazy names of ``client/__init__.py`` (its own modules) are the only ones.

Each rule is its own test; a failure lists every offender with file and line.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "commd"

#: Rule 1: the base layers; they may import only each other (and the standard library, third parties).
BASE = {"core", "protocol", "kernels", "memory", "observe", "runtime", "codecs"}

#: Rules 2-4: what each layer must never import.
FORBIDDEN = {
    "lanes": {"scheduler", "execution", "fabric", "daemon"},
    "scheduler": {"daemon", "fabric", "execution", "lanes"},
    "execution": {"daemon", "fabric", "scheduler"},
    "fabric": {"daemon"},
    # programs and their runtime: below the daemon; they move bytes only through lanes.base.Transport
    "algorithms": {"scheduler", "execution", "fabric", "daemon", "client", "torch_backend"},
    # offline: it reaches the daemons only through the files it writes (a tuning table's data it reads)
    "planner": {"execution", "fabric", "daemon", "lanes", "client", "torch_backend", "algorithms"},
}

#: Rule 5: the only commd layers the client library and the torch backend may import.
CLIENT_SIDE = {"client", "torch_backend"}
CLIENT_ALLOWED = {"protocol", "memory", "runtime", "kernels", "codecs", "client", "torch_backend"}

#: Rule 7b: layers that nothing outside themselves may import (the entry points import them by name).
TOP_ONLY = {"cli", "bench"}
#: Modules that may import cli/: ``python -m commd`` is the console entry point.
ENTRY_POINTS = {"commd.__main__"}

#: Rule 6: private members of third-party (torch) objects that commd uses on purpose, per module.
#: Each is the library's only way to do the thing; keep this list short and say why.
THIRD_PARTY_PRIVATE: dict[str, set[str]] = {
    # A torch.distributed backend written in Python must subclass torch's Work, find registered
    # backends, and answer profiling's one cheap "is a profiler running" flag test.
    "commd.torch_backend.process_group": {"_Work", "_plugins"},
    "commd.torch_backend.profiling": {"_profiler_enabled"},
    # os._exit (documented): the demo's worker leaves without torch's crashy atexit teardown.
    "commd.cli.demo": {"_exit"},
    # CUDA IPC: torch exposes storage sharing between processes only through these.
    "commd.client.cuda_ipc": {"_share_cuda_"},
    "commd.daemon.cuda": {"_new_shared_cuda"},
    # Registration moves a user's storage into shared memory in place (every view follows): torch's
    # share_memory_() does the same with the same swap, but into a file that cannot be sealed.
    # It tells a flat buffer others view from a temporary by its storage's reference count
    # (torch._C._storage_Use_Count(storage._cdata): torch has no public way to ask).
    "commd.client.registry": {"_swap_data_ptr_", "_C", "_cdata"},
    # Gloo/NCCL groups built by hand (own device, timeouts) and Gloo's flat all-gather.
    # torch.distributed does not re-export AllgatherOptions (it lives in torch._C._distributed_c10d).
    "commd.lanes.gloo": {"_Options", "_devices", "_timeout", "_set_default_timeout"},
    "commd.lanes.torch_group": {"_allgather_base", "_C", "_distributed_c10d"},
    "commd.lanes.nccl": {"_timeout"},
    # A DDP model replaced after a failure mid-backward must let go of the parameters: DDP's own
    # recovery hook (torch's test_ddp_remove_autograd_hooks); it has no public one.
    "commd.ft.ddp": {"_remove_autograd_hooks"},
}

#: Rule 8: the daemon folder is a composition root of small files.
DAEMON_MAX_LINES = 300


@dataclass(frozen=True)
class Import:
    """One import statement's target as seen from ``module`` (the dotted name of a commd module)."""

    module: str  # importer
    target: str  # the commd module imported (the deepest dotted prefix that is a module of the tree)
    names: tuple[str, ...]  # the names taken by ``from target import ...`` (empty for ``import target``)
    line: int
    type_checking: bool

    def where(self) -> str:
        return f"{module_path(self.module)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> str:
    path = ROOT / Path(*name.split("."))
    if (path / "__init__.py").exists():
        return str((path / "__init__.py").relative_to(ROOT))
    return str(path.with_suffix(".py").relative_to(ROOT))


SOURCES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES: dict[str, ast.Module] = {name: ast.parse(p.read_text(), str(p)) for name, p in SOURCES.items()}


def layer(module: str) -> str:
    """The folder of a commd module (``commd.lanes.tcp.mesh`` -> ``lanes``; ``commd.runtime`` -> ``runtime``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def resolve(dotted: str) -> str | None:
    """The deepest prefix of ``dotted`` that is a commd module, or None for anything outside commd."""
    parts = dotted.split(".")
    if parts[0] != "commd":
        return None
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in SOURCES:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, type_checking: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below ``node``, with whether it stands under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield child, type_checking
            for stmt in child.body:
                yield stmt, True
                yield from _walk(stmt, True)
            for stmt in child.orelse:
                yield stmt, type_checking
                yield from _walk(stmt, type_checking)
            continue
        yield child, type_checking
        yield from _walk(child, type_checking)


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if SOURCES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> Iterator[Import]:
    for node, tc in _walk(TREES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = resolve(alias.name)
                if target:
                    yield Import(module, target, (), node.lineno, tc)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                # ``from commd.client import ops`` imports the module commd.client.ops
                target = resolve(f"{source}.{alias.name}") or resolve(source)
                if target:
                    name = () if target == f"{source}.{alias.name}" else (alias.name,)
                    yield Import(module, target, name, node.lineno, tc)


IMPORTS: list[Import] = [imp for module in SOURCES for imp in imports_of(module)]


def torch_autoload_module() -> str:
    """The module of commd's ``torch.backends`` entry point, which ``import torch`` runs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["torch.backends"]["commd"]
    return target.split(":")[0]


def _import_time_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The statements that run when the module is imported: not function bodies, not ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (n for stmt in child.orelse for n in [stmt, *_import_time_nodes(stmt)])
            continue
        yield child
        yield from _import_time_nodes(child)


def import_time_targets(module: str) -> tuple[set[str], bool]:
    """The commd modules ``module`` imports when it is imported (parent packages included), and whether
    it imports torch then."""
    targets: set[str] = set()
    imports_torch = False
    for node in _import_time_nodes(TREES[module]):
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            dotted = [f"{source}.{a.name}" for a in node.names] + [source]
        else:
            continue
        for name in dotted:
            imports_torch |= name == "torch" or name.startswith("torch.")
            target = resolve(name)
            while target:  # importing a.b.c runs a and a.b first
                targets.add(target)
                target = resolve(target.rpartition(".")[0]) if "." in target else None
    targets.discard(module)
    return targets, imports_torch


def _report(rule: str, offenders: list[str]) -> str:
    offenders = sorted(set(offenders))
    return f"{rule} ({len(offenders)} offender{'s' if len(offenders) != 1 else ''}):\n  " + "\n  ".join(offenders)


# ---- rules 1-5: who may import whom ----------------------------------------------------------------
def test_the_parser_sees_the_tree() -> None:
    """The checks below are only as good as the import reader: it must see known edges of every kind."""
    edges = {(i.module, i.target, i.type_checking) for i in IMPORTS}
    assert ("commd.client.connection", "commd.protocol.schema", False) in edges  # from commd.protocol import schema
    assert ("commd", "commd.client.connection", True) in edges  # under TYPE_CHECKING
    assert any(i.module == "commd" and i.target == "commd.torch_backend.process_group" and not i.type_checking
               for i in IMPORTS)  # lazy, inside a function
    assert len(SOURCES) > 80


def test_base_layers_import_nothing_above_them() -> None:
    """Rule 1: core/, protocol/, kernels/, memory/, observe/, codecs/ and runtime.py import only each other."""
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if layer(i.module) in BASE and layer(i.target) not in BASE]
    assert not bad, _report("base layers importing upper layers", bad)


def test_layers_never_import_what_sits_above_them() -> None:
    """Rules 2-4: lanes/, scheduler/, execution/ and fabric/ stay off the layers above them."""
    bad = [f"{i.where()}: {layer(i.module)}/ must not import {layer(i.target)}/ ({i.target})" for i in IMPORTS
           if layer(i.target) in FORBIDDEN.get(layer(i.module), set())]
    assert not bad, _report("layer violations", bad)


def test_client_and_torch_backend_import_only_the_client_side() -> None:
    """Rule 5: client/ and torch_backend/ import only protocol, memory, runtime, kernels and client
    (``import commd`` itself is the package's light root, which registers the backend)."""
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if layer(i.module) in CLIENT_SIDE and i.target != "commd" and layer(i.target) not in CLIENT_ALLOWED]
    assert not bad, _report("client-side modules importing daemon-side layers", bad)


def test_nothing_imports_the_command_line_or_the_benchmark() -> None:
    """Rule 7b: cli/ and bench/ are leaves: only they themselves (and ``python -m commd``) import them."""
    bad = [f"{i.where()}: {i.module} imports {i.target}" for i in IMPORTS
           if layer(i.target) in TOP_ONLY and layer(i.module) not in TOP_ONLY and i.module not in ENTRY_POINTS]
    assert not bad, _report("imports of cli/ or bench/", bad)


# ---- rule 6: privacy -----------------------------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_another_modules_private_names() -> None:
    """Rule 6a: ``from m import _x`` and ``import m._x`` across modules are refused."""
    bad = []
    for i in IMPORTS:
        private_path = [p for p in i.target.split(".") if _private(p)]
        private_names = [n for n in i.names if _private(n)]
        if private_path or private_names:
            bad.append(f"{i.where()}: {i.module} imports {', '.join(private_names) or i.target} from {i.target}")
    assert not bad, _report("private names imported across modules", bad)


def _own_names(tree: ast.Module) -> set[str]:
    """Names a module defines itself at top level (its classes, functions, constants): ``Own._x`` is
    the module's own business.  Imported names are not its own."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _is_super(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def test_no_object_reaches_into_a_held_objects_private_members() -> None:
    """Rule 6b: ``x._member`` is allowed only where ``x`` is ``self``, ``cls`` or a name the module
    defines itself (``super()._x`` is the object's own member too); a held object's or another
    module's ``_member`` is refused, apart from the third-party members in THIRD_PARTY_PRIVATE."""
    bad = []
    for module, tree in TREES.items():
        own = _own_names(tree) | {"self", "cls"}
        allowed = THIRD_PARTY_PRIVATE.get(module, set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _private(node.attr) or node.attr in allowed:
                continue
            if (isinstance(node.value, ast.Name) and node.value.id in own) or _is_super(node.value):
                continue
            dotted = _dotted(node)
            shown = dotted or f"<expr>.{node.attr}"
            bad.append(f"{module_path(module)}:{node.lineno}: {shown}")
    assert not bad, _report("private members reached through another object or module", bad)


# ---- rule 7a: no cycles --------------------------------------------------------------------------
def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-import), by Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # iterative, so a deep tree cannot hit the recursion limit
        nonlocal counter
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in SOURCES}
    for i in IMPORTS:
        if i.target != i.module:
            graph[i.module].add(i.target)
    return graph


def test_cycle_finder_finds_cycles() -> None:
    """The finder itself: a three-module ring and a self-loop are found, a diamond is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []


def test_what_torch_autoloads_imports_no_module_that_imports_torch() -> None:
    """Rule 7c: ``import torch`` runs the entry point; nothing it imports then may import torch, since the
    module that imported torch may be half-imported (``from commd.client import Client`` first)."""
    autoload = torch_autoload_module()
    assert autoload in SOURCES
    seen: set[str] = set()
    todo = [autoload]
    offenders = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        targets, imports_torch = import_time_targets(module)
        if imports_torch and module != autoload:
            offenders.append(f"{module_path(module)} imports torch, and {autoload} imports it when torch loads")
        todo.extend(targets)
    assert not offenders, _report("torch's backend autoload", offenders)
    # the check sees the loop it is for: the process group module imports torch and the client at import
    targets, imports_torch = import_time_targets("commd.torch_backend.process_group")
    assert imports_torch and "commd.client.connection" in targets


def test_no_import_cycles() -> None:
    """Rule 7a: the modules form a DAG (every import: lazy, TYPE_CHECKING and torch's autoloading included)."""
    cycles = _cycles(import_graph())
    bad = []
    for component in cycles:
        members = set(component)
        edges = sorted(f"{i.where()}: {i.module} -> {i.target}" + (" (TYPE_CHECKING)" if i.type_checking else "")
                       for i in IMPORTS if i.module in members and i.target in members)
        bad.append(" <-> ".join(component) + "\n    " + "\n    ".join(edges))
    assert not bad, _report("import cycles", bad)


# ---- the daemon is a composition root of small files -----------------------------------------------
def test_daemon_files_are_small() -> None:
    """Every file in commd/daemon/ has at most DAEMON_MAX_LINES lines (one role per file)."""
    bad = []
    for path in sorted((PACKAGE / "daemon").glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > DAEMON_MAX_LINES:
            bad.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not bad, _report(f"daemon files over {DAEMON_MAX_LINES} lines", bad)
