"""Per-client limits: how much of the daemon one client can make it hold.

The daemon is shared by every rank of the node, so nothing a single client
sends may grow it without bound (measured before these limits: 400 small
messages naming 1 MiB inline outputs grew a daemon from 148 to 554 MiB, and
300 replies a client never read grew it to 449 MiB).  A client is bounded in

- inline tensors: at most ``schema.INLINE_MAX_BYTES`` per buffer (checked by
  the schema when an op is parsed);
- pending ops (submitted, not yet answered): by count and by the inline bytes
  the daemon holds for them;
- its reply backlog: replies its op channel could not take yet; past the bound
  the client is dropped as if it had died (``opchannel.OpConnection``);
- op timeouts: a client's timeout is capped at the daemon's maximum.

Every hit is counted in the daemon's ``Stats.limits_hit`` (shown by ``commd status`` as
``limits_hit``) and logged once per client and limit.
"""

from __future__ import annotations

import argparse
import logging
import os
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commd.protocol import schema as s
from commd.runtime import ConfigError, env_float, env_int

log = logging.getLogger("commd.daemon")

#: Far above what a training step keeps in flight (DDP: one op per bucket; FSDP and pipelines: a few
#: per layer or micro-batch — hundreds, rarely thousands), yet it bounds the daemon's records of one
#: client (about 1 KiB each) to some 64 MiB.
DEFAULT_MAX_PENDING_OPS = 65536
#: Inline tensors the daemon holds for one client's pending ops.  Only tensors of at most 4 KiB travel
#: inline (larger ones stay in the client's arena or GPU memory and cost the daemon nothing), so this is
#: 16,384 pending ops with full-size inline buffers: no real job has that many tiny tensors in flight.
DEFAULT_MAX_PENDING_BYTES = 64 << 20
#: Replies queued for a client whose op channel is full, beyond the kernel's 4 MiB socket buffer.  A
#: client that only reads while it waits gets back at most its pending inline bytes plus a small header
#: per op (about 67 MiB at the default limits), so only a client that stopped reading gets past this.
DEFAULT_MAX_REPLY_BACKLOG = 128 << 20
#: Longest an op may wait for its peers, whatever the client asks (the protocol allows 7 days).  Torch's
#: process-group timeout defaults to 30 minutes; jobs that raise it for slow checkpoints use hours.
DEFAULT_MAX_OP_TIMEOUT_S = 24 * 3600.0

#: Most inline buffers one op can carry ('buf', 'in', 'out').
_INLINE_BUFFERS_PER_OP = 3
MAX_PENDING_OPS_RANGE = (1, 1 << 24)
MAX_PENDING_BYTES_RANGE = (_INLINE_BUFFERS_PER_OP * s.INLINE_MAX_BYTES, 1 << 40)
#: A full batch frame of replies must fit, or a reading client could be dropped.
MAX_REPLY_BACKLOG_RANGE = (s.MAX_MESSAGE_BYTES, 1 << 40)
MAX_OP_TIMEOUT_RANGE = (0.001, 7 * 24 * 3600.0)
#: The config file's ``[limits]`` keys (the fields of ``ClientLimits``) and what each bounds; the flags and
#: the COMMD_* variables of the same names win over them.
LIMITS_KEYS: dict[str, str] = {
    "max_pending_ops": "ops one client may have submitted and not yet answered",
    "max_pending_bytes": "inline tensor bytes the daemon holds for one client's pending ops",
    "max_reply_backlog": "reply bytes queued for a client that does not read its op channel; past it the client "
                         "is dropped as if it had died",
    "max_op_timeout": "the longest op timeout, in seconds, a client may ask for; longer ones are capped (the "
                      "default is raised to `--op-timeout` when that is longer)",
}

# Names of the limits (keys of ``limits_hit``).
INLINE = s.INLINE_LIMIT
PENDING_OPS = "pending_ops"
PENDING_BYTES = "pending_bytes"
REPLY_BACKLOG = "reply_backlog"
OP_TIMEOUT = "op_timeout"


