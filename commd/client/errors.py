"""Exceptions a commd user can catch, one per thing they can act on.

Once ``torch.distributed`` is loaded they are also torch.distributed's own types
(``take_torch_bases``, which the torch backend's registration calls): every commd error
is a ``DistBackendError``, the network-like ones (daemon unreachable or gone, a peer
gone) also a ``DistNetworkError``, a bootstrap failure through the c10d store a
``DistStoreError``, and a timeout a Python ``TimeoutError`` as well; so code written
for torch's backends catches commd's failures.  The bases are given late because this
module loads without torch (the ``commd`` command and a daemon start must not pay for
it); an error made before torch loaded becomes a torch type along with its class.
"""

from __future__ import annotations

from types import ModuleType

from commd.protocol import schema as s


class _DistLayout(RuntimeError):
    """RuntimeError with the memory layout of torch's error types (they add a weak-reference slot, as
    any class written in Python does), so ``take_torch_bases`` may swap this base for torch's."""


class CommdError(_DistLayout):
    """Base class of every error raised by the commd client library."""


class ConnectError(CommdError):
    """The node daemon could not be reached or started."""


class UntrustedDaemonError(ConnectError):
    """The job's directory, sockets or daemon process are not the user's own: nothing was sent to them."""


class StoreError(CommdError):
    """Bootstrapping the torch backend through the c10d store failed (a rank never wrote its part)."""


class AuthError(CommdError):
    """The daemon refused us: wrong job secret or wrong job."""


class RequestError(CommdError):
    """The daemon rejected a request as malformed or out of bounds."""


class LimitExceededError(RequestError):
    """The daemon refused the op: it would pass a per-client limit (inline size, pending ops or bytes)."""


class MismatchError(CommdError):
    """Ranks submitted disagreeing ops (kind, dtype, count, op, root...)."""


class PeerDiedError(CommdError):
    """A rank taking part in the op died or left."""


class CommTimeoutError(CommdError, TimeoutError):
    """The op did not complete in time (peers missing or daemon stuck)."""

    @property
    def missing_ranks(self) -> list[int] | None:
        """The global ranks that never submitted the op, where the daemon could name them (else None)."""
        return s.missing_ranks_in(str(self))


class DaemonShutdownError(CommdError):
    """The daemon is shutting down and failed the op."""


class DaemonDiedError(CommdError):
    """The daemon process disappeared."""


#: The torch.distributed types (by name) each class takes as bases once torch is loaded, its commd
#: parent class first; the parent classes come first in this table.
_TORCH_BASES: tuple[tuple[type[CommdError], tuple[type, ...], tuple[str, ...]], ...] = (
    (CommdError, (), ("DistBackendError",)),
    (ConnectError, (CommdError,), ("DistNetworkError",)),
    (PeerDiedError, (CommdError,), ("DistNetworkError",)),
    (DaemonDiedError, (CommdError,), ("DistNetworkError",)),
    (StoreError, (CommdError,), ("DistStoreError",)),
)


def take_torch_bases(dist: ModuleType) -> None:
    """Make commd's errors torch.distributed's error types too (``dist``: the loaded torch.distributed).

    Idempotent.  Raises TypeError if this torch's error types cannot be bases (their layout changed)."""
    if issubclass(CommdError, dist.DistError):
        return
    for cls, commd_bases, torch_names in _TORCH_BASES:
        cls.__bases__ = (*commd_bases, *(getattr(dist, name) for name in torch_names))


_BY_CODE: dict[str, type[CommdError]] = {
    s.E_AUTH: AuthError,
    s.E_VERSION: RequestError,
    s.E_PROTOCOL: RequestError,
    s.E_BOUNDS: RequestError,
    s.E_LIMIT: LimitExceededError,
    s.E_MISMATCH: MismatchError,
    s.E_PEER_DIED: PeerDiedError,
    s.E_TIMEOUT: CommTimeoutError,
    s.E_SHUTDOWN: DaemonShutdownError,
    s.E_INTERNAL: CommdError,
}


def from_reply(code: str, message: str) -> CommdError:
    """Map a daemon ERROR reply to the matching exception."""
    return _BY_CODE.get(code, CommdError)(message)
