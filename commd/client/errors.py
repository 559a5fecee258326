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
    """Base class of every error raised by the commd client library.

    Raised as itself for an error inside the daemon (code ``internal``), on every rank of the failed op."""


class ConnectError(CommdError):
    """The node daemon could not be reached or started.

    Raised in the process that connects (a new ``Client``, the torch backend's bootstrap) and only there; when a
    cluster prologue could not start the daemon, the message is the reason it recorded."""


class UntrustedDaemonError(ConnectError):
    """The job's directory, sockets or daemon process are not the user's own: nothing was sent to them.

    Raised in the connecting process, before its hello carries the job secret; the message names the path or
    process and what is wrong with it."""


class StoreError(CommdError):
    """Bootstrapping the torch backend through the c10d store failed (a rank never wrote its part).

    Raised by ``init_process_group`` or ``new_group`` on the ranks left waiting for the part, after the store's
    timeout; the message names the ranks that never wrote it."""


class AuthError(CommdError):
    """The daemon refused us: wrong job secret or wrong job.

    Raised in the process whose request was refused, and only there."""


class RequestError(CommdError):
    """The daemon rejected a request as malformed or out of bounds.

    Raised on the submitting rank only, the message naming the field: the op never reached the scheduler, so
    its peers wait for it as for a rank that did not submit it."""


class LimitExceededError(RequestError):
    """The daemon refused the op: it would pass a per-client limit (inline size, pending ops or bytes).

    Raised on the submitting rank only; nothing else changes, and the daemon counts the hit."""


class MismatchError(CommdError):
    """Ranks submitted disagreeing ops (kind, dtype, count, op, root...).

    Raised on every rank of the op, on every node; the message names the fields, their values and the ranks
    holding each.  Other groups are not affected."""


class PeerDiedError(CommdError):
    """A rank taking part in the op died or left.

    Raised on every rank whose op waits for the dead rank (or node), naming it; the group's later ops fail
    at once."""


class CommTimeoutError(CommdError, TimeoutError):
    """The op did not complete in time (peers missing or daemon stuck).

    Raised on every rank that submitted the op, naming the ranks that did not (``missing_ranks``); a late
    rank's op fails on arrival with the same message, and the group's later ops are unaffected."""

    @property
    def missing_ranks(self) -> list[int] | None:
        """The global ranks that never submitted the op, where the daemon could name them (else None)."""
        return s.missing_ranks_in(str(self))


class DaemonShutdownError(CommdError):
    """The daemon is shutting down and failed the op.

    Raised on every rank of the node with an op waiting or queued when the daemon stopped."""


class DaemonDiedError(CommdError):
    """The daemon process disappeared.

    Raised on every rank of the node, for each op it has pending and for every later one."""


class UnrecoverableError(CommdError):
    """``commd.ft`` could not carry the job past a failure: the survivors did not agree, too few are left,
    this rank is not among them, or the job's store went with the failed rank.

    Raised on every surviving rank that tried to recover, naming why; nothing was applied to the model."""


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
