"""Which rank of how many a process is: the one rule every sampler and stream follows."""

from __future__ import annotations

import torch

__all__ = ["resolve_rank"]


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    r"""The ``(rank, world_size)`` a sampler or stream splits its work by.

    Args:
        rank (int, optional): This process's rank; with ``world_size``, or neither.
            (default: :obj:`None`)
        world_size (int, optional): The number of ranks. :obj:`None` for both takes them
            from an initialised :mod:`torch.distributed` process group, else ``(0, 1)``.
            (default: :obj:`None`)

    Returns:
        ``(rank, world_size)``, checked.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("pass rank and world_size together")
    if rank is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    return rank, world_size
