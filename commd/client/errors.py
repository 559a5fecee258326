"""Exceptions a commd user can catch, one per thing they can act on."""

from __future__ import annotations

from commd.protocol import schema as s


class CommdError(RuntimeError):
    """Base class of every error raised by the commd client library."""


class ConnectError(CommdError):
    """The node daemon could not be reached or started."""


class UntrustedDaemonError(ConnectError):
    """The job's directory, sockets or daemon process are not the user's own: nothing was sent to them."""


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


class DaemonShutdownError(CommdError):
    """The daemon is shutting down and failed the op."""


class DaemonDiedError(CommdError):
    """The daemon process disappeared."""


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
