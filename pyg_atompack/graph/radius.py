"""Radius graphs in pure torch, with periodic images and a closest-k limit.

Edge convention (PyG's ``flow="source_to_target"``): ``edge_index[0]`` holds
the source ``j`` (the neighbour) and ``edge_index[1]`` the target ``i`` (the
centre that receives the message). Edge vectors point from the centre to the
neighbour: ``vec = pos[j] + shift @ cell - pos[i]`` (ASE's ``D`` convention).
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from ._periodic import lattice_search_setup, normalise_cell, search_cells
from ._search import search_pairs
from ._vesin import prefer_vesin, vesin_module, vesin_pairs

#: Default bound on candidate pairs evaluated at once (about 20 MB of float64
#: temporaries); large enough that a batch of 32 small molecules is one block.
DEFAULT_MAX_PAIRS = 1 << 20

_BACKENDS = ("auto", "torch", "torch_cluster", "vesin")


class NeighbourGraph(NamedTuple):
    """A radius graph with its periodic shifts and differentiable edge vectors.

    Attributes:
        edge_index: ``[2, E]`` int64; row 0 the source ``j`` (neighbour), row 1
            the target ``i`` (centre), sorted by target.
        shift: ``[E, 3]`` int64 cell shift of the source image (zeros for
            non-periodic graphs).
        vec: ``[E, 3]`` edge vectors ``pos[j] + shift @ cell - pos[i]``, built
            with torch ops so gradients reach ``pos`` (and ``cell``).
    """

    edge_index: Tensor
    shift: Tensor
    vec: Tensor

    @property
    def distance(self) -> Tensor:
        """``[E]`` differentiable edge lengths."""
        return self.vec.norm(dim=-1)


@functools.lru_cache(maxsize=1)
def _torch_cluster() -> ModuleType | None:
    try:
        return importlib.import_module("torch_cluster")
    except ImportError:
        return None


def torch_cluster_available() -> bool:
    """Returns whether the optional ``torch_cluster`` extension can be imported."""
    return _torch_cluster() is not None


def radius_graph(
    pos: Tensor,
    r: float,
    batch: Tensor | None = None,
    *,
    loop: bool = False,
    max_num_neighbors: int | None = None,
    cell: Tensor | None = None,
    pbc: Tensor | None = None,
    return_vectors: bool = False,
    backend: str = "auto",
    max_pairs: int = DEFAULT_MAX_PAIRS,
) -> Tensor | NeighbourGraph:
    r"""Connects every atom to all atoms (or periodic images) closer than ``r``.

    Works without ``pyg-lib``/``torch_cluster``. The pure-torch search pads the
    graphs of a batch to a common size and evaluates ``[graphs, rows, atoms]``
    distance blocks of at most ``max_pairs`` pairs, so memory stays
    :math:`O(\text{max\_pairs})` (at least one row, :math:`O(n_i)`) and never
    :math:`O(N_\text{total}^2)`. Periodic graphs enumerate every cell shift
    that can reach the cutoff, so cells smaller than the cutoff are handled
    (an atom also sees its own images).

    .. code-block:: python

        edge_index = radius_graph(data.pos, 5.0, data.batch)
        graph = radius_graph(data.pos, 5.0, data.batch, cell=data.cell,
                             pbc=data.pbc, return_vectors=True)
        energy = pair_energy(graph.distance)  # differentiable w.r.t. pos and cell

    Args:
        pos (torch.Tensor): ``[N, 3]`` float positions.
        r (float): Cutoff radius; pairs with distance strictly below ``r`` are
            edges.
        batch (torch.Tensor, optional): ``[N]`` sorted graph index of every
            atom. (default: :obj:`None`, one graph)
        loop (bool, optional): Keep the self pair ``(i, i)`` with zero shift.
            Periodic self-images are always kept. (default: :obj:`False`)
        max_num_neighbors (int, optional): Keep, for every centre, only the
            ``k`` closest neighbours (ties broken arbitrarily).
            (default: :obj:`None`, no limit)
        cell (torch.Tensor, optional): ``[3, 3]`` or ``[B, 3, 3]`` lattice
            vectors as rows (ASE convention). (default: :obj:`None`)
        pbc (torch.Tensor, optional): ``[3]`` or ``[B, 3]`` bool periodic axes;
            requires ``cell``. Graphs with no periodic axis ignore their cell.
            (default: :obj:`None`, all axes periodic when ``cell`` is given)
        return_vectors (bool, optional): Return a :class:`NeighbourGraph` with
            shifts and differentiable edge vectors instead of ``edge_index``.
            (default: :obj:`False`)
        backend (str, optional): ``"auto"`` searches with ``vesin-torch`` (cell
            lists) one graph alone, batches of periodic cells of 128 atoms or more
            and of molecules of 600 or more on average; other batches with
            ``torch_cluster`` (molecules, when importable) or the padded pure-torch
            search, each where it measured fastest (``benchmarks/neighbours.py``);
            ``"torch"``, ``"torch_cluster"`` or ``"vesin"`` force one. Every
            backend finds the same edges. (default: :obj:`"auto"`)
        max_pairs (int, optional): Largest number of candidate pairs evaluated
            at once. (default: :obj:`2**20`)

    Returns:
        ``edge_index`` ``[2, E]`` (row 0 source ``j``, row 1 target ``i``,
        sorted by target), or a :class:`NeighbourGraph` when
        ``return_vectors=True``. Without ``return_vectors`` a periodic graph
        may contain the same ``(j, i)`` pair once per image.
    """
    batch, counts = _check_inputs(pos, r, batch, max_num_neighbors, backend, cell, pbc)
    starts = torch.cumsum(counts, 0) - counts
    periodic_cell: Tensor | None = None
    if cell is not None:
        cell, pbc = normalise_cell(cell, pbc, len(counts), pos.device)
        if bool(pbc.any()):
            # zero the non-periodic rows: their shifts are zero, and a NaN or
            # placeholder there must not leak into edge vectors
            periodic_cell = torch.where(pbc[:, :, None], cell.to(pos.dtype), 0.0)
    if periodic_cell is not None and backend == "torch_cluster":
        raise ValueError("backend='torch_cluster' cannot search periodic images; "
                         "use backend='torch' or 'auto'")

    use_vesin = backend == "vesin" or (
        backend == "auto" and prefer_vesin(counts, periodic_cell is not None))
    with torch.no_grad():
        detached = pos.detach()
        if use_vesin:
            # invertible cells (checked; free axes completed): vesin needs a full basis
            search = None if periodic_cell is None else search_cells(periodic_cell.detach(), pbc)
            target, source, shift, dist2 = vesin_pairs(detached, counts, r, loop, cell=search,
                                                       pbc=None if search is None else pbc)
        elif periodic_cell is None:
            shift = None
            cluster = _torch_cluster() if backend != "torch" else None
            if cluster is not None and len(pos):
                target, source, dist2 = _cluster_edges(cluster, detached, batch, counts, r, loop)
            else:
                target, source, _, dist2 = search_pairs(detached, counts, starts, r, loop,
                                                        max_pairs)
        else:
            target, source, shift, dist2 = _periodic_edges(
                detached, batch, counts, starts, periodic_cell.detach(), pbc, r, loop, max_pairs)
        order = _target_order(target, dist2, len(pos), max_num_neighbors)
        if order is not None:
            target, source = target[order], source[order]
            shift = shift[order] if shift is not None else None

    edge_index = torch.stack([source, target])
    if not return_vectors:
        return edge_index
    vec = pos[source] - pos[target]
    if shift is None:
        shift = torch.zeros(len(target), 3, dtype=torch.int64, device=pos.device)
    else:
        edge_cells = periodic_cell[batch[target]]
        vec = vec + torch.einsum("ek,ekl->el", shift.to(pos.dtype), edge_cells)
    return NeighbourGraph(edge_index, shift, vec)


def _check_inputs(pos: Tensor, r: float, batch: Tensor | None, max_num_neighbors: int | None,
                  backend: str, cell: Tensor | None,
                  pbc: Tensor | None) -> tuple[Tensor, Tensor]:
    """Validates the arguments and returns ``(batch, atoms per graph)``."""
    if not isinstance(pos, Tensor) or pos.dim() != 2 or pos.shape[1] != 3:
        shape = list(pos.shape) if isinstance(pos, Tensor) else type(pos).__name__
        raise ValueError(f"pos must be a [N, 3] tensor, got {shape}")
    if not pos.is_floating_point():
        raise ValueError(f"pos must be a floating point tensor, got {pos.dtype}")
    if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
        raise ValueError(f"cutoff r must be a positive finite number, got {r!r}")
    if max_num_neighbors is not None and max_num_neighbors < 1:
        raise ValueError(f"max_num_neighbors must be >= 1 or None, got {max_num_neighbors}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if pbc is not None and cell is None:
        raise ValueError("pbc was given without cell; periodic images need lattice vectors")
    if backend == "torch_cluster" and _torch_cluster() is None:
        raise ImportError("backend='torch_cluster' requested but torch_cluster is not "
                          "installed; use backend='torch' (pure torch, same results)")
    if backend == "vesin" and vesin_module() is None:
        raise ImportError("backend='vesin' requested but vesin-torch is not installed; "
                          "use backend='torch' (pure torch, same results)")
    if batch is None:
        batch = torch.zeros(len(pos), dtype=torch.int64, device=pos.device)
    else:
        if batch.dim() != 1 or len(batch) != len(pos):
            raise ValueError(f"batch must be a [N] tensor with N={len(pos)}, "
                             f"got {list(batch.shape)}")
        if batch.dtype != torch.int64:
            batch = batch.to(torch.int64)
        if len(batch) and bool((batch[1:] < batch[:-1]).any() or batch[0] < 0):
            raise ValueError("batch must be non-negative and sorted ascending "
                             "(as built by torch_geometric's Batch)")
    num_graphs = int(batch[-1]) + 1 if len(batch) else 0
    if cell is not None and isinstance(cell, Tensor) and cell.dim() == 3 and cell.shape[0] > 1:
        if cell.shape[0] < num_graphs:
            raise ValueError(f"cell has {cell.shape[0]} entries but batch refers to "
                             f"{num_graphs} graphs")
        num_graphs = cell.shape[0]
    counts = torch.bincount(batch, minlength=num_graphs)
    return batch, counts


def _cluster_edges(cluster: ModuleType, pos: Tensor, batch: Tensor, counts: Tensor, r: float,
                   loop: bool) -> tuple[Tensor, Tensor, Tensor]:
    """All molecule edges from ``torch_cluster`` (closest-k is applied by the caller)."""
    edge_index = cluster.radius_graph(pos, r, batch, loop=loop,
                                      max_num_neighbors=int(counts.max()),
                                      flow="source_to_target")
    source, target = edge_index[0], edge_index[1]
    dist2 = (pos[source] - pos[target]).square().sum(dim=-1)
    keep = dist2 < r * r  # one strict convention whatever the backend
    return target[keep], source[keep], dist2[keep]


def _periodic_edges(pos: Tensor, batch: Tensor, counts: Tensor, starts: Tensor, cell: Tensor,
                    pbc: Tensor, r: float, loop: bool,
                    max_pairs: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Searches wrapped positions, then expresses shifts for the original positions."""
    bounds, offsets = lattice_search_setup(pos, batch, cell, pbc, r)
    wrapped = pos - torch.einsum("nk,nkl->nl", offsets.to(pos.dtype), cell[batch])
    target, source, shift, dist2 = search_pairs(wrapped, counts, starts, r, loop, max_pairs,
                                                cell=cell, bounds=bounds)
    # wrapped[j] + S_w @ cell - wrapped[i] == pos[j] + (S_w - o_j + o_i) @ cell - pos[i]
    shift = shift - offsets[source] + offsets[target]
    return target, source, shift, dist2


def _target_order(target: Tensor, dist2: Tensor, num_nodes: int,
                  max_num_neighbors: int | None) -> Tensor | None:
    """Returns the edge permutation (and selection) that sorts by target.

    With ``max_num_neighbors`` the ``k`` closest edges of each target are kept.
    ``None`` means the edges are already sorted and none needs dropping.
    """
    limited = False
    if max_num_neighbors is not None and len(target):
        degree = torch.bincount(target, minlength=num_nodes)
        limited = int(degree.max()) > max_num_neighbors
    if not limited:
        if len(target) < 2 or bool((target[1:] >= target[:-1]).all()):
            return None
        return torch.argsort(target, stable=True)
    by_distance = torch.argsort(dist2, stable=True)
    order = by_distance[torch.argsort(target[by_distance], stable=True)]
    sorted_target = target[order]
    first_of_target = torch.cumsum(degree, 0) - degree
    rank = torch.arange(len(order), device=target.device) - first_of_target[sorted_target]
    return order[rank < max_num_neighbors]
