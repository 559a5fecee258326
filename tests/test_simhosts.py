"""Simulated hosts: reachability, per-host environment, shaping, cleanup, stale cleanup, CLI, validation.

The ``sim_hosts`` fixture comes from tests/simhosts.py through conftest.py.
Everything that touches namespaces skips where they cannot be used (not
root, no iproute2).  Tests that check for leftovers use their own random
prefix, so instances of concurrent runs never count.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest

import commd.sim.hosts as hosts_module
from commd.sim import __main__ as sim_cli
from commd.sim.hosts import (
    InstanceState,
    ShapingUnavailableError,
    SimHostsError,
    SimulatedHosts,
    cleanup_stale,
    link_commands,
    list_instances,
    netns_unavailable,
    parse_rate,
    remove_instance,
    resolve_delay_backend,
    shaping_unavailable,
)

SimFactory = Callable[..., SimulatedHosts]

#: Echo server: prints its port and what it sees of its host, then echoes every connection.
ECHO_SERVER = """
import os, socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(8)
print(s.getsockname()[1], os.environ["COMMD_NODE"], os.environ["COMMD_RUNTIME_DIR"], flush=True)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := c.recv(65536):
        c.sendall(data)
    c.close()
"""

#: Client: one greeting, then N one-byte round trips; prints JSON with its host's view and the median RTT.
PING_CLIENT = """
import json, os, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
c.sendall(b"hello"); echo = c.recv(5)
rtts = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
print(json.dumps({"echo": echo.decode(), "node": os.environ["COMMD_NODE"],
                  "runtime_dir": os.environ["COMMD_RUNTIME_DIR"], "rtt_median": statistics.median(rtts)}))
"""

#: Sink server: prints its port, reads one connection to EOF, answers with the byte count.
SINK_SERVER = """
import socket
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; buf = bytearray(1 << 20)
while k := c.recv_into(buf):
    n += k
c.sendall(str(n).encode()); c.close()
"""

#: Bulk client: sends argv[3] bytes, waits for the count; prints the seconds it took.
BULK_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20); total = int(sys.argv[3])
chunk = b"x" * (1 << 20); t = time.perf_counter(); sent = 0
while sent < total:
    c.sendall(chunk[: total - sent]); sent += min(len(chunk), total - sent)
c.shutdown(socket.SHUT_WR); assert int(c.recv(64)) == total
print(time.perf_counter() - t)
"""


@pytest.fixture
def require_netns() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


@pytest.fixture
def prefix() -> str:
    """A prefix no other test or concurrent run uses, so leftovers can be told apart."""
    return f"t{uuid.uuid4().hex[:6]}"


def _readline(proc: subprocess.Popen[str], timeout: float = 10.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"no output from {proc.args} within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"{proc.args} exited ({proc.wait()}) without output")
    return line.strip()


def _start_server(host: hosts_module.SimHost, code: str) -> tuple[subprocess.Popen[str], list[str]]:
    proc = host.popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, _readline(proc).split()


def _run_client(host: hosts_module.SimHost, code: str, *args: object, timeout: float = 20.0) -> str:
    proc = host.popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"client failed ({proc.returncode}): {out}"
    return out.strip()


def _leftovers(prefix: str) -> list[str]:
    """Everything named after ``prefix`` that an instance could have left: links, namespaces, dirs, state."""
    found = [n for n in os.listdir("/sys/class/net") if n.startswith(prefix)]
    if os.path.isdir("/run/netns"):
        found += [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
    found += [str(p) for p in Path(tempfile.gettempdir()).glob(f"commd-sim-{prefix}*")]
    found += [f"state:{s.tag}" for s in list_instances(prefix)]
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# --------------------------------------------------------------------------- validation (no root needed)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "count must lie in 1..32"),
        ({"count": 33}, "count must lie in 1..32"),
        ({"count": "2"}, "count must be an int"),
        ({"count": True}, "count must be an int"),
        ({"count": 2, "delay_ms": -1}, "delay_ms must be finite and >= 0"),
        ({"count": 2, "delay_ms": float("nan")}, "delay_ms must be finite"),
        ({"count": 2, "delay_ms": "1"}, "delay_ms must be a number"),
        ({"count": 2, "rate": "10"}, "rate '10' is invalid"),
        ({"count": 2, "rate": "fast"}, "rate 'fast' is invalid"),
        ({"count": 2, "rate": "10gbps"}, "is invalid"),
        ({"count": 2, "rate": 10}, "rate must be a string"),
        ({"count": 2, "rate": "1bit"}, "too low"),
        ({"count": 2, "prefix": "Bad"}, "prefix 'Bad' is invalid"),
        ({"count": 2, "prefix": "muchtoolong"}, "is invalid"),
        ({"count": 2, "prefix": ""}, "is invalid"),
        ({"count": 2, "delay_backend": "magic"}, "delay_backend must be one of"),
    ],
)
def test_arguments_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SimulatedHosts(**kwargs)  # type: ignore[arg-type]


