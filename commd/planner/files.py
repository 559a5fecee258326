"""The planner's JSON files (layer lists, costs, plans): read one, and check its format and version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, what: str, error: type[Exception]) -> Any:
    """The JSON at ``path``; ``error`` naming ``what`` and why when it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise error(f"cannot read the {what} {path}: {exc}") from None


def check_header(raw: Any, where: str, fmt: str, version: int, what: str, error: type[Exception]) -> None:
    """``raw`` is an object of format ``fmt`` and version ``version``, or ``error`` saying which it is not."""
    if not isinstance(raw, dict) or raw.get("format") != fmt:
        raise error(f"{where}: not a {what} (expected \"format\": \"{fmt}\")")
    if raw.get("version") != version:
        raise error(f"{where}: {what} version {raw.get('version')!r}; this commd reads version {version}")