@dataclass(frozen=True)
class ClientLimits:
    """The bounds on one client (every setting validated by ``limits_from_args``)."""

    max_pending_ops: int = DEFAULT_MAX_PENDING_OPS
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    max_reply_backlog: int = DEFAULT_MAX_REPLY_BACKLOG
    max_op_timeout: float = DEFAULT_MAX_OP_TIMEOUT_S

    def to_status(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PendingLedger:
    """One client's ops the daemon has accepted and not yet answered: op id -> inline bytes held."""

    ops: dict[int, int] = field(default_factory=dict)
    bytes: int = 0

    def release(self, op_id: Any) -> None:
        """The op was answered (DONE or ERROR): its share is free again."""
        held = self.ops.pop(op_id, None)
        if held is not None:
            self.bytes -= held


def held_bytes(buffers: dict[str, Any]) -> int:
    """Bytes of an op's buffers that live in the daemon's own memory (inline tensors)."""
    held = 0
    for ref in buffers.values():  # a plain loop: this runs for every op
        if ref.inline is not None:
            held += ref.nbytes
    return held


class LimitGuard:
    """Applies ``ClientLimits`` to the daemon's clients; counts and logs every hit."""

    def __init__(self, limits: ClientLimits, count: Callable[[str], None]) -> None:
        """``count``: where a hit is counted (the daemon's ``Stats.limit_hit``, the one home of counters)."""
        self.limits = limits
        self._count = count
        self._logged: set[tuple[int, str]] = set()

    def hit(self, name: str, rank: int, message: str) -> None:
        """Count one hit of limit ``name`` by ``rank``; log the first one of each client and limit."""
        self._count(name)
        if (rank, name) not in self._logged:
            self._logged.add((rank, name))
            log.warning("rank %d hit the %s limit: %s (further hits are only counted)", rank, name, message)

    def cap_timeout(self, rank: int, timeout: float) -> float:
        """A client's op timeout, at most the daemon's maximum."""
        cap = self.limits.max_op_timeout
        if timeout <= cap:
            return timeout
        self.hit(OP_TIMEOUT, rank, f"an op timeout of {timeout:g}s was capped at the daemon's "
                                   f"maximum of {cap:g}s (--max-op-timeout)")
        return cap

    def admit(self, rank: int, ledger: PendingLedger, op_id: int, buffers: dict[str, Any]) -> None:
        """Record a new pending op, or raise ``LimitError`` if it would pass a limit (the caller counts it)."""
        if op_id in ledger.ops:
            raise s.ProtocolError(f"op id {op_id} is already pending: op ids must be unique")
        limits = self.limits
        if len(ledger.ops) >= limits.max_pending_ops:
            raise s.LimitError(
                f"rank {rank} already has {len(ledger.ops)} pending ops, the daemon's limit per client "
                f"(--max-pending-ops {limits.max_pending_ops})",
                PENDING_OPS,
            )
        held = held_bytes(buffers)
        if held and ledger.bytes + held > limits.max_pending_bytes:
            raise s.LimitError(
                f"rank {rank}'s pending ops already hold {ledger.bytes} inline bytes; {held} more would pass "
                f"the daemon's limit per client (--max-pending-bytes {limits.max_pending_bytes})",
                PENDING_BYTES,
            )
        ledger.ops[op_id] = held
        ledger.bytes += held

    def forget(self, rank: int) -> None:
        """The client left: a new client of that rank gets its own first log line."""
        self._logged = {key for key in self._logged if key[0] != rank}


# ---- settings -----------------------------------------------------------------
def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("per-client limits")
    group.add_argument("--max-pending-ops", type=int, default=None, metavar="N",
                       help="ops one client may have submitted and not yet answered (default: "
                            f"$COMMD_MAX_PENDING_OPS, else the config's [limits], else {DEFAULT_MAX_PENDING_OPS})")
    group.add_argument("--max-pending-bytes", type=int, default=None, metavar="BYTES",
                       help="inline tensor bytes the daemon holds for one client's pending ops (default: "
                            f"$COMMD_MAX_PENDING_BYTES, else the config's [limits], else {DEFAULT_MAX_PENDING_BYTES})")
    group.add_argument("--max-reply-backlog", type=int, default=None, metavar="BYTES",
                       help="replies queued for a client that does not read its op channel; past it the client "
                            "is dropped (default: $COMMD_MAX_REPLY_BACKLOG, else the config's [limits], else "
                            f"{DEFAULT_MAX_REPLY_BACKLOG})")
    group.add_argument("--max-op-timeout", type=float, default=None, metavar="SECONDS",
                       help="longest op timeout a client may ask for; longer ones are capped (default: "
                            "$COMMD_MAX_OP_TIMEOUT, else the config's [limits], else "
                            f"{DEFAULT_MAX_OP_TIMEOUT_S:g} or --op-timeout if longer)")


def config_section(path: str | None) -> dict[str, Any]:
    """The ``[limits]`` table of the daemon's TOML config file (``{}`` without one), keys checked."""
    if not path:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    section = data.get("limits", {})
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [limits] must be a table")
    unknown = set(section) - LIMITS_KEYS.keys()
    if unknown:
        raise ConfigError(f"{path}: unknown [limits] key(s) {sorted(unknown)}")
    ranges: dict[str, tuple[float, float]] = {
        "max_pending_ops": MAX_PENDING_OPS_RANGE, "max_pending_bytes": MAX_PENDING_BYTES_RANGE,
        "max_reply_backlog": MAX_REPLY_BACKLOG_RANGE, "max_op_timeout": MAX_OP_TIMEOUT_RANGE,
    }
    for key, value in section.items():
        wanted = (int, float) if key == "max_op_timeout" else int
        low, high = ranges[key]
        if isinstance(value, bool) or not isinstance(value, wanted) or not low <= value <= high:
            raise ConfigError(f"{path}: [limits] {key} must be a number in [{low}, {high}], got {value!r}")
    return section


def limits_from_args(args: argparse.Namespace, op_timeout: float, config: dict[str, Any] | None = None) -> ClientLimits:
    """Flags, else environment, else the config's ``[limits]``, else defaults; all range-checked.

    ``ConfigError`` names the flag of a bad value, wherever it came from.
    """
    config = config or {}
    pending_ops = _int_setting(args.max_pending_ops, "--max-pending-ops", "COMMD_MAX_PENDING_OPS",
                               config.get("max_pending_ops", DEFAULT_MAX_PENDING_OPS), MAX_PENDING_OPS_RANGE)
    pending_bytes = _int_setting(args.max_pending_bytes, "--max-pending-bytes", "COMMD_MAX_PENDING_BYTES",
                                 config.get("max_pending_bytes", DEFAULT_MAX_PENDING_BYTES), MAX_PENDING_BYTES_RANGE)
    backlog = _int_setting(args.max_reply_backlog, "--max-reply-backlog", "COMMD_MAX_REPLY_BACKLOG",
                           config.get("max_reply_backlog", DEFAULT_MAX_REPLY_BACKLOG), MAX_REPLY_BACKLOG_RANGE)
    low, high = MAX_OP_TIMEOUT_RANGE
    given = args.max_op_timeout
    if given is None and os.environ.get("COMMD_MAX_OP_TIMEOUT"):
        given = env_float("COMMD_MAX_OP_TIMEOUT", DEFAULT_MAX_OP_TIMEOUT_S, low, high)
    if given is None and "max_op_timeout" in config:
        given = float(config["max_op_timeout"])
    if given is None:
        max_timeout = max(DEFAULT_MAX_OP_TIMEOUT_S, op_timeout)
    else:
        if not low <= given <= high:
            raise ConfigError(f"--max-op-timeout {given:g} must lie in [{low:g}, {high:g}] seconds")
        if given < op_timeout:
            raise ConfigError(f"--max-op-timeout {given:g} is shorter than the default op timeout "
                              f"{op_timeout:g} (--op-timeout)")
        max_timeout = given
    return ClientLimits(pending_ops, pending_bytes, backlog, max_timeout)


def _int_setting(given: int | None, flag: str, env: str, fallback: int, bounds: tuple[int, int]) -> int:
    """``given`` (the flag), else ``$env``, else ``fallback`` (the config's value or the default)."""
    low, high = bounds
    if given is None and os.environ.get(env):
        return env_int(env, fallback, low, high)
    if given is None:
        given = fallback
    if not low <= given <= high:
        raise ConfigError(f"{flag} {given} must lie in [{low}, {high}]")
    return given