def test_rates_parse_like_tc() -> None:
    assert parse_rate("10gbit") == 10**10
    assert parse_rate("500mbit") == 5 * 10**8
    assert parse_rate("1.5Gbit") == 15 * 10**8
    with pytest.raises(ValueError):
        resolve_delay_backend(1.0, "magic")
    assert resolve_delay_backend(None) is None
    assert resolve_delay_backend(0.0) is None


def test_shaping_commands_for_each_backend() -> None:
    """The documented commands: netem root + tbf child, or redirect to the delay line + tbf on its TAP."""
    netem = link_commands("t1230001", 1, 0, "10.200.1.1/24", "t1230001br", 0.1, "10gbit", "netem")
    flat = [" ".join(c) for c in netem]
    assert any("root handle 1: netem delay 0.1ms limit 100000" in c for c in flat)
    assert any("parent 1:1 handle 10: tbf rate 10gbit burst 1250000b limit 7500000b" in c for c in flat)
    assert any(c.startswith("tc qdisc add dev t1230001v0 root handle 1: tbf rate 10gbit") for c in flat)
    user = [" ".join(c) for c in link_commands("t1230001", 1, 0, "10.200.1.1/24", "t1230001br", 0.1, None,
                                              "userspace")]
    assert any("mirred egress redirect dev t1230001d0" in c for c in user)
    assert not any("netem" in c or "tbf" in c for c in user)
    assert all(len(name) <= 15 for c in netem + user for name in c if name.startswith("t123"))


# --------------------------------------------------------------------------- hosts


def test_two_hosts_reach_each_other_with_own_env(sim_hosts: SimFactory) -> None:
    sim = sim_hosts(2)
    h0, h1 = sim[0], sim[1]
    assert h0.env.keys() == h1.env.keys() == {"COMMD_NODE", "COMMD_RUNTIME_DIR"}
    assert (h0.env["COMMD_NODE"], h1.env["COMMD_NODE"]) == ("host0", "host1")
    assert h0.runtime_dir != h1.runtime_dir and h0.runtime_dir.is_dir() and h1.runtime_dir.is_dir()
    assert h0.ip != h1.ip and sim.bridge_ip not in (h0.ip, h1.ip)

    server, (port, node, runtime_dir) = _start_server(h0, ECHO_SERVER)
    assert (node, runtime_dir) == ("host0", str(h0.runtime_dir))
    result = json.loads(_run_client(h1, PING_CLIENT, h0.ip, port, 3))
    assert result["echo"] == "hello"
    assert (result["node"], result["runtime_dir"]) == ("host1", str(h1.runtime_dir))

    # The root namespace reaches a host, and a host reaches the root namespace at bridge_ip.
    with socket.create_connection((h0.ip, int(port)), timeout=5) as conn:
        conn.sendall(b"root")
        assert conn.recv(4) == b"root"
    with socket.create_server((sim.bridge_ip, 0)) as listener:
        listener.settimeout(10)
        code = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).sendall(b'hi')"
        client = h1.popen([sys.executable, "-c", code, sim.bridge_ip, listener.getsockname()[1]])
        conn, (peer, _) = listener.accept()
        with conn:
            assert conn.recv(2) == b"hi" and peer == h1.ip
        assert client.wait(10) == 0
    assert server.poll() is None  # still serving: down() must kill it


