"""Neighbour graphs without pyg-lib: radius graphs, periodic images, SchNet graphs.

``torch_geometric.nn.radius_graph`` needs ``pyg-lib`` or ``torch_cluster``;
this module does the same search in pure torch (using ``torch_cluster`` when
installed and no periodic image is needed), adds periodic boundary conditions
with every image inside the cutoff, and plugs into SchNet.

Edge convention, everywhere: ``edge_index[0]`` is the source ``j`` (the
neighbour), ``edge_index[1]`` the target ``i`` (the centre), as PyG's
``flow="source_to_target"``; edges are sorted by target; edge vectors are
``pos[j] + shift @ cell - pos[i]``.
"""

from .interaction import InteractionGraph, SchNetWithGraph
from .radius import DEFAULT_MAX_PAIRS, NeighbourGraph, radius_graph, torch_cluster_available
from .transform import NeighbourTransform, edge_vectors

__all__ = [
    "DEFAULT_MAX_PAIRS",
    "InteractionGraph",
    "NeighbourGraph",
    "NeighbourTransform",
    "SchNetWithGraph",
    "edge_vectors",
    "radius_graph",
    "torch_cluster_available",
]
