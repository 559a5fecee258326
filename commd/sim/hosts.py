"""Simulated hosts: network namespaces on one Linux bridge, one machine.

Multi-node code paths (rendezvous, fabrics, lanes) need several "nodes" with
their own IP address, their own loopback and their own commd runtime
directory.  A network namespace per node, joined to a bridge by a veth pair,
gives exactly that on one machine, and ``tc`` on each link adds the latency
and bandwidth of a real network.

Layout of one instance (``tag`` = prefix + 4 hex digits, unique per instance)::

    root namespace:  bridge <tag>br  10.X.Y.254/24  (SimulatedHosts.bridge_ip)
                     veth   <tag>v<i>  (bridge port of host i)
    namespace <tag>-h<i>:  eth0 10.X.Y.<i+1>/24 (MAC 02:c5:..), lo up

``X.Y`` comes from the instance number claimed in the state directory, so
concurrent instances (other tests, other processes) never share a subnet.

Shaping (exact commands: ``link_commands``).  Each packet is delayed once, on
its sender's link, so host-to-host one-way latency grows by ``delay_ms`` and a
round trip by twice that; a host sends and receives at most ``rate``, like a
full-duplex NIC (tbf on its egress and on its bridge port's egress).  The
delay has two backends:

* ``netem``: ``netem delay`` as eth0's root qdisc with the tbf as its child.
* ``userspace``, for kernels built without netem (CONFIG_NET_SCH_NETEM unset):
  a clsact egress filter on eth0 redirects every frame (mirred) to a TAP
  device ``<tag>d<i>`` in the namespace; one small delay-line process per
  instance reads the frames (as 64 KiB GSO segments) and writes them, after
  the delay, to a second TAP ``<tag>i<i>`` that is a bridge port (learning and
  flooding off; eth0's MAC is a static entry on ``<tag>v<i>``, so the bridge
  delivers to the host over the veth).  The tbf then sits on ``<tag>d<i>``.
  Costs: one Python process per instance forwards all hosts' traffic (a CPU
  core under load; one TCP stream measured 5-9.8 Gbit/s on a 2-core VM),
  each hop adds ~20-40 us of wake-up latency on top of the delay, and a
  host's own broadcasts (ARP) come back to it (harmless).

``delay_backend="auto"`` (the default) uses netem where the kernel has it.

Every instance is recorded in a JSON state file (``state_dir()``) with its
owner's pid before anything is created, and the file is removed last, so
``cleanup_stale`` can find what a crashed run left behind.

This module imports only the standard library: the delay line runs it as a
script (``python -I hosts.py _delay-line ...``) without importing commd.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import functools
import ipaddress
import json
import math
import os
import random
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
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
    "DELAY_BACKENDS",
    "MAX_HOSTS",
    "InstanceState",
    "ShapingUnavailableError",
    "SimHost",
    "SimHostsError",
    "SimulatedHosts",
    "cleanup_stale",
    "link_commands",
    "list_instances",
    "netns_unavailable",
    "parse_rate",
    "remove_instance",
    "resolve_delay_backend",
    "shaping_unavailable",
    "state_dir",
]

DEFAULT_PREFIX = "csim"
MAX_HOSTS = 32
DELAY_BACKENDS = ("auto", "netem", "userspace")
#: Instance numbers map to subnets 10.200.0.0/24 .. 10.254.255.0/24 (rarely used by real networks).
_FIRST_OCTET2 = 200
_INSTANCE_NUMBERS = (255 - _FIRST_OCTET2) * 256
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
#: tc shaping parameters (why these values: see _tbf_args and link_commands).
TBF_BURST_S = 0.001
TBF_MIN_BURST_BYTES = 128 * 1024
TBF_QUEUE_S = 0.005
NETEM_LIMIT_PACKETS = 100_000
#: Bounds on waiting for processes to exit at down().
TERM_GRACE_S = 1.0
KILL_WAIT_S = 5.0
_CMD_TIMEOUT_S = 30.0
_DELAY_LINE_READY_S = 20.0
#: The delay line drops frames beyond this many queued bytes (a full switch buffer).
_DELAY_LINE_MAX_QUEUED = 256 << 20

# /dev/net/tun ioctls and flags (linux/if_tun.h).
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_PR_SET_TIMERSLACK = 29


class SimHostsError(RuntimeError):
    """A system command failed (the message shows the command and its stderr), or state is unusable."""

    def __init__(self, message: str, cmd: Sequence[str] | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.cmd = list(cmd) if cmd is not None else None
        self.stderr = stderr


class ShapingUnavailableError(SimHostsError):
    """The kernel lacks what the requested shaping needs (e.g. netem not built, no /dev/net/tun)."""


# --------------------------------------------------------------------------- commands


def _tool(name: str) -> str | None:
    """Path of ``ip``/``tc``/``bridge``: PATH first, then the sbin dirs a non-login PATH often lacks."""
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
    if argv[0] in ("ip", "tc", "bridge"):
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
def _kernel_missing(feature: str) -> str | None:
    """Try ``feature`` on lo of a throwaway namespace; cached, as the kernel cannot change under us."""
    probes = {
        "netem": [["qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]],
        "tbf": [["qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit", "burst", "128kb", "limit", "1mb"]],
        "redirect": [
            ["qdisc", "add", "dev", "lo", "clsact"],
            ["filter", "add", "dev", "lo", "egress", "u32", "match", "u32", "0", "0",
             "action", "mirred", "egress", "redirect", "dev", "lo"],
        ],
    }
    if _tool("tc") is None:
        return "iproute2's `tc` is not installed"
    name = _throwaway_name()
    try:
        _run(["ip", "netns", "add", name])
    except SimHostsError as exc:
        return f"cannot probe {feature}: {exc}"
    try:
        for args in probes[feature]:
            result = _run(["tc", "-n", name, *args], check=False)
            if result.returncode != 0:
                return f"`tc {shlex.join(args)}` failed: {result.stderr.strip()}"
        return None
    finally:
        _run(["ip", "netns", "del", name], check=False)


def _userspace_delay_missing() -> str | None:
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (CONFIG_TUN)"
    if _tool("bridge") is None:
        return "iproute2's `bridge` is not installed"
    reason = _kernel_missing("redirect")
    return f"no clsact/u32/mirred ({reason})" if reason else None


def resolve_delay_backend(delay_ms: float | None, backend: str = "auto") -> str | None:
    """Which delay backend an instance will use: None (no delay), "netem" or "userspace".

    Raises ShapingUnavailableError saying why when the requested one cannot work here.
    """
    if backend not in DELAY_BACKENDS:
        raise ValueError(f"delay_backend must be one of {', '.join(DELAY_BACKENDS)}, not {backend!r}")
    if delay_ms is None or delay_ms <= 0:
        return None
    netem = _kernel_missing("netem") if backend in ("auto", "netem") else "not tried"
    if netem is None:
        return "netem"
    if backend == "netem":
        raise ShapingUnavailableError(
            f"cannot emulate delay_ms={delay_ms} with netem: the kernel has no netem qdisc "
            f"(CONFIG_NET_SCH_NETEM): {netem}"
        )
    userspace = _userspace_delay_missing()
    if userspace is None:
        return "userspace"
    raise ShapingUnavailableError(
        f"cannot emulate delay_ms={delay_ms}: no netem qdisc ({netem}) and no userspace delay line ({userspace})"
    )


def shaping_unavailable(delay_ms: float | None = None, rate: str | None = None,
                        delay_backend: str = "auto") -> str | None:
    """None if this machine can shape links as asked (a delay backend, tbf for a rate), else why not."""
    try:
        resolve_delay_backend(delay_ms, delay_backend)
    except ShapingUnavailableError as exc:
        return str(exc)
    if rate:
        reason = _kernel_missing("tbf")
        if reason:
            return f"cannot limit rate={rate}: no tbf qdisc (CONFIG_NET_SCH_TBF): {reason}"
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


def _validate(count: int, delay_ms: float | None, rate: str | None, prefix: str, delay_backend: str) -> None:
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
    if delay_backend not in DELAY_BACKENDS:
        raise ValueError(f"delay_backend must be one of {', '.join(DELAY_BACKENDS)}, not {delay_backend!r}")


def _size(nbytes: float) -> str:
    """A byte count as tc reads it ("b" is bytes for tc)."""
    return f"{max(1, int(nbytes))}b"


def _tbf_args(rate: str) -> list[str]:
    """tbf parameters that reach ``rate`` for bulk transfers.

    burst = max(1 ms at rate, 128 KiB): veth traffic arrives as GSO segments of
    up to 64 KiB; a bucket smaller than one would make tbf split every segment
    in software (or cap the rate by timer granularity).  limit = burst + 5 ms at
    rate: enough queue for TCP to keep the link busy without building seconds of
    bufferbloat.  At 10gbit: burst 1250000b, limit 7500000b.
    """
    bytes_per_s = parse_rate(rate) / 8
    burst = max(bytes_per_s * TBF_BURST_S, TBF_MIN_BURST_BYTES)
    limit = burst + bytes_per_s * TBF_QUEUE_S
    return ["tbf", "rate", rate, "burst", _size(burst), "limit", _size(limit)]


def _mac(number: int, index: int) -> str:
    """A locally administered MAC unique to (instance, host): the userspace backend needs it in the fdb."""
    return f"02:c5:{number >> 8:02x}:{number & 255:02x}:00:{index + 1:02x}"


def _bridge_mac(number: int) -> str:
    """Fixed, so the bridge's MAC does not change as ports join (it takes the lowest port MAC otherwise)."""
    return f"02:c5:{number >> 8:02x}:{number & 255:02x}:00:fe"


