"""Tests for pyg_atompack.graph: radius graphs, periodic images, SchNet graphs.

References: a brute-force numpy O(N^2) search for molecules and ASE's
``neighbor_list`` for periodic cells. Comparisons use sets of
``(target, source, shift)`` so that edge order does not matter.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111
from ase.neighborlist import neighbor_list
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import Batch, Data
from torch_geometric.nn.models import SchNet

from pyg_atompack import graph
from pyg_atompack.graph import (
    InteractionGraph,
    SchNetWithGraph,
    radius_graph,
)
from pyg_atompack.graph import radius as radius_module
from pyg_atompack.graph._blocks import plan_blocks

# ---------------------------------------------------------------- references


def brute_force_edges(pos: np.ndarray, batch: np.ndarray, cutoff: float,
                      loop: bool = False) -> dict[tuple[int, int], float]:
    """All (target i, source j) pairs of the same graph closer than cutoff (O(n^2) per graph)."""
    edges = {}
    for graph_id in np.unique(batch):
        atoms = np.flatnonzero(batch == graph_id)
        local = pos[atoms]
        distances = np.linalg.norm(local[None, :, :] - local[:, None, :], axis=-1)
        close = distances < cutoff
        if not loop:
            np.fill_diagonal(close, False)
        for i, j in zip(*np.nonzero(close)):
            edges[(int(atoms[i]), int(atoms[j]))] = float(distances[i, j])
    return edges


def ase_edges(atoms: Atoms, cutoff: float, offset: int = 0) -> dict[tuple, float]:
    """ASE's periodic neighbour list as {(i, j, S): distance}."""
    i, j, shifts, distances = neighbor_list("ijSd", atoms, cutoff)
    return {(int(a) + offset, int(b) + offset, tuple(int(s) for s in shift)): float(d)
            for a, b, shift, d in zip(i, j, shifts, distances)}


def our_edges(result: graph.NeighbourGraph) -> dict[tuple, float]:
    """Our graph as {(i, j, S): distance} (i target, j source)."""
    source, target = result.edge_index.tolist()
    shifts = result.shift.tolist()
    distances = result.distance.detach().tolist()
    edges = {}
    for j, i, shift, d in zip(source, target, shifts, distances):
        key = (i, j, tuple(shift))
        assert key not in edges, f"duplicate edge {key}"
        edges[key] = d
    return edges


def assert_same_edges(ours: dict, reference: dict, atol: float = 1e-9) -> None:
    missing = set(reference) - set(ours)
    extra = set(ours) - set(reference)
    assert not missing and not extra, (
        f"{len(missing)} missing e.g. {sorted(missing)[:3]}, {len(extra)} extra e.g. "
        f"{sorted(extra)[:3]}")
    for key, distance in reference.items():
        assert ours[key] == pytest.approx(distance, abs=atol), key


def assert_closest_k(ours: dict, reference: dict, num_nodes: int, k: int) -> None:
    """Each centre keeps min(k, degree) true edges, none farther than its k-th closest.

    Tie-robust: periodic self-images at S and -S are exactly as far.
    """
    assert set(ours) <= set(reference)
    for i in range(num_nodes):
        distances = sorted(d for key, d in reference.items() if key[0] == i)
        kept = [d for key, d in ours.items() if key[0] == i]
        assert len(kept) == min(k, len(distances)), i
        if kept:
            assert max(kept) <= distances[len(kept) - 1] + 1e-9, i


