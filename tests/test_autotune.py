"""Prefetch and connections chosen by measurement within ``memory_budget``.

The tuner's rule on given measurements; the prefetcher resized while jobs run; and
``ShardStreamDataset(memory_budget=...)`` against the throttled loopback server (a real
HTTP server limited per connection): downloads far slower than the consumer get more
connections, a small budget keeps prefetch low, every sample arrives once in order, and
``stats()`` reports the choice. Without a budget the default ``concurrency=None`` tunes
the connections alone: more than one while downloads are the bottleneck, one while the
consumer is, ``prefetch`` as given. Figures (tuned against fixed settings) are in
``benchmarks/autotune.py``, not here.
"""

from __future__ import annotations

import threading
import time

import pytest
from servers.http_server import serve_directory, write_pt_shards

from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream.autotune import (
    DECODED_FACTOR,
    DEFAULT_MAX_CONCURRENCY,
    StreamTuner,
    stream_tuner,
)
from pyg_atompack.stream.prefetch import Prefetcher
from pyg_atompack.transport import RetryPolicy

FAST = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=10.0)
MB = 1 << 20


class Resizes:
    """Stands in for the prefetcher: records what the tuner asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.observer = None

    def resize(self, depth: int, concurrency: int) -> None:
        self.calls.append((depth, concurrency))


def test_tuner_adds_connections_while_downloads_are_the_bottleneck() -> None:
    tuner = StreamTuner(memory_budget=100 * MB, shard_bytes=MB, max_concurrency=16)
    prefetcher = Resizes()
    tuner.attach(prefetcher)
    assert prefetcher.observer is tuner
    assert tuner.start() == (2, 16)  # nothing measured: wide on the first shard
    tuner.downloaded(connections=16, seconds=0.05)  # D1 = 0.8 s
    tuner.taken(0, wait_s=0.05, now=9.0)
    tuner.taken(1, wait_s=0.0, now=10.0)  # the first shard (its bytes arriving): not used
    assert prefetcher.calls == []  # C unknown yet
    tuner.taken(2, wait_s=0.0, now=10.1)  # C = 0.1 s: D1 / C = 8
    assert tuner.concurrency == 10  # ceil(1.25 x 8)
    # a shard splits over all of them: one in flight suffices, plus one ready ahead
    assert tuner.prefetch == 2
    assert prefetcher.calls == [(2, 10)]
    assert "D1/C = 8.00" in tuner.decisions[-1]["reason"]


def test_tuner_drops_connections_when_downloads_are_fast() -> None:
    tuner = StreamTuner(memory_budget=100 * MB, shard_bytes=MB)
    tuner.downloaded(connections=4, seconds=0.01)  # D1 = 0.04 s
    tuner.taken(0, wait_s=0.0, now=0.0)
    tuner.taken(1, wait_s=0.0, now=1.0)
    tuner.taken(2, wait_s=0.0, now=2.0)  # C = 1 s
    assert (tuner.prefetch, tuner.concurrency) == (1, 1)
    tuner.downloaded(connections=1, seconds=0.03)  # jitter: 0.035 s, still far below C
    tuner.taken(3, wait_s=0.0, now=2.9)
    assert (tuner.prefetch, tuner.concurrency) == (1, 1)


def test_default_tuner_keeps_prefetch_and_tunes_connections() -> None:
    tuner = stream_tuner(None, [MB], num_workers=1, concurrency=None, prefetch=1)
    assert tuner is not None and tuner.memory_budget is None
    assert tuner.start() == (1, DEFAULT_MAX_CONCURRENCY)  # wide on the first shard only
    tuner.downloaded(connections=8, seconds=0.1)  # D1 = 0.8 s
    for index, now in enumerate((0.0, 1.0, 1.2, 1.4)):  # C = 0.2 s: D1 / C = 4
        tuner.taken(index, wait_s=0.0, now=now)
    assert (tuner.prefetch, tuner.concurrency) == (1, 5)  # ceil(1.25 x 4); prefetch kept
    assert "memory_budget" not in tuner.decisions[-1]["reason"]
    # the consumer becomes the bottleneck: one connection
    for _ in range(4):
        tuner.downloaded(connections=5, seconds=0.002)
    assert (tuner.prefetch, tuner.concurrency) == (1, 1)
    # an explicit concurrency, or the sequential prefetch=0, tunes nothing
    assert stream_tuner(None, [MB], num_workers=1, concurrency=2, prefetch=1) is None
    assert stream_tuner(None, [MB], num_workers=1, concurrency=None, prefetch=0) is None
    # workers share the rank's connections
    assert stream_tuner(None, [MB], num_workers=2, concurrency=None,
                        prefetch=1).max_concurrency == DEFAULT_MAX_CONCURRENCY // 2
    with pytest.raises(ValueError, match="memory_budget"):
        StreamTuner(None, MB)


def test_takes_reported_by_the_consumers_process_alone_time_consumption() -> None:
    # the retrieval process (stream/offproc.py) builds items ahead of the consumer: its
    # prefetcher's takes come as fast as samples are built and must not count as C
    tuner = StreamTuner(None, MB, prefetch=1, max_concurrency=8)
    tuner.takes_reported_elsewhere()
    tuner.downloaded(connections=8, seconds=0.01)  # D1 = 0.08 s
    for index, now in enumerate((0.0, 0.001, 0.002, 0.003)):  # the child, building
        tuner.taken(index, 0.0, now=now)
    assert tuner.consume_s is None and tuner.concurrency == 8
    for index, now in enumerate((5.0, 6.0, 7.5, 8.5)):  # the consumer's process
        tuner.taken(index, 0.5 if index == 2 else 0.0, now=now, elsewhere=True)
    assert tuner.consume_s == pytest.approx(1.0)  # 1.5 s between takes, 0.5 s waited
    assert tuner.concurrency == 1


def test_unsplit_downloads_need_prefetch_and_memory_caps_it() -> None:
    roomy = StreamTuner(memory_budget=1000 * MB, shard_bytes=MB)
    roomy.downloaded(connections=1, seconds=0.4)  # D1 = 0.4 s, one connection per shard
    for index, now in enumerate((0.0, 1.0, 1.1)):  # C = 0.1 s
        roomy.taken(index, 0.0, now=now)
    assert (roomy.prefetch, roomy.concurrency) == (6, 5)  # 5 in flight, 1 each, 1 ready

    budget = int(3 * DECODED_FACTOR * MB)  # room for 3 live shards: prefetch 2 at most
    short = StreamTuner(memory_budget=budget, shard_bytes=MB)
    short.downloaded(connections=1, seconds=0.4)
    for index, now in enumerate((0.0, 1.0, 1.1)):
        short.taken(index, 0.0, now=now)
    assert (short.prefetch, short.concurrency) == (2, 5)
    assert "capped at 2 by memory_budget" in short.decisions[-1]["reason"]
    report = short.report()
    assert report["memory_budget"] == budget and report["prefetch"] == 2


def test_budget_is_split_between_workers_and_checked() -> None:
    tuner = stream_tuner(8 * MB, [MB, 2 * MB, None], num_workers=2)
    assert tuner.memory_budget == 4 * MB and tuner.shard_bytes == 2 * MB
    assert tuner.max_concurrency == 8
    assert stream_tuner(None, [MB], 1) is None
    for bad in (0, -5, 1.5, "1GB", True):
        with pytest.raises(ValueError, match="memory_budget must be a positive number"):
            StreamTuner(bad, MB)


def test_prefetcher_resize_runs_more_jobs_at_once_and_fewer_again() -> None:
    running, peak, gate = set(), [0], threading.Event()
    lock = threading.Lock()

    def load(job, cancel, lease):
        with lock:
            running.add(job)
            peak[0] = max(peak[0], len(running))
        gate.wait(5)
        lease.release()
        with lock:
            running.discard(job)
        return job

    prefetcher = Prefetcher(list(range(12)), load, depth=1, concurrency=1)
    try:
        time.sleep(0.1)
        assert peak[0] == 1
        prefetcher.resize(4, 4)  # 4 ahead over 4 connections: 4 jobs side by side
        deadline = time.monotonic() + 5
        while peak[0] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peak[0] == 4
        prefetcher.resize(1, 1)
        gate.set()
        assert list(prefetcher) == list(range(12))  # in order, none lost or repeated
    finally:
        prefetcher.close()
    with pytest.raises(ValueError, match="cannot resize"):
        Prefetcher([1], lambda job, cancel, lease: job, depth=0).resize(1, 1)


def shard_ids(dataset: ShardStreamDataset, consume_s: float) -> list[int]:
    ids = []
    for sample in dataset:
        ids.append(int(sample.sample_id))
        time.sleep(consume_s)
    return ids


@pytest.fixture
def slow_link(tmp_path):
    # 6 shards of ~330 KB (11 parts of 32 KiB each) over connections of 1 MB/s: one
    # connection takes ~0.33 s per shard, while the consumer spends ~0.05 s on it
    names = write_pt_shards(tmp_path, [20] * 6, atoms=300)
    for server in serve_directory(tmp_path, bandwidth=1_000_000):
        yield server, names


def test_stream_on_a_slow_link_gets_more_connections(slow_link) -> None:
    server, _ = slow_link
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    dataset = ShardStreamDataset(source, memory_budget=1 << 30)
    ids = shard_ids(dataset, consume_s=0.05 / 20)
    assert ids == [shard * 1000 + i for shard in range(6) for i in range(20)]
    tuned = dataset.stats()["autotune"]
    assert tuned["memory_budget"] == 1 << 30
    assert tuned["decisions"][0]["event"] == "start"
    assert tuned["concurrency"] >= 3, tuned  # D1/C ~ 6: several connections
    assert tuned["single_connection_s"] > tuned["consume_s"]
    # ranges went out side by side
    assert max(len(server.requests_for(name)) for name in ("shard-0004.pt", "shard-0005.pt")) > 1


def test_stream_with_a_small_budget_keeps_prefetch_low(slow_link) -> None:
    server, names = slow_link
    shard_bytes = max(s.size for s in RemoteSource(server.url("manifest.json")).list_shards())
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    budget = int(2 * DECODED_FACTOR * shard_bytes)  # two live shards
    dataset = ShardStreamDataset(source, options=SourceOptions(split_shards=False),
                                 memory_budget=budget)
    ids = shard_ids(dataset, consume_s=0.05 / 20)
    assert sorted(ids) == [shard * 1000 + i for shard in range(6) for i in range(20)]
    tuned = dataset.stats()["autotune"]
    assert tuned["prefetch"] == 1, tuned  # the budget holds no more
    assert any("by memory_budget" in d["reason"] for d in tuned["decisions"]), tuned
    assert dataset.stats()["peak_live_shards"] <= 3
    assert ShardStreamDataset(source).stats()["autotune"] is None


def test_default_stream_opens_more_connections_while_downloads_are_the_bottleneck(
        slow_link) -> None:
    server, _ = slow_link
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    dataset = ShardStreamDataset(source)  # the defaults: concurrency=None, prefetch=1
    ids = shard_ids(dataset, consume_s=0.05 / 20)
    assert ids == [shard * 1000 + i for shard in range(6) for i in range(20)]
    stats = dataset.stats()
    tuned = stats["autotune"]
    assert stats["concurrency"] is None and tuned["memory_budget"] is None
    # prefetch as given (one more in the retrieval process, stream/offproc.py), never
    # changed: memory stays where a fixed concurrency keeps it
    assert {d["prefetch"] for d in tuned["decisions"]} == {tuned["prefetch"]}
    assert tuned["prefetch"] <= 2
    assert tuned["concurrency"] > 1, tuned  # D1/C ~ 6
    assert stats["peak_live_shards"] <= 3
    assert len(server.requests_for("shard-0005.pt")) > 1  # ranges side by side


@pytest.fixture
def fast_link(tmp_path):
    # 12 shards of ~330 KB over connections of 20 MB/s: ~0.02 s per shard on one
    # connection, while the consumer spends ~0.15 s on it. More samples than the
    # retrieval process builds ahead (stream/offproc.py's AHEAD_SAMPLES): the later
    # shards download once the consumer's pace is measured
    names = write_pt_shards(tmp_path, [20] * 12, atoms=300)
    for server in serve_directory(tmp_path, bandwidth=20_000_000):
        yield server, names


def test_default_stream_keeps_one_connection_while_the_consumer_is_the_bottleneck(
        fast_link) -> None:
    server, _ = fast_link
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    dataset = ShardStreamDataset(source)
    ids = shard_ids(dataset, consume_s=0.15 / 20)
    assert ids == [shard * 1000 + i for shard in range(12) for i in range(20)]
    tuned = dataset.stats()["autotune"]
    assert tuned["concurrency"] == 1, tuned
    assert tuned["single_connection_s"] < tuned["consume_s"]
    # the consumer's time per shard, not the time to build its samples ahead of it
    assert tuned["consume_s"] > 0.1, tuned
    # once measured, shards come whole over one connection each
    assert len(server.requests_for("shard-0011.pt")) == 1
    # an explicit concurrency is kept as given: nothing tuned
    fixed = ShardStreamDataset(source, concurrency=2)
    shard_ids(fixed, consume_s=0.0)
    assert fixed.stats()["autotune"] is None