def link_commands(tag: str, number: int, index: int, ip_cidr: str, bridge: str,
                  delay_ms: float | None, rate: str | None, backend: str | None) -> list[list[str]]:
    """Every command that builds host ``index``'s link, shaping included (backend from resolve_delay_backend).

    netem: ``netem delay D limit 100000`` as eth0's root qdisc (netem's default
    1000-packet limit drops packets once delay x rate exceeds 1000 packets, e.g.
    10 ms at 10 Gbit/s), tbf as its child.  userspace: see the module docstring;
    the delay-line process must already hold the two TAP devices.  In both,
    a tbf on the bridge port (traffic into the host) limits what it receives.
    """
    netns, port = _netns_name(tag, index), _port_name(tag, index)
    in_ns = ["ip", "-n", netns]
    cmds = [
        ["ip", "netns", "add", netns],
        ["ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "address", _mac(number, index),
         "netns", netns],
        ["ip", "link", "set", port, "master", bridge, "up"],
        [*in_ns, "addr", "add", ip_cidr, "dev", "eth0"],
        [*in_ns, "link", "set", "lo", "up"],
    ]
    tc_ns = ["tc", "-n", netns, "qdisc", "add", "dev"]
    if backend == "netem":
        cmds.append([*tc_ns, "eth0", "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms",
                     "limit", str(NETEM_LIMIT_PACKETS)])
        if rate:
            cmds.append([*tc_ns, "eth0", "parent", "1:1", "handle", "10:", *_tbf_args(rate)])
    elif backend == "userspace":
        tap_ns, tap_bridge = _delay_tap_names(tag, index)
        cmds += [
            ["ip", "link", "set", tap_ns, "netns", netns],
            [*in_ns, "link", "set", tap_ns, "up"],
            ["ip", "link", "set", tap_bridge, "master", bridge],
            ["ip", "link", "set", tap_bridge, "type", "bridge_slave", "learning", "off", "flood", "off",
             "mcast_flood", "off", "bcast_flood", "off"],
            ["ip", "link", "set", tap_bridge, "up"],
            ["bridge", "fdb", "replace", _mac(number, index), "dev", port, "master", "static"],
            [*tc_ns, "eth0", "clsact"],
            ["tc", "-n", netns, "filter", "add", "dev", "eth0", "egress", "u32", "match", "u32", "0", "0",
             "action", "mirred", "egress", "redirect", "dev", tap_ns],
        ]
        if rate:
            cmds.append([*tc_ns, tap_ns, "root", "handle", "1:", *_tbf_args(rate)])
    elif rate:
        cmds.append([*tc_ns, "eth0", "root", "handle", "1:", *_tbf_args(rate)])
    if rate:
        cmds.append(["tc", "qdisc", "add", "dev", port, "root", "handle", "1:", *_tbf_args(rate)])
    cmds.append([*in_ns, "link", "set", "eth0", "up"])
    return cmds


