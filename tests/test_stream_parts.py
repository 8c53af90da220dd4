"""The first shard fetched over several connections at once, as byte ranges."""

from __future__ import annotations

import mmap

import pytest
from servers.http_server import serve_directory, write_pt_shards

from pyg_atompack.stream import (
    CancelToken,
    HTTPSource,
    ShardFetchError,
    ShardStreamDataset,
)
from pyg_atompack.stream.http import MIN_PART_BYTES, fetch_url_in_parts
from pyg_atompack.transport import RetryPolicy

FAST = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=5.0)


@pytest.fixture
def big_file(tmp_path):
    data = bytes(range(256)) * (3 * MIN_PART_BYTES // 256 + 7)  # a bit over 3 parts
    (tmp_path / "big.bin").write_bytes(data)
    return tmp_path, data


def _fetch(server, data, parts, **options):
    return fetch_url_in_parts(server.url("big.bin"), size=len(data), parts=parts,
                              name="big.bin", policy=FAST, cancel=CancelToken(), **options)


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


def test_dataset_fetches_its_first_shard_in_parts_before_any_other(tmp_path):
    names = write_pt_shards(tmp_path, [400, 400, 400], atoms=8)
    assert (tmp_path / names[0]).stat().st_size > 3 * MIN_PART_BYTES
    for server in serve_directory(tmp_path, bandwidth=2_000_000):
        # whole-shard streaming: the first shard in equal parts (streamed as it arrives,
        # the default, it comes in growing ranges in file order: test_stream_arriving.py)
        dataset = ShardStreamDataset(HTTPSource(server.url("manifest.json"), retry=FAST),
                                     prefetch=2, concurrency=3, stream_shards="none")
        ids = [int(sample.sample_id) for sample in dataset]
        assert ids == [*range(400), *range(1000, 1400), *range(2000, 2400)]
        first = server.requests_for(names[0])
        assert len(first) == 3 and all(entry.range for entry in first)
        others = server.requests_for(names[1]) + server.requests_for(names[2])
        assert [entry.range for entry in others] == [None, None]  # whole, later shards
        assert min(e.started for e in others) >= max(e.finished for e in first) - 0.05
        plain = ShardStreamDataset(HTTPSource(server.url("manifest.json"), retry=FAST),
                                   prefetch=2, concurrency=3, split_first=False,
                                   stream_shards="none")
        before = len(server.requests_for(names[0]))
        assert len(list(plain)) == 1200
        assert [e.range for e in server.requests_for(names[0])[before:]] == [None]
