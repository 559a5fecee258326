"""Registering the "commd" backend with torch.distributed, without importing the client.

torch's backend autoloading (the ``torch.backends`` entry point) calls ``autoload`` from
inside ``import torch``; so does commd's own import hook (``autoregister``) right after
torch loads.  Either may happen while a commd client module is itself half-imported (a
user's ``from commd.client import Client`` imports torch), so registering must import
nothing of the client library: the group factory loads ``process_group`` on the first
``init_process_group("commd")``, when every import has finished.

The backend is registered for the devices this torch has: ``cpu`` always, ``cuda`` only
where CUDA is available.  torch takes a backend's registered devices as its preferred
ones, and code that asks for a group's device (``ShardedTensor.gather``, checkpoint
resharding) must not be sent to a CUDA that this torch cannot use.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from commd.client.errors import take_torch_bases
from commd.torch_backend import BACKEND_NAME

_registered = False


def backend_devices() -> list[str]:
    """The device types to register the backend for: ``cpu``, and ``cuda`` where this torch can use it."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _create_group(dist_opts: Any, backend_opts: Any) -> Any:
    """torch's factory for a "commd" group: the process group module loads here, on first use."""
    from commd.torch_backend.process_group import create_group

    return create_group(dist_opts, backend_opts)


def register_backend() -> None:
    """Register "commd" with torch.distributed (idempotent); commd's errors become torch's error types."""
    global _registered
    try:
        take_torch_bases(dist)
    except (TypeError, AttributeError) as exc:  # a torch whose error types cannot be bases (or lacks them)
        warnings.warn(f"commd: its errors cannot be torch.distributed's error types too: {exc}", RuntimeWarning,
                      stacklevel=2)
    if _registered or BACKEND_NAME in dist.Backend.backend_list:
        _registered = True
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=backend_devices())
    _registered = True


def autoload() -> None:
    """Entry point for torch's backend autoloading (the ``torch.backends`` group)."""
    register_backend()
