"""The documentation's code blocks run, as tests (README.md and docs/**/*.md), and the site builds.

A user pastes what the docs show; these tests make sure it still works. The conventions every
page follows:

- The site: `mkdocs.yml` (MkDocs + Material, strict, offline); `make docs` builds it, and a broken
  link or anchor fails the build (test_site_builds). Link between pages with relative `.md` links,
  to repo files outside docs/ only by plain text paths in backticks.
- Every claim is one the project measured or tested; figures go on docs/performance.md only (with
  date, machine, load and the command that reproduces them). Current behaviour only, no history.
- Every code block runs, as a test. By the fence's language and an optional HTML comment on the
  line just before the fence:
  - `python`: run as a script in a fresh interpreter (this venv's python), cwd the page's temp
    dir, `COMMD_RUNTIME_DIR` a private temp dir, 120 s timeout; must exit 0.
  - `<!-- test: launch N -->` before a python block: written to `train.py` and run with
    `commd launch --nproc-per-node N train.py` (N ranks on one node); must exit 0, 120 s.
  - `<!-- test: file NAME -->` before any block: its text is written to NAME in the page's temp
    dir for a later block of the page (not run; a toml, xml or json file is still checked).
  - `sh` / `console` (aliases `bash`, `shell`): `<!-- test: run -->` runs it with
    `bash -euo pipefail` in the page's temp dir, this venv's bin first on PATH, 300 s timeout
    (a console block: its lines after a `$ ` or `# ` prompt); `<!-- test: slow -->` the same, but
    only under `pytest -m slow` (root, simulated hosts, minutes); `<!-- test: no-run REASON -->`
    shown only, REASON saying why. An sh or console block without an annotation fails.
  - `toml`: must parse; a commd daemon config (a `[scheduler]`, `[[rules]]`, `[[algorithms]]`,
    `[[compression]]`, `[limits]` or `[metrics]` table) must also pass commd's own config checks.
  - `text`: shown only (output samples); `xml`, `json`: shown, and must parse.
  - Any other language: only with `no-run REASON` or `file NAME`. `slow` and `no-run` also apply
    to python blocks (e.g. root or a GPU needed). Python fragments are not allowed: show a small,
    complete, runnable example (a few layers, `torch.multiprocessing` or `launch N`).
- Each page's blocks run in one test, in page order, in one temp dir; a failure names the page
  and the block's first line. Any daemon a block started is stopped after the block.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster import free_port
from docs_blocks import Block, PageError, parse_page
from helpers import kill_pid

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PYTHON_TIMEOUT_S = 120.0
SHELL_TIMEOUT_S = 300.0
#: How long a timed-out block gets between SIGTERM and SIGKILL.
TERM_GRACE_S = 30.0
#: Tables that make a toml block a commd daemon config.
DAEMON_TABLES = frozenset({"scheduler", "rules", "algorithms", "compression", "limits", "metrics"})
#: Variables of the environment running the tests that a block must not inherit (they would pick
#: another job, daemon, rank or store than the block's own).
INHERITED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RUN_ID")
OUTPUT_TAIL_LINES = 40


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _blocks(page: Path) -> list[Block] | PageError:
    try:
        return parse_page(page, _name(page))
    except PageError as exc:
        return exc


def _budget(blocks: list[Block] | PageError, slow: bool) -> float:
    """The page test's own limit: its blocks' limits added up, so a block's timeout reports first."""
    if isinstance(blocks, PageError):
        return 60.0
    total = 60.0
    for block in blocks:
        if (block.slow if slow else block.runs):
            total += (PYTHON_TIMEOUT_S if block.lang == "python" else SHELL_TIMEOUT_S) + TERM_GRACE_S
    return total


#: Pages whose examples start several jobs (half a minute or more): they run in make test-extended,
#: which CI runs too, so that make test stays under its 15 minutes.
EXTENDED_PAGES = {"docs/tuning.md", "docs/fault-tolerance.md", "docs/gpus.md", "docs/observability.md"}


def _params(slow: bool) -> list[object]:
    params = []
    for page in _pages():
        blocks = _blocks(page)
        if slow and (isinstance(blocks, PageError) or not any(b.slow for b in blocks)):
            continue
        marks = [pytest.mark.timeout(_budget(blocks, slow))]
        if not slow and _name(page) in EXTENDED_PAGES:
            marks.append(pytest.mark.extended)
        params.append(pytest.param(page, id=_name(page), marks=marks))
    return params


