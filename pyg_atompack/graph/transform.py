"""Neighbour graphs found ahead of the forward pass, and edge vectors rebuilt from them.

The search needs no gradient: only the edge vectors do. :class:`NeighbourTransform` finds
a batch's edges (indices and periodic shifts) before the step, e.g. on the GPU on a side
stream while the previous step runs (:class:`pyg_atompack.pyg.device.DeviceFeeder`), and
:func:`edge_vectors` turns them into differentiable vectors inside the forward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch_geometric.data import Data

from .radius import DEFAULT_MAX_PAIRS, radius_graph


def edge_vectors(pos: Tensor, batch: Tensor | None, edge_index: Tensor, edge_shift: Tensor,
                 cell: Tensor | None = None, pbc: Tensor | None = None) -> Tensor:
    """Edge vectors ``pos[j] + shift @ cell - pos[i]``, differentiable in ``pos`` and ``cell``.

    Args:
        pos (Tensor): ``[N, 3]`` positions.
        batch (Tensor): ``[N]`` graph of every atom (:obj:`None`: one graph).
        edge_index (Tensor): ``[2, E]`` (row 0 source ``j``, row 1 target ``i``).
        edge_shift (Tensor): ``[E, 3]`` integer cell shifts of the sources.
        cell (Tensor, optional): ``[3, 3]`` or ``[B, 3, 3]`` lattice vectors. (default: :obj:`None`)
        pbc (Tensor, optional): ``[3]`` or ``[B, 3]`` periodic axes. (default: all periodic)

    Returns:
        ``[E, 3]`` edge vectors.
    """
    source, target = edge_index[0], edge_index[1]
    vec = pos[source] - pos[target]
    if cell is None:
        return vec
    cell = cell.unsqueeze(0) if cell.dim() == 2 else cell
    if pbc is None:
        pbc = torch.ones(3, dtype=torch.bool, device=pos.device)
    pbc = pbc.unsqueeze(0) if pbc.dim() == 1 else pbc
    # non-periodic rows may hold zeros, NaN or placeholders: they must not reach vectors
    periodic_cell = torch.where(pbc[:, :, None], cell.to(pos.dtype), 0.0)
    shift = edge_shift.to(pos.dtype)
    if periodic_cell.shape[0] == 1:  # one cell for every graph
        return vec + shift @ periodic_cell[0]
    if batch is None:
        raise ValueError("one cell per graph needs the batch vector")
    return vec + torch.einsum("ek,ekl->el", shift, periodic_cell[batch[target]])


class NeighbourTransform:
    r"""Finds a batch's neighbour graph and stores it as ``edge_index`` and ``edge_shift``.

    Use :meth:`pyg_atompack.graph.InteractionGraph.transform` to get one with the model's
    cutoff and neighbour limit; :class:`~pyg_atompack.graph.SchNetWithGraph` then skips
    its own search for batches that carry the edges.

    .. code-block:: python

        feeder = DeviceFeeder(loader, "cuda", transform=model.model.interaction_graph.transform())

    Args:
        cutoff (float): Cutoff radius (strict).
        max_num_neighbors (int, optional): Keep the closest ``k`` neighbours of every atom.
            (default: :obj:`32`)
        backend (str, optional): The search backend, see
            :func:`~pyg_atompack.graph.radius_graph`. (default: :obj:`"auto"`)
        max_pairs (int, optional): Block size of the pure-torch search.
            (default: :obj:`2**20`)
    """

    def __init__(self, cutoff: float, max_num_neighbors: int | None = 32, *,
                 backend: str = "auto", max_pairs: int = DEFAULT_MAX_PAIRS) -> None:
        self.cutoff = float(cutoff)
        self.max_num_neighbors = max_num_neighbors
        self.backend = backend
        self.max_pairs = max_pairs

    def __call__(self, data: Data) -> Data:
        graph = radius_graph(data.pos.detach(), self.cutoff, getattr(data, "batch", None),
                             max_num_neighbors=self.max_num_neighbors,
                             cell=getattr(data, "cell", None), pbc=getattr(data, "pbc", None),
                             return_vectors=True, backend=self.backend,
                             max_pairs=self.max_pairs)
        data.edge_index = graph.edge_index
        data.edge_shift = graph.shift
        return data

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(cutoff={self.cutoff}, "
                f"max_num_neighbors={self.max_num_neighbors}, backend={self.backend!r})")
