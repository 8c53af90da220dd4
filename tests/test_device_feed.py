"""Batches handed out on the device: ``DeviceFeeder`` and the loaders' ``device=`` option.

On a CUDA machine every test runs on the GPU (side stream, pinned memory, events); on a
CPU the same code paths run with the CPU device: the one-ahead order, the values, the
transform on the device, the neighbour graph found ahead of the forward pass, and exact
resume through ``state_dict`` while one batch is always drawn ahead. Loaders use real
DataLoader workers and real shards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk
from torch_geometric.data import Batch, Data
from torch_geometric.nn.models import SchNet

from pyg_atompack import AtompackDataset, AtompackLoader, ShardStreamDataset, atp, convert
from pyg_atompack.graph import InteractionGraph, NeighbourTransform, SchNetWithGraph
from pyg_atompack.pyg.device import DeviceFeeder
from pyg_atompack.pyg.resume import StatefulLoader

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
N_MOLECULES = 23


def write_atp(path: Path, count: int = N_MOLECULES) -> Path:
    rng = np.random.default_rng(0)
    with atp.Writer(path) as writer:
        for i in range(count):
            n = 3 + i % 4
            writer.add(rng.normal(scale=1.5, size=(n, 3)).astype(np.float32),
                       rng.integers(1, 10, n).astype(np.uint8), energy=float(i),
                       properties={"sample_id": i})
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("feed")
    path = write_atp(root / "train.atp")
    convert.shard(path, root / "shards", 5)
    return {"atp": path, "shards": root / "shards"}


def ids(batch: Batch) -> list[int]:
    assert batch.pos.device.type == DEVICE.type
    return batch.sample_id.view(-1).tolist()


class Recording:
    """An iterable that logs when each item is drawn, relative to what the consumer holds."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.drawn: list[int] = []

    def __iter__(self):
        for index in range(self.count):
            self.drawn.append(index)
            yield Data(pos=torch.full((2, 3), float(index)), index=torch.tensor([index]))


def test_feeder_draws_exactly_one_batch_ahead_and_keeps_order() -> None:
    source = Recording(5)
    feeder = DeviceFeeder(source, DEVICE, snapshot=lambda: len(source.drawn))
    seen = []
    for batch in feeder:
        index = int(batch.index)
        seen.append(index)
        assert batch.pos.device.type == DEVICE.type
        assert float(batch.pos[0, 0]) == index
        # while the consumer holds batch k, batch k + 1 (and no further) has been drawn
        assert source.drawn == list(range(min(index + 2, 5)))
        # the state is the loader's right after drawing the batch held, not the one ahead
        assert feeder.state == (index + 1 if index < 4 else 5)
    assert seen == [0, 1, 2, 3, 4]
    assert list(DeviceFeeder([], DEVICE)) == []
    assert feeder.uses_stream == (DEVICE.type == "cuda")


def test_feeder_moves_nested_items_and_runs_the_transform_on_the_device() -> None:
    on_device = []

    def transform(item):
        on_device.append(item["x"].device.type)
        return {**item, "double": item["x"] * 2}

    items = [{"x": torch.arange(3.0) + k, "pair": (torch.ones(1), "label")} for k in range(3)]
    out = list(DeviceFeeder(items, DEVICE, transform=transform))
    assert on_device == [DEVICE.type] * 3
    for k, item in enumerate(out):
        assert item["pair"][1] == "label" and item["pair"][0].device.type == DEVICE.type
        torch.testing.assert_close(item["double"].cpu(), (torch.arange(3.0) + k) * 2)


def test_bad_device_options_are_named() -> None:
    with pytest.raises(ValueError, match="device_transform needs device="):
        StatefulLoader([Data(pos=torch.zeros(1, 3))], device_transform=lambda b: b)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda'.*no CUDA device"):
            DeviceFeeder([], "cuda")


def schnet(cutoff: float = 4.0, dtype: torch.dtype = torch.float64) -> SchNetWithGraph:
    torch.manual_seed(0)
    model = SchNet(hidden_channels=16, num_filters=16, num_interactions=2, num_gaussians=10,
                   cutoff=cutoff, interaction_graph=InteractionGraph(cutoff, 6))
    return SchNetWithGraph(model.to(dtype)).to(DEVICE)


def energy_and_forces(model: SchNetWithGraph, batch: Batch) -> tuple[torch.Tensor, ...]:
    batch.pos.requires_grad_(True)
    cell = getattr(batch, "cell", None)
    if cell is not None:
        cell.requires_grad_(True)
    energy = model(batch).sum()
    wrt = [batch.pos] + ([cell] if cell is not None else [])
    return (energy.detach(), *torch.autograd.grad(energy, wrt))


