"""Handing consumed shards' memory back to the OS (``trim_memory``)."""

from __future__ import annotations

import sys

import pytest
import torch
from servers.http_server import write_pt_shards
from torch_geometric.data import Data

from pyg_atompack.stream import LocalSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream import iteration as stream_iteration
from pyg_atompack.stream.memory import release_free_memory

SIZES = [5, 7, 3, 6]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim is Linux")
def test_release_free_memory_calls_malloc_trim_on_glibc():
    # the CI and development machines run glibc, which has malloc_trim
    assert release_free_memory() is True


@pytest.mark.parametrize("prefetch", [0, 2])
def test_memory_is_trimmed_once_per_consumed_shard(tmp_path, monkeypatch, prefetch):
    write_pt_shards(tmp_path, SIZES)
    monkeypatch.setattr(stream_iteration, "TRIM_AFTER_BYTES", 1)  # every shard is large
    calls = []
    monkeypatch.setattr(stream_iteration, "release_free_memory", lambda: calls.append(1) or True)
    # threads: the trims are counted in this process
    samples = list(ShardStreamDataset(LocalSource(tmp_path),
                                      options=SourceOptions(retrieval="threads"),
                                      prefetch=prefetch))
    assert len(samples) == sum(SIZES)
    # after every shard but the last, the next sample pulled has released it
    assert len(calls) == len(SIZES) - 1


def test_trimming_can_be_switched_off(tmp_path, monkeypatch):
    write_pt_shards(tmp_path, SIZES)
    calls = []
    monkeypatch.setattr(stream_iteration, "release_free_memory", lambda: calls.append(1) or True)
    list(ShardStreamDataset(LocalSource(tmp_path), options=SourceOptions(trim_memory=False)))
    assert calls == []


def test_trimming_happens_after_the_shard_is_released(tmp_path, monkeypatch):
    # when the trim runs, no sample of the finished shard may be alive in the stream
    import weakref

    shard = [Data(x=torch.full((3, 1), float(i))) for i in range(4)]
    torch.save(shard, tmp_path / "a.pt")
    torch.save([Data(x=torch.zeros(3, 1)) for _ in range(4)], tmp_path / "b.pt")
    refs: list[weakref.ref] = []
    alive_at_trim = []

    def check() -> bool:
        alive_at_trim.append(sum(ref() is not None for ref in refs))
        return True

    monkeypatch.setattr(stream_iteration, "release_free_memory", check)
    monkeypatch.setattr(stream_iteration, "TRIM_AFTER_BYTES", 1)
    iterator = iter(ShardStreamDataset(LocalSource(tmp_path), prefetch=0))
    for _ in range(4):
        refs.append(weakref.ref(next(iterator)))
    rest = list(iterator)
    assert len(rest) == 4 and alive_at_trim == [0]


def test_small_shards_are_trimmed_after_enough_bytes_not_after_each(tmp_path, monkeypatch):
    sizes = [4] * 7
    write_pt_shards(tmp_path, sizes)
    smallest = min(path.stat().st_size for path in tmp_path.glob("*.pt"))
    largest = max(path.stat().st_size for path in tmp_path.glob("*.pt"))
    assert largest < 1.25 * smallest  # so 2.5 shards' worth always takes three shards
    # a trim is due once three shards' bytes were consumed since the last one
    monkeypatch.setattr(stream_iteration, "TRIM_AFTER_BYTES", int(2.5 * smallest))
    calls = []
    monkeypatch.setattr(stream_iteration, "release_free_memory", lambda: calls.append(1) or True)
    samples = list(ShardStreamDataset(LocalSource(tmp_path),  # trims counted here
                                      options=SourceOptions(retrieval="threads"), prefetch=1))
    assert len(samples) == sum(sizes)
    # due after shards 3 and 6 (and run when the next sample is pulled); not after 7
    assert len(calls) == 2
