"""Interaction graphs for :class:`torch_geometric.nn.models.SchNet` without pyg-lib.

SchNet calls ``interaction_graph(pos, batch)`` and expects
``(edge_index, edge_weight)``, ``edge_weight`` being the differentiable edge
lengths. :class:`InteractionGraph` provides that on top of :func:`radius_graph`.

SchNet's signature has no room for a cell. For periodic data either fix one
cell for every batch (``InteractionGraph(cutoff, cell=..., pbc=...)``), set the
batch's cells around the forward call with :meth:`InteractionGraph.periodic`,
or wrap the model in :class:`SchNetWithGraph`, which does that from a
``Batch`` carrying ``cell`` and ``pbc``. Periodic images become extra edges
(possibly several between the same pair), which SchNet's message passing
handles as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch_geometric.data import Data

from .radius import DEFAULT_MAX_PAIRS, radius_graph
from .transform import NeighbourTransform, edge_vectors


class InteractionGraph(torch.nn.Module):
    r"""Radius graph with differentiable distances, usable as SchNet's interaction graph.

    .. code-block:: python

        from torch_geometric.nn.models import SchNet
        from pyg_atompack.graph import InteractionGraph

        model = SchNet(cutoff=10.0, interaction_graph=InteractionGraph(cutoff=10.0))
        energy = model(batch.z, batch.pos, batch.batch)
        forces = -torch.autograd.grad(energy.sum(), batch.pos, create_graph=True)[0]

    Args:
        cutoff (float, optional): Cutoff radius (strict). (default: :obj:`10.0`)
        max_num_neighbors (int, optional): Keep the closest ``k`` neighbours of
            every atom; ``None`` keeps all. (default: ``32``, as SchNet)
        cell (torch.Tensor, optional): ``[3, 3]`` or ``[B, 3, 3]`` lattice
            vectors used for every call, e.g. one simulation box.
            (default: :obj:`None`, non-periodic)
        pbc (torch.Tensor, optional): ``[3]`` or ``[B, 3]`` periodic axes for
            ``cell``. (default: :obj:`None`, all periodic when ``cell`` is set)
        max_pairs (int, optional): Block size of the search, see
            :func:`radius_graph`. (default: :obj:`2**20`)
    """

    cell: Tensor | None
    pbc: Tensor | None

    def __init__(self, cutoff: float = 10.0, max_num_neighbors: int | None = 32,
                 cell: Tensor | None = None, pbc: Tensor | None = None,
                 max_pairs: int = DEFAULT_MAX_PAIRS) -> None:
        super().__init__()
        if pbc is not None and cell is None:
            raise ValueError("pbc was given without cell")
        self.cutoff = float(cutoff)
        self.max_num_neighbors = max_num_neighbors
        self.max_pairs = max_pairs
        # non-persistent buffers follow .to(device) but stay out of state_dict
        self.register_buffer("cell", None if cell is None else torch.as_tensor(cell),
                             persistent=False)
        self.register_buffer("pbc", None if pbc is None else torch.as_tensor(pbc, dtype=torch.bool),
                             persistent=False)
        self._override: tuple[Tensor, Tensor | None] | None = None
        self._edges: tuple[Tensor, Tensor] | None = None

    @contextmanager
    def periodic(self, cell: Tensor | None, pbc: Tensor | None = None) -> Iterator[None]:
        """Uses ``cell``/``pbc`` for the calls made inside the ``with`` block.

        Not thread-safe: one model, one batch at a time.

        Args:
            cell (Tensor | None): ``[B, 3, 3]`` (or ``[3, 3]``) lattice vectors of the batch;
                ``None`` makes the block non-periodic.
            pbc (Tensor, optional): ``[B, 3]`` (or ``[3]``) periodic axes. (default: all periodic)
        """
        previous = self._override
        self._override = (cell, pbc) if cell is not None else (None, None)
        try:
            yield
        finally:
            self._override = previous

    @contextmanager
    def edges(self, edge_index: Tensor, edge_shift: Tensor) -> Iterator[None]:
        """Uses edges found before the forward pass (:class:`NeighbourTransform`) in the block.

        The search is skipped; edge lengths are still computed from ``pos`` (and the cell
        of :meth:`periodic`) with torch ops, so forces and stress are unchanged.

        Args:
            edge_index (Tensor): ``[2, E]`` edges of this graph's cutoff and neighbour limit.
            edge_shift (Tensor): ``[E, 3]`` cell shifts of the sources.
        """
        previous = self._edges
        self._edges = (edge_index, edge_shift)
        try:
            yield
        finally:
            self._edges = previous

    def transform(self) -> NeighbourTransform:
        """The :class:`NeighbourTransform` that finds this graph's edges ahead of time."""
        return NeighbourTransform(self.cutoff, self.max_num_neighbors, max_pairs=self.max_pairs)

    def forward(self, pos: Tensor, batch: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Builds the graph.

        Args:
            pos (Tensor): ``[N, 3]`` positions.
            batch (Tensor, optional): ``[N]`` sorted graph index of every atom.
                (default: :obj:`None`)

        Returns:
            ``edge_index`` ``[2, E]`` (row 0 neighbour ``j``, row 1 centre ``i``)
            and ``edge_weight`` ``[E]``, the distances, differentiable w.r.t.
            ``pos`` (and the cell).
        """
        cell, pbc = self._override if self._override is not None else (self.cell, self.pbc)
        if self._edges is not None:
            return self._edges[0], edge_vectors(pos, batch, *self._edges, cell, pbc).norm(dim=-1)
        graph = radius_graph(pos, self.cutoff, batch, max_num_neighbors=self.max_num_neighbors,
                             cell=cell, pbc=pbc, return_vectors=True, max_pairs=self.max_pairs)
        return graph.edge_index, graph.distance

    def extra_repr(self) -> str:
        periodic = "" if self.cell is None else ", periodic=True"
        return f"cutoff={self.cutoff}, max_num_neighbors={self.max_num_neighbors}{periodic}"


class SchNetWithGraph(torch.nn.Module):
    r"""Runs a SchNet on a ``Batch``, passing the batch's ``cell``/``pbc`` to its graph.

    .. code-block:: python

        schnet = SchNet(cutoff=6.0, interaction_graph=InteractionGraph(6.0))
        model = SchNetWithGraph(schnet)
        energy = model(batch)  # [B, 1]; periodic where batch.pbc says so

    A batch without ``cell`` is treated as molecules. When ``cell`` is present
    and ``pbc`` is not, all axes are periodic. A batch carrying ``edge_index`` and
    ``edge_shift`` (from :meth:`InteractionGraph.transform`, e.g. built on the GPU
    while the previous step ran: :class:`~pyg_atompack.pyg.device.DeviceFeeder`) is
    not searched again.

    Args:
        model (torch.nn.Module): A SchNet (or any model called as
            ``model(z, pos, batch)``) whose ``interaction_graph`` is an
            :class:`InteractionGraph`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        graph = getattr(model, "interaction_graph", None)
        if not isinstance(graph, InteractionGraph):
            raise TypeError("SchNetWithGraph needs a model whose interaction_graph is an "
                            f"InteractionGraph, got {type(graph).__name__}")
        self.model = model

    def forward(self, data: Data) -> Tensor:
        """Computes the model output for every graph of ``data``.

        Args:
            data (torch_geometric.data.Data | torch_geometric.data.Batch): Needs
                ``z`` and ``pos``; uses ``batch``, ``cell`` and ``pbc`` when present.

        Returns:
            The model output, ``[B, 1]`` energies for SchNet.
        """
        batch = getattr(data, "batch", None)
        cell = getattr(data, "cell", None)
        pbc = getattr(data, "pbc", None)
        graph = self.model.interaction_graph
        edge_shift = getattr(data, "edge_shift", None)
        if getattr(data, "edge_index", None) is None or edge_shift is None:
            with graph.periodic(cell, pbc):
                return self.model(data.z, data.pos, batch)
        with graph.periodic(cell, pbc), graph.edges(data.edge_index, edge_shift):
            return self.model(data.z, data.pos, batch)
