"""Slurm support for the job prolog: host-list expansion, this node's rank, node 0's address.

Slurm's Prolog runs as root with almost no environment (no PATH, no
``scontrol`` to rely on), so deploy/slurm/prolog.sh asks ``commd slurm-plan``
(run as the job's user) for the values the daemon needs.  The output is
``KEY=VALUE`` lines of validated values only (digits, node names, an IPv4
address), so the script can read them without ``eval``.

The job's secret for multi-node jobs is derived by the prolog itself, as root,
from the site secret (``job_secret`` is the reference the tests compare it to):
the job user's code never sees the site secret.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import re
import socket
import sys

#: One host name as Slurm writes it (no brackets or commas left).
HOST_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: The text between brackets: comma-separated numbers or ranges ``lo-hi``.
RANGE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
JOB_ID = re.compile(r"^[0-9]{1,12}$")
#: Refuse lists that expand to more hosts than any job can have (a typo like node[1-99999999]).
MAX_HOSTS = 65536
#: Salt of the job-secret derivation; changing it changes every job's secret.
SECRET_CONTEXT = "commd-slurm-job:"
DEFAULT_PORT_BASE = 41000
DEFAULT_PORT_SPAN = 1000


class HostListError(ValueError):
    """A Slurm host list (SLURM_JOB_NODELIST) that cannot be expanded."""


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets; brackets must balance and not nest."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise HostListError(f"nested '[' at position {i} in {text!r}")
            depth = 1
        elif char == "]":
            if not depth:
                raise HostListError(f"unmatched ']' at position {i} in {text!r}")
            depth = 0
        elif char == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise HostListError(f"unclosed '[' in {text!r}")
    items.append(text[start:])
    return items


def _expand_range(body: str, whole: str) -> list[str]:
    """``01-03,7`` -> ['01', '02', '03', '7']: zero padding follows the lower bound's width."""
    out: list[str] = []
    for part in body.split(","):
        match = RANGE_ITEM.match(part)
        if not match:
            raise HostListError(f"bad range {part!r} in {whole!r}: expected N or N-M")
        low_text, high_text = match.group(1), match.group(2)
        low = int(low_text)
        high = int(high_text) if high_text is not None else low
        if high < low:
            raise HostListError(f"range {part!r} in {whole!r} runs backwards")
        if high - low + 1 > MAX_HOSTS:
            raise HostListError(f"range {part!r} in {whole!r} has more than {MAX_HOSTS} hosts")
        width = len(low_text)
        out.extend(str(n).zfill(width) for n in range(low, high + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list (``node[01-03,07],gpu5``, ``r[1-2]n[1-2]``) in Slurm's order.

    Raises HostListError for anything malformed, an empty list, a host name
    that is not 1-64 of ``[A-Za-z0-9_.-]``, duplicates, or more than MAX_HOSTS names.
    """
    text = text.strip()
    if not text:
        raise HostListError("the host list is empty")
    hosts: list[str] = []
    for item in _split_top_level(text):
        if not item:
            raise HostListError(f"empty entry in host list {text!r}")
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", item):
            if piece.startswith("["):
                choices = _expand_range(piece[1:-1], text)
            elif piece:
                choices = [piece]
            else:
                continue
            names = [prefix + choice for prefix in names for choice in choices]
            if len(hosts) + len(names) > MAX_HOSTS:
                raise HostListError(f"host list {text!r} has more than {MAX_HOSTS} hosts")
        hosts.extend(names)
    seen: set[str] = set()
    for name in hosts:
        if not HOST_NAME.match(name):
            raise HostListError(f"host name {name!r} in {text!r} is invalid (1-64 of A-Z a-z 0-9 _ . -)")
        if name in seen:
            raise HostListError(f"host {name!r} appears twice in {text!r}")
        seen.add(name)
    return hosts


def node_rank(hosts: list[str], node: str) -> int:
    """This node's index in the job's host list: its rank in the fabric."""
    try:
        return hosts.index(node)
    except ValueError:
        shown = ",".join(hosts[:8]) + (",..." if len(hosts) > 8 else "")
        raise HostListError(f"this node {node!r} is not in the job's node list ({shown})") from None


def resolve_ipv4(host: str) -> str:
    """The IPv4 address of ``host`` (the rendezvous store listens on node 0)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise HostListError(f"cannot resolve node 0 {host!r} to an IPv4 address: {exc}") from None
    address = str(infos[0][4][0])
    ipaddress.IPv4Address(address)
    return address


def rendezvous_port(job_id: str, base: int = DEFAULT_PORT_BASE, span: int = DEFAULT_PORT_SPAN) -> int:
    """Node 0's store port for a job: base + job id mod span (jobs sharing node 0 rarely collide)."""
    if not JOB_ID.match(job_id):
        raise HostListError(f"job id {job_id!r} is not a number")
    if not (1024 <= base and 1 <= span and base + span <= 65536):
        raise HostListError(f"port range [{base}, {base + span}) must lie in [1024, 65536)")
    return base + int(job_id) % span


def job_secret(site_secret: str, job_id: str) -> str:
    """HMAC-SHA256(site secret, 'commd-slurm-job:<id>') in hex: every node of the job derives the same."""
    return hmac.new(site_secret.encode(), (SECRET_CONTEXT + job_id).encode(), hashlib.sha256).hexdigest()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodelist", required=True, help="the job's host list (SLURM_JOB_NODELIST)")
    parser.add_argument("--node", required=True, help="this node's name as Slurm knows it")
    parser.add_argument("--job-id", required=True, help="SLURM_JOB_ID")
    parser.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE,
                        help="the rendezvous port is port-base + job id modulo port-span (default %(default)s)")
    parser.add_argument("--port-span", type=int, default=DEFAULT_PORT_SPAN,
                        help="how many ports the rendezvous port is chosen among (default %(default)s)")


def plan(nodelist: str, node: str, job_id: str, port_base: int, port_span: int) -> dict[str, str]:
    """What this node's daemon needs: node count, rank, and (several nodes) the rendezvous address."""
    if not JOB_ID.match(job_id):
        raise HostListError(f"job id {job_id!r} is not a number")
    hosts = expand_hostlist(nodelist)
    rank = node_rank(hosts, node)
    values = {"NNODES": str(len(hosts)), "NODE_RANK": str(rank), "NODE0": hosts[0]}
    if len(hosts) > 1:
        port = rendezvous_port(job_id, port_base, port_span)
        values["RENDEZVOUS"] = f"{resolve_ipv4(hosts[0])}:{port}"
    return values


def run(args: argparse.Namespace) -> int:
    """Print the plan as KEY=VALUE lines; exit 2 with the reason on stderr when it cannot be made."""
    try:
        values = plan(args.nodelist, args.node, args.job_id, args.port_base, args.port_span)
    except HostListError as exc:
        print(f"commd slurm-plan: {exc}", file=sys.stderr)
        return 2
    for key, value in values.items():
        print(f"{key}={value}")
    return 0