# --------------------------------------------------------------------------- delay line (userspace backend)


def _open_tap(name: str) -> int:
    """Create TAP ``name`` (gone when the fd closes) carrying GSO frames with a virtio-net header."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifreq = struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR)
        fcntl.ioctl(fd, _TUNSETIFF, ifreq)
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    except OSError:
        os.close(fd)
        raise
    return fd


def _delay_line_main(argv: Sequence[str]) -> int:
    """``DELAY_MS OWNER_PID NSTAP:BRIDGETAP...``: create the TAPs, say "ready", forward with the delay.

    Runs until killed; exits by itself when OWNER_PID (0: none) is gone, so a
    crashed test leaves no busy process behind (its TAPs vanish with it).
    """
    delay_s = float(argv[0]) / 1000
    owner = int(argv[1])
    with contextlib.suppress(OSError, AttributeError):
        # Default timer slack (50 us) would add up to 50 us to every sub-millisecond wait.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    route: dict[int, int] = {}
    for pair in argv[2:]:
        ns_name, bridge_name = pair.split(":")
        route[_open_tap(ns_name)] = _open_tap(bridge_name)
    readers = list(route) + list(route.values())
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    _delay_line(route, readers, delay_s, owner)
    return 0


def _delay_line(route: dict[int, int], readers: list[int], delay_s: float, owner: int) -> None:
    """One FIFO is enough: the delay is the same for every frame, so deadlines are in arrival order."""
    queue: collections.deque[tuple[float, int, bytes]] = collections.deque()
    queued = 0
    next_owner_check = 0.0
    owner_start = _start_time(owner) if owner else None
    while True:
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, out, frame = queue.popleft()
            queued -= len(frame)
            with contextlib.suppress(OSError):  # a full or vanished device drops the frame, like a wire
                os.write(out, frame)
        if owner and now >= next_owner_check:
            next_owner_check = now + 1.0
            if _start_time(owner) != owner_start or _is_zombie(owner):
                return
        timeout = min(1.0, queue[0][0] - now) if queue else 1.0
        ready, _, _ = select.select(readers, [], [], max(0.0, timeout))
        deadline = time.monotonic() + delay_s
        for fd in ready:
            out = route.get(fd)
            for _ in range(64):  # bounded, so frames due on other links are not held up
                try:
                    frame = os.read(fd, 1 << 17)
                except (BlockingIOError, InterruptedError):
                    break
                if out is None or queued + len(frame) > _DELAY_LINE_MAX_QUEUED:
                    continue  # bridge-side TAPs get nothing worth keeping (flooding is off)
                queue.append((deadline, out, frame))
                queued += len(frame)


def _delay_tap_names(tag: str, index: int) -> tuple[str, str]:
    return f"{tag}d{index}", f"{tag}i{index}"


def _start_delay_line(state: InstanceState, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the instance's delay line (own session, survives a CLI `up`) and wait until it holds the TAPs."""
    pairs = [":".join(_delay_tap_names(state.tag, i)) for i in range(state.count)]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), "_delay-line",
             f"{state.delay_ms}", str(state.owner_pid or 0), *pairs],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
        )
    state.helpers.append([proc.pid, _start_time(proc.pid)])
    state.save()
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], _DELAY_LINE_READY_S)
    line = proc.stdout.readline() if ready else b""
    proc.stdout.close()
    if line.strip() != b"ready":
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        raise SimHostsError(f"the delay line did not start (exit {proc.returncode}); its log {log_path}:\n{tail}",
                            proc.args, tail)
    return proc


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


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith("Z")


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
    delay_backend: str | None = None
    hosts: list[dict[str, Any]] = field(default_factory=list)
    #: [pid, start time] of helper processes (the delay line) to kill at teardown.
    helpers: list[list[Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    @property
    def path(self) -> Path:
        return state_dir() / f"{self.number:04x}.json"

    @property
    def persistent(self) -> bool:
        """Made by `python -m commd.sim up`: no owner, stays until `down`."""
        return self.owner_pid is None

    def owner_alive(self) -> bool:
        if self.owner_pid is None:
            return True
        return _start_time(self.owner_pid) == self.owner_start

    def netns_names(self) -> list[str]:
        return [_netns_name(self.tag, i) for i in range(self.count)]

    def link_names(self) -> list[str]:
        """Root-namespace links, bridge ports first (deleting a veth end deletes its peer in the host)."""
        names = [_port_name(self.tag, i) for i in range(self.count)]
        # The delay line's TAPs vanish with it; listed for a set-up that failed before they were placed.
        return names + [tap for i in range(self.count) for tap in _delay_tap_names(self.tag, i)]

    def env(self, index: int) -> dict[str, str]:
        """What a process in host ``index`` needs: its node name and private runtime dir, nothing else."""
        info = self.hosts[index]
        return {"COMMD_NODE": info["name"], "COMMD_RUNTIME_DIR": info["runtime_dir"]}

    def argv(self, index: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` wrapped to run in host ``index``'s namespace (``ip netns exec`` execs it: same pid)."""
        if isinstance(cmd, str):
            raise TypeError("cmd must be a list of arguments, not a string")
        return [_tool("ip") or "ip", "netns", "exec", self.hosts[index]["netns"], *map(str, cmd)]

    def save(self, exclusive: bool = False) -> None:
        data = json.dumps(asdict(self), indent=1).encode()
        if exclusive:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)  # readers never see half a file

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
    for path in state_dir().glob("*.json"):
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
                    backend: str | None, persistent: bool) -> InstanceState:
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
        subnet = ipaddress.IPv4Network(f"10.{_FIRST_OCTET2 + number // 256}.{number % 256}.0/24")
        if any(subnet.overlaps(net) for net in occupied):
            continue
        tag = f"{prefix}{number:04x}"
        state = InstanceState(
            number=number, prefix=prefix, tag=tag, bridge=f"{tag}br", bridge_ip=str(subnet[254]),
            subnet=str(subnet), count=count,
            runtime_base=str(Path(tempfile.gettempdir()) / f"commd-sim-{tag}"), owner_pid=owner_pid,
            owner_start=owner_start, delay_ms=delay_ms, rate=rate, delay_backend=backend,
        )
        names_taken = (
            _link_exists(state.bridge)
            or Path(state.runtime_base).exists()
            or any(_link_exists(name) for name in state.link_names())
            or any(_netns_exists(name) for name in state.netns_names())
        )
        if names_taken:
            continue
        for i in range(count):
            state.hosts.append({
                "name": f"host{i}",
                "netns": _netns_name(tag, i),
                "ip": str(subnet[i + 1]),
                "runtime_dir": str(Path(state.runtime_base) / f"host{i}"),
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


def _stop_processes(procs: Sequence[subprocess.Popen[Any]], state: InstanceState) -> list[str]:
    """TERM then KILL what we started (whole process groups), the delay line, then whatever else is inside."""
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
    for pid, start in state.helpers:
        if start is None or _start_time(pid) != start:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, 0)  # ours if this process started it
        except ChildProcessError:
            # Someone else's (a CLI `up`): wait until it has exited, so its TAPs are gone.
            deadline = time.monotonic() + KILL_WAIT_S
            while _start_time(pid) == start and not _is_zombie(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
    deadline = time.monotonic() + KILL_WAIT_S
    for netns in state.netns_names():
        while True:
            pids = [pid for pid in _netns_pids(netns) if pid != os.getpid()]
            if not pids:
                break
            if time.monotonic() > deadline:
                problems.append(f"processes {pids} still run in namespace {netns}")
                break
            for pid in pids:
                # Not reaped here: a zombie has left the namespace, and its parent's Popen wants the status.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
    return problems


def _teardown(state: InstanceState, procs: Sequence[subprocess.Popen[Any]] = ()) -> list[str]:
    """Remove everything ``state`` names that exists; each step tolerates absence. Returns problems."""
    problems = _stop_processes(procs, state)
    for name in [*state.link_names(), state.bridge]:
        if _link_exists(name):
            try:
                _run(["ip", "link", "del", name])
            except SimHostsError as exc:
                if _link_exists(name):  # not just gone meanwhile (a TAP of an exiting delay line)
                    problems.append(str(exc))
    for netns in state.netns_names():
        if _netns_exists(netns):
            try:
                _run(["ip", "netns", "del", netns])
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
    ``prefix=None`` looks at every prefix.  Namespaces and links named like
    ``prefix`` instances that no state file accounts for (state dir wiped) are
    removed too.
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
    pattern = re.compile(rf"^({re.escape(prefix)}[0-9a-f]{{4}})(?:-h|[vdi])(\d+)$|^({re.escape(prefix)}[0-9a-f]{{4}})br$")
    orphans: dict[str, list[int]] = {}
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    for name in names + os.listdir("/sys/class/net"):
        match = pattern.match(name)
        if not match:
            continue
        tag = match.group(1) or match.group(3)
        if tag not in known:
            orphans.setdefault(tag, []).append(int(match.group(2)) if match.group(2) else 0)
    for tag, indices in orphans.items():
        ghost = InstanceState(
            number=int(tag[-4:], 16), prefix=prefix, tag=tag, bridge=f"{tag}br", bridge_ip="", subnet="",
            count=1 + max(indices), runtime_base=str(Path(tempfile.gettempdir()) / f"commd-sim-{tag}"),
            owner_pid=None, owner_start=None,
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
                 prefix: str | None = None, delay_backend: str = "auto") -> None:
        prefix = DEFAULT_PREFIX if prefix is None else prefix
        _validate(count, delay_ms, rate, prefix, delay_backend)
        self.count = count
        self.delay_ms = float(delay_ms) if delay_ms is not None else None
        self.rate = rate.strip().lower() if rate is not None else None
        self.prefix = prefix
        self.requested_backend = delay_backend
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
    def delay_backend(self) -> str | None:
        """"netem", "userspace", or None (no delay, or not up)."""
        return self.state.delay_backend if self.state else None

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
        backend = resolve_delay_backend(self.delay_ms, self.requested_backend)
        reason = shaping_unavailable(None, self.rate)
        if reason:
            raise ShapingUnavailableError(reason)
        self.state = _claim_instance(self.prefix, self.count, self.delay_ms, self.rate, backend, persistent)
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
        base = Path(state.runtime_base)
        base.mkdir(mode=0o700)
        _run(["ip", "link", "add", "name", state.bridge, "address", _bridge_mac(state.number), "type", "bridge"])
        _run(["ip", "addr", "add", f"{state.bridge_ip}/{prefix_len}", "dev", state.bridge])
        _run(["ip", "link", "set", state.bridge, "up"])
        if state.delay_backend == "userspace":
            _start_delay_line(state, base / "delay-line.log")
        for index, info in enumerate(state.hosts):
            for cmd in link_commands(state.tag, state.number, index, f"{info['ip']}/{prefix_len}", state.bridge,
                                     state.delay_ms, state.rate, state.delay_backend):
                _run(cmd)
            Path(info["runtime_dir"]).mkdir(mode=0o700)
            self.hosts.append(SimHost(info["name"], info["netns"], info["ip"], state.env(index), self._procs))

    def _reset(self) -> None:
        self.state = None
        self.hosts = []
        self._procs = []

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

    def set_link(self, index: int, up: bool) -> None:
        """Pull (``up=False``) or plug back (``up=True``) host ``index``'s cable: its bridge port goes
        down, so every packet to or from it is lost while its address, routes and sockets stay.  That
        is a link or switch-port failure, not a host failure: nothing on either side is told, and TCP
        connections that outlive the cut retransmit once it is plugged back."""
        if self.state is None:
            raise SimHostsError(f"{self!r} is not up")
        if not 0 <= index < self.count:
            raise ValueError(f"no host {index}: the hosts are 0..{self.count - 1}")
        _run(["ip", "link", "set", _port_name(self.state.tag, index), "up" if up else "down"])

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


if __name__ == "__main__" and sys.argv[1:2] == ["_delay-line"]:
    sys.exit(_delay_line_main(sys.argv[2:]))
