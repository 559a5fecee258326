"""Client library: connect to the node daemon and submit ops on tensors."""

from commd.client import ops
from commd.client.connection import Client
from commd.client.errors import (
    AuthError,
    CommdError,
    CommTimeoutError,
    ConnectError,
    DaemonDiedError,
    DaemonShutdownError,
    LimitExceededError,
    MismatchError,
    PeerDiedError,
    RequestError,
    UntrustedDaemonError,
)
from commd.client.handle import Handle
from commd.client.spawn import ensure_daemon

__all__ = [
    "AuthError", "Client", "CommTimeoutError", "CommdError", "ConnectError", "DaemonDiedError",
    "DaemonShutdownError", "Handle", "LimitExceededError", "MismatchError", "PeerDiedError", "RequestError",
    "UntrustedDaemonError", "ensure_daemon", "ops",
]
