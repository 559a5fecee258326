"""Buffer layout helpers shared by the single-node executor, the hierarchy and the lanes."""

from __future__ import annotations

import itertools

import torch


def block_offsets(counts: list[int]) -> list[int]:
    """Where each of consecutive blocks of ``counts`` starts: [0, c0, c0+c1, ...] (len(counts) entries)."""
    return list(itertools.accumulate(counts[:-1], initial=0)) if counts else []


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor``: ops that reduce nothing move bytes, whatever the dtype."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
