"""Several batches per DataLoader item (pyg.bundle): same batches, same order, exact resume.

Real DataLoader workers (forked, with their arenas) hand over bundles of consecutive
batches; every test compares with the in-process loader built the same way.
"""

from __future__ import annotations

import gc
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from groups_fixtures import plain_file, write_framed
from test_groups_pyg import ADSORPTION
from test_offproc_handoff import _same, _write
from torch_geometric.data import Batch

from pyg_atompack import AtompackDataset, AtompackLoader, atp
from pyg_atompack.atp.groups import encode_groups
from pyg_atompack.data import AtompackGroupDataset
from pyg_atompack.pyg import handoff
from pyg_atompack.pyg.arena import Arena
from pyg_atompack.pyg.bundle import BatchBundle, BundleSampler, _PlainLayout, bundle_size


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> AtompackDataset:
    return AtompackDataset(_write(tmp_path_factory.mktemp("bundles") / "m.atp",
                                  molecules=90))


def _equal(left: Batch, right: Batch) -> None:
    """``_same`` for batches that may carry non-tensor attributes too."""
    assert type(left) is type(right) and sorted(left.keys()) == sorted(right.keys())
    for key, value in left:
        if isinstance(value, torch.Tensor):
            assert value.dtype == right[key].dtype and torch.equal(value, right[key]), key
        else:
            assert value == right[key], key
    assert left._slice_dict.keys() == right._slice_dict.keys()
    assert left._num_graphs == right._num_graphs


def _ids(batches) -> list[list[float]]:
    return [batch.energy.tolist() for batch in batches]


def test_bundled_workers_hand_out_the_in_process_batches_from_one_slab(dataset):
    reference = list(AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5))
    loader = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                            batches_per_item=3)
    assert isinstance(loader.batch_sampler, BundleSampler)
    assert len(loader) == len(reference) == 23
    batches = list(loader)
    assert len(batches) == len(reference)
    for mine, theirs in zip(batches, reference, strict=True):
        _same(mine, theirs)
        assert mine.to_data_list()[1].energy.item() == theirs.to_data_list()[1].energy.item()
    # the three batches of a bundle are views of one buffer: one message, one slab
    for start in range(0, 21, 3):
        storages = {t.untyped_storage().data_ptr() for batch in batches[start:start + 3]
                    for _, t in batch if t.numel()}
        assert len(storages) == 1, start
    arenas = loader.dataset.arenas
    assert sum(a.busy_chunks() for a in arenas) > 0
    del batches, mine
    gc.collect()
    assert sum(a.busy_chunks() for a in arenas) == 0  # every slab given back


def test_the_second_pass_and_the_bundle_size_by_default(dataset):
    loader = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                            persistent_workers=True)
    size = loader.batch_sampler.size  # 23 batches, 2 workers: at least 2 bundles each
    assert size == bundle_size(4 * 40, 23, 2) == 5
    reference = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5)
    for _ in range(2):  # the epoch advances in both
        assert _ids(loader) == _ids(reference)
    assert bundle_size(64 * 64, 1000, 2) == 21  # ~4 MiB of 64 x 64-atom batches
    assert bundle_size(64 * 64, 1000, 0) == 1
    assert not isinstance(AtompackLoader(dataset, batch_size=4).batch_sampler, BundleSampler)
    assert not isinstance(AtompackLoader(dataset, batch_size=4, num_workers=2,
                                         snapshot_every_n_steps=2).batch_sampler,
                          BundleSampler)
    with pytest.raises(ValueError, match="batches_per_item must be at least 1"):
        AtompackLoader(dataset, batch_size=4, num_workers=2, batches_per_item=0)


@pytest.mark.parametrize("taken", [1, 2, 3, 4, 7])
def test_a_state_inside_a_bundle_resumes_exactly_on_any_worker_count(dataset, taken):
    full = _ids(AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5))
    loader = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                            batches_per_item=3)
    iterator = iter(loader)
    head = [next(iterator).energy.tolist() for _ in range(taken)]
    state = loader.state_dict()
    del iterator
    assert head == full[:taken]
    for workers, size in ((2, 3), (2, 2), (0, None), (3, None)):
        resumed = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5,
                                 num_workers=workers, batches_per_item=size)
        resumed.load_state_dict(state)
        assert _ids(resumed) == full[taken:], (workers, size)


def test_a_resumed_state_saved_again_before_any_batch_keeps_its_place(dataset):
    full = _ids(AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5))
    loader = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                            batches_per_item=3)
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    state = loader.state_dict()
    del iterator
    again = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                           batches_per_item=3)
    again.load_state_dict(state)
    saved = again.state_dict()  # before iterating: the loaded place, inside its bundle
    iterator = iter(again)
    assert next(iterator).energy.tolist() == full[4]
    final = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                           batches_per_item=3)
    final.load_state_dict(saved)
    assert _ids(final) == full[4:]


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_atom_budget_batches_bundle_and_resume_inside_a_bundle(dataset, workers):
    full = _ids(AtompackLoader(dataset, max_atoms=130, shuffle=True, seed=2))
    loader = AtompackLoader(dataset, max_atoms=130, shuffle=True, seed=2, num_workers=2,
                            batches_per_item=4)
    assert _ids(loader) == full
    loader = AtompackLoader(dataset, max_atoms=130, shuffle=True, seed=2, num_workers=2,
                            batches_per_item=4)
    iterator = iter(loader)
    head = [next(iterator).energy.tolist() for _ in range(6)]
    state = loader.state_dict()
    del iterator
    resumed = AtompackLoader(dataset, max_atoms=130, shuffle=True, seed=2,
                             num_workers=workers)
    resumed.load_state_dict(state)
    assert head == full[:6]
    assert _ids(resumed) == full[6:]


