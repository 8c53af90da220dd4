"""Bounded, cancellable, in-order prefetching of shard jobs on background threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from pyg_atompack.stream.errors import StreamCancelled
from pyg_atompack.stream.sources import CancelToken

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")

THREAD_NAME_PREFIX = "pyg_atompack-prefetch"
_JOIN_TIMEOUT_S = 2.0


class Lease:
    """The connections a prefetch job may download over, until it gives them back.

    Attributes:
        connections (int): Connections granted (1 or more): the job fetches over this many
            concurrent requests.
    """

    __slots__ = ("connections", "_give_back", "granted_at")

    def __init__(self, connections: int, give_back: Callable[[int], None]) -> None:
        self.connections = connections
        self._give_back = give_back
        self.granted_at = time.monotonic()

    def release(self) -> None:
        """Give the connections back (the job's download has ended); idempotent."""
        give_back, self._give_back = self._give_back, None
        if give_back is not None:
            give_back(self.connections, time.monotonic() - self.granted_at)


class Prefetcher(Generic[JobT, ResultT]):
    """Run ``load(job, cancel, lease)`` ahead of the consumer, yielding results in job order.

    With ``depth = k > 0``, up to ``k`` jobs beyond the one being consumed are started or
    finished ahead, on at most ``min(concurrency, k)`` threads. A slot is freed when the
    consumer takes a result, so at most ``k + 1`` results exist at any time (the ``k``
    ahead plus the one the consumer holds). With ``depth = 0`` nothing runs in the
    background: each job is loaded on the consumer's thread when asked for (the
    sequential baseline).

    ``concurrency`` also bounds the connections downloads hold at once. A job starts
    when a slot and at least one connection are free, and is leased (:class:`Lease`) as
    many of the free ones as it can use (``connections(job)``). It gives them back when
    its download ends (:meth:`Lease.release`; at the latest when ``load`` returns),
    before its decoding, so the next download starts while it decodes. Where servers
    cap each connection's bandwidth, shards one after another over ``c`` connections
    each arrive at the same total rate as ``c`` shards side by side, but each ``c``
    times sooner: a download-bound stream ends with one shard to consume after its
    last byte instead of ``c``, and the consumer waits once per shard, not ``c``
    shards at a time (``benchmarks/stream_overlap.py``).

    :meth:`resize` changes the depth and the connections while jobs run, and an
    ``observer`` (:class:`pyg_atompack.stream.autotune.StreamTuner`) hears of every
    download's connections and duration and of every result taken, with the consumer's
    wait for it.

    An exception raised by a job is re-raised to the consumer when it reaches that job.
    :meth:`close` cancels in-flight jobs through the shared :class:`CancelToken` (which
    interrupts blocking socket reads) and joins every thread.

    Args:
        jobs (Sequence[JobT]): Work items, in delivery order.
        load (Callable[[JobT, CancelToken, Lease], ResultT]): ``load(job, cancel, lease) ->
            result``; runs on a background thread (with ``depth = 0`` on the consumer's,
            leased ``connections(job)``).
        depth (int): Prefetch depth ``k``.
        concurrency (int, optional): Maximum jobs running, and connections held, at once.
            (default: :obj:`1`)
        connections (Callable[[JobT], int], optional): The most connections a job can use;
            :obj:`concurrency` or more makes a job that starts alone the only
            download until it gives them back. (default: one per job)
        settled (Callable[[ResultT], None], optional): Called on every successful result once
            the consumer can take it, and waited for before its lease is given back
            and the thread that loaded it takes another job: a result handed over
            while its download goes on keeps its connections until the download ends.
            It must not raise. (default: :obj:`None`)
    """

    def __init__(self, jobs: Sequence[JobT],
                 load: Callable[[JobT, CancelToken, Lease], ResultT], *,
                 depth: int, concurrency: int = 1,
                 connections: Callable[[JobT], int] | None = None,
                 settled: Callable[[ResultT], None] | None = None):
        if depth < 0 or concurrency < 1:
            raise ValueError(f"need depth >= 0 and concurrency >= 1, got {depth}, {concurrency}")
        self.jobs = list(jobs)
        self.load = load
        self.depth = depth
        self.cancel = CancelToken()
        self.wait_s = 0.0
        self._condition = threading.Condition()
        self._next_job = 0
        self._free_slots = depth
        self._concurrency = concurrency
        self._free_connections = concurrency
        self._connections = connections or (lambda job: 1)
        self._results: dict[int, tuple[bool, object]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._settled = settled
        #: told ``downloaded(connections, seconds)`` and ``taken(index, wait_s)``
        self.observer: Any = None
        if depth > 0:
            for number in range(min(concurrency, depth, len(self.jobs))):
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{THREAD_NAME_PREFIX}-{number}")
                self._threads.append(thread)
                thread.start()

    def _claim(self) -> tuple[int, Lease] | None:
        with self._condition:
            while not self._closed and self._next_job < len(self.jobs) and (
                    self._free_slots <= 0 or self._free_connections <= 0):
                self._condition.wait()
            if self._closed or self._next_job >= len(self.jobs):
                return None
            claimed = self._next_job
            wanted = min(max(self._connections(self.jobs[claimed]), 1), self._concurrency)
            granted = min(wanted, self._free_connections)
            self._free_slots -= 1
            self._free_connections -= granted
            self._next_job += 1
            return claimed, Lease(granted, self._give_back)

    def _give_back(self, connections: int, seconds: float) -> None:
        with self._condition:
            self._free_connections += connections
            self._condition.notify_all()
        if self.observer is not None:
            self.observer.downloaded(connections, seconds)

    def resize(self, depth: int, concurrency: int) -> None:
        """Change the depth and the connections from now on (jobs in flight keep theirs).

        Args:
            depth (int): The new prefetch depth (at least 1: a prefetcher that started
                with depth 0 runs no threads and is not resized).
            concurrency (int): The new maximum of connections held at once.
        """
        if self.depth == 0 or depth < 1 or concurrency < 1:
            raise ValueError(f"cannot resize depth {self.depth} to {depth}, {concurrency}")
        with self._condition:
            self._free_slots += depth - self.depth
            self._free_connections += concurrency - self._concurrency
            self.depth, self._concurrency = depth, concurrency
            wanted = min(concurrency, depth, len(self.jobs) - self._next_job)
            for number in range(len(self._threads), len(self._threads) + wanted
                                - sum(thread.is_alive() for thread in self._threads)):
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{THREAD_NAME_PREFIX}-{number}")
                self._threads.append(thread)
                thread.start()
            self._condition.notify_all()

    def _work(self) -> None:
        while (claimed := self._claim()) is not None:
            index, lease = claimed
            try:
                outcome = (True, self.load(self.jobs[index], self.cancel, lease))
            except StreamCancelled:
                lease.release()
                return
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                outcome = (False, error)
            settle = self._settled if outcome[0] else None
            if settle is None:
                lease.release()
            with self._condition:
                if self._closed:
                    return
                self._results[index] = outcome
                self._condition.notify_all()
            if settle is not None:
                settle(outcome[1])  # returns when its download ends (or is cancelled)
                lease.release()
            del outcome, settle  # the consumer's copy must be the only reference once taken

    def __iter__(self) -> Iterator[ResultT]:
        for index in range(len(self.jobs)):
            yield self._take(index)

    def _take(self, index: int) -> ResultT:
        if self.depth == 0:
            started = time.monotonic()
            job = self.jobs[index]
            lease = Lease(min(max(self._connections(job), 1), self._concurrency),
                          lambda n, s: None)
            try:
                return self.load(job, self.cancel, lease)
            finally:
                self.wait_s += time.monotonic() - started
        started = time.monotonic()
        with self._condition:
            while index not in self._results:
                if self._closed:
                    raise StreamCancelled("prefetcher was closed")
                self._condition.wait()
            succeeded, value = self._results.pop(index)
            self._free_slots += 1
            self._condition.notify_all()
        waited = time.monotonic() - started
        self.wait_s += waited
        if self.observer is not None:
            self.observer.taken(index, waited)
        if not succeeded:
            raise value
        return value

    def close(self) -> None:
        """Cancel in-flight jobs, drop finished results and join the threads."""
        with self._condition:
            self._closed = True
            self._results.clear()
            self._condition.notify_all()
        self.cancel.cancel()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)
        self._threads.clear()

    def __enter__(self) -> Prefetcher[JobT, ResultT]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
