"""commd: a per-node communication daemon for distributed training.

``import commd`` registers the torch.distributed backend ``"commd"``.
"""

from __future__ import annotations

__version__ = "0.1.0"

from commd.client import (  # noqa: E402
    Client,
    CommdError,
    CommTimeoutError,
    MismatchError,
    PeerDiedError,
)


def _register() -> None:
    from commd.torch_backend.process_group import register_backend

    register_backend()


_register()

from commd.torch_backend.process_group import Options  # noqa: E402  (pg_options: the lane of a group)


def empty(shape, dtype=None):  # type: ignore[no-untyped-def]
    """A tensor in this process's commd arena (zero-copy for collectives).

    Needs the ``commd`` process group to be initialized (or a connected Client).
    """
    import torch

    from commd.torch_backend.process_group import current_client

    return current_client().empty(shape, dtype or torch.float32)


__all__ = ["Client", "CommTimeoutError", "CommdError", "MismatchError", "Options", "PeerDiedError", "empty"]