def random_batch(sizes: list[int], seed: int, box: float = 6.0,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = np.random.default_rng(seed)
    pos = generator.uniform(0.0, box, size=(sum(sizes), 3))
    batch = np.repeat(np.arange(len(sizes)), sizes)
    return torch.tensor(pos, dtype=dtype), torch.tensor(batch)


def molecule_reference(pos: torch.Tensor, batch: torch.Tensor, cutoff: float,
                       loop: bool = False) -> dict[tuple, float]:
    pairs = brute_force_edges(pos.double().numpy(), batch.numpy(), cutoff, loop)
    return {(i, j, (0, 0, 0)): d for (i, j), d in pairs.items()}


# ---------------------------------------------------------------- molecules


@pytest.mark.parametrize("max_pairs", [graph.DEFAULT_MAX_PAIRS, 50, 7, 1])
def test_molecule_batches_match_brute_force(max_pairs: int) -> None:
    pos, batch = random_batch([5, 1, 12, 0, 3, 20], seed=1)  # graph 3 has no atoms
    result = radius_graph(pos, 2.5, batch, return_vectors=True, max_pairs=max_pairs)
    assert_same_edges(our_edges(result), molecule_reference(pos, batch, 2.5))
    assert result.shift.abs().sum() == 0


def test_edge_index_convention_and_sorting() -> None:
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    edge_index = radius_graph(pos, 1.5)
    assert edge_index.tolist() == [[1, 0], [0, 1]]
    vectors = radius_graph(pos, 1.5, return_vectors=True).vec
    # vec = pos[source] - pos[target]: for target 0 the neighbour 1 lies along +x
    assert vectors.tolist() == [[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]
    pos, batch = random_batch([7, 9, 4], seed=3)
    targets = radius_graph(pos, 3.0, batch)[1]
    assert bool((targets[1:] >= targets[:-1]).all())


def test_empty_graphs_and_loops() -> None:
    # graph 1 has no atoms (batch skips it); graph 2 a single atom
    pos = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [9.0, 9, 9]], dtype=torch.float64)
    batch = torch.tensor([0, 0, 2])
    result = radius_graph(pos, 1.0, batch, loop=True, return_vectors=True)
    assert_same_edges(our_edges(result), molecule_reference(pos, batch, 1.0, loop=True))
    assert radius_graph(torch.zeros(0, 3), 1.0).shape == (2, 0)


def test_float32_positions() -> None:
    pos, batch = random_batch([10, 15], seed=4, dtype=torch.float32)
    ours = our_edges(radius_graph(pos, 2.0, batch, return_vectors=True))
    reference = molecule_reference(pos, batch, 2.0)
    assert set(ours) == set(reference)
    assert all(abs(ours[k] - reference[k]) < 1e-5 for k in reference)


def test_closest_neighbours_are_kept() -> None:
    pos, batch = random_batch([25, 18], seed=5)
    k = 4
    result = radius_graph(pos, 4.0, batch, max_num_neighbors=k, return_vectors=True)
    assert_closest_k(our_edges(result), molecule_reference(pos, batch, 4.0), len(pos), k)
    assert int(torch.bincount(result.edge_index[1]).max()) == k


def test_many_graphs_blockwise_never_dense() -> None:
    sizes = [30] * 200
    pos, batch = random_batch(sizes, seed=6, box=5.0)
    budget = 4096
    blocks = plan_blocks(sizes, None, budget)
    # every block stays within budget: nothing close to N_total^2 = 36e6 pairs
    assert max(block.num_pairs for block in blocks) <= budget
    result = radius_graph(pos, 2.0, batch, return_vectors=True, max_pairs=budget)
    assert_same_edges(our_edges(result), molecule_reference(pos, batch, 2.0))


def covered_cells(sizes: list[int], bounds: list, budget: int) -> dict[int, list]:
    """Runs the planner and returns, per graph, the (row, shift) cells it covers."""
    covered = {g: [] for g in range(len(sizes))}
    for block in plan_blocks(sizes, bounds, budget):
        # one row against one shift of a graph larger than the budget may overflow
        assert block.num_pairs <= max(budget, block.width)
        assert block.width == max(sizes[block.first:block.stop])
        for g in range(block.first, block.stop):
            own = (0, 0, 0) if bounds is None else bounds[g]
            assert all(b >= o for b, o in zip(block.bounds, own))
            covered[g].extend((row, shift) for row in range(block.row_start,
                                                            min(block.row_stop, sizes[g]))
                              for shift in range(block.shift_start, block.shift_stop))
    return covered


