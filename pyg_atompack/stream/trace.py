"""Per-shard timing traces of a streaming run, and their summary.

Times are seconds on the monotonic clock relative to the start of the iteration. Each
process (main, or every DataLoader worker) records its own trace; workers write theirs
as JSON files into the dataset's trace directory when their iteration ends, and the main
process merges the files of the current epoch (see ``ShardStreamDataset.trace``).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

TRACE_FIELDS = (
    "shard_index", "identifier", "download_start_s", "download_finish_s",
    "deserialize_finish_s", "consume_start_s", "consume_finish_s", "bytes", "structures",
)


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
        """JSON-serialisable snapshot: origin, records, wait and peak live shards."""
        with self._lock:
            records = [asdict(self._records[p]) for p in sorted(self._records)]
        return {"origin": self.origin, "rank": self.rank, "worker": self.worker,
                "wait_s": self.wait_s, "peak_live_shards": self.peak_live_shards,
                "records": records}

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
        ``{"origin", "wait_s", "peak_live_shards", "records"}`` with every time rebased
        to the earliest origin; wait times add up, peaks are the per-process maximum.
    """
    snapshots = list(snapshots)
    if not snapshots:
        return {"origin": None, "wait_s": 0.0, "peak_live_shards": 0, "records": []}
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
    return {"origin": origin, "wait_s": sum(s["wait_s"] for s in snapshots),
            "peak_live_shards": max(s["peak_live_shards"] for s in snapshots),
            "records": records}


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
        ``peak_live_shards``, ``bytes``, ``structures``, ``shards`` and ``skipped``.
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
    }


__all__ = ["ShardTrace", "TraceRecorder", "merge_traces", "summarize", "TRACE_FIELDS"]
