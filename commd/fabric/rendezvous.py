"""Form the fabric: find the other daemons, agree on a secret, connect lanes and control.

Two ways in, as clusters start daemons:

* a TCPStore (``--rendezvous HOST:PORT``): node 0 hosts it, or every daemon
  joins one that already exists (the training job's, with ``--join-store``);
* MPI (``mpiexec -n K commd daemon``): the daemons' MPI world is the fabric
  and the MPI lane gets a real communicator.

Control traffic (negotiation, status, errors) then runs on commd's own
channel (``fabric/channel.py``: msgpack frames on TCP) from every daemon to
the coordinator (node 0), opened with a challenge/response on the job
secret, so a process that reaches the port but lacks the secret is refused.
The secret is given to every node (COMMD_SECRET / COMMD_SECRET_FILE) or, under
MPI, sent by node 0 over the MPI world; it never goes into a store.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets as pysecrets
import select
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from commd.fabric.channel import ChannelClosed, Connection
from commd.protocol import schema as s
from commd.runtime import new_secret
from commd.scheduler.config import SchedulerConfig, config_from_wire

if TYPE_CHECKING:
    from commd.lanes.base import Lane  # the lanes import torch: only a fabric that forms needs them

log = logging.getLogger("commd.fabric")

FABRIC_VERSION = 1


class FabricError(RuntimeError):
    """The fabric could not be formed; the text says which node or step failed."""


@dataclass
class FabricSpec:
    nnodes: int | None
    node_rank: int | None
    node_name: str
    rendezvous: tuple[str, int] | None = None
    join_store: bool = False
    use_mpi: bool = False
    advertise: str | None = None
    timeout: float = 300.0
    op_timeout: float = 30.0


@dataclass
class NodeInfo:
    rank: int
    name: str
    ip: str
    tcp_port: int
    ctl_port: int
    lanes: list[str]
    pid: int


@dataclass
class Fabric:
    """What a daemon knows about its fabric once it is formed."""

    node_rank: int
    nodes: list[NodeInfo]
    secret: str
    lanes: dict[str, Lane]
    config: SchedulerConfig | None  # the coordinator's (members learn it at join)
    #: Control connections: the coordinator holds one per member; a member holds {0: coordinator}.
    links: dict[int, Connection] = field(default_factory=dict)
    #: The control tree's links that are not also star links (scheduler/tree.py): a node deeper than
    #: node 0's children holds one to its parent, a relay one to each child.  Empty for a star.
    tree_links: dict[int, Connection] = field(default_factory=dict)
    keep: list[Any] = field(default_factory=list)  # stores / communicators the lanes use
    #: This node's programs (``commd.algorithms.catalog.Catalog``; None: programs unavailable).
    catalog: Any = None
    #: The user programs node 0 sent with its config (``Catalog.shared()``'s form; a member adopts them).
    programs: Any = None

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def is_coordinator(self) -> bool:
        return self.node_rank == 0

    def node_of_name(self) -> dict[str, int]:
        return {n.name: n.rank for n in self.nodes}


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {text!r} must be HOST:PORT with a port in [1, 65535]")
    return host.strip("[]"), int(port)


def _route_ip(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _mac(secret: str, *parts: object) -> str:
    text = "/".join(str(p) for p in parts)
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def establish(spec: FabricSpec, job: str, secret: str | None, config: SchedulerConfig,
              programs: dict[str, Any] | None = None) -> Fabric:
    """Run the whole rendezvous; raises FabricError with a precise reason.  ``programs``: node 0's
    user programs, sent to every member with the config (as its tuning table is)."""
    deadline = time.monotonic() + spec.timeout
    keep: list[Any] = []
    comm = None
    store = None
    if spec.use_mpi:
        from commd.lanes.mpi import init_mpi

        comm = init_mpi()
        nnodes, rank = comm.Get_size(), comm.Get_rank()
        if spec.nnodes not in (None, nnodes) or spec.node_rank not in (None, rank):
            raise FabricError(
                f"--nnodes/--node-rank ({spec.nnodes}, {spec.node_rank}) disagree with the MPI world "
                f"(size {nnodes}, rank {rank})"
            )
        secret = comm.bcast((secret or new_secret()) if rank == 0 else None, root=0)
        ip = spec.advertise or _route_ip(socket.gethostname())
    else:
        if spec.rendezvous is None or spec.nnodes is None or spec.node_rank is None:
            raise FabricError("a multi-node daemon needs --nnodes, --node-rank and --rendezvous (or mpiexec)")
        nnodes, rank = spec.nnodes, spec.node_rank
        secret = _require_secret(secret, rank)
        host, port = spec.rendezvous
        store = _open_store(host, port, rank == 0 and not spec.join_store, deadline)
        keep.append(store)
        ip = spec.advertise or _route_ip(host)

    from commd.lanes.tcp import TcpLane

    tcp = TcpLane(rank, nnodes, secret, ip)
    listener = None
    ctl_port = 0
    if nnodes > 1:  # node 0's for every member, a relay's for its children in the control tree
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((ip, 0))
        listener.listen(64)
        ctl_port = listener.getsockname()[1]
    my_lanes = ["tcp", "gloo"] + (["mpi"] if comm is not None and nnodes > 1 else [])
    from commd.lanes.nccl import nccl_unavailable

    if nccl_unavailable() is None:
        my_lanes.append("nccl")
    info = NodeInfo(rank, spec.node_name, ip, tcp.endpoint[1], ctl_port, my_lanes, os.getpid())
    raw = json.dumps({"v": FABRIC_VERSION, **info.__dict__})
    if comm is not None:
        infos_raw = comm.allgather(raw)
    else:
        store.set(f"node/{rank}", raw)
        infos_raw = [_store_get(store, f"node/{r}", deadline, f"node {r} to join the rendezvous") for r in range(nnodes)]
    nodes = _check_nodes([json.loads(x) for x in infos_raw], nnodes)
    common = [lane for lane in ("tcp", "gloo", "mpi", "nccl") if all(lane in n.lanes for n in nodes)]
    log.info("fabric: node %d/%d '%s' at %s; nodes %s; lanes %s", rank, nnodes, spec.node_name, ip,
             [n.name for n in nodes], common)

    gloo_store = store
    if comm is not None:  # no TCPStore given: node 0 hosts one for Gloo/NCCL, announced over MPI
        from torch.distributed import TCPStore

        if rank == 0:
            hosted = TCPStore(ip, 0, None, True, timedelta(seconds=max(1.0, deadline - time.monotonic())),
                              wait_for_workers=False)
            port = comm.bcast(hosted.port, root=0)
            gloo_store = hosted
        else:
            port = comm.bcast(None, root=0)
            gloo_store = _open_store(nodes[0].ip, port, False, deadline)
        keep.append(gloo_store)
        keep.append(comm)

    # The control channel first: a node with the wrong secret learns it from the coordinator.
    fabric = Fabric(rank, nodes, secret, {}, config if rank == 0 else None, keep=keep)
    try:
        if rank != 0:
            _join_coordinator(fabric, job, deadline)
        elif listener is not None:
            _accept_members(fabric, listener, job, deadline, set(range(1, nnodes)), fabric.links,
                            {"t": "welcome", "config": config.to_wire(), "programs": programs})
        if listener is not None:
            _link_tree(fabric, listener, job, deadline)
    finally:
        if listener is not None:
            listener.close()
    try:
        tcp.connect([(n.ip, n.tcp_port) for n in nodes], max(0.1, deadline - time.monotonic()))
    except Exception as exc:
        raise FabricError(f"tcp lane: {exc}") from None
    lanes: dict[str, Lane] = {"tcp": tcp}
    from torch.distributed import PrefixStore

    from commd.lanes.gloo import GlooLane

    lanes["gloo"] = GlooLane(PrefixStore("gloo/", gloo_store), rank, nnodes, ip, spec.op_timeout)
    if "mpi" in common:
        from commd.lanes.mpi import MpiLane

        lanes["mpi"] = MpiLane(comm.Dup())  # its own communicator: rendezvous traffic never meets lane ops
    if "nccl" in common:
        import torch

        from commd.lanes.nccl import NcclLane

        device = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
        lanes["nccl"] = NcclLane(PrefixStore("nccl/", gloo_store), rank, nnodes, device, spec.op_timeout)
    fabric.lanes = {name: lane for name, lane in lanes.items() if name in common}
    return fabric


def _open_store(host: str, port: int, is_master: bool, deadline: float) -> Any:
    from torch.distributed import TCPStore

    remaining = max(1.0, deadline - time.monotonic())
    try:
        return TCPStore(host, port, None, is_master, timedelta(seconds=remaining), wait_for_workers=False)
    except Exception as exc:
        role = "host" if is_master else "reach"
        raise FabricError(f"cannot {role} the rendezvous store at {host}:{port}: {exc}") from None


def _store_get(store: Any, key: str, deadline: float, what: str) -> str:
    remaining = deadline - time.monotonic()
    try:
        store.wait([key], timedelta(seconds=max(0.1, remaining)))
        return store.get(key).decode()
    except Exception:
        raise FabricError(f"timed out waiting for {what}") from None


def _require_secret(secret: str | None, rank: int) -> str:
    """A store rendezvous needs the job secret given to every node; it never travels in the store.

    Anyone who reaches a TCPStore's port can read (and write) every key, so a
    secret published there would let them join the fabric or impersonate a node.
    """
    if not secret:
        raise FabricError(
            f"node {rank}: a job on several nodes needs the same secret on every node: set COMMD_SECRET, "
            "or COMMD_SECRET_FILE to a file only you can read (mode 0600), in every node's environment "
            "(e.g. `openssl rand -hex 32`). commd does not publish a secret through the rendezvous "
            "store: anyone who can reach its port could read it. (Under mpiexec none is needed.)"
        )
    return secret


def _check_nodes(raw: list[dict[str, Any]], nnodes: int) -> list[NodeInfo]:
    nodes = []
    for i, item in enumerate(raw):
        if item.get("v") != FABRIC_VERSION:
            raise FabricError(f"node {i} speaks fabric version {item.get('v')}, this daemon {FABRIC_VERSION}")
        item = {k: v for k, v in item.items() if k != "v"}
        nodes.append(NodeInfo(**item))
        if nodes[-1].rank != i:
            raise FabricError(f"rendezvous slot {i} holds node rank {nodes[-1].rank}")
    names: dict[str, int] = {}
    for node in nodes:
        if node.name in names:
            raise FabricError(
                f"nodes {names[node.name]} and {node.rank} both call themselves '{node.name}': give each "
                "daemon a distinct --node-name (or COMMD_NODE)"
            )
        names[node.name] = node.rank
    if len(nodes) != nnodes:
        raise FabricError(f"expected {nnodes} nodes, found {len(nodes)}")
    return nodes


def _link_tree(fabric: Fabric, listener: socket.socket, job: str, deadline: float) -> None:
    """The control tree's links beyond the star: to this node's parent (unless that is node 0, whose
    star link serves), then from its children.  A parent answers only once its own parent has, so
    the tree forms top down and nothing waits in a circle."""
    from commd.scheduler.tree import ControlTree

    tree = ControlTree(fabric.nnodes, fabric.config.control_fanout)
    if tree.is_star:
        return
    me = fabric.node_rank
    parent = tree.parent[me]
    if parent is not None and parent != 0:
        _join_coordinator(fabric, job, deadline, parent)
    children = set(tree.children[me])
    if children and me != 0:
        _accept_members(fabric, listener, job, deadline, children, fabric.tree_links, {"t": "welcome"})
    log.info("fabric: control tree of fan-out %d, depth %d; node %d's parent %s, children %s",
             tree.fanout, tree.depth(), me, parent, sorted(children))


def _accept_members(
    fabric: Fabric, listener: socket.socket, job: str, deadline: float, awaited: set[int],
    links: dict[int, Connection], welcome: dict[str, Any],
) -> None:
    """Challenge every connecting node of ``awaited``; admit only those proving the secret (node 0:
    every member, with node 0's config; a relay: its children in the control tree)."""
    listener.setblocking(False)
    pending: dict[int, tuple[Connection, int | None, str | None]] = {}  # fd -> (conn, node, nonce)
    while not awaited <= set(links):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(awaited - set(links))
            for conn, _, _ in pending.values():
                conn.close()
            raise FabricError(f"nodes {missing} never joined node {fabric.node_rank}'s control channel")
        ready, _, _ = select.select([listener] + [c.sock for c, _, _ in pending.values()], [], [], remaining)
        for sock in ready:
            if sock is listener:
                try:
                    peer, _ = listener.accept()
                except BlockingIOError:
                    continue
                conn = Connection(peer)
                pending[peer.fileno()] = (conn, None, None)
                continue
            conn, node, nonce = pending[sock.fileno()]
            try:
                msg = conn.poll_message()
                if msg is None:
                    continue
                claimed = s.int_field(msg, "node", 1, fabric.nnodes - 1)
                if claimed not in awaited:
                    raise s.ProtocolError(f"node {claimed} is not expected on node {fabric.node_rank}'s "
                                          "control channel")
                if msg["t"] == "join" and node is None:
                    nonce = pysecrets.token_hex(16)
                    pending[sock.fileno()] = (conn, claimed, nonce)
                    conn.send_blocking({"t": "challenge", "nonce": nonce})
                elif msg["t"] == "proof" and node == claimed:
                    expected = _mac(fabric.secret, "commd-join", job, node, nonce)
                    if not hmac.compare_digest(s.field(msg, "mac", str), expected):
                        log.warning("node %d failed authentication (wrong job secret)", node)
                        conn.send_blocking({"t": "rejected", "why": "wrong job secret"})
                        raise s.ProtocolError("wrong job secret")
                    if node in links:
                        raise s.ProtocolError(f"node {node} joined twice")
                    del pending[sock.fileno()]
                    links[node] = conn
                    conn.send_blocking(welcome)
                else:
                    raise s.ProtocolError(f"unexpected {msg['t']!r} during the join")
            except (s.ProtocolError, KeyError, ChannelClosed, OSError) as exc:
                log.warning("control channel: refused a peer: %s", exc)
                pending.pop(sock.fileno(), None)
                conn.close()


def _join_coordinator(fabric: Fabric, job: str, deadline: float, target: int = 0) -> None:
    """Join node ``target``'s control channel: the coordinator (node 0, which sends its config), or
    this node's parent in the control tree."""
    coordinator = fabric.nodes[target]
    where = f"{coordinator.ip}:{coordinator.ctl_port}"
    who = "the coordinator" if target == 0 else f"node {target}, this node's parent in the control tree,"
    while True:
        try:
            sock = socket.create_connection((coordinator.ip, coordinator.ctl_port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise FabricError(f"cannot reach the control channel of {who} at {where}: {exc}") from None
            time.sleep(0.1)
    conn = Connection(sock)

    def ask(message: dict[str, Any], want: str) -> dict[str, Any]:
        try:
            conn.send_blocking(message)
            reply = conn.recv_blocking(deadline)
        except (ChannelClosed, OSError) as exc:
            raise FabricError(f"{who} at {where} closed the join: {exc}") from None
        if reply is None:
            raise FabricError(f"{who} at {where} did not answer the join")
        if reply["t"] == "rejected":
            raise FabricError(f"{who} refused this node: {reply.get('why')}")
        if reply["t"] != want:
            raise FabricError(f"unexpected {reply['t']!r} from {who} during the join")
        return reply

    challenge = ask({"t": "join", "node": fabric.node_rank}, "challenge")
    nonce = s.field(challenge, "nonce", str)
    welcome = ask({"t": "proof", "node": fabric.node_rank,
                   "mac": _mac(fabric.secret, "commd-join", job, fabric.node_rank, nonce)}, "welcome")
    if target != 0:
        fabric.tree_links[target] = conn
        return
    try:
        fabric.config = config_from_wire(welcome["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise FabricError(f"the coordinator's config is not valid: {exc}") from None
    fabric.programs = welcome.get("programs")  # validated and checked by the catalogue that adopts them
    fabric.links[0] = conn
