"""Tensor-parallel state. braid runs one rank until tensor parallelism is built (ServerArgs refuses tp_size > 1);
the layers already ask for their rank's share through these."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def tp_size() -> int:
    return _TP_SIZE


def tp_rank() -> int:
    return _TP_RANK


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x

