"""The prefetcher's connection leases: what a download may use, and when it gives it back."""

from __future__ import annotations

import threading
import time

import pytest

from pyg_atompack.remote import RemoteFile
from pyg_atompack.stream.errors import ShardFetchError
from pyg_atompack.stream.prefetch import Prefetcher


def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class _Downloads:
    """Jobs whose download ends when ``downloaded[job]`` is set and whose decoding ends
    when ``decoded[job]`` is set, recording their leases and the connections held."""

    def __init__(self, count: int, release_early: bool = True):
        self.downloaded = [threading.Event() for _ in range(count)]
        self.decoded = [threading.Event() for _ in range(count)]
        self.leased: dict[int, int] = {}
        self.held = self.peak = 0
        self.release_early = release_early
        self._lock = threading.Lock()

    def load(self, job, cancel, lease):
        with self._lock:
            self.leased[job] = lease.connections
            self.held += lease.connections
            self.peak = max(self.peak, self.held)
        assert self.downloaded[job].wait(5)
        with self._lock:
            self.held -= lease.connections
        if self.release_early:
            lease.release()  # the bytes are in: the next download may start
            lease.release()  # idempotent
        assert self.decoded[job].wait(5)
        return job

    def finish(self, job: int) -> None:
        self.downloaded[job].set()
        self.decoded[job].set()


def test_a_download_is_leased_the_connections_free_when_it_starts():
    jobs = _Downloads(4)
    prefetcher = Prefetcher(range(4), jobs.load, depth=3, concurrency=3,
                            connections=lambda job: 2)
    try:
        results = iter(prefetcher)
        _until(lambda: len(jobs.leased) == 2)
        time.sleep(0.05)
        # job 0 can use two of the three connections, job 1 gets the one left, job 2
        # waits for a connection (a slot is free)
        assert jobs.leased == {0: 2, 1: 1}
        jobs.downloaded[0].set()  # job 0's bytes are in; it is still decoding
        _until(lambda: 2 in jobs.leased)
        assert jobs.leased[2] == 2 and not jobs.decoded[0].is_set()
        jobs.decoded[0].set()
        assert next(results) == 0  # the consumer frees a slot; no connection is free
        time.sleep(0.05)
        assert 3 not in jobs.leased
        jobs.finish(1)
        assert next(results) == 1
        _until(lambda: 3 in jobs.leased)
        assert jobs.leased[3] == 1  # job 2 still holds two
        jobs.finish(2)
        jobs.finish(3)
        assert list(results) == [2, 3]
        assert jobs.peak <= 3
    finally:
        prefetcher.close()


def test_a_download_that_never_says_its_bytes_are_in_frees_its_connections_on_return():
    jobs = _Downloads(3, release_early=False)
    prefetcher = Prefetcher(range(3), jobs.load, depth=2, concurrency=2,
                            connections=lambda job: 2)
    try:
        results = iter(prefetcher)
        _until(lambda: 0 in jobs.leased)
        jobs.downloaded[0].set()
        time.sleep(0.05)
        assert jobs.leased == {0: 2}  # still decoding: its lease is not given back yet
        jobs.decoded[0].set()
        _until(lambda: 1 in jobs.leased)
        assert jobs.leased[1] == 2
        jobs.finish(1)
        jobs.finish(2)
        assert list(results) == [0, 1, 2]
    finally:
        prefetcher.close()


def test_a_failed_download_gives_its_connections_back():
    leased = {}

    def load(job, cancel, lease):
        leased[job] = lease.connections
        if job == 0:
            raise ShardFetchError("shard 0: gone")
        return job

    prefetcher = Prefetcher(range(3), load, depth=2, concurrency=2, connections=lambda job: 2)
    try:
        with pytest.raises(ShardFetchError, match="shard 0"):
            next(iter(prefetcher))
        _until(lambda: len(leased) == 3)
        assert leased == {0: 2, 1: 2, 2: 2}  # both connections free for each later one
    finally:
        prefetcher.close()


def test_a_result_settled_later_keeps_its_connections_until_then():
    settled = threading.Event()
    leased = []

    def load(job, cancel, lease):
        leased.append((job, lease.connections))
        return job

    prefetcher = Prefetcher(range(2), load, depth=2, concurrency=2,
                            connections=lambda job: 2 if job == 0 else 1,
                            settled=lambda result: settled.wait(5) if result == 0 else None)
    try:
        results = iter(prefetcher)
        assert next(results) == 0  # handed over while its download goes on
        time.sleep(0.05)
        assert leased == [(0, 2)]
        settled.set()
        assert list(results) == [1]
        assert leased == [(0, 2), (1, 1)]
    finally:
        prefetcher.close()


def test_sequential_loading_leases_what_a_job_can_use():
    leased = []
    prefetcher = Prefetcher(range(2), lambda job, cancel, lease: leased.append(
        lease.connections) or job, depth=0, concurrency=3, connections=lambda job: 5)
    assert list(prefetcher) == [0, 1]
    assert leased == [3, 3]  # capped at concurrency


def test_a_shard_is_leased_no_more_connections_than_it_has_parts():
    """A lease larger than a download's parts would hold connections nobody uses (and
    keep other shards from starting): one part per MIN_PART_BYTES, at most the budget."""
    from pyg_atompack.stream.loading import ShardLoader
    from pyg_atompack.stream.sources import ShardInfo
    from pyg_atompack.transport.transfers import MIN_PART_BYTES

    class Ranged:
        def fetch_in_parts(self, shard, cancel, parts):  # pragma: no cover - not called
            raise AssertionError

    class Whole:
        pass

    shards = [ShardInfo(RemoteFile("tiny", size=MIN_PART_BYTES - 1)),
              ShardInfo(RemoteFile("two", size=2 * MIN_PART_BYTES)),
              ShardInfo(RemoteFile("big", size=10 << 20)), ShardInfo(RemoteFile("unknown"))]

    def loader(source):
        return ShardLoader(source, shards, trusted=False, verify=True, on_error="raise")

    ranged = loader(Ranged())
    assert [ranged.connections(i, 3) for i in range(4)] == [1, 2, 3, 1]
    assert ranged.connections(2, 1) == 1
    assert [loader(Whole()).connections(i, 3) for i in range(4)] == [1] * 4
