"""The padded, blockwise pair search shared by molecules and periodic cells."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._blocks import Bounds, SearchBlock, plan_blocks

# Slack on the shift pruning test, for the same reason as the shift bound.
_PRUNE_SLACK = 1e-6


@functools.lru_cache(maxsize=64)
def _shift_grid(bounds: Bounds, device: torch.device) -> Tensor:
    """All shifts with ``|S_k| <= bounds[k]``, ``[S, 3]`` int64."""
    ranges = [torch.arange(-b, b + 1, device=device) for b in bounds]
    grid = torch.meshgrid(*ranges, indexing="ij")
    return torch.stack([axis.reshape(-1) for axis in grid], dim=1)


def search_pairs(pos: Tensor, counts: Tensor, starts: Tensor, cutoff: float, loop: bool,
                 max_pairs: int, cell: Tensor | None = None,
                 bounds: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Finds every (target, source, shift) closer than ``cutoff``, block by block.

    Args:
        pos (Tensor): ``[N, 3]`` detached positions (wrapped into their cells when periodic).
        counts (Tensor): ``[B]`` atoms per graph.
        starts (Tensor): ``[B]`` index of every graph's first atom.
        cutoff (float): Neighbour cutoff (strict: ``d < cutoff``).
        loop (bool): Keep the zero-shift self pair ``(i, i)``.
        max_pairs (int): Largest number of candidate pairs evaluated at once.
        cell (Tensor, optional): ``[B, 3, 3]`` detached lattice vectors in ``pos.dtype``, with
            non-periodic rows zeroed; ``None`` for a batch of molecules. (default: :obj:`None`)
        bounds (Tensor, optional): ``[B, 3]`` int64 largest shift per axis (required with ``cell``).
            (default: :obj:`None`)

    Returns:
        Global target and source indices, ``[E, 3]`` shifts (``None`` for
        molecules) and squared distances.
    """
    bounds_list = None if cell is None else [tuple(b) for b in bounds.tolist()]
    arange = torch.arange(int(counts.max()) if len(counts) else 0, device=pos.device)
    found = [_search_block(block, pos, counts, starts, arange, cutoff, loop, cell, bounds)
             for block in plan_blocks(counts.tolist(), bounds_list, max_pairs)]
    empty = torch.empty(0, dtype=torch.int64, device=pos.device)
    target = torch.cat([empty] + [part[0] for part in found])
    source = torch.cat([empty] + [part[1] for part in found])
    dist2 = torch.cat([pos.new_empty(0)] + [part[3] for part in found])
    if cell is None:
        return target, source, None, dist2
    zeros = torch.zeros(1, 3, dtype=torch.int64, device=pos.device)
    shifts = torch.cat([empty.reshape(0, 3)] + [
        zeros.expand(len(part[0]), 3) if part[2] is None else part[2] for part in found])
    return target, source, shifts, dist2


def _search_block(block: SearchBlock, pos: Tensor, counts: Tensor, starts: Tensor,
                  arange: Tensor, cutoff: float, loop: bool, cell: Tensor | None,
                  bounds: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Evaluates one block: ``[graphs, rows, width, shifts]`` squared distances."""
    chunk = slice(block.first, block.stop)
    chunk_starts = starts[chunk]
    columns = arange[:block.width]
    valid = columns[None, :] < counts[chunk, None]  # [graphs, width]
    padded = pos[torch.where(valid, chunk_starts[:, None] + columns[None, :], 0)]
    rows = slice(block.row_start, block.row_stop)
    images = padded[:, :, None, :]  # [graphs, width, shifts, 3]: the neighbour images
    mask = valid[:, None, :, None] & valid[:, rows, None, None]
    shift_values, zero_shift = None, 0
    if any(block.bounds):
        shift_values, moves, allowed = _block_shifts(block, padded, valid, cell[chunk],
                                                     bounds[chunk], cutoff)
        images = images + moves[:, None, :, :]
        mask = mask & allowed[:, None, None, :]
        zero = torch.nonzero((shift_values == 0).all(dim=1)).flatten().tolist()
        zero_shift = zero[0] if zero else None
    centres = padded[:, rows]
    # one coordinate at a time: a reduction over a trailing axis of 3 is slow
    dist2 = None
    for axis in range(3):
        component = images[:, None, :, :, axis] - centres[:, :, None, None, axis]
        dist2 = component.square() if dist2 is None else dist2.addcmul_(component, component)
    mask = mask & (dist2 < cutoff * cutoff)
    if not loop and zero_shift is not None:
        mask[:, :, :, zero_shift] &= columns[rows][:, None] != columns[None, :]
    graph, row, col, shift = torch.nonzero(mask, as_tuple=True)
    offset = chunk_starts[graph]
    return (offset + block.row_start + row, offset + col,
            None if shift_values is None else shift_values[shift],
            dist2[graph, row, col, shift])


def _block_shifts(block: SearchBlock, padded: Tensor, valid: Tensor, cell: Tensor,
                  bounds: Tensor, cutoff: float) -> tuple[Tensor, Tensor, Tensor]:
    """The block's shifts, their translations per graph, and which each graph may use.

    A shift is usable by a graph when it lies within the graph's own bounds
    (the chunk's grid is the union) and its translation ``t`` can reach the
    cutoff at all: ``|x_j + t - x_i| >= |t| - 2 rho`` with ``rho`` the radius of
    the graph around its centroid. Shifts no graph can use are dropped, which
    trims the corners of the box-shaped grid.

    Returns:
        ``[S, 3]`` int64 shifts, ``[graphs, S, 3]`` translations and
        ``[graphs, S]`` bool usability.
    """
    shift_values = _shift_grid(block.bounds, padded.device)[block.shift_start:block.shift_stop]
    moves = torch.einsum("sk,gkl->gsl", shift_values.to(padded.dtype), cell)
    weights = valid.to(padded.dtype)[:, :, None]
    centroid = (padded * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
    radius = ((padded - centroid[:, None, :]).norm(dim=-1) * weights[..., 0]).amax(dim=1)
    reach = (cutoff + 2 * radius) * (1 + _PRUNE_SLACK) + _PRUNE_SLACK
    allowed = (shift_values.abs()[None] <= bounds[:, None, :]).all(dim=-1)
    allowed &= moves.norm(dim=-1) < reach[:, None]
    used = allowed.any(dim=0)
    if not bool(used.all()):
        shift_values, moves, allowed = shift_values[used], moves[:, used], allowed[:, used]
    return shift_values, moves, allowed
