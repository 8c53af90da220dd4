"""The neighbour-search backends of :func:`pyg_atompack.graph.radius_graph` agree.

``vesin-torch`` (cell lists, a dependency) against the project's padded pure-torch search
and ASE's neighbour list, on molecules, tiny and triclinic cells, unwrapped positions,
slabs and mixed batches; the ``auto`` rule; the pure-torch fallback when ``vesin`` is
missing. Edge sets are compared as ``{(target, source, shift): distance}``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, fcc111
from ase.neighborlist import neighbor_list

from pyg_atompack.graph import _vesin as vesin_backend
from pyg_atompack.graph import radius_graph

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def edges(result) -> dict[tuple, float]:
    source, target = result.edge_index.tolist()
    found = {}
    for j, i, shift, d in zip(source, target, result.shift.tolist(),
                              result.distance.detach().tolist()):
        key = (i, j, tuple(shift))
        assert key not in found, f"duplicate edge {key}"
        found[key] = d
    return found


def assert_same(ours: dict, reference: dict, atol: float = 1e-6) -> None:
    assert ours.keys() == reference.keys(), (
        f"missing {sorted(set(reference) - set(ours))[:3]}, "
        f"extra {sorted(set(ours) - set(reference))[:3]}")
    for key, distance in reference.items():
        assert ours[key] == pytest.approx(distance, abs=atol), key


def ase_reference(structures: list[Atoms], cutoff: float) -> dict[tuple, float]:
    reference, offset = {}, 0
    for atoms in structures:
        i, j, shifts, distances = neighbor_list("ijSd", atoms, cutoff)
        reference.update({(int(a) + offset, int(b) + offset, tuple(int(s) for s in shift)):
                          float(d) for a, b, shift, d in zip(i, j, shifts, distances)})
        offset += len(atoms)
    return reference


def both(pos, cutoff, batch=None, **kwargs) -> tuple[dict, dict]:
    vesin = radius_graph(pos, cutoff, batch, return_vectors=True, backend="vesin", **kwargs)
    torch_ = radius_graph(pos, cutoff, batch, return_vectors=True, backend="torch", **kwargs)
    assert torch.equal(vesin.edge_index[1], torch.sort(vesin.edge_index[1]).values)
    return edges(vesin), edges(torch_)


@pytest.mark.parametrize("sizes", [[21], [20, 64, 1, 300], [5, 0, 7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_molecules_match_the_padded_search(sizes: list[int], dtype: torch.dtype) -> None:
    generator = np.random.default_rng(sum(sizes))
    pos = torch.tensor(generator.normal(scale=2.5, size=(sum(sizes), 3)), dtype=dtype)
    batch = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    ours, padded = both(pos, 4.0, batch, cell=None)
    assert ours  # the clouds are dense enough to have edges
    assert_same(ours, padded, atol=1e-4 if dtype == torch.float32 else 1e-9)


def test_periodic_cases_match_ase() -> None:
    generator = np.random.default_rng(3)
    tiny = Atoms("Cu", positions=[[0.1, 0.2, 0.3]], cell=np.eye(3) * 2.0, pbc=True)
    triclinic = Atoms("H8", positions=generator.uniform(-4, 12, size=(8, 3)),  # unwrapped
                      cell=[[4.0, 0, 0], [1.3, 3.7, 0], [0.4, 0.9, 4.4]], pbc=True)
    slab = fcc111("Al", size=(2, 2, 3), vacuum=5.0)  # pbc = [True, True, False]
    bare_slab = fcc111("Cu", size=(2, 2, 2))
    bare_slab.cell[2] = 0.0  # no third vector at all
    crystal = bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 2, 2))  # 64 atoms
    molecule = Atoms("H4", positions=generator.normal(scale=1.0, size=(4, 3)),
                     cell=np.zeros((3, 3)), pbc=False)
    structures = [tiny, triclinic, slab, bare_slab, crystal, molecule]
    pos = torch.tensor(np.concatenate([a.positions for a in structures]))
    batch = torch.arange(len(structures)).repeat_interleave(
        torch.tensor([len(a) for a in structures]))
    cell = torch.tensor(np.stack([np.asarray(a.cell) for a in structures]))
    pbc = torch.tensor(np.stack([a.pbc for a in structures]))
    ours, padded = both(pos, 4.5, batch, cell=cell, pbc=pbc)
    reference = ase_reference(structures, 4.5)
    assert_same(ours, reference)
    assert_same(padded, reference)
    assert (0, 0, (1, 0, 0)) in ours  # the tiny cell's atom sees its own image


def test_loops_and_closest_neighbours_match() -> None:
    crystal = bulk("NaCl", "rocksalt", a=5.64).repeat((2, 2, 2))
    pos = torch.tensor(crystal.positions)
    cell = torch.tensor(np.asarray(crystal.cell))
    ours, padded = both(pos, 6.0, cell=cell, loop=True)
    assert (0, 0, (0, 0, 0)) in ours
    assert_same(ours, padded)
    limited = radius_graph(pos, 6.0, cell=cell, max_num_neighbors=6, return_vectors=True,
                           backend="vesin")
    degree = torch.bincount(limited.edge_index[1], minlength=len(pos))
    assert bool((degree == 6).all())
    assert float(limited.distance.max()) == pytest.approx(5.64 / 2, abs=1e-9)  # the 6 nearest


def test_gradients_flow_through_vesin_edges() -> None:
    crystal = bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2))
    pos = torch.tensor(crystal.positions, requires_grad=True)
    cell = torch.tensor(np.asarray(crystal.cell), requires_grad=True)
    for backend in ("vesin", "torch"):
        graph = radius_graph(pos, 4.0, cell=cell, return_vectors=True, backend=backend)
        energy = (graph.distance - 2.5).square().sum()
        grad_pos, grad_cell = torch.autograd.grad(energy, [pos, cell])
        if backend == "vesin":
            first = (grad_pos, grad_cell)
    torch.testing.assert_close(first[0], grad_pos)
    torch.testing.assert_close(first[1], grad_cell)
    assert float(first[1].abs().sum()) > 0  # the cell gets gradients: strain reaches energy


def test_auto_rule_and_fallback_without_vesin(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = vesin_backend.vesin_pairs

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    from pyg_atompack.graph import radius as radius_module
    monkeypatch.setattr(radius_module, "vesin_pairs", counting)
    generator = np.random.default_rng(5)
    small = torch.tensor(generator.normal(scale=2.0, size=(2 * 20, 3)))
    small_batch = torch.arange(2).repeat_interleave(20)
    radius_graph(small, 4.0, small_batch)
    assert calls == []  # small molecules: the padded search
    big = torch.tensor(generator.normal(scale=6.0, size=(700, 3)))
    radius_graph(big, 4.0)
    assert calls == [1]  # a large molecule: vesin
    radius_graph(small, 4.0, small_batch, cell=torch.eye(3) * 9.0)
    assert calls == [1]  # a batch of small cells: the padded search
    radius_graph(small[:20], 4.0, cell=torch.eye(3) * 9.0)
    assert calls == [1, 1]  # one cell alone: vesin
    radius_graph(big[:300], 4.0, torch.arange(2).repeat_interleave(150),
                 cell=torch.eye(3) * 30.0)
    assert calls == [1, 1, 2]  # a batch of 150-atom cells: vesin
    expected = radius_graph(big, 4.0, return_vectors=True)
    assert calls == [1, 1, 2, 1]

    monkeypatch.setattr(vesin_backend, "vesin_module", lambda: None)
    monkeypatch.setattr(radius_module, "vesin_module", lambda: None)
    fallback = radius_graph(big, 4.0, return_vectors=True)
    assert calls == [1, 1, 2, 1]  # without vesin, auto is the padded search
    assert_same(edges(fallback), edges(expected))
    with pytest.raises(ImportError, match="vesin-torch is not installed"):
        radius_graph(big, 4.0, backend="vesin")


def test_vesin_is_installed() -> None:
    # a dependency (pyproject.toml): "auto" would silently fall back without it
    assert vesin_backend.vesin_module() is not None


@pytest.mark.parametrize("backend", ["vesin", "torch"])
def test_search_on_the_compute_device_matches_cpu(backend: str) -> None:
    # on a CUDA machine the search runs on the GPU; elsewhere the same calls on the CPU
    crystal = bulk("Si", "diamond", a=5.43, cubic=True).repeat((2, 2, 2))
    molecule = np.random.default_rng(8).normal(scale=3.0, size=(150, 3))
    pos = torch.tensor(np.concatenate([crystal.positions, molecule]))
    batch = torch.tensor([0] * len(crystal) + [1] * len(molecule))
    cell = torch.tensor(np.stack([np.asarray(crystal.cell), np.zeros((3, 3))]))
    pbc = torch.tensor([[True] * 3, [False] * 3])
    on_cpu = edges(radius_graph(pos, 5.0, batch, cell=cell, pbc=pbc, return_vectors=True,
                                backend="torch"))
    on_device = radius_graph(pos.to(DEVICE), 5.0, batch.to(DEVICE), cell=cell.to(DEVICE),
                             pbc=pbc.to(DEVICE), return_vectors=True, backend=backend)
    assert on_device.edge_index.device.type == DEVICE
    assert_same(edges(on_device), on_cpu)


def test_threads_searching_at_once_get_their_own_results() -> None:
    # a read-ahead thread's transform and the model's forward may search at the same time
    import threading

    crystals = [bulk("Cu", "fcc", a=3.5 + 0.05 * k).repeat((3, 3, 3)) for k in range(4)]
    inputs = [(torch.tensor(c.positions), torch.tensor(np.asarray(c.cell))) for c in crystals]
    expected = [edges(radius_graph(p, 5.0, cell=c, return_vectors=True, backend="torch"))
                for p, c in inputs]
    found: dict[int, list] = {k: [] for k in range(4)}

    def search(k: int) -> None:
        for _ in range(5):
            pos, cell = inputs[k]
            found[k].append(edges(radius_graph(pos, 5.0, cell=cell, return_vectors=True,
                                               backend="vesin")))

    threads = [threading.Thread(target=search, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k in range(4):
        assert len(found[k]) == 5
        for result in found[k]:
            assert_same(result, expected[k])
