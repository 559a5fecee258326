"""Client library: connect to the node daemon and submit ops on tensors.

The exceptions load with the package; ``Client``, ``Handle``, ``ops`` and
``ensure_daemon`` on first use, so that importing an error class (as the
``commd`` command does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
    UnrecoverableError,
    UntrustedDaemonError,
)

if TYPE_CHECKING:
    from commd.client import ops
    from commd.client.connection import Client
    from commd.client.handle import Handle
    from commd.client.spawn import ensure_daemon

#: Lazily loaded names: attribute -> (module, attribute in it; None for the module itself).
_LAZY = {
    "Client": ("commd.client.connection", "Client"),
    "Handle": ("commd.client.handle", "Handle"),
    "ensure_daemon": ("commd.client.spawn", "ensure_daemon"),
    "ops": ("commd.client.ops", None),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'commd.client' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)


__all__ = [
    "AuthError", "Client", "CommTimeoutError", "CommdError", "ConnectError", "DaemonDiedError",
    "DaemonShutdownError", "Handle", "LimitExceededError", "MismatchError", "PeerDiedError", "RequestError",
    "UnrecoverableError", "UntrustedDaemonError", "ensure_daemon", "ops",
]
