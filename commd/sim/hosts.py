"""Simulated hosts: network namespaces on one Linux bridge, one machine.

Multi-node code paths (rendezvous, fabrics, lanes) need several "nodes" with
their own IP address, their own loopback and their own commd runtime
directory.  A network namespace per node, joined to a bridge by a veth pair,
gives exactly that on one machine, and ``tc`` on each link adds the latency
and bandwidth of a real network.

Layout of one instance (``tag`` = prefix + 4 hex digits, unique per instance)::

    root namespace:  bridge <tag>br  10.X.Y.254/24  (SimulatedHosts.bridge_ip)
                     veth   <tag>v<i>  (bridge port of host i)
    namespace <tag>-h<i>:  eth0 10.X.Y.<i+1>/24, lo up

``X.Y`` comes from the instance number claimed in the state directory, so
concurrent instances (other tests, other processes) never share a subnet.

Shaping (see ``shaping_commands``): on each host's eth0 egress ``netem delay``
as root qdisc with a ``tbf`` child, and a ``tbf`` on the bridge port's egress
(traffic *into* the host), so a host sends and receives at most ``rate`` like
a full-duplex NIC, and each packet is delayed once, on its sender's link:
host-to-host one-way latency grows by ``delay_ms``, a round trip by twice that.

Every instance is recorded in a JSON state file (``state_dir()``) with its
owner's pid before anything is created, and the file is removed last, so
``cleanup_stale`` can find what a crashed run left behind.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "DEFAULT_PREFIX",
    "MAX_HOSTS",
    "InstanceState",
    "ShapingUnavailableError",
    "SimHost",
    "SimHostsError",
    "SimulatedHosts",
    "cleanup_stale",
    "list_instances",
    "netns_unavailable",
    "parse_rate",
    "remove_instance",
    "shaping_commands",
    "shaping_unavailable",
    "state_dir",
]

DEFAULT_PREFIX = "csim"
MAX_HOSTS = 32
#: Instance numbers map to subnets 10.200.0.0/24 .. 10.254.255.0/24 (rarely used by real networks).
_FIRST_OCTET2 = 200
_INSTANCE_NUMBERS = (255 - _FIRST_OCTET2) * 256
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: tc shaping parameters (why these values: see shaping_commands).
TBF_BURST_S = 0.001
TBF_MIN_BURST_BYTES = 128 * 1024
TBF_QUEUE_S = 0.005
NETEM_LIMIT_PACKETS = 100_000
#: Bounds on waiting for processes to exit at down().
TERM_GRACE_S = 1.0
KILL_WAIT_S = 5.0
_CMD_TIMEOUT_S = 30.0


class SimHostsError(RuntimeError):
    """A system command failed (the message shows the command and its stderr), or state is unusable."""

    def __init__(self, message: str, cmd: Sequence[str] | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.cmd = list(cmd) if cmd is not None else None
        self.stderr = stderr


class ShapingUnavailableError(SimHostsError):
    """The kernel lacks a qdisc the requested shaping needs (e.g. netem not built)."""


# --------------------------------------------------------------------------- commands


def _tool(name: str) -> str | None:
    """Path of ``ip``/``tc``: PATH first, then the sbin dirs that a non-login PATH often lacks."""
    found = shutil.which(name)
    if found:
        return found
    for directory in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        candidate = os.path.join(directory, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a system command; on failure raise SimHostsError naming the command and its stderr."""
    argv = list(cmd)
    if argv[0] in ("ip", "tc"):
        argv[0] = _tool(argv[0]) or argv[0]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise SimHostsError(f"command not found: {shlex.join(cmd)}", cmd) from exc
    except subprocess.TimeoutExpired as exc:
        raise SimHostsError(f"command timed out after {_CMD_TIMEOUT_S:.0f}s: {shlex.join(cmd)}", cmd) from exc
    if check and result.returncode != 0:
        stderr = result.stderr.strip()
        raise SimHostsError(
            f"command failed (exit {result.returncode}): {shlex.join(cmd)}: {stderr or '(no stderr)'}",
            cmd,
            stderr,
        )
    return result


def _netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/run/netns", name))


def _link_exists(name: str) -> bool:
    """Whether a network interface exists in this process's (root) namespace."""
    return os.path.exists(os.path.join("/sys/class/net", name))


