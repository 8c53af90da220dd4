"""Bounded, cancellable, in-order prefetching of shard jobs on background threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from pyg_atompack.stream.errors import StreamCancelled
from pyg_atompack.stream.sources import CancelToken

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")

THREAD_NAME_PREFIX = "pyg_atompack-prefetch"
_JOIN_TIMEOUT_S = 2.0


class Prefetcher(Generic[JobT, ResultT]):
    """Run ``load(job, cancel)`` ahead of the consumer, yielding results in job order.

    With ``depth = k > 0``, up to ``k`` jobs beyond the one being consumed are started or
    finished ahead, on at most ``min(concurrency, k)`` threads. A slot is freed when the
    consumer takes a result, so at most ``k + 1`` results exist at any time (the ``k``
    ahead plus the one the consumer holds). With ``depth = 0`` nothing runs in the
    background: each job is loaded on the consumer's thread when asked for (the
    sequential baseline).

    An exception raised by a job is re-raised to the consumer when it reaches that job.
    :meth:`close` cancels in-flight jobs through the shared :class:`CancelToken` (which
    interrupts blocking socket reads) and joins every thread.

    Args:
        jobs (Sequence[JobT]): Work items, in delivery order.
        load (Callable[[JobT, CancelToken], ResultT]): ``load(job, cancel) -> result``; runs on a
            background thread.
        depth (int): Prefetch depth ``k``.
        concurrency (int, optional): Maximum jobs running at once. (default: :obj:`1`)
        first_alone (bool, optional): Start no other job until the first has finished (it uses all
            ``concurrency`` connections itself, see ``ShardStreamDataset(split_first=)``).
            (default: :obj:`False`)
        settled (Callable[[ResultT], None], optional): Called on every successful result once
            the consumer can take it, and waited for before the thread that loaded it
            takes another job (and, with ``first_alone``, before other jobs start
            after the first): a result handed over while its download goes on keeps
            its connections until the download ends. It must not raise.
            (default: :obj:`None`)
    """

    def __init__(self, jobs: Sequence[JobT], load: Callable[[JobT, CancelToken], ResultT], *,
                 depth: int, concurrency: int = 1, first_alone: bool = False,
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
        self._results: dict[int, tuple[bool, object]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._first_pending = first_alone  # later jobs wait while the first one runs
        self._settled = settled
        if depth > 0:
            for number in range(min(concurrency, depth, len(self.jobs))):
                thread = threading.Thread(target=self._work, daemon=True,
                                          name=f"{THREAD_NAME_PREFIX}-{number}")
                self._threads.append(thread)
                thread.start()

    def _claim(self) -> int | None:
        with self._condition:
            while not self._closed and self._next_job < len(self.jobs) and (
                    self._free_slots == 0 or (self._first_pending and self._next_job > 0)):
                self._condition.wait()
            if self._closed or self._next_job >= len(self.jobs):
                return None
            self._free_slots -= 1
            claimed = self._next_job
            self._next_job += 1
            return claimed

    def _work(self) -> None:
        while (index := self._claim()) is not None:
            try:
                outcome = (True, self.load(self.jobs[index], self.cancel))
            except StreamCancelled:
                return
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                outcome = (False, error)
            settle = self._settled if outcome[0] else None
            with self._condition:
                if index == 0 and settle is None:
                    self._first_pending = False
                if self._closed:
                    return
                self._results[index] = outcome
                self._condition.notify_all()
            if settle is not None:
                settle(outcome[1])  # returns when its download ends (or is cancelled)
                if index == 0:
                    with self._condition:
                        self._first_pending = False
                        self._condition.notify_all()
            del outcome, settle  # the consumer's copy must be the only reference once taken

    def __iter__(self) -> Iterator[ResultT]:
        for index in range(len(self.jobs)):
            yield self._take(index)

    def _take(self, index: int) -> ResultT:
        if self.depth == 0:
            started = time.monotonic()
            try:
                return self.load(self.jobs[index], self.cancel)
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
        self.wait_s += time.monotonic() - started
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
