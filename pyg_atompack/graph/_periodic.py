"""Lattice geometry for periodic graphs: which cell shifts can reach the cutoff.

Minimum image is not enough when the cutoff exceeds half a cell height (small
cells, large cutoffs): an atom then sees several copies of the same neighbour,
and its own copies. The search therefore tests every integer shift ``S`` that
can bring an image within the cutoff.

Bounding the shifts: with ``b_k`` the reciprocal lattice vectors
(``b_k . a_l = delta_kl``, the columns of ``inv(cell)``) and ``f`` fractional
coordinates, the pair vector ``d = x_j + S @ cell - x_i`` satisfies
``b_k . d = f_jk - f_ik + S_k`` and ``|b_k . d| <= |b_k| |d| < r |b_k|``. Hence
``|S_k| < r |b_k| + span_k`` with ``span_k`` the spread of the graph's
fractional coordinates along ``k``. ``1 / |b_k|`` is the distance between
lattice planes, so this is the usual "cutoff over plane spacing" count. Atoms
are wrapped into the cell first (``span_k < 1``) and the shifts corrected back
afterwards, so unwrapped trajectories do not inflate the search.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Slack on the shift bound: an extra shift costs a little time, a missing one
# silently drops neighbours.
_SHIFT_SLACK = 1e-6


def normalise_cell(cell: Tensor, pbc: Tensor | None, num_graphs: int,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """Broadcasts ``cell`` and ``pbc`` to one entry per graph.

    Args:
        cell (Tensor): ``[3, 3]`` (shared) or ``[B, 3, 3]`` lattice vectors as rows.
        pbc (Tensor | None): ``[3]`` or ``[B, 3]`` periodic axes, or ``None`` for all periodic.
        num_graphs (int): ``B``.
        device (torch.device): Device of the positions.

    Returns:
        ``cell`` as ``[B, 3, 3]`` (keeping its autograd history) and ``pbc`` as
        a ``[B, 3]`` bool tensor.
    """
    cell = torch.as_tensor(cell, device=device)
    if cell.dim() == 2:
        cell = cell.unsqueeze(0)
    if cell.dim() != 3 or cell.shape[1:] != (3, 3):
        raise ValueError(f"cell must have shape [3, 3] or [B, 3, 3], got {list(cell.shape)}")
    if not cell.is_floating_point():
        raise ValueError(f"cell must be a floating point tensor, got {cell.dtype}")
    if cell.shape[0] == 1:
        cell = cell.expand(num_graphs, 3, 3)
    elif cell.shape[0] != num_graphs:
        raise ValueError(f"cell has {cell.shape[0]} entries but the batch has {num_graphs} graphs")
    if pbc is None:
        return cell, torch.ones(num_graphs, 3, dtype=torch.bool, device=device)
    pbc = torch.as_tensor(pbc, device=device)
    if pbc.dim() == 1:
        pbc = pbc.unsqueeze(0)
    if pbc.dim() != 2 or pbc.shape[1] != 3:
        raise ValueError(f"pbc must have shape [3] or [B, 3], got {list(pbc.shape)}")
    if pbc.shape[0] == 1:
        pbc = pbc.expand(num_graphs, 3)
    elif pbc.shape[0] != num_graphs:
        raise ValueError(f"pbc has {pbc.shape[0]} entries but the batch has {num_graphs} graphs")
    return cell, pbc.to(torch.bool)


def _degenerate(rows: Tensor) -> Tensor:
    """Per matrix: are the rows zero or (numerically) linearly dependent?"""
    singular = torch.linalg.svdvals(rows)
    scale = rows.norm(dim=-1).amax(dim=-1)
    return (scale == 0) | (singular.amin(dim=-1) <= 1e-10 * scale)


def _raise_degenerate(cell: Tensor, axes: list[int], graph: int) -> None:
    raise ValueError(
        f"graph {graph}: the periodic lattice vectors (axes {axes}) of cell {cell.tolist()} "
        "are zero or linearly dependent")


def search_cells(cell: Tensor, pbc: Tensor) -> Tensor:
    """Returns invertible float64 cells whose periodic rows are those of ``cell``.

    Non-periodic rows are replaced by an orthonormal basis of the complement of
    the periodic rows (a slab may carry a zero third vector); graphs with no
    periodic axis get the identity. Shifts along non-periodic axes are always
    zero, so this never changes an edge vector; it only makes fractional
    coordinates defined.

    Args:
        cell (Tensor): ``[B, 3, 3]`` lattice vectors (detached).
        pbc (Tensor): ``[B, 3]`` periodic axes.

    Returns:
        ``[B, 3, 3]`` float64 invertible matrices.
    """
    cell = cell.to(torch.float64)
    full = pbc.all(dim=1)
    completed = torch.eye(3, dtype=torch.float64, device=cell.device).repeat(len(cell), 1, 1)
    if bool(full.any()):
        bad = torch.nonzero(full).flatten()[_degenerate(cell[full])]
        if len(bad):
            graph = int(bad[0])
            _raise_degenerate(cell[graph], [0, 1, 2], graph)
        completed[full] = cell[full]
    partial = pbc.any(dim=1) & ~full
    for graph in torch.nonzero(partial).flatten().tolist():
        axes = [k for k in range(3) if bool(pbc[graph, k])]
        rows = cell[graph, axes]
        if bool(_degenerate(rows)):
            _raise_degenerate(cell[graph], axes, graph)
        _, _, vh = torch.linalg.svd(rows, full_matrices=True)
        completed[graph, axes] = rows
        free_axes = [k for k in range(3) if k not in axes]
        completed[graph, free_axes] = vh[len(axes):]
    return completed


def lattice_search_setup(pos: Tensor, batch: Tensor, cell: Tensor, pbc: Tensor,
                         cutoff: float) -> tuple[Tensor, Tensor]:
    """Wraps atoms into their cells and bounds the shifts each graph needs.

    Args:
        pos (Tensor): ``[N, 3]`` detached positions.
        batch (Tensor): ``[N]`` graph index of every atom.
        cell (Tensor): ``[B, 3, 3]`` detached lattice vectors.
        pbc (Tensor): ``[B, 3]`` periodic axes.
        cutoff (float): Neighbour cutoff.

    Returns:
        ``bounds`` ``[B, 3]`` int64, the largest ``|S_k|`` to test per graph
        (zero on non-periodic axes), and ``offsets`` ``[N, 3]`` int64, the
        number of cells each atom was moved back by
        (``wrapped = pos - offsets @ cell``).
    """
    completed = search_cells(cell, pbc)
    inverse = torch.linalg.inv(completed)
    atom_pbc = pbc[batch]
    frac = torch.einsum("nk,nkl->nl", pos.to(torch.float64), inverse[batch])
    offsets = torch.where(atom_pbc, torch.floor(frac), 0.0)
    wrapped = frac - offsets
    index = batch[:, None].expand(-1, 3)
    high = torch.zeros(len(cell), 3, dtype=torch.float64, device=pos.device)
    low = torch.zeros_like(high)
    high = high.scatter_reduce(0, index, wrapped, "amax", include_self=False)
    low = low.scatter_reduce(0, index, wrapped, "amin", include_self=False)
    reach = cutoff * inverse.norm(dim=-2) + (high - low)
    bounds = torch.floor(reach * (1 + _SHIFT_SLACK) + _SHIFT_SLACK).to(torch.int64)
    return bounds * pbc, offsets.to(torch.int64)
