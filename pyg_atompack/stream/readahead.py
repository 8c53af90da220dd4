"""Building the samples of lazily decoded shards ahead of the consumer, on one thread.

A lazily decoded shard (:class:`~pyg_atompack.pyg.samples.BufferViewSamples`: ``.pt``
layouts indexed in place, ``.atp`` shards) is its bytes plus an index; each ``Data`` is
built when it is taken (~15-40 us a sample). Built in the consumer's thread, that time
adds to every training step, where a loader that unpickles whole shards on its prefetch
thread (FoldPipe: ``torch.load``) hands over ready samples. :class:`ReadAhead` moves the
building off the consumer's thread without giving up the lazy layout's memory: one
background thread keeps a small window of the next samples of each shard being consumed
ready, in the order the consumer takes them.

The thread only gains where the consumer leaves the GIL free while it computes (torch
kernels, waiting on a GPU, I/O, ``time.sleep`` in the benchmarks); a consumer that holds
the GIL throughout gets no gain and loses little (the same work moves between threads).
The consumer never waits for the thread to start on a sample: when nothing is ready it
builds the next sample itself, so a starved or slow thread costs at most one build.
The thread refills a shard's window in one burst once half of it has been taken:
waking it for every sample cost more CPU in wake-ups than the builds it took over.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX

_JOIN_TIMEOUT_S = 2.0

SampleT = TypeVar("SampleT")

#: Ready samples kept per shard being consumed: enough for a batch of small molecules,
#: small against a shard (each is a few views of the shard's buffer).
DEFAULT_READ_AHEAD = 16


class _Job(Generic[SampleT]):
    """One shard's samples in consumption order; ``built`` holds the ready ones."""

    __slots__ = ("make", "order", "next", "built", "building", "active", "refilling")

    def __init__(self, make: Callable[[int], SampleT], order: Sequence[int]) -> None:
        self.make = make
        self.order = order
        self.next = 0  # position in ``order`` of the next sample to build
        self.built: deque[tuple[bool, object]] = deque()  # (succeeded, sample or error)
        self.building = False  # one build of a job at a time, by either thread
        self.active = True
        self.refilling = True  # the thread builds until the window is full


class ReadAhead(Generic[SampleT]):
    """Builds ``make(index)`` for the indices of each shard ahead of the consumer.

    Samples come out of :meth:`run` in ``order``, exactly as ``map(make, order)`` gives
    them (an exception raised by ``make`` is raised when its sample is reached). The
    thread starts with the first shard and keeps at most ``window`` built samples per
    shard that has not been consumed; a shard's ready samples are dropped when its
    :meth:`run` generator closes. Builds of one shard never overlap, so ``make`` needs
    to be safe only against builds of other shards.

    Args:
        window (int, optional): Samples built ahead per shard; ``0`` builds every sample in the
            consumer's thread, when it is taken, and starts no thread.
            (default: :data:`DEFAULT_READ_AHEAD`)
    """

    def __init__(self, window: int = DEFAULT_READ_AHEAD) -> None:
        if window < 0:
            raise ValueError(f"read-ahead window must be >= 0, got {window}")
        self.window = window
        self._condition = threading.Condition()
        self._jobs: list[_Job] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def run(self, make: Callable[[int], SampleT], order: Sequence[int]) -> Iterator[SampleT]:
        """Yields ``make(index)`` for every index of ``order``, built ahead.

        Args:
            make (Callable[[int], Any]): Builds the sample of one index.
            order (Sequence[int]): The indices, in the order they are taken.

        Yields:
            The samples, in ``order``.
        """
        if self.window == 0 or len(order) < 2 or self._closed:
            for index in order:
                yield make(index)
            return
        job = _Job(make, order)
        with self._condition:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name=f"{THREAD_NAME_PREFIX}-build")
                self._thread.start()
            self._condition.notify_all()
        try:
            for _ in range(len(order)):
                yield self._take(job)
        finally:
            with self._condition:
                job.active = False
                job.built.clear()
                self._jobs.remove(job)

    def _take(self, job: _Job) -> SampleT:
        if job.built:  # ready: only this thread takes from the deque, the other appends
            succeeded, value = job.built.popleft()
            if not job.refilling and len(job.built) <= self.window // 2:
                # refill in one burst from half the window: one wake-up of the thread
                # per window / 2 samples, not one per sample
                with self._condition:
                    job.refilling = True
                    self._condition.notify_all()
            if not succeeded:
                raise value  # type: ignore[misc]
            return value  # type: ignore[return-value]
        with self._condition:
            while not job.built and job.building:
                self._condition.wait()  # the thread is building exactly this sample
            if job.built:
                succeeded, value = job.built.popleft()
                if not succeeded:
                    raise value  # type: ignore[misc]
                return value  # type: ignore[return-value]
            index = job.order[job.next]
            job.next += 1
            job.building = True
        try:
            return job.make(index)  # nothing ready: build it here rather than wait
        finally:
            with self._condition:
                job.building = False
                self._condition.notify_all()

    def _next_job(self) -> _Job | None:
        for job in self._jobs:
            if job.refilling and not job.building and job.next < len(job.order):
                if len(job.built) < self.window:
                    return job
                job.refilling = False  # full: wait until half of it is taken
        return None

    def _work(self) -> None:
        condition = self._condition
        while True:
            with condition:
                while not self._closed and (job := self._next_job()) is None:
                    condition.wait()
                if self._closed:
                    return
                index = job.order[job.next]
                job.next += 1
                job.building = True
            try:
                outcome: tuple[bool, object] = (True, job.make(index))
            except BaseException as error:  # noqa: BLE001 - raised to the consumer in order
                outcome = (False, error)
            with condition:
                job.building = False
                if job.active:
                    job.built.append(outcome)
                condition.notify_all()
            # no reference may outlive the shard: a sample views its shard's buffer
            del outcome, job

    def close(self) -> None:
        """Drop every ready sample and join the thread."""
        with self._condition:
            self._closed = True
            for job in self._jobs:
                job.built.clear()
            self._condition.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_TIMEOUT_S)
        self._thread = None
