"""Prefetch depth and connections chosen by measurement, within a memory budget.

``ShardStreamDataset(memory_budget=...)`` hands its :class:`~pyg_atompack.stream.prefetch.
Prefetcher` to a :class:`StreamTuner`, which watches two things the prefetcher reports:

* each download: how long its connections were held and how many there were
  (:meth:`StreamTuner.downloaded`). On a link limited per connection, a shard split over
  ``c`` ranges arrives ``c`` times sooner, so ``seconds x connections`` estimates ``D1``,
  the time one connection alone would take;
* each shard the consumer takes: how long it waited for it, and how long it spent on the
  previous one (:meth:`StreamTuner.taken`), an estimate of ``C``, the consumption time.

From them it sets the connections so that downloads keep up with the consumer,
``c = ceil(margin x D1 / C)`` (more while downloads are the bottleneck, fewer when they are
not), and the prefetch depth so that enough shards are in flight to cover one download,
``ceil(D / C)`` with ``D = D1 / connections per shard``, plus one ready ahead while
``D1 > C``, but never more than the memory budget holds: ``(prefetch + 1)`` live shards
of ``DECODED_FACTOR x`` their listed bytes.
Before anything is measured the stream starts wide, with every connection it may use on
the first shard (connections cost no memory: they are ranges of one shard) and two shards
ahead where the budget holds them: the consumer waits for the first shard whatever the
settings, so it should arrive as soon as possible, and the second right after it. The
first shard's consumption is not measured (it is handed out as its bytes arrive, so the
consumer waits inside it). Each change is recorded with its reason; ``stats()`` reports
them under ``autotune``.

Without a budget, ``concurrency=None`` (the default) tunes the connections alone: the
prefetch depth stays as given, so the stream holds the ``prefetch + 1`` live shards it would
hold with any fixed ``concurrency``; connections are byte ranges of the shard being
downloaded and add no shard to memory. Up to :data:`DEFAULT_MAX_CONCURRENCY` per rank.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

__all__ = ["DECODED_FACTOR", "DEFAULT_MAX_CONCURRENCY", "MAX_CONCURRENCY", "StreamTuner",
           "check_memory_budget", "attach", "stream_tuner"]

#: A live shard's memory as a multiple of its listed (downloaded) bytes: the download
#: buffer plus the samples built from it.
DECODED_FACTOR = 1.5
#: The most connections a tuned stream opens (per rank).
MAX_CONCURRENCY = 16
#: The most connections the default stream (``concurrency=None``, no budget) opens per
#: rank: enough for downloads 6x slower than consumption on a link limited per
#: connection, few enough to stay polite to a shared server.
DEFAULT_MAX_CONCURRENCY = 8
#: Connections planned per connection the measurements ask for: downloads that only just
#: keep up leave the consumer waiting at every fluctuation.
MARGIN = 1.25
#: A setting shrinks only below this share of its value (estimates jitter).
SHRINK = 0.75
#: Smoothing of the estimates (weight of the newest measurement).
SMOOTHING = 0.5


def check_memory_budget(memory_budget: int | None) -> None:
    """Raises a clear error for a budget that is not a positive number of bytes.

    Args:
        memory_budget (int): ``ShardStreamDataset``'s ``memory_budget``.
    """
    if memory_budget is None:
        return
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) \
            or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got "
                         f"{memory_budget!r}")


class StreamTuner:
    """Chooses one stream's prefetch depth and connections from what it measures.

    Args:
        memory_budget (int): Bytes this stream's live shards may take (:obj:`None`:
            ``prefetch`` is fixed and only the connections are tuned).
        shard_bytes (int): The largest listed shard size (:obj:`None` if the
            source lists none; the tuner then uses the downloads' sizes as they come).
        max_concurrency (int, optional): The most connections it opens.
            (default: :obj:`MAX_CONCURRENCY`)
        prefetch (int, optional): A fixed prefetch depth (without a budget).
            (default: :obj:`None`)
    """

    def __init__(self, memory_budget: int | None, shard_bytes: int | None,
                 max_concurrency: int = MAX_CONCURRENCY, prefetch: int | None = None) -> None:
        check_memory_budget(memory_budget)
        if (memory_budget is None) == (prefetch is None):
            raise ValueError("pass a memory_budget (prefetch tuned) or a fixed prefetch")
        self.memory_budget = memory_budget
        self.fixed_prefetch = prefetch
        self.shard_bytes = shard_bytes
        self.max_concurrency = max(1, max_concurrency)
        # two shards: the second downloads as soon as the first's connections come back
        self.prefetch = prefetch if prefetch is not None else min(2, self._prefetch_cap())
        self.concurrency = self.max_concurrency
        self.single_connection_s: float | None = None  # D1
        self.consume_s: float | None = None  # C
        self.connections_per_shard: float | None = None
        self.decisions: list[dict[str, Any]] = []
        self._prefetcher: Any = None
        self._last_take: float | None = None
        self._takes = 0
        self._takes_elsewhere = False
        self._lock = threading.Lock()
        self._origin = time.monotonic()
        self._note("start", "nothing measured: every connection on the first shard, "
                            + ("two shards ahead (if the budget holds them)"
                               if prefetch is None else f"prefetch fixed at {prefetch}"))

    # ------------------------------------------------------------------ settings
    def start(self) -> tuple[int, int]:
        """``(prefetch, concurrency)`` to build the prefetcher with."""
        return self.prefetch, self.concurrency

    def attach(self, prefetcher: Any) -> None:
        """Receive the prefetcher's reports and resize it from now on.

        Args:
            prefetcher (Prefetcher): The stream's prefetcher, built with :meth:`start`.
        """
        self._prefetcher = prefetcher
        prefetcher.observer = self

    def _prefetch_cap(self) -> int:
        """The deepest prefetch the budget holds (at least 1: a stream that never overlaps
        is the sequential baseline, which ``prefetch=0`` asks for explicitly)."""
        if self.fixed_prefetch is not None:
            return self.fixed_prefetch
        if not self.shard_bytes or self.memory_budget is None:
            return 1
        live = self.memory_budget // math.ceil(DECODED_FACTOR * self.shard_bytes)
        return max(1, int(live) - 1)

    # ------------------------------------------------------------------ reports
    def downloaded(self, connections: int, seconds: float, size: int | None = None) -> None:
        """A download ended (called by the prefetcher when its connections come back).

        Args:
            connections (int): Connections it held.
            seconds (float): How long it held them.
            size (int, optional): Its bytes, when known. (default: :obj:`None`)
        """
        with self._lock:
            if size and (self.shard_bytes is None or size > self.shard_bytes):
                self.shard_bytes = size
            single = seconds * max(1, connections)
            self.single_connection_s = _smooth(self.single_connection_s, single)
            self.connections_per_shard = _smooth(self.connections_per_shard,
                                                 float(max(1, connections)))
        self._retune("download")

    def takes_reported_elsewhere(self) -> None:
        """From now on only :meth:`taken` calls with ``elsewhere=True`` time consumption.

        The retrieval process (:mod:`~pyg_atompack.stream.offproc`) builds items ahead of
        the consumer, up to a bound that may hold several shards: its prefetcher's takes
        time the building, not the consumer. The consumer's process reports its own takes
        instead.
        """
        self._takes_elsewhere = True

    def taken(self, index: int, wait_s: float, now: float | None = None, *,
              elsewhere: bool = False) -> None:
        """The consumer took result ``index`` after waiting ``wait_s`` seconds for it.

        Args:
            index (int): The job's index.
            wait_s (float): Seconds it was blocked since its previous take.
            now (float, optional): :func:`time.monotonic` of the take.
                (default: :obj:`None`, now)
            elsewhere (bool, optional): Reported by the consumer's process rather than
                by the prefetcher (see :meth:`takes_reported_elsewhere`).
                (default: :obj:`False`)
        """
        if self._takes_elsewhere and not elsewhere:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._takes += 1
            # between two takes the consumer waited, then worked on the previous shard;
            # not the first one: handed out as its bytes arrive, the consumer waited
            # inside it (stream/arriving.py), which would count as consumption
            if self._last_take is not None and self._takes > 2:
                self.consume_s = _smooth(self.consume_s,
                                         max(now - self._last_take - wait_s, 1e-6))
            self._last_take = now
        self._retune("take")

    # ------------------------------------------------------------------ decisions
    def _retune(self, event: str) -> None:
        with self._lock:
            if self.single_connection_s is None or self.consume_s is None:
                return
            ratio = self.single_connection_s / self.consume_s  # D1 / C
            concurrency = min(self.max_concurrency, max(1, _ceil(MARGIN * ratio)))
            # shards that split use several connections each: fewer need to be in flight;
            # while downloads could be the bottleneck, one more is ready ahead, so that a
            # download never has to fit exactly into one shard's consumption
            per_shard = max(1.0, min(self.connections_per_shard or 1.0, concurrency))
            in_flight = _ceil(MARGIN * ratio / per_shard) + (1 if ratio > 1 else 0)
            cap = self._prefetch_cap()  # the fixed prefetch, without a budget
            prefetch = min(cap, max(1, in_flight))
            if self.fixed_prefetch is not None:  # no budget: only connections are tuned
                prefetch = cap
            # hysteresis: grow at once, shrink only on a clear change (estimates jitter)
            if self.prefetch * SHRINK < prefetch < self.prefetch <= cap:
                prefetch = self.prefetch
            if self.concurrency * SHRINK < concurrency < self.concurrency:
                concurrency = self.concurrency
            if (prefetch, concurrency) == (self.prefetch, self.concurrency):
                return
            self.prefetch, self.concurrency = prefetch, concurrency
            reason = (f"D1/C = {ratio:.2f} (D1 {self.single_connection_s:.3f} s, "
                      f"C {self.consume_s:.3f} s)")
            if in_flight > cap and self.fixed_prefetch is None:
                reason += f"; prefetch capped at {cap} by memory_budget"
            self._note(event, reason)
        if self._prefetcher is not None:
            self._prefetcher.resize(prefetch, concurrency)

    def _note(self, event: str, reason: str) -> None:
        self.decisions.append({"at_s": round(time.monotonic() - self._origin, 4),
                               "event": event, "prefetch": self.prefetch,
                               "concurrency": self.concurrency, "reason": reason})

    def report(self) -> dict[str, Any]:
        """JSON-serialisable: the budget, the settings in force and every decision."""
        with self._lock:
            return {"memory_budget": self.memory_budget, "shard_bytes": self.shard_bytes,
                    "prefetch": self.prefetch, "concurrency": self.concurrency,
                    "single_connection_s": self.single_connection_s,
                    "consume_s": self.consume_s, "decisions": list(self.decisions)}


def stream_tuner(memory_budget: int | None, unit_bytes: list[int | None],
                 num_workers: int, concurrency: int | None = 1,
                 prefetch: int = 1) -> StreamTuner | None:
    """The tuner of one stream (one DataLoader worker's share of the rank's budget).

    Args:
        memory_budget (int): The rank's budget; :obj:`None` tunes at most the connections.
        unit_bytes (list): Listed sizes of the shards (or record blocks) it reads.
        num_workers (int): DataLoader workers of the rank: each gets an equal share.
        concurrency (int, optional): The stream's ``concurrency``; :obj:`None` (without a
            budget) tunes the connections, up to :data:`DEFAULT_MAX_CONCURRENCY` per rank.
            (default: :obj:`1`)
        prefetch (int, optional): This stream's share of ``prefetch``, kept without a
            budget. (default: :obj:`1`)

    Returns:
        The tuner, or :obj:`None` when nothing is tuned (a budget is not given and
        ``concurrency`` is, or ``prefetch=0``, the sequential baseline).
    """
    known = [size for size in unit_bytes if size]
    workers = max(1, num_workers)
    largest = max(known) if known else None
    if memory_budget is None:
        if concurrency is not None or prefetch < 1:
            return None
        return StreamTuner(None, largest, prefetch=prefetch,
                           max_concurrency=-(-DEFAULT_MAX_CONCURRENCY // workers))
    return StreamTuner(max(1, memory_budget // workers), largest,
                       max_concurrency=max(1, -(-MAX_CONCURRENCY // workers)))


def attach(tuner: StreamTuner | None, prefetcher: Any) -> Any:
    """Hands ``prefetcher`` to ``tuner`` (if any) and returns it."""
    if tuner is not None:
        tuner.attach(prefetcher)
    return prefetcher


def _ceil(value: float) -> int:
    # measured ratios are never exact: 4.000000000000001 asks for 4, not 5
    return math.ceil(value - 1e-9)


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - SMOOTHING) * previous + SMOOTHING * value
