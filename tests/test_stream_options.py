"""``SourceOptions``: checked when made, one home per stream (the source or the dataset)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
from servers.http_server import ShardServer, serve_directory, write_pt_shards

import pyg_atompack
from pyg_atompack.pyg.errors import FieldSelectionError
from pyg_atompack.stream import (
    LocalSource,
    RemoteSource,
    ShardFetchError,
    ShardStreamDataset,
    SourceOptions,
    open_source,
)
from pyg_atompack.transport import RetryPolicy

SIZES = [4, 3, 5]
ALL_IDS = sorted(shard * 1000 + i for shard, count in enumerate(SIZES) for i in range(count))
# no retries of its own: what a stream retries comes from SourceOptions(retries=)
NO_RETRY = RetryPolicy(retries=0, backoff=0.01, max_backoff=0.02, jitter=0.0, timeout=5.0)


@pytest.fixture
def server(tmp_path) -> ShardServer:
    write_pt_shards(tmp_path, SIZES)
    yield from serve_directory(tmp_path)


def _ids(dataset) -> list[int]:
    return [int(sample.sample_id) for sample in dataset]


def test_the_dataset_keeps_iteration_settings_only():
    parameters = inspect.signature(ShardStreamDataset.__init__).parameters
    assert len(parameters) - 1 <= 18  # self aside
    fields = {field.name for field in dataclasses.fields(SourceOptions)}
    assert not fields & set(parameters)  # each setting lives in one place
    assert pyg_atompack.SourceOptions is SourceOptions


@pytest.mark.parametrize("arguments, message", [
    ({"retries": -1}, "retries must be"),
    ({"block_bytes": 0}, "block_bytes must be"),
    ({"interleave": 0}, "interleave >= 1"),
    ({"read_ahead": -1}, "read_ahead >= 0"),
    ({"stream_shards": "some"}, "stream_shards must be one of"),
    ({"verify_before_use": "sha256"}, "verify_before_use"),
    ({"retrieval": "fibers"}, "retrieval must be one of"),
])
def test_bad_values_fail_when_the_options_are_made(arguments, message):
    with pytest.raises(ValueError, match=message):
        SourceOptions(**arguments)


def test_names_are_checked_and_rename_is_an_owned_copy():
    with pytest.raises(FieldSelectionError, match="unknown names preset 'pyg-qm9000'"):
        SourceOptions(names="pyg-qm9000")
    with pytest.raises(FieldSelectionError):
        SourceOptions(rename={"forces": "f", "stress": "f"})
    rename = {"forces": "force"}
    options = SourceOptions(rename=rename)
    rename["energy"] = "E"
    assert options.rename == {"forces": "force"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.retries = 3  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(options)) == options  # travels into workers
    assert hash(options) == hash(SourceOptions(rename={"forces": "force"}))
    assert len({options, SourceOptions(rename={"forces": "force"}), SourceOptions()}) == 2


def test_options_given_with_a_url_reach_the_stream(server):
    options = SourceOptions(rename={"sample_id": "key"}, read_ahead=0)
    dataset = ShardStreamDataset(server.url("manifest.json"), options=options)
    assert dataset.options is dataset.source.options is options
    assert sorted(int(sample.key) for sample in dataset) == ALL_IDS


def test_a_source_carrying_options_keeps_them_and_refuses_others(server, tmp_path):
    source = open_source(server.url("manifest.json"), SourceOptions(trusted=True))
    assert isinstance(source, RemoteSource) and source.options.trusted
    assert ShardStreamDataset(source).options.trusted
    with pytest.raises(ValueError, match="carries its own SourceOptions"):
        ShardStreamDataset(source, options=SourceOptions())
    local = LocalSource(tmp_path, options=SourceOptions(verify=False))
    with pytest.raises(ValueError, match="carries its own SourceOptions"):
        ShardStreamDataset(local, options=SourceOptions(verify=False))
    with pytest.raises(ValueError, match="already a source"):
        open_source(local, SourceOptions())
    with pytest.raises(ValueError, match="already a source"):
        open_source(local, retry=NO_RETRY)  # storage options belong to it as well
    assert open_source(local) is local


def test_a_source_without_options_takes_the_datasets(tmp_path):
    write_pt_shards(tmp_path, SIZES)

    class Plain:  # a Source of one's own, with no options attribute
        def __init__(self):
            self.inner = LocalSource(tmp_path)

        def list_shards(self):
            return self.inner.list_shards()

        def fetch(self, shard, cancel):
            return self.inner.fetch(shard, cancel)

    dataset = ShardStreamDataset(Plain(), options=SourceOptions(interleave=2), prefetch=2,
                                 shuffle=True, seed=1)
    assert dataset.options.interleave == 2 and sorted(_ids(dataset)) == ALL_IDS
    assert ShardStreamDataset(Plain()).options == SourceOptions()
    with pytest.raises(TypeError, match="options must be a SourceOptions"):
        ShardStreamDataset(Plain(), options={"interleave": 2})


def test_retries_from_the_options_decide_whether_a_fault_is_outlasted(server):
    url = server.url("manifest.json")
    server.add_fault("shard-0001.pt", "500", times=1)  # used up by the one attempt
    give_up = SourceOptions(retries=0, retrieval="threads", stream_shards="none")
    with pytest.raises(ShardFetchError, match=r"shard-0001\.pt"):
        _ids(ShardStreamDataset(open_source(url, give_up, retry=NO_RETRY)))
    server.add_fault("shard-0001.pt", "500", times=2)
    outlast = dataclasses.replace(give_up, retries=2)
    source = open_source(url, outlast, retry=NO_RETRY)
    assert source.retry.retries == 2 and source.retry.timeout == NO_RETRY.timeout
    assert sorted(_ids(ShardStreamDataset(source))) == ALL_IDS
    # a source made without options gets the dataset's retries on a copy
    plain = RemoteSource(url, retry=NO_RETRY)
    server.add_fault("shard-0001.pt", "500", times=2)
    dataset = ShardStreamDataset(plain, options=outlast)
    assert sorted(_ids(dataset)) == ALL_IDS
    assert plain.retry is NO_RETRY and dataset.source.retry.retries == 2
