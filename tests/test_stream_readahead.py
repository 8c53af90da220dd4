"""Samples of lazily decoded shards built ahead of the consumer: same stream, bounded, closed."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from servers.http_server import write_pt_shards
from torch_geometric.data import Batch, Data

from pyg_atompack.pyg.data import data_from_mapping
from pyg_atompack.stream import LocalSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX
from pyg_atompack.stream.readahead import ReadAhead

BUILD_THREAD = f"{THREAD_NAME_PREFIX}-build"
WAIT_S = 60.0  # generous: only a broken read-ahead ever waits this long


def _build_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == BUILD_THREAD]


class _Recorder:
    """``make`` for :meth:`ReadAhead.run` that notes who built what, and when."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.started: list[tuple[int, str]] = []
        self.built_by_thread = threading.Event()
        self.fail_at = fail_at

    def __call__(self, index: int) -> dict:
        name = threading.current_thread().name
        with self.lock:
            self.started.append((index, name))
        if index == self.fail_at:
            raise RuntimeError(f"sample {index} is damaged")
        if name == BUILD_THREAD:
            self.built_by_thread.set()
        return {"index": index}


def test_read_ahead_yields_the_order_and_keeps_its_window():
    make = _Recorder()
    ahead = ReadAhead(window=3)
    order = [5, 1, 7, 0, 3, 2, 6, 4, 9, 8]
    taken = []
    try:
        samples = ahead.run(make, order)
        taken.append(next(samples)["index"])
        # the thread fills the window while the consumer does something else
        assert make.built_by_thread.wait(WAIT_S)
        for sample in samples:
            with make.lock:
                started = len(make.started)
            # beyond the samples handed out (this one too): at most the window, plus
            # one build under way
            assert started - (len(taken) + 1) <= 3 + 1
            taken.append(sample["index"])
    finally:
        ahead.close()
    assert taken == order
    assert sorted(index for index, _ in make.started) == sorted(order)  # each built once
    assert not _build_threads()


def test_a_failed_build_is_raised_at_its_sample():
    ahead = ReadAhead(window=4)
    try:
        samples = ahead.run(_Recorder(fail_at=3), range(6))
        assert [next(samples)["index"] for _ in range(3)] == [0, 1, 2]
        with pytest.raises(RuntimeError, match="sample 3 is damaged"):
            next(samples)
    finally:
        ahead.close()
    assert not _build_threads()


def test_closing_drops_ready_samples_and_joins_the_thread():
    make = _Recorder()
    ahead = ReadAhead(window=4)
    samples = ahead.run(make, range(100))
    next(samples)
    assert make.built_by_thread.wait(WAIT_S)
    samples.close()  # the consumer stops mid-shard
    assert ahead._jobs == []  # the shard's ready samples are gone with it
    ahead.close()
    assert not _build_threads()
    with make.lock:
        assert len(make.started) <= 1 + 4 + 1  # never more than the window ahead


def test_no_window_builds_in_the_consumer_thread():
    make = _Recorder()
    assert [s["index"] for s in ReadAhead(window=0).run(make, [2, 0, 1])] == [2, 0, 1]
    assert {name for _, name in make.started} == {threading.current_thread().name}
    assert not _build_threads()


@pytest.mark.parametrize("settings, interleave", [
    ({}, 1), ({"shuffle": True, "seed": 4}, 1), ({"shuffle": True, "shuffle_buffer": 5}, 1),
    ({}, 3), ({"batch_size": 4}, 1)])
def test_stream_is_the_same_with_and_without_read_ahead(tmp_path, settings, interleave):
    write_pt_shards(tmp_path, [6, 9, 4, 7], collated=(2,))

    def stream(read_ahead: int) -> list:
        options = SourceOptions(read_ahead=read_ahead, interleave=interleave)
        dataset = ShardStreamDataset(LocalSource(tmp_path), options=options, prefetch=2,
                                     **settings)
        return [(item.sample_id.view(-1).tolist(), item.pos) for item in dataset]

    built_here, built_ahead = stream(0), stream(16)
    assert [ids for ids, _ in built_here] == [ids for ids, _ in built_ahead]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(built_here, built_ahead))
    assert not _build_threads()


def test_read_ahead_must_not_be_negative(tmp_path):
    write_pt_shards(tmp_path, [2])
    with pytest.raises(ValueError, match="read_ahead"):
        ShardStreamDataset(LocalSource(tmp_path), options=SourceOptions(read_ahead=-1))


def test_data_from_mapping_is_the_data_pyg_builds():
    mapping = {"pos": torch.randn(3, 3), "z": torch.tensor([1, 6, 8]), "name": "water",
               "energy": torch.tensor([1.5])}
    built = data_from_mapping(dict(mapping))
    reference = Data(**mapping)
    assert type(built) is Data
    assert built.__dict__.keys() == reference.__dict__.keys()
    assert built._store.__dict__.keys() == reference._store.__dict__.keys()
    assert built._store._parent() is built
    assert built.num_nodes == 3 and built.name == "water"
    for other in (pickle.loads(pickle.dumps(built)), copy.copy(built), built.clone()):
        assert other.keys() == reference.keys()
        assert torch.equal(other.pos, reference.pos)
    batch = Batch.from_data_list([built, data_from_mapping(dict(mapping))])
    assert batch.num_graphs == 2 and batch.pos.shape == (6, 3)
    built.extra = torch.zeros(1)  # attribute assignment still goes to the store
    assert "extra" in built._store._mapping
