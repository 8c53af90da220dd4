"""Read-side names: ``rename=`` and ``names="pyg-md17"`` on every dataset, so a training
script written for ``torch_geometric.datasets.MD17`` (``data.force``, float32 energy)
runs unchanged on data converted from PyG's own ``MD17.process()`` output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch
from torch_geometric.datasets import MD17
from torch_geometric.loader import DataLoader
from torch_geometric.nn.models import SchNet

from pyg_atompack import (
    AtompackDataset,
    AtompackLoader,
    MemmapDataset,
    ShardStreamDataset,
    SourceOptions,
)
from pyg_atompack.convert import ConversionNote, WriteOptions, convert
from pyg_atompack.graph import InteractionGraph
from pyg_atompack.pyg import FieldSelectionError, resolve_names
from pyg_atompack.stream import LocalSource


@pytest.fixture(scope="module")
def md17(tmp_path_factory):
    """PyG's real ``MD17.process()`` on a small raw file in its own (sGDML npz) format."""
    root = tmp_path_factory.mktemp("md17")
    rng = np.random.default_rng(3)
    raw = root / "aspirin" / "raw"
    raw.mkdir(parents=True)
    frames, z = 7, np.array([6, 6, 8, 1, 1], dtype=np.int64)
    np.savez(raw / "md17_aspirin.npz", z=z,
             R=rng.normal(size=(frames, 5, 3)) * 1.2, E=rng.normal(size=(frames, 1)) - 4e5,
             F=rng.normal(size=(frames, 5, 3)) * 30)

    def no_download(self):
        raise AssertionError("the raw file is in place: MD17 must not download")

    original = MD17.download
    MD17.download = no_download
    try:
        dataset = MD17(str(root), "aspirin")
    finally:
        MD17.download = original
    assert len(dataset) == frames and dataset[0].force.shape == (5, 3)
    return root, dataset


@pytest.fixture(scope="module")
def converted(md17, tmp_path_factory):
    root, dataset = md17
    out = tmp_path_factory.mktemp("converted")
    processed = root / "aspirin" / "processed" / "data.pt"
    with pytest.warns(ConversionNote, match="name their forces 'force'.*stored as 'forces'"):
        convert(processed, out / "md17.atp")
    convert(out / "md17.atp", out / "shards", write_options=WriteOptions(shard_size=3))
    convert(out / "md17.atp", out / "memmap", dst_format="memmap")
    return out


def _assert_like_md17(data, reference, *, float32_everything: bool = False) -> None:
    assert "forces" not in data and data.force.shape == reference.force.shape
    assert data.energy.dtype == torch.float32 == reference.energy.dtype
    assert torch.equal(data.energy, reference.energy)
    assert torch.equal(data.force.to(reference.force.dtype), reference.force)
    assert torch.equal(data.z, reference.z)
    assert torch.equal(data.pos.to(reference.pos.dtype), reference.pos)


def _md17_training_step(model, optimizer, batch) -> float:
    """The training step of a script written for torch_geometric.datasets.MD17."""
    pos = batch.pos.detach().float().requires_grad_(True)
    energy = model(batch.z, pos, batch.batch).view(-1)
    force = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
    loss = torch.nn.functional.mse_loss(energy, batch.energy.view(-1)) + \
        torch.nn.functional.mse_loss(force, batch.force)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def _model():
    torch.manual_seed(0)
    return SchNet(hidden_channels=16, num_filters=16, num_interactions=1, num_gaussians=8,
                  cutoff=5.0, interaction_graph=InteractionGraph(cutoff=5.0))


def test_every_dataset_gives_md17_names_and_a_force_training_step_runs(md17, converted):
    _, reference = md17
    atompack = AtompackDataset(converted / "md17.atp", names="pyg-md17")
    memmap = MemmapDataset(converted / "memmap", names="pyg-md17")
    for dataset in (atompack, memmap):
        assert len(dataset) == len(reference)
        for i in range(len(reference)):
            _assert_like_md17(dataset[i], reference[i])

    stream = ShardStreamDataset(LocalSource(converted / "shards"),
                                options=SourceOptions(names="pyg-md17"), batch_size=3, prefetch=0)
    streamed = [b for b in stream]
    assert [b.num_graphs for b in streamed] == [3, 3, 1]
    for i, data in enumerate(d for b in streamed for d in b.to_data_list()):
        _assert_like_md17(data, reference[i])

    loaders = {
        "AtompackLoader": AtompackLoader(atompack, batch_size=4),
        "DataLoader(MemmapDataset)": DataLoader(memmap, batch_size=4),
        "ShardStreamDataset": streamed,
    }
    for name, loader in loaders.items():
        model = _model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        batch = next(iter(loader))
        before = [p.detach().clone() for p in model.parameters()]
        loss = _md17_training_step(model, optimizer, batch)
        assert np.isfinite(loss), name
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), name


def test_loader_batches_match_pyg_collation_with_renames(converted):
    dataset = AtompackDataset(converted / "md17.atp", names="pyg-md17")
    loader = AtompackLoader(dataset, batch_size=3, follow_batch=["force"])
    fast = next(iter(loader))
    slow = Batch.from_data_list([dataset[i] for i in range(3)], follow_batch=["force"])
    assert set(fast.keys()) == set(slow.keys())
    for key, value in slow.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fast[key], value), key
    assert torch.equal(fast.to_data_list()[1].force, dataset[1].force)
    assert "forces_batch" not in fast and "force_batch" in fast

    # the loader's own rename applies on top; exclude_keys use the final names
    loader = AtompackLoader(dataset, batch_size=2, rename={"force": "F"}, exclude_keys=["pos"])
    batch = next(iter(loader))
    assert "F" in batch and "force" not in batch and "pos" not in batch
    assert torch.equal(batch.F[: dataset[0].num_nodes], dataset[0].force)
    # fields= and transforms see the renamed attributes
    selected = AtompackDataset(converted / "md17.atp", fields=["force"],
                               rename={"forces": "force"}, transform=lambda d: d)
    assert "force" in selected[0] and "energy" not in selected[0]
    assert selected[0].force.shape == (5, 3)
    batch = next(iter(AtompackLoader(selected, batch_size=2, rename={"force": "F"})))
    assert "F" in batch and "force" not in batch


def test_bad_renames_are_refused():
    with pytest.raises(FieldSelectionError, match="unknown names preset"):
        resolve_names(names="pyg-qm9000")
    with pytest.raises(FieldSelectionError, match="would hide the attribute"):
        resolve_names(rename={"forces": "pos"})
    with pytest.raises(FieldSelectionError, match="the same name"):
        resolve_names(rename={"forces": "f", "stress": "f"})
    assert resolve_names() is None