def test_delay_slows_round_trips(sim_hosts: SimFactory) -> None:
    """Shaped minus unshaped median RTT >= the delay (each direction is delayed once: ~2x in fact)."""
    delay_ms = 1.0
    plain = sim_hosts(2)
    shaped = sim_hosts(2, delay_ms=delay_ms)
    medians = []
    for sim in (plain, shaped):
        _, (port, *_) = _start_server(sim[0], ECHO_SERVER)
        medians.append(json.loads(_run_client(sim[1], PING_CLIENT, sim[0].ip, port, 30))["rtt_median"])
    plain_rtt, shaped_rtt = medians
    extra_ms = (shaped_rtt - plain_rtt) * 1000
    assert extra_ms >= delay_ms, f"delay {delay_ms} ms ({shaped.delay_backend}) added only {extra_ms:.3f} ms"
    assert extra_ms < 10 * delay_ms + 50, f"delay {delay_ms} ms added {extra_ms:.1f} ms: wrong units?"


def test_rate_limits_throughput(sim_hosts: SimFactory) -> None:
    rate_bps, nbytes = 100e6, 8 << 20
    plain = sim_hosts(2)
    shaped = sim_hosts(2, rate="100mbit")
    seconds = []
    for sim in (plain, shaped):
        _, (port,) = _start_server(sim[0], SINK_SERVER)
        seconds.append(float(_run_client(sim[1], BULK_CLIENT, sim[0].ip, port, nbytes)))
    plain_s, shaped_s = seconds
    shaped_bps = nbytes * 8 / shaped_s
    # Payload excludes TCP/IP/Ethernet headers (~4%); the 128 KiB bucket may pass at line speed.
    assert shaped_bps <= rate_bps * 1.05, f"{shaped_bps / 1e6:.0f} Mbit/s through a 100mbit link"
    assert shaped_bps >= rate_bps * 0.5, f"only {shaped_bps / 1e6:.0f} Mbit/s through a 100mbit link"
    assert plain_s * 3 < shaped_s


def test_down_removes_everything_even_when_the_body_raises(require_netns: None, prefix: str) -> None:
    with pytest.raises(RuntimeError, match="body failed"), SimulatedHosts(2, prefix=prefix) as sim:
        tracked = sim[0].popen(["sleep", "60"])
        # A process started behind the module's back (not through popen) must die too.
        untracked = subprocess.Popen(sim[1].argv(["sleep", "60"]))
        runtime_dirs = [h.runtime_dir for h in sim]
        assert len(_leftovers(prefix)) >= 6
        raise RuntimeError("body failed")
    assert _leftovers(prefix) == []
    assert not any(d.exists() for d in runtime_dirs)
    assert tracked.poll() == -signal.SIGTERM
    assert untracked.wait(5) == -signal.SIGKILL
    sim.down()  # again: nothing to do
    assert not sim.is_up and len(sim) == 0


