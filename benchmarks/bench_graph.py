"""Benchmark: pure-torch radius graph against naive approaches (CPU).

Run: ``python benchmarks/bench_graph.py``. Prints the median time of each
method and its ratio to ``pyg_atompack.graph.radius_graph`` measured in the
same process (absolute times drift on a shared machine; ratios less so).

Cases:
- molecules: 32 aspirin-sized graphs (21 atoms), cutoff 10 A, the SchNet/MD17
  setting; against a Python loop over graphs and a dense ``N_total^2`` mask.
- crystals: 32 periodic 8-atom cells, cutoff 5 A; against ASE's neighbour list
  called per structure.
- share of the graph in one SchNet (MD17 configuration) energy + forces step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from ase import Atoms
from ase.neighborlist import neighbor_list
from torch_geometric.nn.models import SchNet

from pyg_atompack.graph import InteractionGraph, radius_graph


def median_seconds(function: Callable[[], object], repeats: int = 30) -> float:
    function()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def per_graph_loop(pos: torch.Tensor, batch: torch.Tensor, cutoff: float) -> torch.Tensor:
    """The obvious approach: one cdist per graph in a Python loop."""
    edges = []
    counts = torch.bincount(batch).tolist()
    start = 0
    for size in counts:
        local = pos[start:start + size]
        close = torch.cdist(local, local) < cutoff
        close.fill_diagonal_(False)
        target, source = torch.nonzero(close, as_tuple=True)
        edges.append(torch.stack([source + start, target + start]))
        start += size
    return torch.cat(edges, dim=1)


def dense_all_pairs(pos: torch.Tensor, batch: torch.Tensor, cutoff: float) -> torch.Tensor:
    """One N_total x N_total distance matrix masked by graph membership."""
    close = (torch.cdist(pos, pos) < cutoff) & (batch[:, None] == batch[None, :])
    close.fill_diagonal_(False)
    target, source = torch.nonzero(close, as_tuple=True)
    return torch.stack([source, target])


def report(title: str, reference: float, others: dict[str, float]) -> None:
    print(f"{title}: radius_graph {reference * 1e3:.3f} ms")
    for name, seconds in others.items():
        print(f"  {name:<28s} {seconds * 1e3:8.3f} ms  ({seconds / reference:5.1f}x ours)")


def bench_molecules() -> None:
    generator = np.random.default_rng(0)
    pos = torch.tensor(generator.normal(scale=1.6, size=(32 * 21, 3)), dtype=torch.float32)
    batch = torch.arange(32).repeat_interleave(21)
    ours = median_seconds(lambda: radius_graph(pos, 10.0, batch, max_num_neighbors=32))
    with_vectors = median_seconds(
        lambda: radius_graph(pos, 10.0, batch, max_num_neighbors=32, return_vectors=True))
    report("32 x 21-atom molecules, cutoff 10", ours, {
        "ours + edge vectors": with_vectors,
        "python loop of cdist": median_seconds(lambda: per_graph_loop(pos, batch, 10.0)),
        "dense N_total^2": median_seconds(lambda: dense_all_pairs(pos, batch, 10.0)),
    })


def bench_crystals() -> None:
    generator = np.random.default_rng(1)
    structures = []
    for _ in range(32):
        cell = np.diag(generator.uniform(3.5, 5.0, size=3)) + generator.uniform(-0.5, 0.5, (3, 3))
        frac = generator.uniform(0, 1, size=(8, 3))
        structures.append(Atoms("Si8", scaled_positions=frac, cell=cell, pbc=True))
    pos = torch.tensor(np.concatenate([a.positions for a in structures]))
    batch = torch.arange(32).repeat_interleave(8)
    cell = torch.tensor(np.stack([a.cell.array for a in structures]))
    ours = median_seconds(lambda: radius_graph(pos, 5.0, batch, cell=cell, return_vectors=True),
                          repeats=10)
    ase_seconds = median_seconds(
        lambda: [neighbor_list("ijS", a, 5.0) for a in structures], repeats=10)
    report("32 x 8-atom periodic cells, cutoff 5", ours, {"ASE neighbor_list loop": ase_seconds})


def bench_schnet_share() -> None:
    torch.manual_seed(0)
    model = SchNet(hidden_channels=128, num_filters=128, num_interactions=6, num_gaussians=50,
                   cutoff=10.0, interaction_graph=InteractionGraph(cutoff=10.0))
    z = torch.tensor([6] * 9 + [8] * 4 + [1] * 8).repeat(32)
    pos = torch.randn(32 * 21, 3) * 1.6
    batch = torch.arange(32).repeat_interleave(21)

    def step() -> None:
        p = pos.clone().requires_grad_(True)
        energy = model(z, p, batch)
        torch.autograd.grad(energy.sum(), p, create_graph=True)

    graph_seconds = median_seconds(lambda: model.interaction_graph(pos, batch))
    step_seconds = median_seconds(step, repeats=5)
    print(f"SchNet energy+forces step (32 x 21 atoms): {step_seconds * 1e3:.1f} ms, "
          f"graph {graph_seconds * 1e3:.2f} ms ({100 * graph_seconds / step_seconds:.1f}%)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    bench_molecules()
    bench_crystals()
    bench_schnet_share()
