"""Per-shard timing traces of a streaming run, and their summary.

Times are seconds on the monotonic clock relative to the start of the iteration. Each
process (main, or every DataLoader worker) records its own trace; workers write theirs
as JSON files into the dataset's trace directory when their iteration ends, and the main
process merges the files of the current epoch (see ``ShardStreamDataset.trace``).

The consumer's side, step by step, is :class:`StepWaitMeter`'s: the share of each
training step spent waiting for data, on the wall clock or, when the model runs on a
GPU, with CUDA events.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TRACE_FIELDS = (
    "shard_index", "identifier", "download_start_s", "download_finish_s",
    "deserialize_finish_s", "consume_start_s", "consume_finish_s", "bytes", "structures",
)

#: Values of ``StepWaitMeter(clock=)`` and :func:`resolve_wait_clock`.
WAIT_CLOCKS = ("auto", "wall", "cuda")


@dataclass
class ShardTrace:
    """Timeline of one shard (``None`` for stages it never reached).

    Attributes:
        shard_index: Index of the shard in the source listing.
        identifier: Shard name.
        download_start_s: Start of the transfer.
        download_finish_s: All bytes received (and verified).
        deserialize_finish_s: Samples decoded, bytes released.
        consume_start_s: First sample handed to the consumer.
        consume_finish_s: Consumer came back after the last sample of this shard.
        bytes: Shard size in bytes.
        structures: Number of samples decoded.
        rank: DDP rank of the reading process.
        worker: DataLoader worker id (0 in the main process).
        status: ``"ok"``, ``"skipped"`` (failed, ``on_error="skip"``) or ``"cancelled"``.
        steps: Consumer steps attributed to this shard (those whose sample or batch
            ended with one of its samples; see :class:`StepWaitMeter`).
        step_wait_s: Time those steps waited for their data.
        step_time_s: Their whole time (wait + compute).
    """

    shard_index: int
    identifier: str
    download_start_s: float | None = None
    download_finish_s: float | None = None
    deserialize_finish_s: float | None = None
    consume_start_s: float | None = None
    consume_finish_s: float | None = None
    bytes: int = 0
    structures: int = 0
    rank: int = 0
    worker: int = 0
    status: str = "ok"
    steps: int = 0
    step_wait_s: float = 0.0
    step_time_s: float = 0.0


class _WallMark:
    """A moment on the host's monotonic clock (the CPU stand-in for a CUDA event)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = time.perf_counter()

    def done(self) -> bool:
        return True

    def seconds_to(self, later: _WallMark) -> float:
        return later.seconds - self.seconds