def _throwaway_name() -> str:
    return f"csprobe{uuid.uuid4().hex[:8]}"


def netns_unavailable() -> str | None:
    """None if network namespaces can be used here, else why not (a pytest skip reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, veth, bridges)"
    if _tool("ip") is None:
        return "simulated hosts need iproute2's `ip` (not found in PATH, /usr/sbin or /sbin)"
    name = _throwaway_name()
    try:
        _run(["ip", "netns", "add", name])
    except SimHostsError as exc:
        return f"cannot create a network namespace here: {exc}"
    try:
        _run(["ip", "netns", "del", name])
    except SimHostsError as exc:
        return f"cannot delete a network namespace here: {exc}"
    return None


@functools.cache
def _qdisc_missing(kind: str) -> str | None:
    """Try ``kind`` as root qdisc of lo in a throwaway namespace (the kernel config cannot change)."""
    name = _throwaway_name()
    try:
        _run(["ip", "netns", "add", name])
    except SimHostsError as exc:
        return f"cannot probe qdisc {kind}: {exc}"
    try:
        args = {"netem": ["netem", "delay", "1ms"], "tbf": ["tbf", "rate", "1gbit", "burst", "128kb", "limit", "1mb"]}
        result = _run(["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", *args[kind]], check=False)
        if result.returncode != 0:
            return (
                f"the kernel has no '{kind}' qdisc (CONFIG_NET_SCH_{kind.upper()} not built?): "
                f"tc said: {result.stderr.strip()}"
            )
        return None
    finally:
        _run(["ip", "netns", "del", name], check=False)


def shaping_unavailable(delay_ms: float | None = None, rate: str | None = None) -> str | None:
    """None if the kernel can shape links as asked (netem for a delay, tbf for a rate), else why not."""
    if _tool("tc") is None and ((delay_ms or 0) > 0 or rate):
        return "link shaping needs iproute2's `tc` (not found)"
    if delay_ms is not None and delay_ms > 0:
        reason = _qdisc_missing("netem")
        if reason:
            return f"cannot emulate delay_ms={delay_ms}: {reason}"
    if rate:
        reason = _qdisc_missing("tbf")
        if reason:
            return f"cannot limit rate={rate}: {reason}"
    return None


# --------------------------------------------------------------------------- validation and shaping


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate like "10gbit" or "500mbit" (SI units, as tc reads them)."""
    if not isinstance(rate, str):
        raise ValueError(f"rate must be a string like '10gbit' or '500mbit', not {rate!r}")
    match = _RATE_RE.match(rate)
    if not match:
        raise ValueError(
            f"rate {rate!r} is invalid: use a number and one of bit, kbit, mbit, gbit, tbit (e.g. '10gbit')"
        )
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is too low: at least 8kbit")
    return int(bits)


def _validate(count: int, delay_ms: float | None, rate: str | None, prefix: str) -> None:
    if isinstance(count, bool) or not isinstance(count, int):
        raise ValueError(f"count must be an int in 1..{MAX_HOSTS}, not {count!r}")
    if not 1 <= count <= MAX_HOSTS:
        raise ValueError(f"count must lie in 1..{MAX_HOSTS} (one /24 subnet, short interface names), not {count}")
    if delay_ms is not None:
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)):
            raise ValueError(f"delay_ms must be a number of milliseconds >= 0, not {delay_ms!r}")
        if not math.isfinite(delay_ms) or delay_ms < 0:
            raise ValueError(f"delay_ms must be finite and >= 0, not {delay_ms!r}")
        if delay_ms > 10_000:
            raise ValueError(f"delay_ms={delay_ms} is more than 10 s; that is no network")
    if rate is not None:
        parse_rate(rate)
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"prefix {prefix!r} is invalid: 1-8 characters, lowercase letters and digits, starting with a letter "
            "(interface names are limited to 15 characters)"
        )


def _size(nbytes: float) -> str:
    """A byte count as tc reads it ("b" is bytes for tc)."""
    return f"{max(1, int(nbytes))}b"


