"""ShardStreamDataset with its retrieval in a child process (stream/offproc.py)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import time

import pytest
import torch
from servers.http_server import ShardServer, serve_directory, write_pt_shards
from torch.utils.data import DataLoader

from pyg_atompack.stream import (
    LocalSource,
    RemoteSource,
    ShardDecodeError,
    ShardFetchError,
    ShardStreamDataset,
    SourceOptions,
)
from pyg_atompack.stream.errors import RetrievalProcessError
from pyg_atompack.stream.offproc import use_child_process
from pyg_atompack.transport import RetryPolicy

SIZES = [5, 7, 3, 6, 4, 8, 5, 2]  # 40 samples, uneven shards
ALL_IDS = sorted(s * 1000 + i for s, n in enumerate(SIZES) for i in range(n))
FAST = RetryPolicy(retries=1, backoff=0.01, timeout=5.0)
CHILD = "pyg_atompack-stream"


@pytest.fixture
def server(tmp_path) -> ShardServer:
    write_pt_shards(tmp_path, SIZES, collated=(1, 4), atoms=40)
    yield from serve_directory(tmp_path)


def _source(server: ShardServer) -> RemoteSource:
    return RemoteSource(server.url("manifest.json"), retry=FAST)


def _ids(items) -> list[int]:
    return [int(v) for item in items for v in item.sample_id.view(-1)]


def _children() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name == CHILD]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_default_rule():
    assert use_child_process("auto", 1, in_worker=False)
    assert not use_child_process("auto", 0, in_worker=False)  # nothing to move off
    assert not use_child_process("auto", 2, in_worker=True)  # a worker is a process already
    assert not use_child_process("threads", 2, in_worker=False)
    assert use_child_process("process", 0, in_worker=False)
    with pytest.raises(ValueError, match="retrieval must be one of"):
        ShardStreamDataset("/nonexistent", options=SourceOptions(retrieval="fibers"))


@pytest.mark.parametrize("settings, interleave", [
    ({}, 1),
    ({"shuffle": True, "seed": 5}, 1),
    ({"shuffle": True, "seed": 5, "batch_size": 4}, 1),
    ({"shuffle": True, "seed": 2, "shuffle_buffer": 6, "batch_size": 3}, 2),
])
def test_the_same_items_in_the_same_order_as_in_process(server, settings, interleave):
    reference = ShardStreamDataset(
        _source(server), options=SourceOptions(retrieval="threads", interleave=interleave),
        prefetch=2, **settings)
    dataset = ShardStreamDataset(
        _source(server), options=SourceOptions(retrieval="process", interleave=interleave),
        prefetch=2, **settings)
    expected = list(reference)
    items = list(dataset)
    assert _ids(items) == _ids(expected)
    assert sorted(_ids(items)) == ALL_IDS
    for mine, theirs in zip(items, expected, strict=True):
        assert type(mine) is type(theirs)
        for key, value in theirs:
            assert torch.equal(mine[key], value), key
    assert not _children()
    # the consumer's steps are timed here; downloads and decoding come from the child
    stats = dataset.stats()
    assert stats["structures"] == 40 and stats["shards"] == 8
    assert stats["wait_share"] is not None
    for record in dataset.trace:
        assert record["download_start_s"] <= record["download_finish_s"]
        assert record["consume_start_s"] <= record["consume_finish_s"]
        assert record["bytes"] > 0


@pytest.mark.parametrize("resume_with", ["process", "threads"])
def test_state_dict_resumes_exactly_whichever_side_retrieves(server, resume_with):
    # (with a shuffle buffer or interleaving, a resume keeps the samples but not their
    # order, in-process too)
    options = {"shuffle": True, "seed": 9, "batch_size": 3}
    expected = _ids(ShardStreamDataset(_source(server), options=SourceOptions(retrieval="threads"),
                                       **options))
    dataset = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                                 **options)
    iterator = iter(dataset)
    taken = [next(iterator) for _ in range(5)]
    time.sleep(0.2)  # the child has built items ahead: the state must not count them
    state = dataset.state_dict()
    assert state["samples_emitted"] == 15
    del iterator
    resumed = ShardStreamDataset(_source(server), options=SourceOptions(retrieval=resume_with),
                                 **options)
    resumed.load_state_dict(state)
    assert _ids(taken) + _ids(resumed) == expected
    assert resumed.state_dict()["finished"]


def test_errors_in_the_child_name_the_shard_and_nothing_hangs(tmp_path):
    write_pt_shards(tmp_path, [4, 4, 4], atoms=3)
    (tmp_path / "shard-0001.pt").write_bytes(b"this is not a torch file" * 10)
    for server in serve_directory(tmp_path):
        dataset = ShardStreamDataset(_source(server),
                                     options=SourceOptions(verify=False, retrieval="process"))
        seen = []
        with pytest.raises(ShardDecodeError, match=r"shard-0001\.pt: not a readable \.pt"):
            for sample in dataset:
                seen.append(int(sample.sample_id))
        assert seen == [0, 1, 2, 3]  # the first shard, then the error
        assert not _children()
        server.add_fault("shard-0000.pt", "500", times=10)
        with pytest.raises(ShardFetchError, match=r"http://127\.0\.0\.1:\d+/shard-0000\.pt"):
            list(ShardStreamDataset(_source(server),
                                    options=SourceOptions(retrieval="process", verify=False,
                                                          stream_shards="none")))
        assert not _children()


def test_a_killed_child_is_a_clear_error(server):
    dataset = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                                 prefetch=1)
    iterator = iter(dataset)
    next(iterator)
    [child] = _children()
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(RetrievalProcessError, match=r"was killed by SIGKILL"):
        for _ in iterator:
            pass
    assert not _children()


@pytest.mark.parametrize("how", ["end", "break", "exception", "dropped", "never started"])
def test_no_process_or_descriptor_outlives_the_iteration(server, how):
    dataset = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                                 prefetch=2)
    list(ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                            prefetch=2))  # warm up
    gc.collect()
    before = _open_fds()
    if how == "end":
        assert len(list(dataset)) == 40
    elif how == "break":
        for index, _ in enumerate(dataset):
            if index == 3:
                break
    elif how == "exception":
        with pytest.raises(KeyError):
            for _ in dataset:
                raise KeyError("the consumer failed")
    elif how == "dropped":
        iterator = iter(dataset)
        next(iterator)
        del iterator
    else:
        iterator = iter(dataset)  # forked, never asked
        del iterator
    gc.collect()
    assert not _children()
    assert _open_fds() == before
    assert not [name for name in os.listdir("/dev/shm") if "pyg_atompack" in name]


def test_dataloader_workers_retrieve_in_themselves(server):
    dataset = ShardStreamDataset(_source(server), prefetch=2, batch_size=4)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(_ids(loader)) == ALL_IDS  # each worker streams in itself (auto)
    forced = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                                prefetch=2)
    with pytest.raises(RuntimeError, match="daemonic"):
        list(DataLoader(forced, batch_size=None, num_workers=1))


def test_large_batches_travel_through_shared_memory(server):
    dataset = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="process"),
                                 prefetch=2, batch_size=20)
    batches = list(dataset)
    assert [b.num_graphs for b in batches] == [20, 20]
    # 20 molecules of 40 atoms: over the arena's threshold, so the tensors view one buffer
    # of shared chunks, not a copy received through the pipe
    storages = {t.untyped_storage().data_ptr() for b in batches for _, t in b
                if isinstance(t, torch.Tensor) and t.numel()}
    assert len(storages) == 2


def test_local_sources_and_prefetch_zero_stay_in_process(tmp_path):
    write_pt_shards(tmp_path, [3, 2])
    dataset = ShardStreamDataset(LocalSource(tmp_path), prefetch=0)
    iterator = iter(dataset)
    next(iterator)
    assert not _children()  # prefetch=0: loading on demand, in this process
    del iterator