def test_planner_covers_rows_and_shifts_once() -> None:
    sizes = [3, 0, 40, 7, 7, 1, 100, 2]
    covered = covered_cells(sizes, None, 500)
    assert all(sorted(cells) == [(row, 0) for row in range(size)]
               for cells, size in zip(covered.values(), sizes))
    bounds = [(1, 1, 1), (0, 0, 0), (3, 3, 3), (0, 0, 0), (2, 0, 1), (1, 1, 0), (0, 0, 0),
              (4, 1, 1)]
    covered = covered_cells(sizes, bounds, 300)
    for g, size in enumerate(sizes):
        if size == 0:
            continue
        grid = len({shift for _, shift in covered[g]})
        assert sorted(covered[g]) == [(r, s) for r in range(size) for s in range(grid)]
        assert grid >= graph._blocks.grid_size(bounds[g])
    with pytest.raises(ValueError, match="max_pairs"):
        plan_blocks(sizes, None, 0)


# ---------------------------------------------------------------- periodic


def periodic_check(atoms_list: list[Atoms], cutoff: float, max_pairs: int | None = None) -> None:
    pos = torch.tensor(np.concatenate([a.positions for a in atoms_list]))
    batch = torch.tensor(np.repeat(np.arange(len(atoms_list)), [len(a) for a in atoms_list]))
    cell = torch.tensor(np.stack([a.cell.array for a in atoms_list]))
    pbc = torch.tensor(np.stack([a.pbc for a in atoms_list]))
    kwargs = {} if max_pairs is None else {"max_pairs": max_pairs}
    result = radius_graph(pos, cutoff, batch, cell=cell, pbc=pbc, return_vectors=True, **kwargs)
    reference, offset = {}, 0
    for atoms in atoms_list:
        if atoms.pbc.any():
            reference.update(ase_edges(atoms, cutoff, offset))
        else:
            local = brute_force_edges(atoms.positions, np.zeros(len(atoms), int), cutoff)
            reference.update({(i + offset, j + offset, (0, 0, 0)): d
                              for (i, j), d in local.items()})
        offset += len(atoms)
    assert_same_edges(our_edges(result), reference)


def test_tiny_cell_sees_many_images_and_itself() -> None:
    # 2 atoms in a 2 A cube, cutoff 5 A: the cutoff spans the cell 2.5 times
    atoms = Atoms("H2", positions=[[0.1, 0.2, 0.3], [1.2, 0.9, 1.4]], cell=np.eye(3) * 2.0,
                  pbc=True)
    periodic_check([atoms], 5.0)
    result = radius_graph(torch.tensor(atoms.positions), 5.0, cell=torch.tensor(atoms.cell.array),
                          return_vectors=True)
    self_images = (result.edge_index[0] == result.edge_index[1])
    assert bool(self_images.any()) and bool((result.shift[self_images].abs().sum(1) > 0).all())


@pytest.mark.parametrize("max_pairs", [graph.DEFAULT_MAX_PAIRS, 37])
def test_triclinic_and_unwrapped_positions(max_pairs: int) -> None:
    generator = np.random.default_rng(7)
    cell = np.array([[3.1, 0.0, 0.0], [1.4, 2.7, 0.0], [0.9, -0.8, 3.3]])
    positions = generator.uniform(-0.5, 1.5, size=(5, 3)) @ cell  # partly outside the cell
    positions[2] += 7 * cell[0] - 4 * cell[2]  # an atom of an unwrapped trajectory
    atoms = Atoms("CH4", positions=positions, cell=cell, pbc=True)
    primitive = bulk("Cu", "fcc", a=3.6)  # one-atom triclinic cell
    periodic_check([atoms, primitive], 4.5, max_pairs=max_pairs)