def _tbf_args(rate: str) -> list[str]:
    """tbf parameters that reach ``rate`` for bulk transfers.

    burst = max(1 ms at rate, 128 KiB): veth traffic arrives as GSO segments of
    up to 64 KiB; a bucket smaller than one would make tbf split every segment
    in software (or cap the rate by timer granularity).  limit = burst + 5 ms at
    rate: enough queue for TCP to keep the link busy without building seconds of
    bufferbloat.
    """
    bytes_per_s = parse_rate(rate) / 8
    burst = max(bytes_per_s * TBF_BURST_S, TBF_MIN_BURST_BYTES)
    limit = burst + bytes_per_s * TBF_QUEUE_S
    return ["tbf", "rate", rate, "burst", _size(burst), "limit", _size(limit)]


def shaping_commands(
    netns: str, host_dev: str, bridge_port: str, delay_ms: float | None, rate: str | None
) -> list[list[str]]:
    """The tc commands that shape one host's link (empty when neither delay nor rate is set).

    Host egress (inside ``netns``): ``netem delay D limit 100000`` as root, tbf as
    its child (netem's default 1000-packet limit drops packets once delay x rate
    exceeds 1000 packets, e.g. 10 ms at 10 Gbit/s).  Bridge port egress (traffic
    to the host): tbf only, so a host also receives at most ``rate``.
    """
    commands: list[list[str]] = []
    delay = delay_ms is not None and delay_ms > 0
    if delay:
        commands.append(
            ["tc", "-n", netns, "qdisc", "add", "dev", host_dev, "root", "handle", "1:",
             "netem", "delay", f"{delay_ms:g}ms", "limit", str(NETEM_LIMIT_PACKETS)]
        )
        if rate:
            commands.append(
                ["tc", "-n", netns, "qdisc", "add", "dev", host_dev, "parent", "1:1", "handle", "10:",
                 *_tbf_args(rate)]
            )
    elif rate:
        commands.append(["tc", "-n", netns, "qdisc", "add", "dev", host_dev, "root", "handle", "1:", *_tbf_args(rate)])
    if rate:
        commands.append(["tc", "qdisc", "add", "dev", bridge_port, "root", "handle", "1:", *_tbf_args(rate)])
    return commands


# --------------------------------------------------------------------------- state


