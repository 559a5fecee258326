"""What the commd.ft tests that run their ranks under `commd launch --max-restarts` share: the
launch and each rank's result file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def launch(script: str, nproc: int, out_dir: Path, *args: object) -> tuple[str, list[str], dict[int, dict[str, Any]]]:
    """`commd launch --max-restarts 1 --nproc-per-node NPROC scripts/SCRIPT OUT_DIR ARGS...` (bounded),
    and its standard error, the result files' names, and each rank's result (a replacement's for a
    restarted rank)."""
    proc = subprocess.run(
        [sys.executable, "-m", "commd", "launch", "--max-restarts", "1", "--nproc-per-node", str(nproc),
         str(SCRIPTS / script), str(out_dir), *map(str, args)],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=240,
        check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    names = sorted(path.name for path in out_dir.glob("*.pt"))
    results = {int(name[4:].split(".")[0]): torch.load(out_dir / name) for name in names}
    return proc.stderr, names, results


def save_result(out_dir: Path, rank: int, restarts: int, out: dict[str, Any]) -> None:
    """A rank's result: OUT_DIR/rank<R>.pt, or rank<R>.restart<K>.pt for a replacement."""
    name = f"rank{rank}" + (f".restart{restarts}" if restarts else "")
    torch.save(out, out_dir / f"{name}.part")
    os.rename(out_dir / f"{name}.part", out_dir / f"{name}.pt")


def guard_record(guard: Any) -> dict[str, Any]:
    """What a guard did, for the test to check."""
    return {"steps": guard.steps, "ranks": guard.ranks,
            "recoveries": [(r.step, r.gone, r.survivors) for r in guard.recoveries],
            "joins": [(j.epoch, j.step, j.joined, j.members, j.seconds, j.state_bytes) for j in guard.joins]}