def test_down_after_partial_setup(require_netns: None, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failing command names itself and its stderr, and what was made before it is undone."""
    real = hosts_module.link_commands

    def failing_second_host(tag: str, number: int, index: int, *args: object) -> list[list[str]]:
        cmds = real(tag, number, index, *args)  # type: ignore[arg-type]
        return cmds[:3] + [["ip", "link", "set", "dev", "nosuchdev0", "up"]] if index == 1 else cmds

    monkeypatch.setattr(hosts_module, "link_commands", failing_second_host)
    sim = SimulatedHosts(3, prefix=prefix)
    with pytest.raises(SimHostsError, match=r"ip link set dev nosuchdev0 up.*nosuchdev0") as info:
        sim.up()
    assert info.value.cmd == ["ip", "link", "set", "dev", "nosuchdev0", "up"]
    assert info.value.stderr
    assert _leftovers(prefix) == []
    assert not sim.is_up
    sim.down()


def test_cleanup_stale_removes_only_dead_owners(require_netns: None, prefix: str) -> None:
    # The crashed owner imports the module as a plain file: it needs nothing but the standard library.
    child_code = (
        f"import sys, time; sys.path.insert(0, {str(Path(hosts_module.__file__).parent)!r}); import hosts\n"
        f"sim = hosts.SimulatedHosts(2, delay_ms=0.2, prefix={prefix!r}).up()\n"
        "print(sim.tag, flush=True); time.sleep(60)\n"
    )
    live = SimulatedHosts(1, prefix=prefix)
    kept = SimulatedHosts(1, prefix=prefix)
    orphan_ns = f"{prefix}fffe-h0"
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        tag = _readline(child, timeout=20)
        live.up()
        kept.up(persistent=True)
        subprocess.run(["ip", "netns", "add", orphan_ns], check=True)
        child.kill()
        child.wait()
        (crashed,) = [s for s in list_instances(prefix) if s.tag == tag]
        assert not crashed.owner_alive()
        for pid, _ in crashed.helpers:  # the delay line notices its owner is gone and exits by itself
            assert _wait_gone(pid, 5.0), f"delay line {pid} outlived its owner"

        removed = cleanup_stale(prefix)

        assert sorted(removed) == sorted([tag, f"{prefix}fffe"])
        remaining = [n for n in _leftovers(prefix) if tag in n or orphan_ns in n]
        assert remaining == []
        assert {s.tag for s in list_instances(prefix)} == {live.tag, kept.tag}
        assert live.state is not None and all(os.path.exists(f"/run/netns/{n}") for n in live.state.netns_names())
    finally:
        child.kill()
        child.wait()
        live.down()
        for state in list_instances(prefix):
            remove_instance(state)
        subprocess.run(["ip", "netns", "del", orphan_ns], capture_output=True)
    assert _leftovers(prefix) == []


def test_missing_netem_is_reported(require_netns: None, prefix: str) -> None:
    """Asking for netem on a kernel without it fails before creating anything, naming the kernel option."""
    if hosts_module._kernel_missing("netem") is None:
        pytest.skip("this kernel has netem")
    assert "netem" in (shaping_unavailable(1.0, delay_backend="netem") or "")
    with pytest.raises(ShapingUnavailableError, match="CONFIG_NET_SCH_NETEM"):
        SimulatedHosts(2, delay_ms=1.0, prefix=prefix, delay_backend="netem").up()
    assert _leftovers(prefix) == []


# --------------------------------------------------------------------------- command line


def test_cli_up_list_exec_down(require_netns: None, prefix: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        assert sim_cli.main(["up", "2", "--prefix", prefix, "--rate", "1gbit"]) == 0
        out = capsys.readouterr().out
        tag = out.split()[1].rstrip(":")
        assert tag.startswith(prefix) and "host1" in out and f"exec --instance {tag} host0" in out
        (state,) = list_instances(prefix)
        assert state.persistent and state.tag == tag
        assert cleanup_stale(prefix) == []  # made by `up`: not stale although its process is gone

        assert sim_cli.main(["list"]) == 0
        assert tag in capsys.readouterr().out

        code = "import os; print(os.environ['COMMD_NODE'], os.environ['COMMD_RUNTIME_DIR'])"
        done = subprocess.run(
            [sys.executable, "-m", "commd.sim", "exec", "--instance", tag, "host1", "--", sys.executable, "-c", code],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["host1", state.hosts[1]["runtime_dir"]]

        assert sim_cli.main(["exec", "--instance", tag, "nohost", "--", "true"]) == 2
        assert "no host 'nohost'" in capsys.readouterr().err
        assert sim_cli.main(["down", "--prefix", prefix]) == 0
        assert f"removed {tag}" in capsys.readouterr().out
        assert _leftovers(prefix) == []
    finally:
        for state in list_instances(prefix):
            remove_instance(state)


@pytest.mark.parametrize(
    "argv",
    [["up", "0"], ["up", "2", "--rate", "fast"], ["up", "2", "--delay-ms", "-1"], ["up", "2", "--prefix", "BAD"],
     ["down", "--all", "--prefix", "x"], ["bogus"]],
)
def test_cli_rejects_bad_input(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        sim_cli.main(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_instance_state_round_trips(tmp_path: Path) -> None:
    state = InstanceState(number=1, prefix="t", tag="t0001", bridge="t0001br", bridge_ip="10.200.1.254",
                          subnet="10.200.1.0/24", count=1, runtime_base="/tmp/commd-sim-t0001", owner_pid=None,
                          owner_start=None)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(asdict(state)))
    assert InstanceState.load(path) == state
    path.write_text("{")
    with pytest.raises(SimHostsError, match="unreadable state file"):
        InstanceState.load(path)