def state_dir() -> Path:
    """Where instances are recorded: /run/commd-sim (tmpfs: gone with the namespaces at reboot), else /tmp."""
    for base in (Path("/run"), Path(tempfile.gettempdir())):
        path = base / "commd-sim"
        try:
            path.mkdir(mode=0o755, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise SimHostsError("no writable state directory (/run/commd-sim or $TMPDIR/commd-sim)")


def _start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (guards pid reuse), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


@dataclass
class InstanceState:
    """What one instance created, as recorded in its state file: enough to remove it from any process."""

    number: int
    prefix: str
    tag: str
    bridge: str
    bridge_ip: str
    subnet: str
    count: int
    runtime_base: str
    owner_pid: int | None
    owner_start: int | None
    delay_ms: float | None = None
    rate: str | None = None
    hosts: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @property
    def path(self) -> Path:
        return state_dir() / f"{self.number:04x}.json"

    def owner_alive(self) -> bool:
        """True for instances made by `python -m commd.sim up` (no owner: they stay until `down`)."""
        if self.owner_pid is None:
            return True
        return _start_time(self.owner_pid) == self.owner_start

    def netns_names(self) -> list[str]:
        return [_netns_name(self.tag, i) for i in range(self.count)]

    def port_names(self) -> list[str]:
        return [_port_name(self.tag, i) for i in range(self.count)]

    def save(self, exclusive: bool = False) -> None:
        data = json.dumps(asdict(self), indent=1).encode()
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = os.open(self.path, flags, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    @classmethod
    def load(cls, path: Path) -> InstanceState:
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise SimHostsError(f"unreadable state file {path}: {exc}") from exc


def _netns_name(tag: str, index: int) -> str:
    return f"{tag}-h{index}"


def _port_name(tag: str, index: int) -> str:
    return f"{tag}v{index}"


def list_instances(prefix: str | None = None) -> list[InstanceState]:
    """Recorded instances (optionally only those with ``prefix``), oldest first; unreadable files skipped."""
    found = []
    for path in sorted(state_dir().glob("*.json")):
        try:
            state = InstanceState.load(path)
        except SimHostsError:
            continue
        if prefix is None or state.prefix == prefix:
            found.append(state)
    return sorted(found, key=lambda s: s.created)


def _occupied_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks the root namespace already routes (a new bridge subnet must not overlap them)."""
    result = _run(["ip", "-4", "-o", "route", "show", "table", "all"], check=False)
    nets = []
    for line in result.stdout.splitlines():
        words = line.split()
        if not words:
            continue
        dest = words[1] if words[0] in ("local", "broadcast", "unicast", "multicast") and len(words) > 1 else words[0]
        if dest == "default":
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.IPv4Network(dest, strict=False))
    return nets


def _claim_instance(prefix: str, count: int, delay_ms: float | None, rate: str | None,
                    persistent: bool) -> InstanceState:
    """Pick an unused instance number (subnet and names) and record it, exclusively, before creating anything."""
    occupied = _occupied_networks()
    directory = state_dir()
    owner_pid = None if persistent else os.getpid()
    owner_start = None if persistent else _start_time(os.getpid())
    rng = random.SystemRandom()
    for _ in range(500):
        number = rng.randrange(_INSTANCE_NUMBERS)
        if (directory / f"{number:04x}.json").exists():
            continue
        octet2, octet3 = _FIRST_OCTET2 + number // 256, number % 256
        subnet = ipaddress.IPv4Network(f"10.{octet2}.{octet3}.0/24")
        if any(subnet.overlaps(net) for net in occupied):
            continue
        tag = f"{prefix}{number:04x}"
        runtime_base = Path(tempfile.gettempdir()) / f"commd-sim-{tag}"
        names_taken = (
            _link_exists(f"{tag}br")
            or runtime_base.exists()
            or any(_netns_exists(_netns_name(tag, i)) or _link_exists(_port_name(tag, i)) for i in range(count))
        )
        if names_taken:
            continue
        state = InstanceState(
            number=number, prefix=prefix, tag=tag, bridge=f"{tag}br", bridge_ip=str(subnet[254]),
            subnet=str(subnet), count=count, runtime_base=str(runtime_base), owner_pid=owner_pid,
            owner_start=owner_start, delay_ms=delay_ms, rate=rate,
        )
        for i in range(count):
            state.hosts.append({
                "name": f"host{i}",
                "netns": _netns_name(tag, i),
                "ip": str(subnet[i + 1]),
                "runtime_dir": str(runtime_base / f"host{i}"),
            })
        try:
            state.save(exclusive=True)
        except FileExistsError:
            continue
        return state
    raise SimHostsError(f"no free instance number/subnet found in {directory} after 500 tries")


# --------------------------------------------------------------------------- teardown


def _kill_group(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group if it leads one (popen starts a new session), else just ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    except ProcessLookupError:
        # The leader is gone; members of its group may live on.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _netns_pids(netns: str) -> list[int]:
    if not _netns_exists(netns):
        return []
    result = _run(["ip", "netns", "pids", netns], check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _stop_processes(procs: Sequence[subprocess.Popen[Any]], netns_names: Sequence[str]) -> list[str]:
    """TERM then KILL what we started (whole process groups), then KILL whatever else lives in the namespaces."""
    problems: list[str] = []
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        # Also after the leader exited: children it left in its group die with it.
        _kill_group(proc.pid, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"process {proc.pid} ({shlex.join(map(str, proc.args))}) survived SIGKILL")
    deadline = time.monotonic() + KILL_WAIT_S
    for netns in netns_names:
        while True:
            pids = [pid for pid in _netns_pids(netns) if pid != os.getpid()]
            if not pids:
                break
            if time.monotonic() > deadline:
                problems.append(f"processes {pids} still run in namespace {netns}")
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                # Reap it if it happens to be our child (started without popen).
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
            time.sleep(0.01)
    return problems


def _teardown(state: InstanceState, procs: Sequence[subprocess.Popen[Any]] = ()) -> list[str]:
    """Remove everything ``state`` names that exists; each step tolerates absence. Returns problems."""
    problems = _stop_processes(procs, state.netns_names())
    # Deleting the root end of a veth pair deletes its peer (eth0 in the host) at once.
    for port in state.port_names():
        if _link_exists(port):
            try:
                _run(["ip", "link", "del", port])
            except SimHostsError as exc:
                problems.append(str(exc))
    for netns in state.netns_names():
        if _netns_exists(netns):
            try:
                _run(["ip", "netns", "del", netns])
            except SimHostsError as exc:
                problems.append(str(exc))
    if _link_exists(state.bridge):
        try:
            _run(["ip", "link", "del", state.bridge])
        except SimHostsError as exc:
            problems.append(str(exc))
    base = Path(state.runtime_base)
    if base.name.startswith("commd-sim-") and base.exists():
        shutil.rmtree(base, ignore_errors=True)
        if base.exists():
            problems.append(f"could not remove runtime dirs under {base}")
    if not problems:
        with contextlib.suppress(FileNotFoundError):
            state.path.unlink()
    return problems


def remove_instance(state: InstanceState) -> None:
    """Remove a recorded instance (processes, links, namespaces, runtime dirs, state file)."""
    problems = _teardown(state)
    if problems:
        raise SimHostsError(f"instance {state.tag} not fully removed: " + "; ".join(problems))


def cleanup_stale(prefix: str | None = DEFAULT_PREFIX) -> list[str]:
    """Remove instances whose owner process is gone (crashed test runs); return their tags.

    Instances of live owners and those made by `python -m commd.sim up` are kept.
    ``prefix=None`` looks at every prefix.  Namespaces and bridge ports that
    match ``prefix`` but have no state file at all (state dir wiped) are removed
    too.
    """
    removed = []
    for state in list_instances(prefix):
        if state.owner_alive():
            continue
        remove_instance(state)
        removed.append(state.tag)
    if prefix is not None:
        removed.extend(_remove_orphans(prefix))
    return removed


def _remove_orphans(prefix: str) -> list[str]:
    """Namespaces/links named like ``prefix`` instances that no state file accounts for."""
    known = {state.tag for state in list_instances(None)}
    pattern = re.compile(rf"^({re.escape(prefix)}[0-9a-f]{{4}})(?:-h\d+|v\d+|br)$")
    orphans: dict[str, set[str]] = {}
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    names += os.listdir("/sys/class/net")
    for name in names:
        match = pattern.match(name)
        if match and match.group(1) not in known:
            orphans.setdefault(match.group(1), set()).add(name)
    for tag, members in orphans.items():
        indices = [int(m) for name in members for m in re.findall(r"(?:-h|v)(\d+)$", name[len(tag):])]
        ghost = InstanceState(
            number=int(tag[-4:], 16), prefix=prefix, tag=tag, bridge=f"{tag}br", bridge_ip="", subnet="",
            count=1 + max(indices, default=0),
            runtime_base=str(Path(tempfile.gettempdir()) / f"commd-sim-{tag}"), owner_pid=None, owner_start=None,
        )
        problems = _teardown(ghost)
        if problems:
            raise SimHostsError(f"orphaned {tag} not fully removed: " + "; ".join(problems))
    return sorted(orphans)


# --------------------------------------------------------------------------- hosts


@dataclass
class SimHost:
    """One simulated node: a namespace with its own IP, loopback and commd runtime dir."""

    name: str
    netns: str
    ip: str
    env: dict[str, str]
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list, repr=False)

    @property
    def runtime_dir(self) -> Path:
        return Path(self.env["COMMD_RUNTIME_DIR"])

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this host's namespace (``ip netns exec`` execs it: same pid, no extra process)."""
        if isinstance(cmd, str):
            raise TypeError("cmd must be a list of arguments, not a string")
        return [_tool("ip") or "ip", "netns", "exec", self.netns, *map(str, cmd)]

    def popen(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this host, environment = os.environ + host.env + ``env``; killed at down().

        It gets its own session (process group) so down() can kill it with
        everything it started.
        """
        merged = {**os.environ, **self.env, **(env or {})}
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(cmd), env=merged, **kwargs)
        self._procs.append(proc)
        return proc


class SimulatedHosts:
    """``count`` simulated hosts on one bridge; a context manager that always removes what it made.

    >>> with SimulatedHosts(2, delay_ms=0.1, rate="10gbit") as sim:
    ...     server = sim[0].popen(["python3", "-m", "http.server"])
    ...     # sim[1] reaches it at sim[0].ip; the root namespace at sim.bridge_ip
    """

    def __init__(self, count: int, delay_ms: float | None = None, rate: str | None = None,
                 prefix: str | None = None) -> None:
        prefix = DEFAULT_PREFIX if prefix is None else prefix
        _validate(count, delay_ms, rate, prefix)
        self.count = count
        self.delay_ms = float(delay_ms) if delay_ms is not None else None
        self.rate = rate.strip().lower() if rate is not None else None
        self.prefix = prefix
        self.hosts: list[SimHost] = []
        self.state: InstanceState | None = None
        self._procs: list[subprocess.Popen[Any]] = []

    # -- properties

    @property
    def tag(self) -> str | None:
        return self.state.tag if self.state else None

    @property
    def bridge(self) -> str | None:
        return self.state.bridge if self.state else None

    @property
    def bridge_ip(self) -> str | None:
        """Address of the bridge, for processes in the root namespace (e.g. a rendezvous server)."""
        return self.state.bridge_ip if self.state else None

    @property
    def subnet(self) -> str | None:
        return self.state.subnet if self.state else None

    @property
    def is_up(self) -> bool:
        return self.state is not None

    def __len__(self) -> int:
        return len(self.hosts)

    def __iter__(self) -> Iterator[SimHost]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> SimHost:
        return self.hosts[index]

    def host(self, name: str) -> SimHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r} (have {[h.name for h in self.hosts]})")

    def __repr__(self) -> str:
        where = f"{self.tag} {self.subnet}" if self.state else "down"
        return f"SimulatedHosts({self.count}, delay_ms={self.delay_ms}, rate={self.rate!r}, {where})"

    # -- lifecycle

    def up(self, persistent: bool = False) -> SimulatedHosts:
        """Create bridge, namespaces, veths, addresses and shaping; on any failure undo it all and raise.

        ``persistent`` records no owner pid, so cleanup_stale leaves the
        instance alone after this process exits (the CLI's `up`).
        """
        if self.state is not None:
            raise SimHostsError(f"{self!r} is already up")
        reason = netns_unavailable()
        if reason:
            raise SimHostsError(reason)
        reason = shaping_unavailable(self.delay_ms, self.rate)
        if reason:
            raise ShapingUnavailableError(reason)
        self.state = _claim_instance(self.prefix, self.count, self.delay_ms, self.rate, persistent)
        try:
            self._create(self.state)
        except BaseException:
            problems = _teardown(self.state, self._procs)
            self._reset()
            if problems:
                warnings.warn("incomplete undo after failed up(): " + "; ".join(problems), stacklevel=2)
            raise
        return self

    def _create(self, state: InstanceState) -> None:
        prefix_len = ipaddress.IPv4Network(state.subnet).prefixlen
        _run(["ip", "link", "add", "name", state.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{state.bridge_ip}/{prefix_len}", "dev", state.bridge])
        _run(["ip", "link", "set", state.bridge, "up"])
        base = Path(state.runtime_base)
        base.mkdir(mode=0o700)
        for index, info in enumerate(state.hosts):
            netns, port = info["netns"], _port_name(state.tag, index)
            _run(["ip", "netns", "add", netns])
            _run(["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns])
            _run(["ip", "link", "set", port, "master", state.bridge, "up"])
            _run(["ip", "-n", netns, "addr", "add", f"{info['ip']}/{prefix_len}", "dev", "eth0"])
            _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", netns, "link", "set", "lo", "up"])
            for cmd in shaping_commands(netns, "eth0", port, state.delay_ms, state.rate):
                _run(cmd)
            runtime_dir = Path(info["runtime_dir"])
            runtime_dir.mkdir(mode=0o700)
            env = {"COMMD_NODE": info["name"], "COMMD_RUNTIME_DIR": str(runtime_dir)}
            self.hosts.append(SimHost(info["name"], netns, info["ip"], env, self._procs))

    def _reset(self) -> None:
        self.state = None
        self.hosts = []
        self._procs.clear()

    def down(self) -> None:
        """Kill the hosts' processes and remove everything up() made; safe to call again or after a failed up().

        Raises SimHostsError if something could not be removed (after trying
        everything); the state file then stays, so cleanup_stale can retry.
        """
        if self.state is None:
            return
        problems = _teardown(self.state, self._procs)
        tag = self.state.tag
        self._reset()
        if problems:
            raise SimHostsError(f"instance {tag} not fully removed: " + "; ".join(problems))

    def __enter__(self) -> SimulatedHosts:
        return self if self.state is not None else self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.down()
        except SimHostsError as err:
            if exc is None:
                raise
            # Don't hide the body's exception behind a cleanup one.
            warnings.warn(str(err), stacklevel=2)