def _pickled(bundle: BatchBundle) -> BatchBundle:
    # as a worker sends it (ForkingPickler with the packed reducers) and the main
    # process reads it
    return pickle.loads(ForkingPickler.dumps(bundle))


def test_plain_batches_travel_as_tensors_and_names_others_pickled(dataset):
    batches = list(AtompackLoader(dataset, batch_size=5, follow_batch=["forces"]))[:4]
    arena = Arena(1 << 20)
    handoff.use_arena(arena)
    try:
        plain = _PlainLayout.of(batches)
        assert plain is not None
        received = _pickled(BatchBundle(batches))
        assert isinstance(received._packed[1], _PlainLayout)
        assert arena.busy_chunks() > 0  # through the arena
        for mine, theirs in zip(received.batches(), batches, strict=True):
            _same(mine, theirs)
            assert mine.forces_batch.tolist() == theirs.forces_batch.tolist()
        # a string attribute: the general path (pickled with tensor numbers), still equal
        odd = [batch.clone() for batch in batches]
        odd[1].label = "not a tensor"
        assert _PlainLayout.of(odd) is None
        received = _pickled(BatchBundle(odd))
        assert isinstance(received._packed[1], bytes)
        for mine, theirs in zip(received.batches(), odd, strict=True):
            _equal(mine, theirs)
        assert received.batches()[1].label == "not a tensor"
        # a tensor overlapping another: sent the default way, the aliasing kept
        odd[2].pos_head = odd[2].pos[:3]
        assert _PlainLayout.of(odd) is None
        received = _pickled(BatchBundle(odd))
        assert received._packed is None
        third = received.batches()[2]
        assert third.pos_head.data_ptr() == third.pos.data_ptr()
        _equal(third, odd[2])
    finally:
        handoff.use_arena(None)
    del received, mine
    gc.collect()
    assert arena.busy_chunks() == 0


def test_pin_memory_pins_one_buffer_per_bundle(dataset, monkeypatch):
    batches = list(AtompackLoader(dataset, batch_size=5))[:3]
    received = _pickled(BatchBundle(batches))
    if torch.cuda.is_available():  # the real thing
        pinned = received.pin_memory()
        tensors = [t for batch in pinned.batches() for _, t in batch if t.numel()]
        assert all(t.is_pinned() for t in tensors)
    else:  # no accelerator: count the calls torch would make
        calls = []

        def pin(tensor):
            calls.append(tensor.numel())
            return tensor.clone()

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
        pinned = received.pin_memory()
        tensors = [t for batch in pinned.batches() for _, t in batch if t.numel()]
        assert len(calls) == 1  # one slab, not one pin per tensor of every batch
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for mine, theirs in zip(pinned.batches(), batches, strict=True):
        _same(mine, theirs)


def test_the_per_sample_transform_path_bundles_too(tmp_path):
    path = tmp_path / "t.atp"
    rng = np.random.default_rng(1)
    with atp.Writer(path) as writer:
        writer.add_batch(rng.normal(size=(30, 5, 3)).astype(np.float32),
                         rng.integers(1, 9, (30, 5)).astype(np.uint8),
                         energy=np.arange(30, dtype=np.float64))

    def shift(data):
        data.pos = data.pos + 1
        return data

    dataset = AtompackDataset(path, transform=shift)
    reference = list(AtompackLoader(dataset, batch_size=4))
    mine = list(AtompackLoader(dataset, batch_size=4, num_workers=2, batches_per_item=2))
    for left, right in zip(mine, reference, strict=True):
        _same(left, right)


def test_group_batches_bundle_in_the_in_process_order(tmp_path):
    """Whole groups per batch (strings among their attributes: the general path)."""
    path = tmp_path / "groups.atp"
    write_framed(path, plain_file(tmp_path / "plain.atp", 7),
                 [encode_groups([("adsorption", ADSORPTION)])])
    dataset = AtompackGroupDataset(path, "adsorption", fields=["energy"])
    reference = list(AtompackLoader(dataset, batch_size=1, shuffle=True, seed=4))
    loader = AtompackLoader(dataset, batch_size=1, shuffle=True, seed=4, num_workers=2,
                            batches_per_item=2)
    assert isinstance(loader.batch_sampler, BundleSampler)
    mine = list(loader)
    assert [b.group_id.tolist() for b in mine] == [b.group_id.tolist() for b in reference]
    for left, right in zip(mine, reference, strict=True):
        _equal(left, right)
