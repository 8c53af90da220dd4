"""Shards fetched over several connections at once, as byte ranges."""

from __future__ import annotations

import json
import mmap

import pytest
from servers.http_server import serve_directory, write_pt_shards

from pyg_atompack.stream import (
    CancelToken,
    RemoteSource,
    ShardFetchError,
    ShardStreamDataset,
    SourceOptions,
)
from pyg_atompack.transport import RetryPolicy
from pyg_atompack.transport.transfers import MIN_PART_BYTES

FAST = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=5.0)


@pytest.fixture
def big_file(tmp_path):
    data = bytes(range(256)) * (3 * MIN_PART_BYTES // 256 + 7)  # a bit over 3 parts
    (tmp_path / "big.bin").write_bytes(data)
    # listed with its size, so nothing but the parts asks for big.bin
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"shards": [{"name": "big.bin", "bytes": len(data)}]}))
    return tmp_path, data


def _fetch(server, data, parts):
    source = RemoteSource(server.url("manifest.json"), suffixes=None, retry=FAST)
    (shard,) = source.list_shards()
    return source.fetch_in_parts(shard, CancelToken(), parts)


def test_parts_are_concurrent_ranges_assembled_in_one_map(big_file):
    root, data = big_file
    for server in serve_directory(root, bandwidth=400_000):
        body = _fetch(server, data, parts=3)
        assert isinstance(body, mmap.mmap) and body[:] == data
        log = server.requests_for("big.bin")
        assert sorted(entry.range for entry in log) == sorted(
            f"bytes={len(data) * n // 3}-{len(data) * (n + 1) // 3 - 1}" for n in range(3))
        assert all(entry.status == 206 for entry in log)
        # every part started before any finished: they ran side by side
        assert max(entry.started for entry in log) < min(entry.finished for entry in log)


def test_small_bodies_are_not_split(big_file):
    root, data = big_file
    for server in serve_directory(root):
        body = _fetch(server, data, parts=64)  # parts would be under MIN_PART_BYTES
        assert body[:] == data
        assert len(server.requests_for("big.bin")) == len(data) // MIN_PART_BYTES


def test_a_broken_part_resumes_its_own_range(big_file):
    root, data = big_file
    for server in serve_directory(root):
        server.add_fault("big.bin", "reset", at_fraction=0.5)  # the first request to arrive
        body = _fetch(server, data, parts=2)
        assert body[:] == data
        log = server.requests_for("big.bin")
        assert len(log) == 3
        broken = next(entry for entry in log if entry.fault == "reset")
        first, last = (int(v) for v in broken.range[len("bytes="):].split("-"))
        retry = [entry for entry in log if entry is not broken
                 and entry.range.endswith(f"-{last}") and entry.range != broken.range]
        # the retry asks for the rest of the broken range only (nothing fetched twice)
        assert retry and int(retry[0].range[len("bytes="):].split("-")[0]) > first
        assert sum(entry.body_bytes for entry in log) == len(data)


def test_a_server_ignoring_ranges_gets_one_plain_download(big_file):
    root, data = big_file
    for server in serve_directory(root, ignore_ranges=True):
        assert _fetch(server, data, parts=3)[:] == data
        plain = [entry for entry in server.requests_for("big.bin") if entry.range is None]
        assert len(plain) == 1 and plain[0].status == 200


def test_a_part_failing_for_good_names_the_shard(big_file):
    root, data = big_file
    for server in serve_directory(root):
        server.add_fault("big.bin", "500", times=50)
        with pytest.raises(ShardFetchError, match="big.bin"):
            _fetch(server, data, parts=2)


def test_dataset_fetches_each_shard_over_the_connections_free_when_it_starts(tmp_path):
    """Every shard takes the connections free when its download starts, one per part,
    and gives them back when its bytes are in: with a consumer that waits for every
    shard, shards come one after another in three parts each; a shard too small for
    parts holds one connection, so the others run beside it; ``split_shards=False``
    fetches them whole, side by side."""
    names = write_pt_shards(tmp_path, [400, 400, 400, 20, 20], atoms=8)
    assert (tmp_path / names[0]).stat().st_size > 3 * MIN_PART_BYTES
    assert (tmp_path / names[3]).stat().st_size < MIN_PART_BYTES
    for server in serve_directory(tmp_path, bandwidth=2_000_000):
        def stream(server=server, split_shards=True):
            options = SourceOptions(stream_shards="none", split_shards=split_shards)
            dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                                         options=options, prefetch=2, concurrency=3)
            before = [len(server.requests_for(name)) for name in names]
            ids = [int(sample.sample_id) for sample in dataset]
            assert ids == [*range(400), *range(1000, 1400), *range(2000, 2400),
                           *range(3000, 3020), *range(4000, 4020)]
            return [server.requests_for(name)[count:] for name, count in zip(names, before)]

        logs = stream()
        for log in logs[:3]:
            assert len(log) == 3 and all(entry.range for entry in log)
        for earlier, later in zip(logs[:3], logs[1:3]):  # each over all three connections
            assert min(e.started for e in later) >= max(e.finished for e in earlier) - 0.05
        assert [[e.range for e in log] for log in logs[3:]] == [[None], [None]]
        whole = stream(split_shards=False)
        assert [[e.range for e in log] for log in whole] == [[None]] * 5
        assert whole[1][0].started < whole[0][0].finished  # side by side
