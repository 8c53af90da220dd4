"""Unbatched samples leave the retrieval process in chunks (stream/offproc.py,
stream/samplechunks.py): same samples, exact resume, no sample held back."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch
from servers.http_server import ShardServer, serve_directory, write_pt_shards
from torch_geometric.data import Data

from pyg_atompack.pyg.arena import Arena
from pyg_atompack.stream import (
    RemoteSource,
    ShardStreamDataset,
    SourceOptions,
    offproc,
    samplechunks,
)
from pyg_atompack.stream.samplechunks import pack_columns, unpack_columns
from pyg_atompack.transport import RetryPolicy

SIZES = [9, 13, 4, 11, 7, 12, 3, 10]  # 69 samples: chunks span shards
ALL_IDS = sorted(s * 1000 + i for s, n in enumerate(SIZES) for i in range(n))
FAST = RetryPolicy(retries=1, backoff=0.01, timeout=5.0)
THREADS, PROCESS = SourceOptions(retrieval="threads"), SourceOptions(retrieval="process")


@pytest.fixture
def server(tmp_path) -> ShardServer:
    write_pt_shards(tmp_path, SIZES, collated=(2, 5), atoms=6)
    yield from serve_directory(tmp_path)


def _source(server: ShardServer) -> RemoteSource:
    return RemoteSource(server.url("manifest.json"), retry=FAST)


def _ids(items) -> list[int]:
    return [int(v) for item in items for v in item.sample_id.view(-1)]


def _same(mine: Data, theirs: Data) -> None:
    assert type(mine) is type(theirs)
    assert list(mine.keys()) == list(theirs.keys())
    for key, value in theirs:
        if isinstance(value, torch.Tensor):
            assert mine[key].dtype == value.dtype and mine[key].shape == value.shape, key
            assert torch.equal(mine[key], value), key
        else:
            assert mine[key] == value, key


@pytest.mark.parametrize("options", [{}, {"shuffle": True, "seed": 4},
                                     {"shuffle": True, "seed": 1, "shuffle_buffer": 8}])
def test_unbatched_samples_come_in_chunks_equal_and_in_order(server, options):
    expected = list(ShardStreamDataset(_source(server), prefetch=2,
                                       options=SourceOptions(retrieval="threads"),
                                       **options))
    samples = list(ShardStreamDataset(_source(server), prefetch=2,
                                      options=SourceOptions(retrieval="process"),
                                      **options))
    assert _ids(samples) == _ids(expected)
    assert sorted(_ids(samples)) == ALL_IDS
    for mine, theirs in zip(samples, expected, strict=True):
        _same(mine, theirs)
    # samples of one message are views of one buffer: fewer buffers than samples
    buffers = {sample.pos.untyped_storage().data_ptr() for sample in samples}
    assert len(buffers) < len(samples)
    # and each is its own sample: writing one leaves the others as they were
    samples[0].pos.add_(1000.0)
    assert torch.equal(samples[1].pos, expected[1].pos)


@pytest.mark.parametrize("resume_with", ["process", "threads"])
@pytest.mark.parametrize("taken", [1, 7, 40])
def test_state_dict_counts_each_sample_handed_out_of_a_chunk(server, resume_with, taken):
    options = {"shuffle": True, "seed": 3}
    expected = _ids(ShardStreamDataset(_source(server), options=THREADS, **options))
    dataset = ShardStreamDataset(_source(server), options=PROCESS, **options)
    iterator = iter(dataset)
    first = [next(iterator) for _ in range(taken)]
    time.sleep(0.2)  # the child has built (and sent) samples ahead: not counted
    state = dataset.state_dict()
    assert state["samples_emitted"] == taken
    del iterator
    resumed = ShardStreamDataset(
        _source(server), options=SourceOptions(retrieval=resume_with), **options)
    resumed.load_state_dict(state)
    assert _ids(first) + _ids(resumed) == expected
    assert resumed.state_dict()["finished"]


def test_samples_ready_are_not_held_back_for_a_fuller_chunk(server):
    # the second shard's bytes are held: the first shard's 9 samples must still arrive
    # (the child sends what it holds when its loop waits), not wait to fill a chunk
    gate = server.hold("shard-0001.pt", 0)
    release = threading.Timer(30.0, gate.set)  # never a hang, whatever happens
    release.start()
    try:
        dataset = ShardStreamDataset(_source(server), prefetch=1, options=SourceOptions(
            retrieval="process", stream_shards="none"))
        iterator = iter(dataset)
        first = [next(iterator) for _ in range(SIZES[0])]
        held = not gate.is_set()
        gate.set()
        rest = list(iterator)
    finally:
        release.cancel()
        gate.set()
    assert held, "the first shard's samples waited for the second shard"
    assert _ids(first) == [i for i in range(SIZES[0])]
    assert sorted(_ids(first + rest)) == ALL_IDS


def test_an_error_comes_after_the_samples_before_it(tmp_path):
    write_pt_shards(tmp_path, [6, 5, 4], atoms=3)
    (tmp_path / "shard-0002.pt").write_bytes(b"not a torch file" * 20)
    for server in serve_directory(tmp_path):
        seen = []
        with pytest.raises(Exception, match=r"shard-0002\.pt"):
            for sample in ShardStreamDataset(_source(server), options=SourceOptions(
                    verify=False, retrieval="process")):
                seen.append(int(sample.sample_id))
        assert seen == [0, 1, 2, 3, 4, 5, 1000, 1001, 1002, 1003, 1004]


class Tagged(Data):
    """A Data subclass, to check that the class survives the columns."""


def _odd_samples() -> list[Data]:
    samples = []
    for i in range(5):
        atoms = 20 * i
        sample = Tagged(pos=torch.randn(atoms, 3), z=torch.arange(atoms),
                        flag=torch.tensor(i % 2 == 0),
                        energy=torch.tensor(float(i), dtype=torch.float64), name=f"m{i}",
                        ragged=torch.ones(2, i), half=torch.zeros(atoms, dtype=torch.bfloat16))
        samples.append(sample)
    return samples


@pytest.mark.parametrize("arena", [False, True])
def test_columns_round_trip_any_flat_samples(arena):
    samples = _odd_samples()
    shared = Arena(1 << 20) if arena else None
    # (a big chunk, so that an arena is used when given)
    samples = samples * 60
    packed = pack_columns(samples, shared)
    assert packed is not None
    rebuilt = unpack_columns(*pickle.loads(pickle.dumps(packed)))
    assert len(rebuilt) == len(samples)
    for mine, theirs in zip(rebuilt, samples, strict=True):
        _same(mine, theirs)
        mine.validate()  # a well-formed PyG object (its store knows its parent)
    if shared is not None:
        assert shared.busy_chunks() > 0
        del rebuilt, mine
        assert shared.busy_chunks() == 0  # the run goes back when the samples die


def test_what_does_not_fit_columns_goes_the_general_way():
    a = Data(pos=torch.zeros(2, 3))
    b = Data(pos=torch.zeros(2, 3), z=torch.zeros(2))
    assert pack_columns([a, b]) is None  # other attributes
    alias = torch.zeros(3)
    assert pack_columns([Data(x=alias, y=alias), Data(x=alias, y=alias)]) is None
    assert pack_columns([{"x": torch.zeros(1)}, {"x": torch.zeros(1)}]) is None
    # a column of mixed dtypes or ranks travels per sample, values unchanged
    mixed = [Data(v=torch.zeros(2)), Data(v=torch.zeros(2, dtype=torch.int32)),
             Data(v=torch.zeros(0)), Data(v=torch.zeros(0, 4))]
    rebuilt = unpack_columns(*pack_columns(mixed))
    for mine, theirs in zip(rebuilt, mixed, strict=True):
        _same(mine, theirs)


def test_a_sample_that_cannot_be_sent_is_a_clear_error(server, monkeypatch):
    # a transform makes samples that cannot be pickled: the consumer gets the error
    def unpicklable(sample):
        sample.callback = lambda: None
        return sample

    dataset = ShardStreamDataset(_source(server), options=PROCESS, transform=unpicklable)
    with pytest.raises(Exception, match="pickle"):
        list(dataset)


def test_chunks_are_bounded(monkeypatch):
    assert 1 < samplechunks.CHUNK_SAMPLES < offproc.AHEAD_SAMPLES