def test_mixed_pbc_and_molecules_in_one_batch() -> None:
    slab = fcc111("Al", size=(2, 2, 2), vacuum=4.0)  # pbc (True, True, False)
    slab.rattle(0.05, seed=1)
    wire = Atoms("C3", positions=[[0.0, 0.0, 0.0], [1.3, 0.2, 0.1], [2.5, -0.3, 0.4]],
                 cell=[[3.7, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
                 pbc=[True, False, False])
    molecule = Atoms("H2O", positions=[[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.2, 0.93, 0.0]])
    assert tuple(slab.pbc) == (True, True, False)
    periodic_check([slab, molecule, wire], 6.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_atoms=st.integers(1, 6),
       cutoff=st.floats(0.8, 6.0), flags=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_random_cells_match_ase(seed: int, num_atoms: int, cutoff: float,
                                flags: tuple[bool, bool, bool]) -> None:
    generator = np.random.default_rng(seed)
    cell = np.diag(generator.uniform(1.5, 5.0, size=3)) + generator.uniform(-1.0, 1.0, (3, 3))
    frac = generator.uniform(-0.3, 1.3, size=(num_atoms, 3))
    atoms = Atoms(f"H{num_atoms}", positions=frac @ cell, cell=cell, pbc=flags)
    periodic_check([atoms], cutoff, max_pairs=int(generator.integers(1, 5000)))


def test_periodic_closest_neighbours_and_loops() -> None:
    atoms = bulk("Si", "diamond", a=5.43)
    atoms.rattle(0.02, seed=3)
    pos, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    k = 6
    result = radius_graph(pos, 4.5, cell=cell, max_num_neighbors=k, return_vectors=True)
    reference = ase_edges(atoms, 4.5)
    assert_closest_k(our_edges(result), reference, len(atoms), k)
    with_loops = our_edges(radius_graph(pos, 4.5, cell=cell, loop=True, return_vectors=True))
    assert set(with_loops) - set(reference) == {(0, 0, (0, 0, 0)), (1, 1, (0, 0, 0))}


def test_shared_cell_float32_and_non_periodic_flags() -> None:
    generator = np.random.default_rng(4)
    cell = np.array([[4.0, 0.0, 0.0], [0.0, 4.5, 0.0], [0.5, 0.0, 5.0]])
    structures = [Atoms("H4", scaled_positions=generator.uniform(0, 1, (4, 3)), cell=cell,
                        pbc=True) for _ in range(3)]
    pos = torch.tensor(np.concatenate([a.positions for a in structures]), dtype=torch.float32)
    batch = torch.arange(3).repeat_interleave(4)
    result = radius_graph(pos, 4.2, batch, cell=torch.tensor(cell, dtype=torch.float32),
                          return_vectors=True)  # one [3, 3] cell for the batch, pbc default
    ours = our_edges(result)
    reference = {}
    for index, atoms in enumerate(structures):
        reference.update(ase_edges(atoms, 4.2, offset=4 * index))
    assert set(ours) == set(reference)
    assert all(abs(ours[key] - reference[key]) < 1e-4 for key in reference)
    # a cell with every axis non-periodic is ignored, even if it holds garbage
    flags = torch.zeros(3, 3, dtype=torch.bool)
    garbage = torch.full((3, 3, 3), float("nan"))
    molecules = radius_graph(pos, 4.2, batch, cell=garbage, pbc=flags, return_vectors=True)
    assert_same_edges(our_edges(molecules), molecule_reference(pos, batch, 4.2), atol=1e-5)


def test_periodic_gradients_match_finite_differences() -> None:
    generator = np.random.default_rng(8)
    cell = torch.tensor([[2.3, 0.1, 0.0], [0.3, 2.1, 0.0], [0.0, 0.2, 2.6]], dtype=torch.float64,
                        requires_grad=True)
    pos = torch.tensor(generator.uniform(0, 2, size=(3, 3)), requires_grad=True)

    def energy(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        result = radius_graph(p, 3.0, cell=c, return_vectors=True)
        # a smooth pair energy that vanishes at the cutoff, so FD does not jump
        d = result.distance
        return ((1.0 - d / 3.0) ** 3 / d).sum()

    assert torch.autograd.gradcheck(energy, (pos, cell))
    forces = -torch.autograd.grad(energy(pos, cell), pos)[0]
    step = 1e-6
    with torch.no_grad():
        for atom, axis in [(0, 0), (1, 2), (2, 1)]:
            plus, minus = pos.clone(), pos.clone()
            plus[atom, axis] += step
            minus[atom, axis] -= step
            numeric = -(energy(plus, cell) - energy(minus, cell)) / (2 * step)
            assert float(forces[atom, axis]) == pytest.approx(float(numeric), rel=1e-5, abs=1e-7)


def test_molecule_gradcheck() -> None:
    pos = torch.tensor(np.random.default_rng(9).uniform(0, 2, size=(4, 3)), requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p: radius_graph(p, 10.0, return_vectors=True).distance, (pos,))


# ---------------------------------------------------------------- errors


def test_bad_inputs_give_clear_errors() -> None:
    pos = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="sorted"):
        radius_graph(pos, 1.0, torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        radius_graph(torch.zeros(4, 2), 1.0)
    with pytest.raises(ValueError, match="positive"):
        radius_graph(pos, -1.0)
    with pytest.raises(ValueError, match="without cell"):
        radius_graph(pos, 1.0, pbc=torch.tensor([True, True, True]))
    with pytest.raises(ValueError, match="cell has 2 entries but batch refers to 4 graphs"):
        radius_graph(pos, 1.0, torch.arange(4), cell=torch.eye(3).repeat(2, 1, 1))
    with pytest.raises(ValueError, match="pbc has 2 entries but the batch has 3 graphs"):
        radius_graph(pos, 1.0, torch.tensor([0, 0, 1, 1]), cell=torch.eye(3).repeat(3, 1, 1),
                     pbc=torch.ones(2, 3, dtype=torch.bool))
    flat_cell = torch.stack([torch.eye(3) * 4, torch.tensor([[4.0, 0, 0], [8.0, 0, 0], [0, 0, 4]])])
    with pytest.raises(ValueError, match="graph 1: .* linearly dependent"):
        radius_graph(pos, 1.0, torch.tensor([0, 0, 1, 1]), cell=flat_cell)
    with pytest.raises(ValueError, match="backend"):
        radius_graph(pos, 1.0, backend="cuda")


# ---------------------------------------------------------------- backends


def test_pure_torch_path_without_torch_cluster() -> None:
    # torch_cluster is not a dependency; the pure-torch path must serve "auto"
    radius_module._torch_cluster.cache_clear()
    assert graph.torch_cluster_available() is False
    pos, batch = random_batch([8, 11], seed=10)
    assert_same_edges(our_edges(radius_graph(pos, 3.0, batch, return_vectors=True)),
                      molecule_reference(pos, batch, 3.0))
    with pytest.raises(ImportError, match="torch_cluster is not installed"):
        radius_graph(pos, 3.0, batch, backend="torch_cluster")


def test_torch_cluster_is_used_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stand-in extension module (brute force) proves the dispatch: it is used
    # for molecules and bypassed for periodic graphs; results stay identical.
    calls = []

    def fake_radius_graph(x, r, batch=None, loop=False, max_num_neighbors=32,
                          flow="source_to_target"):
        calls.append(max_num_neighbors)
        pairs = brute_force_edges(x.numpy(), batch.numpy(), r, loop)
        return torch.tensor([[j for _, j in pairs], [i for i, _ in pairs]], dtype=torch.int64)

    module = types.ModuleType("torch_cluster")
    module.radius_graph = fake_radius_graph
    monkeypatch.setitem(sys.modules, "torch_cluster", module)
    radius_module._torch_cluster.cache_clear()
    try:
        pos, batch = random_batch([6, 9], seed=11)
        result = radius_graph(pos, 3.0, batch, max_num_neighbors=3, return_vectors=True)
        assert calls == [9]  # asked for all neighbours; closest-k applied by us
        expected = radius_graph(pos, 3.0, batch, max_num_neighbors=3, return_vectors=True,
                                backend="torch")
        assert our_edges(result).keys() == our_edges(expected).keys()
        radius_graph(pos, 3.0, batch, cell=torch.eye(3) * 5.0)
        assert calls == [9]
    finally:
        radius_module._torch_cluster.cache_clear()


# ---------------------------------------------------------------- SchNet


def aspirin_like_batch(num_graphs: int, seed: int) -> Batch:
    generator = np.random.default_rng(seed)
    z = torch.tensor([6] * 9 + [8] * 4 + [1] * 8)
    graphs = []
    for _ in range(num_graphs):
        pos = generator.normal(scale=1.6, size=(21, 3))
        graphs.append(Data(z=z, pos=torch.tensor(pos, dtype=torch.float32)))
    return Batch.from_data_list(graphs)


def test_schnet_md17_configuration_trains() -> None:
    torch.manual_seed(0)
    model = SchNet(hidden_channels=128, num_filters=128, num_interactions=6, num_gaussians=50,
                   cutoff=10.0, interaction_graph=InteractionGraph(cutoff=10.0))
    data = aspirin_like_batch(8, seed=12)
    pos = data.pos.requires_grad_(True)
    energy = model(data.z, pos, data.batch)
    forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
    assert energy.shape == (8, 1) and forces.shape == (8 * 21, 3)
    loss = energy.square().mean() + forces.square().mean()
    loss.backward()
    gradients = [p.grad for p in model.parameters() if p.grad is not None]
    assert gradients and all(bool(torch.isfinite(g).all()) for g in gradients)
    assert any(float(g.abs().sum()) > 0 for g in gradients)


def test_schnet_forces_match_finite_differences() -> None:
    torch.manual_seed(1)
    model = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, num_gaussians=10,
                   cutoff=4.0, interaction_graph=InteractionGraph(cutoff=4.0)).double()
    data = aspirin_like_batch(2, seed=13)
    pos = data.pos.double().requires_grad_(True)

    def energy(p: torch.Tensor) -> torch.Tensor:
        return model(data.z, p, data.batch).sum()

    forces = -torch.autograd.grad(energy(pos), pos)[0]
    step = 1e-5
    with torch.no_grad():
        for atom, axis in [(0, 0), (5, 1), (30, 2)]:
            plus, minus = pos.clone(), pos.clone()
            plus[atom, axis] += step
            minus[atom, axis] -= step
            numeric = -(energy(plus) - energy(minus)) / (2 * step)
            assert float(forces[atom, axis]) == pytest.approx(float(numeric), rel=1e-4, abs=1e-6)


def test_periodic_schnet_is_invariant_to_wrapping() -> None:
    torch.manual_seed(2)
    schnet = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, num_gaussians=10,
                    cutoff=5.0, interaction_graph=InteractionGraph(cutoff=5.0)).double()
    model = SchNetWithGraph(schnet)
    crystal = bulk("NaCl", "rocksalt", a=5.6) * (1, 1, 1)
    cell = torch.tensor(crystal.cell.array).unsqueeze(0)
    positions = torch.tensor(crystal.positions)
    moved = positions.clone()
    moved[1] += cell[0, 0] - 2 * cell[0, 2]  # the same crystal, one atom in another cell
    z = torch.tensor(crystal.numbers)
    pbc = torch.ones(1, 3, dtype=torch.bool)
    a = Batch.from_data_list([Data(z=z, pos=positions, cell=cell, pbc=pbc),
                              Data(z=z, pos=moved, cell=cell, pbc=pbc)])
    energies = model(a).detach()
    assert energies.shape == (2, 1)
    assert float(energies[0]) == pytest.approx(float(energies[1]), rel=1e-10)
    # the same atoms without periodicity is a different system
    molecule = Batch.from_data_list([Data(z=z, pos=positions)])
    assert model(molecule).item() != pytest.approx(float(energies[0]), rel=1e-3)
    # and a fixed cell on the graph gives the same as the per-batch cell
    fixed = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, num_gaussians=10,
                   cutoff=5.0, interaction_graph=InteractionGraph(5.0, cell=cell[0])).double()
    fixed.load_state_dict(schnet.state_dict())
    assert fixed(z, positions).item() == pytest.approx(float(energies[0]), rel=1e-12)


def test_schnet_with_graph_needs_interaction_graph() -> None:
    with pytest.raises(TypeError, match="InteractionGraph"):
        SchNetWithGraph(SchNet(cutoff=5.0))
