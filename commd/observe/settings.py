"""Where the metrics go: flags, then environment, then the config file's ``[metrics]`` table.

Off unless one of them names a port or a textfile; validated here so that a bad
value stops the daemon at start with a message naming it, never later.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commd.runtime import ConfigError

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_TEXTFILE_INTERVAL_S = 15.0
MAX_TEXTFILE_INTERVAL_S = 3600.0
#: The config file's ``[metrics]`` keys (the fields of ``MetricsSettings``) and what each sets; the
#: ``--metrics-*`` flags and the COMMD_METRICS_* variables win over them.
CONFIG_KEYS: dict[str, str] = {
    "port": "serve Prometheus metrics over HTTP on this port (0: any free port, shown by `commd status`); unset: "
            "no endpoint",
    "addr": "the address the metrics endpoint binds to",
    "textfile": "also write the metrics to this file (replaced atomically), for node_exporter's textfile "
                "collector",
    "interval_s": "seconds between rewrites of the textfile (0.1 to 3600)",
}


@dataclass
class MetricsSettings:
    port: int | None = None  # None: no HTTP endpoint; 0: any free port (logged)
    addr: str = DEFAULT_ADDR
    textfile: str | None = None
    interval_s: float = DEFAULT_TEXTFILE_INTERVAL_S

    @property
    def enabled(self) -> bool:
        return self.port is not None or self.textfile is not None


def _port(raw: Any, where: str) -> int:
    if isinstance(raw, str):
        try:
            raw = int(raw, 10)
        except ValueError:
            raise ConfigError(f"{where} {raw!r} is not a port number") from None
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= 65535:
        raise ConfigError(f"{where} {raw!r} must be a port number in [0, 65535]")
    return raw


def _addr(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"{where} must be an IP address, got {raw!r}")
    try:
        ipaddress.ip_address(raw)
    except ValueError:
        raise ConfigError(f"{where} {raw!r} is not an IP address") from None
    return raw


def _interval(raw: Any, where: str) -> float:
    if isinstance(raw, str):
        try:
            raw = float(raw)
        except ValueError:
            raise ConfigError(f"{where} {raw!r} is not a number") from None
    if not isinstance(raw, int | float) or isinstance(raw, bool) or not 0.1 <= raw <= MAX_TEXTFILE_INTERVAL_S:
        raise ConfigError(f"{where} {raw!r} must be seconds in [0.1, {MAX_TEXTFILE_INTERVAL_S:g}]")
    return float(raw)


def _textfile(raw: Any, where: str) -> str:
    if not isinstance(raw, str) or not raw:
        raise ConfigError(f"{where} must be a file path")
    path = Path(raw).expanduser().absolute()
    if path.is_dir():
        raise ConfigError(f"{where} {raw!r} is a directory, not a file")
    if not path.parent.is_dir():
        raise ConfigError(f"{where} {raw!r}: directory {str(path.parent)!r} does not exist")
    return str(path)


def config_section(config_path: str | None) -> dict[str, Any]:
    """The config file's ``[metrics]`` table (empty without a file or table); keys checked."""
    if not config_path:
        return {}
    try:
        data = tomllib.loads(Path(config_path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # the scheduler's loader reports an unreadable config
    section = data.get("metrics", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{config_path}: [metrics] must be a table")
    unknown = set(section) - CONFIG_KEYS.keys()
    if unknown:
        raise ConfigError(f"{config_path}: unknown [metrics] key(s) {sorted(unknown)}; known: {sorted(CONFIG_KEYS)}")
    return section


def resolve(port: int | None, addr: str | None, textfile: str | None, interval_s: float | None,
            config_path: str | None) -> MetricsSettings:
    """Flags (given as arguments), then COMMD_METRICS_* variables, then the config's ``[metrics]``."""
    section = config_section(config_path)
    out = MetricsSettings()

    def first(flag: Any, flag_name: str, env_name: str, key: str, parse: Callable[[Any, str], Any]) -> Any:
        """The flag's value, else the variable's, else the config key's (parsed, naming its source); None."""
        if flag is not None:
            return parse(flag, flag_name)
        if os.environ.get(env_name):
            return parse(os.environ[env_name], env_name)
        if key in section:
            return parse(section[key], f"[metrics] {key}")
        return None

    for field_name, value in (
        ("port", first(port, "--metrics-port", "COMMD_METRICS_PORT", "port", _port)),
        ("addr", first(addr, "--metrics-addr", "COMMD_METRICS_ADDR", "addr", _addr)),
        ("textfile", first(textfile, "--metrics-textfile", "COMMD_METRICS_TEXTFILE", "textfile", _textfile)),
        ("interval_s", first(interval_s, "--metrics-interval", "COMMD_METRICS_INTERVAL", "interval_s", _interval)),
    ):
        if value is not None:
            setattr(out, field_name, value)
    if out.port:
        check_bindable(out.addr, out.port)
    return out


def check_bindable(addr: str, port: int) -> None:
    """Fail at start, with the reason, when the metrics port cannot be had (in use, no such address)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server will
        try:
            probe.bind((addr, port))
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