@pytest.fixture
def page_dirs() -> Iterator[tuple[Path, Path]]:
    """The page's working directory and its private COMMD_RUNTIME_DIR (short: socket paths are
    limited to about 107 bytes), removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="cdoc"))
    runtime = work / "rt"
    runtime.mkdir(mode=0o700)
    try:
        yield work, runtime
    finally:
        _stop_daemons(runtime)
        shutil.rmtree(work, ignore_errors=True)


def _environment(runtime: Path, work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_") and k not in INHERITED}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        COMMD_RUNTIME_DIR=str(runtime),
        COMMD_TUNING_DIR=str(work / "tuning"),  # never a table `commd tune` left on this machine
        MASTER_ADDR="127.0.0.1",  # for examples that start their own ranks (env://)
        MASTER_PORT=str(free_port()),
        PYTHONUNBUFFERED="1",
    )
    return env


def _stop_daemons(runtime: Path) -> None:
    """Stop every daemon still running for a job under ``runtime`` (auto-started daemons have their own
    session, so they outlive the block's process group; those of finished jobs have exited already)."""
    for pid_file in runtime.glob("**/daemon.pid"):
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        kill_pid(pid, timeout=10.0)


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` in its own session; (exit code or None on timeout, its output). Whatever the
    block left running in that session is killed afterwards."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        # SIGTERM first: a shell block's EXIT trap (e.g. removing its simulated hosts) still runs.
        _signal_session(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_session(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        code = None
    _signal_session(proc.pid, signal.SIGKILL)
    return code, out


def _signal_session(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(output: str) -> str:
    lines = output.rstrip().splitlines()
    return "\n".join(["    " + line for line in lines[-OUTPUT_TAIL_LINES:]])


def _check_parsed(block: Block, work: Path) -> str | None:
    """A toml, xml or json block's problem (None: fine)."""
    try:
        if block.lang == "json":
            json.loads(block.text)
        elif block.lang == "xml":
            ET.fromstring(block.text)
        elif block.lang == "toml":
            data = tomllib.loads(block.text)
            if DAEMON_TABLES & set(data):
                _check_daemon_config(block.text, work / f".config-{block.line}.toml")
    except Exception as exc:  # noqa: BLE001 - any refusal is the block's failure, with its message
        return f"{type(exc).__name__}: {exc}"
    return None


def _check_daemon_config(text: str, path: Path) -> None:
    """Load a daemon config as `commd daemon --config` does: scheduler rules, [limits], [metrics]."""
    from commd.daemon.limits import config_section as limits_section
    from commd.observe.settings import config_section as metrics_section
    from commd.scheduler.config import load_config

    path.write_text(text)
    load_config(path)
    limits_section(str(path))
    metrics_section(str(path))


def _execute(block: Block, work: Path, env: dict[str, str]) -> str | None:
    """Run one block (or write / check it); its failure as text, or None."""
    if block.directive == "file":
        target = work / block.arg
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.text)
        return _check_parsed(block, work) if block.lang in ("toml", "xml", "json") else None
    if block.lang in ("toml", "xml", "json"):
        return _check_parsed(block, work)
    if block.lang == "python":
        if block.directive == "launch":
            (work / "train.py").write_text(block.text)
            argv = [str(BIN / "commd"), "launch", "--nproc-per-node", block.arg, "train.py"]
        else:
            script = work / f"block_{block.line}.py"
            script.write_text(block.text)
            argv = [sys.executable, script.name]
        timeout = PYTHON_TIMEOUT_S
    elif block.lang in ("sh", "console"):
        script = work / f"block_{block.line}.sh"
        script.write_text(block.shell_script())
        argv = ["bash", "-euo", "pipefail", script.name]
        timeout = SHELL_TIMEOUT_S
    else:
        return None
    try:
        code, output = _run(argv, work, env, timeout)
    finally:
        _stop_daemons(Path(env["COMMD_RUNTIME_DIR"]))
    if code is None:
        return f"timed out after {timeout:.0f} s\n{_tail(output)}"
    if code != 0:
        return f"exit code {code}\n{_tail(output)}"
    return None


def _run_page(page: Path, work: Path, runtime: Path, slow: bool) -> None:
    blocks = _blocks(page)
    if isinstance(blocks, PageError):  # the page's line and what is wrong there, no traceback
        pytest.fail(str(blocks), pytrace=False)
    env = _environment(runtime, work)
    failures = []
    for block in blocks:
        if block.directive == "file" or block.lang in ("toml", "xml", "json"):
            wanted = True  # files and checks: cheap, and the slow blocks may need the files
        elif slow:
            wanted = block.slow
        else:
            wanted = block.runs
        if not wanted:
            continue
        problem = _execute(block, work, env)
        if problem:
            what = block.lang + (f", {block.directive} {block.arg}".rstrip() if block.directive else "")
            failures.append(f"{block.where} ({what}): {problem}")
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)


@pytest.mark.parametrize("page", _params(slow=False))
def test_page_blocks(page: Path, page_dirs: tuple[Path, Path]) -> None:
    """Every block of the page that runs in `make test` runs and succeeds; the others are well-formed."""
    _run_page(page, *page_dirs, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("page", _params(slow=True))
def test_page_slow_blocks(page: Path, page_dirs: tuple[Path, Path]) -> None:
    """The page's slow blocks (root, simulated hosts) run and succeed."""
    _run_page(page, *page_dirs, slow=True)


@pytest.mark.timeout(SHELL_TIMEOUT_S + 30)
def test_site_builds(tmp_path: Path) -> None:
    """`make docs`' strict build succeeds: no broken link or anchor, no page outside the nav."""
    mkdocs = BIN / "mkdocs"
    if not mkdocs.exists():
        found = shutil.which("mkdocs")
        if found is None:
            pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
        mkdocs = Path(found)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    code, output = _run([str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], REPO, env,
                        SHELL_TIMEOUT_S)
    assert code == 0, f"mkdocs build --strict failed ({'timed out' if code is None else f'exit {code}'}):\n" \
        + _tail(output)