class _CudaMark:
    """A CUDA event recorded on the current stream: the moment the GPU reaches it."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event
        event.record()

    def done(self) -> bool:
        return bool(self.event.query())

    def seconds_to(self, later: _CudaMark) -> float:
        later.event.synchronize()
        return self.event.elapsed_time(later.event) / 1e3  # milliseconds


def _cuda_event() -> Any:
    import torch  # only where a model runs on a GPU

    return torch.cuda.Event(enable_timing=True)


def check_wait_clock(clock: str) -> None:
    """Raise :class:`ValueError` unless ``clock`` is one of :data:`WAIT_CLOCKS`.

    Args:
        clock (str): The value of ``wait_clock``.
    """
    if clock not in WAIT_CLOCKS:
        raise ValueError(f"wait_clock must be one of {WAIT_CLOCKS}, got {clock!r}")


def resolve_wait_clock(clock: str) -> str:
    """The clock :class:`StepWaitMeter` uses for ``clock`` (one of :data:`WAIT_CLOCKS`).

    Args:
        clock (str): ``"wall"``, ``"cuda"``, or ``"auto"``: CUDA events when CUDA is
            initialised in this process (a model or tensor was put on a GPU), else the
            wall clock.

    Returns:
        ``"wall"`` or ``"cuda"``.
    """
    check_wait_clock(clock)
    if clock != "auto":
        return clock
    import sys

    torch = sys.modules.get("torch")  # no torch imported: nothing can be on a GPU
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda"
    return "wall"


class StepWaitMeter:
    """The share of each consumer step spent waiting for data.

    A *step* runs from the moment the consumer asks for a sample or batch (calls
    ``next()``) to the moment it asks for the following one. Its *wait* is the time
    from asking to receiving the item; the rest of the step, from receiving the item
    to asking again, is the consumer's *compute* (moving the batch to the device,
    forward, backward, optimiser step, logging). The wait share is
    ``sum(wait) / sum(wait + compute)`` over the steps measured: 0 when data is always
    ready, near 1 when the consumer spends its time waiting. A step whose consumer
    never asks again (the loop was left with ``break``) has no end and is not counted.

    Clocks:

    * ``"wall"``: :func:`time.perf_counter` on the consumer's thread.
    * ``"cuda"``: CUDA events recorded on the consumer thread's current stream when it
      asks and when it receives. An event times the moment the GPU reaches it, after
      the work queued before it, so a step's wait is how long the *GPU* sat idle
      waiting for that batch: zero when the batch arrived while the GPU was still
      busy with the previous step's kernels, even if the Python thread did wait.
      Events are read (without blocking) as they complete, and at :meth:`summary`.

    Args:
        clock (str, optional): ``"wall"`` or ``"cuda"``; ``"auto"`` picks with
            :func:`resolve_wait_clock`. (default: :obj:`"wall"`)
        event_factory (Callable[[], Any], optional): Makes the CUDA events (an object
            with ``record()``, ``query()``, ``synchronize()`` and
            ``elapsed_time(other)`` in milliseconds, like :class:`torch.cuda.Event`);
            for tests. (default: :obj:`None`, ``torch.cuda.Event(enable_timing=True)``)
    """

    def __init__(self, clock: str = "wall",
                 event_factory: Callable[[], Any] | None = None) -> None:
        self.clock = resolve_wait_clock(clock)
        if self.clock == "cuda":
            factory = event_factory or _cuda_event
            self._mark: Callable[[], Any] = lambda: _CudaMark(factory())
        else:
            self._mark = _WallMark
        self.steps = 0
        self.wait_s = 0.0
        self.step_s = 0.0
        self.by_key: dict[Hashable, list] = {}  # key -> [steps, wait_s, step_s]
        self._asked: Any = None
        self._received: tuple[Any, Hashable] | None = None
        self._open: list[tuple[Any, Any, Any, Hashable]] = []  # ended, not yet read
        self._lock = threading.Lock()

    def asked(self) -> None:
        """The consumer asks for its next item (it has finished the previous step)."""
        mark = self._mark()
        with self._lock:
            if self._received is not None and self._asked is not None:
                received, key = self._received
                self._open.append((self._asked, received, mark, key))
                self._read_locked(block=False)
            self._asked, self._received = mark, None

    def received(self, key: Hashable = None) -> None:
        """The consumer receives the item it asked for.

        Args:
            key (Hashable, optional): What the step is attributed to in :attr:`by_key`
                (the dataset passes the position of the item's last shard).
                (default: :obj:`None`)
        """
        mark = self._mark()
        with self._lock:
            self._received = (mark, key)

    def _read_locked(self, block: bool) -> None:
        # steps whose end the clock has reached, oldest first (the wall clock's at once)
        while self._open and (block or self._open[0][2].done()):
            asked, received, ended, key = self._open.pop(0)
            wait, step = asked.seconds_to(received), asked.seconds_to(ended)
            self.steps += 1
            self.wait_s += wait
            self.step_s += step
            totals = self.by_key.get(key)
            if totals is None:
                totals = self.by_key[key] = [0, 0.0, 0.0]
            totals[0] += 1
            totals[1] += wait
            totals[2] += step

    def summary(self) -> dict:
        """Figures of the steps measured so far (waits for the GPU's events to complete).

        Returns:
            ``steps``, ``step_wait_s`` (summed waits), ``step_s`` (summed step times),
            ``wait_share`` (their ratio, :obj:`None` before a step has ended) and
            ``wait_clock`` (``"wall"`` or ``"cuda"``).
        """
        with self._lock:
            self._read_locked(block=True)
        return {"steps": self.steps, "step_wait_s": self.wait_s, "step_s": self.step_s,
                "wait_share": self.wait_s / self.step_s if self.step_s > 0 else None,
                "wait_clock": self.clock}

    def wrap(self, items: Iterable) -> Iterator:
        """Yield ``items`` while timing the consumer's steps.

        For a consumer the dataset cannot see itself, e.g. a ``DataLoader`` with
        worker processes: ``for batch in meter.wrap(loader): ...``.

        Args:
            items (Iterable): Any iterable.

        Yields:
            Its items, unchanged.
        """
        iterator = iter(items)
        while True:
            self.asked()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self.received()
            yield item


class TraceRecorder:
    """Thread-safe collector of :class:`ShardTrace` records for one iteration.

    Args:
        rank (int, optional): DDP rank stamped on records. (default: :obj:`0`)
        worker (int, optional): Worker id stamped on records. (default: :obj:`0`)
    """

    def __init__(self, rank: int = 0, worker: int = 0):
        self.origin = time.monotonic()
        self.rank = rank
        self.worker = worker
        self.wait_s = 0.0
        self.meter: StepWaitMeter | None = None  # the consumer's steps (main process)
        self.tuner: Any = None  # a StreamTuner (stream/autotune.py) with memory_budget
        self.peak_live_shards = 0
        self._live_shards = 0
        self._lock = threading.Lock()
        self._records: dict[int, ShardTrace] = {}

    def now(self) -> float:
        """Seconds since the iteration started."""
        return time.monotonic() - self.origin

    def record(self, position: int, shard_index: int, identifier: str) -> ShardTrace:
        """The (new or existing) record of the shard at ``position`` in this stream."""
        with self._lock:
            if position not in self._records:
                self._records[position] = ShardTrace(shard_index, identifier, rank=self.rank,
                                                     worker=self.worker)
            return self._records[position]

    def consumption_started(self, position: int, shard_index: int) -> None:
        """The consumer took the first sample of the shard at ``position``."""
        record = self.record(position, shard_index, "")
        if record.consume_start_s is None:
            record.consume_start_s = self.now()

    def cut_short(self, positions: Iterable[int] | None = None) -> None:
        """End the consumption of shards started but not finished (a quota, ``break`` or
        error ended the iteration), at ``positions`` (:obj:`None`: any)."""
        now = self.now()
        with self._lock:
            records = (self._records.values() if positions is None else
                       [self._records[p] for p in positions if p in self._records])
            for record in records:
                if record.consume_start_s is not None and record.consume_finish_s is None:
                    record.consume_finish_s = now

    def shard_alive(self, delta: int) -> None:
        """Count a decoded shard coming to life (+1) or being released (-1)."""
        with self._lock:
            self._live_shards += delta
            self.peak_live_shards = max(self.peak_live_shards, self._live_shards)

    @property
    def live_shards(self) -> int:
        """Decoded shards currently alive."""
        return self._live_shards

    def to_dict(self) -> dict:
        """JSON-serialisable snapshot: origin, records, waits and peak live shards."""
        steps = self.meter.summary() if self.meter is not None else None
        by_key = dict(self.meter.by_key) if self.meter is not None else {}
        with self._lock:
            records = []
            for position in sorted(self._records):
                record = asdict(self._records[position])
                count, wait, total = by_key.get(position, (0, 0.0, 0.0))
                record.update(steps=count, step_wait_s=wait, step_time_s=total)
                records.append(record)
        return {"origin": self.origin, "rank": self.rank, "worker": self.worker,
                "wait_s": self.wait_s, "peak_live_shards": self.peak_live_shards,
                "step_wait": steps, "records": records,
                "autotune": None if self.tuner is None else self.tuner.report()}

    def write(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_dict` atomically as JSON."""
        path = Path(path)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(self.to_dict()), encoding="utf-8")
        os.replace(temporary, path)


def merge_traces(snapshots: Iterable[Mapping]) -> dict:
    """Merge per-process snapshots (from :meth:`TraceRecorder.to_dict`) onto one clock.

    Args:
        snapshots (Iterable[Mapping]): Snapshots of processes that ran the same epoch.

    Returns:
        ``{"origin", "wait_s", "peak_live_shards", "step_wait", "records"}`` with every
        time rebased to the earliest origin; wait times add up, peaks are the
        per-process maximum; ``step_wait`` is the one process's
        :meth:`StepWaitMeter.summary` that timed its consumer (:obj:`None` if none did:
        DataLoader workers cannot see the main process's steps).
    """
    snapshots = list(snapshots)
    if not snapshots:
        return {"origin": None, "wait_s": 0.0, "peak_live_shards": 0, "step_wait": None,
                "records": []}
    origin = min(s["origin"] for s in snapshots)
    records = []
    for snapshot in snapshots:
        shift = snapshot["origin"] - origin
        for record in snapshot["records"]:
            moved = dict(record)
            for key in TRACE_FIELDS:
                if key.endswith("_s") and moved.get(key) is not None:
                    moved[key] += shift
            records.append(moved)
    records.sort(key=lambda r: (r["download_start_s"] is None, r["download_start_s"] or 0.0))
    steps = next((s["step_wait"] for s in snapshots if s.get("step_wait")), None)
    return {"origin": origin, "wait_s": sum(s["wait_s"] for s in snapshots),
            "peak_live_shards": max(s["peak_live_shards"] for s in snapshots),
            "step_wait": steps, "records": records}


def _span(record: Mapping, start: str, end: str) -> tuple[float, float] | None:
    if record.get(start) is None or record.get(end) is None:
        return None
    return record[start], record[end]


def summarize(merged: Mapping) -> dict:
    """Summary figures of a (merged) trace.

    Args:
        merged (Mapping): Output of :func:`merge_traces` (or one snapshot).

    Returns:
        ``total_s`` (latest event), ``io_s`` (summed download time), ``deserialize_s``,
        ``consume_s``, ``overlap_s`` (sum over all (download, consume) pairs of their
        intersection), ``wait_s`` (time the consumer blocked waiting for a shard),
        ``peak_live_shards``, ``bytes``, ``structures``, ``shards``, ``skipped``, and
        the consumer's steps as :meth:`StepWaitMeter.summary` gives them: ``steps``,
        ``step_wait_s``, ``step_s``, ``wait_share`` and ``wait_clock`` (the last
        two :obj:`None` when no step was timed, e.g. behind DataLoader workers).
    """
    records = merged["records"]
    downloads = [s for r in records if (s := _span(r, "download_start_s", "download_finish_s"))]
    consumes = [s for r in records if (s := _span(r, "consume_start_s", "consume_finish_s"))]
    decodes = [s for r in records
               if (s := _span(r, "download_finish_s", "deserialize_finish_s"))]
    overlap = 0.0
    for d_start, d_end in downloads:
        for c_start, c_end in consumes:
            overlap += max(0.0, min(d_end, c_end) - max(d_start, c_start))
    times = [r[k] for r in records for k in TRACE_FIELDS if k.endswith("_s") and r.get(k)]
    return {
        "total_s": max(times, default=0.0),
        "io_s": math.fsum(b - a for a, b in downloads),
        "deserialize_s": math.fsum(b - a for a, b in decodes),
        "consume_s": math.fsum(b - a for a, b in consumes),
        "overlap_s": overlap,
        "wait_s": merged["wait_s"],
        "peak_live_shards": merged["peak_live_shards"],
        "bytes": sum(r["bytes"] for r in records),
        "structures": sum(r["structures"] for r in records),
        "shards": len(records),
        "skipped": sum(r["status"] == "skipped" for r in records),
        **(merged.get("step_wait") or {"steps": 0, "step_wait_s": 0.0, "step_s": 0.0,
                                       "wait_share": None, "wait_clock": None}),
    }


__all__ = ["ShardTrace", "TraceRecorder", "StepWaitMeter", "check_wait_clock",
           "resolve_wait_clock", "merge_traces", "summarize", "TRACE_FIELDS", "WAIT_CLOCKS"]
