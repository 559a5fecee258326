"""commd: a per-node communication daemon for distributed training.

``import commd`` registers the torch.distributed backend ``"commd"``: at once
if torch is already imported, else as soon as it is.  Importing commd does not
import torch itself, so the ``commd`` command and the daemon start fast; the
client names below are loaded on first use.  Once torch.distributed is loaded,
commd's errors are its error types too (every one a ``DistBackendError``;
``commd.client.errors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from commd.client.errors import (  # noqa: E402
    CommdError,
    CommTimeoutError,
    MismatchError,
    PeerDiedError,
    StoreError,
    UnrecoverableError,
)
from commd.torch_backend.autoregister import register_when_torch_loads  # noqa: E402

register_when_torch_loads()

if TYPE_CHECKING:
    from commd.client.connection import Client
    from commd.torch_backend.process_group import Options  # pg_options: the lane of a group


def __getattr__(name: str) -> Any:
    """``commd.Client`` and ``commd.Options`` import torch, so they load on first use."""
    if name == "Client":
        from commd.client.connection import Client

        return Client
    if name == "Options":
        from commd.torch_backend.process_group import Options

        return Options
    raise AttributeError(f"module 'commd' has no attribute {name!r}")


def empty(shape, dtype=None):  # type: ignore[no-untyped-def]
    """A tensor in this process's commd arena (zero-copy for collectives).

    Needs the ``commd`` process group to be initialized (or a connected Client).
    """
    import torch

    from commd.torch_backend.process_group import current_client

    return current_client().empty(shape, dtype or torch.float32)


def alltonext(send, recv, group=None, async_op=False):  # type: ignore[no-untyped-def]
    """AllToNext: rank r's ``recv`` = rank r - 1's ``send`` (rank 0's ``recv`` is left as it was).

    ``group``: None (the default process group), a commd torch process group, or a commd
    group's name.  See ``commd.torch_backend.process_group.alltonext``."""
    from commd.torch_backend.process_group import alltonext as run

    return run(send, recv, group, async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):  # type: ignore[no-untyped-def]
    """torch's ``dist.monitored_barrier`` (Gloo only) for commd groups: a barrier that, after ``timeout``
    (a timedelta or seconds; None: the group's op timeout), fails on every waiting rank naming the
    first rank that did not arrive, or all of them with ``wait_all_ranks``.
    See ``commd.torch_backend.process_group.monitored_barrier``."""
    from commd.torch_backend.process_group import monitored_barrier as run

    run(group, timeout, wait_all_ranks)


def batch_isend_irecv(p2p_op_list):  # type: ignore[no-untyped-def]
    """``dist.batch_isend_irecv`` whose ops reach the daemon as one message on a commd group (torch's
    own sends them one by one there); one work for the batch.  See
    ``commd.torch_backend.process_group.batch_isend_irecv``."""
    from commd.torch_backend.process_group import batch_isend_irecv as run

    return run(p2p_op_list)


__all__ = ["Client", "CommTimeoutError", "CommdError", "MismatchError", "Options", "PeerDiedError", "StoreError",
           "UnrecoverableError", "alltonext", "batch_isend_irecv", "empty", "monitored_barrier"]
