"""Batches leaving DataLoader workers through a shared-memory arena (pyg.arena, pyg.handoff)."""

from __future__ import annotations

import gc
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch, Data

from pyg_atompack import AtompackDataset, AtompackLoader, atp
from pyg_atompack.data import loader as loader_module
from pyg_atompack.pyg import handoff
from pyg_atompack.pyg.arena import CHUNK_BYTES, Arena, arenas_for_children


def _write(path, molecules: int = 96, atoms: int = 40):
    rng = np.random.default_rng(3)
    with atp.Writer(path, compression="none") as writer:
        writer.add_batch(rng.normal(size=(molecules, atoms, 3)).astype(np.float32),
                         rng.integers(1, 10, (molecules, atoms)).astype(np.uint8),
                         energy=np.arange(molecules, dtype=np.float64),
                         forces=rng.normal(size=(molecules, atoms, 3)).astype(np.float32))
    return path


def _same(left: Batch, right: Batch) -> None:
    assert type(left) is type(right) and sorted(left.keys()) == sorted(right.keys())
    for key, value in left:
        assert value.dtype == right[key].dtype and torch.equal(value, right[key]), key
    assert left._slice_dict.keys() == right._slice_dict.keys()
    for key in left._slice_dict:
        assert torch.equal(left._slice_dict[key], right._slice_dict[key])
        assert torch.equal(left._inc_dict[key], right._inc_dict[key])


def test_arena_lends_runs_of_chunks_and_takes_them_back_when_views_die():
    arena = Arena(4 * CHUNK_BYTES)
    first = arena.allocate(CHUNK_BYTES + 1)  # two chunks
    second = arena.allocate(10)
    assert (first, second) == (0, 2) and arena.busy_chunks() == 3
    assert arena.allocate(2 * CHUNK_BYTES) is None  # one chunk left
    arena.writable(first, 8).copy_(torch.arange(8, dtype=torch.uint8))
    claimed = arena.claim(first, CHUNK_BYTES + 1)
    view = claimed[4:8].view(torch.int32)
    del claimed
    assert arena.busy_chunks() == 3  # a view still holds the storage
    assert view.tolist() == [int.from_bytes(bytes([4, 5, 6, 7]), "little")]
    del view
    assert arena.busy_chunks() == 1  # only `second` is left
    arena.give_back(second, 10)
    assert arena.busy_chunks() == 0
    assert arena.allocate(5 * CHUNK_BYTES) is None  # larger than the arena


def test_a_packed_batch_rebuilds_cheaply_and_equal_through_an_arena(tmp_path):
    dataset = AtompackDataset(_write(tmp_path / "m.atp"))
    batch = next(iter(AtompackLoader(dataset, batch_size=32)))
    arena = Arena(1 << 20)
    handoff.install()  # this test process pickles as a worker would
    try:
        handoff.use_arena(arena)
        shared = ForkingPickler.dumps(batch)
        assert len(shared) < 8 << 10  # the bytes stay in the arena
        handoff.use_arena(None)
        inline = ForkingPickler.dumps(batch)
        assert len(inline) > 32 * 40 * 12
    finally:
        handoff.use_arena(None)
        for cls in (Data, type(batch)):
            ForkingPickler._extra_reducers.pop(cls, None)
        handoff._installed_in = None
    backs = [pickle.loads(raw) for raw in (shared, inline)]
    for back in backs:
        _same(batch, back)
        assert back.to_data_list()[5].energy == batch.to_data_list()[5].energy
    assert arena.busy_chunks() > 0
    del backs, back
    gc.collect()
    assert arena.busy_chunks() == 0


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_batches_come_through_the_arenas_and_give_them_back(tmp_path, persistent):
    dataset = AtompackDataset(_write(tmp_path / "m.atp"))
    reference = list(AtompackLoader(dataset, batch_size=16))
    loader = AtompackLoader(dataset, batch_size=16, num_workers=2,
                            persistent_workers=persistent)
    for _ in range(2):  # a second pass: the same arenas, or new ones for new workers
        batches = list(loader)
        arenas = loader.dataset.arenas
        assert arenas is not None and len(arenas) == 2
        assert sum(a.busy_chunks() for a in arenas) == len(batches)  # one chunk each
        for mine, theirs in zip(batches, reference, strict=True):
            _same(mine, theirs)
        del batches, mine
        gc.collect()
        assert sum(a.busy_chunks() for a in arenas) == 0


def test_a_full_arena_sends_through_the_pipe_and_nothing_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "arenas_for_children",
                        lambda count, context: arenas_for_children(count, context,
                                                                   size=2 * CHUNK_BYTES))
    dataset = AtompackDataset(_write(tmp_path / "m.atp"))
    reference = list(AtompackLoader(dataset, batch_size=16))
    kept = list(AtompackLoader(dataset, batch_size=16, num_workers=2))  # all kept alive
    assert len(kept) == len(reference) == 6
    for mine, theirs in zip(kept, reference, strict=True):
        _same(mine, theirs)


def test_spawned_workers_get_no_arena_and_still_deliver(tmp_path):
    dataset = AtompackDataset(_write(tmp_path / "m.atp", molecules=32))
    reference = list(AtompackLoader(dataset, batch_size=16))
    loader = AtompackLoader(dataset, batch_size=16, num_workers=1,
                            multiprocessing_context="spawn")
    batches = list(loader)
    assert loader.dataset.arenas is None
    for mine, theirs in zip(batches, reference, strict=True):
        _same(mine, theirs)