@pytest.mark.parametrize("periodic", [False, True])
def test_graph_built_ahead_gives_the_same_energy_forces_and_stress(periodic: bool) -> None:
    rng = np.random.default_rng(4)
    graphs = []
    for k in range(3):
        if periodic:
            crystal = bulk("Cu", "fcc", a=3.6 + 0.1 * k).repeat((2, 1, 1))
            crystal.rattle(0.05, seed=k)
            graphs.append(Data(z=torch.tensor(crystal.numbers), pos=torch.tensor(crystal.positions),
                               cell=torch.tensor(np.asarray(crystal.cell)).unsqueeze(0),
                               pbc=torch.tensor([[True, True, True]])))
        else:
            n = 5 + k
            graphs.append(Data(z=torch.tensor(rng.integers(1, 9, n)),
                               pos=torch.tensor(rng.normal(scale=1.5, size=(n, 3)))))
    model = schnet()
    transform = model.model.interaction_graph.transform()
    assert isinstance(transform, NeighbourTransform) and transform.max_num_neighbors == 6

    def fresh() -> list[Batch]:
        return [Batch.from_data_list([g.clone() for g in graphs])]

    (ahead,) = list(DeviceFeeder(fresh(), DEVICE, transform=transform))
    assert ahead.edge_index.device.type == DEVICE.type and ahead.edge_shift.shape[1] == 3
    assert bool((ahead.edge_shift != 0).any()) == periodic
    (plain,) = list(DeviceFeeder(fresh(), DEVICE))
    assert "edge_index" not in plain
    for expected, got in zip(energy_and_forces(model, plain), energy_and_forces(model, ahead)):
        torch.testing.assert_close(got, expected)


def remaining_after_resume(make_loader, stop_after: int) -> tuple[list[int], list[int], list]:
    """The full pass, and the head + tail of a pass interrupted and resumed in a new loader."""
    full = [sample for batch in make_loader() for sample in ids(batch)]
    first = make_loader()
    head, iterator = [], iter(first)
    for _ in range(stop_after):
        head += ids(next(iterator))
    state = first.state_dict()
    del iterator
    second = make_loader()
    second.load_state_dict(state)
    tail = [sample for batch in second for sample in ids(batch)]
    return full, head, tail


@pytest.mark.parametrize("workers", [0, 2])
def test_atompack_loader_on_the_device_resumes_exactly(files: dict, workers: int) -> None:
    def make() -> AtompackLoader:
        return AtompackLoader(AtompackDataset(files["atp"]), batch_size=4, shuffle=True,
                              seed=3, num_workers=workers, device=DEVICE,
                              pin_memory=DEVICE.type == "cuda")

    full, head, tail = remaining_after_resume(make, stop_after=2)
    assert sorted(full) == list(range(N_MOLECULES)) and full != sorted(full)
    assert head + tail == full


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_loader_over_a_stream_on_the_device_resumes_exactly(files: dict,
                                                                    workers: int) -> None:
    def make() -> StatefulLoader:
        stream = ShardStreamDataset(files["shards"], shuffle=True, seed=5)
        return StatefulLoader(stream, batch_size=3, num_workers=workers, device=DEVICE)

    full, head, tail = remaining_after_resume(make, stop_after=3)
    assert sorted(full) == list(range(N_MOLECULES))
    assert head + tail == full


def test_stream_iteration_on_the_device_resumes_exactly_and_builds_graphs(files: dict) -> None:
    model = schnet(cutoff=3.0, dtype=torch.float32)

    def make() -> ShardStreamDataset:
        return ShardStreamDataset(files["shards"], shuffle=True, seed=7, batch_size=4,
                                  device=DEVICE,
                                  device_transform=model.model.interaction_graph.transform())

    full, head, tail = remaining_after_resume(make, stop_after=2)
    assert sorted(full) == list(range(N_MOLECULES))
    assert head + tail == full
    batch = next(iter(make()))
    assert batch.edge_index.device.type == DEVICE.type
    energy, forces = energy_and_forces(model, batch)
    assert forces.shape == batch.pos.shape and bool(torch.isfinite(forces).all())


def test_stream_device_option_behind_workers_is_refused_by_name(files: dict) -> None:
    stream = ShardStreamDataset(files["shards"], batch_size=4, device=DEVICE)
    loader = StatefulLoader(stream, batch_size=None, num_workers=1)
    with pytest.raises(ValueError, match="pass device= to the loader"):
        next(iter(loader))
