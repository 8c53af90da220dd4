"""Statistics shared by the paired benchmarks (stream overlap, SchNet training).

A *paired* benchmark runs a baseline and a candidate back to back, N times, alternating
which goes first, so that drift on a shared machine hits both sides of a pair alike. The
per-pair speed-up ``baseline / candidate`` is then summarised by its geometric mean (the
right mean for ratios) with a deterministic percentile-bootstrap confidence interval.

The module also turns per-shard traces (download and consume intervals) into the
overlap figures used to explain a speed-up: I/O time, compute time, consumer wait, and the
I/O-compute overlap, defined as the sum over all (download, consume) interval pairs of
their intersection.

Only numpy is needed, so every benchmark can import this file directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_RESAMPLES = 20_000
DEFAULT_SEED = 20_240_601

Interval = tuple[float, float]


def _as_positive_array(values: Iterable[float], what: str) -> np.ndarray:
    array = np.asarray(list(values), dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what}: expected a non-empty sequence of numbers")
    if not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise ValueError(f"{what}: every value must be finite and > 0, got {array.tolist()}")
    return array


def paired_speedups(baseline: Sequence[float], candidate: Sequence[float]) -> np.ndarray:
    """Per-pair speed-ups ``baseline[i] / candidate[i]``.

    Args:
        baseline: Wall times of the reference runs (seconds).
        candidate: Wall times of the runs being evaluated, in the same pair order.

    Returns:
        A float64 array of speed-ups; values above 1 mean the candidate is faster.
    """
    base = _as_positive_array(baseline, "baseline times")
    cand = _as_positive_array(candidate, "candidate times")
    if base.shape != cand.shape:
        raise ValueError(f"paired samples differ in length: {base.size} vs {cand.size}")
    return base / cand


def geometric_mean(values: Sequence[float]) -> float:
    """Geometric mean of positive values.

    Args:
        values: Positive numbers, e.g. paired speed-ups.

    Returns:
        ``exp(mean(log(values)))``.
    """
    array = _as_positive_array(values, "geometric mean input")
    return float(np.exp(np.mean(np.log(array))))


def bootstrap_ci(
    values: Sequence[float],
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> tuple[float, float]:
    """Deterministic percentile-bootstrap confidence interval.

    The same ``values``, ``resamples`` and ``seed`` always give the same interval, so
    results files can be regenerated exactly.

    Args:
        values: The observed sample (one value per pair).
        statistic: Vectorised statistic: maps an array of shape ``(resamples, n)`` to
            shape ``(resamples,)`` (e.g. ``lambda a: a.mean(axis=1)``).
        confidence: Two-sided coverage of the interval. (default: :obj:`0.95`)
        resamples: Number of bootstrap resamples. (default: :obj:`20000`)
        seed: Seed of the resampling generator. (default: fixed constant)

    Returns:
        ``(low, high)`` percentile bounds.
    """
    sample = np.asarray(values, dtype=np.float64)
    if sample.ndim != 1 or sample.size == 0:
        raise ValueError("bootstrap_ci needs a non-empty 1-D sample")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, sample.size, size=(resamples, sample.size))
    estimates = np.asarray(statistic(sample[picks]), dtype=np.float64)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(estimates, [tail, 100.0 - tail])
    return float(low), float(high)


def _geomean_rows(array: np.ndarray) -> np.ndarray:
    return np.exp(np.mean(np.log(array), axis=1))


def _mean_rows(array: np.ndarray) -> np.ndarray:
    return array.mean(axis=1)


def _median_rows(array: np.ndarray) -> np.ndarray:
    return np.median(array, axis=1)


@dataclass(frozen=True)
class PairedSummary:
    """Summary of a paired comparison (all times in seconds).

    Attributes:
        pairs: Number of pairs.
        speedup_geomean: Geometric mean of ``baseline / candidate``.
        speedup_ci: Bootstrap interval of the geometric mean.
        saved_mean: Mean of ``baseline - candidate``.
        saved_mean_ci: Bootstrap interval of ``saved_mean``.
        saved_median: Median of ``baseline - candidate``.
        saved_median_ci: Bootstrap interval of ``saved_median``.
        baseline_median: Median baseline time.
        candidate_median: Median candidate time.
    """

    pairs: int
    speedup_geomean: float
    speedup_ci: tuple[float, float]
    saved_mean: float
    saved_mean_ci: tuple[float, float]
    saved_median: float
    saved_median_ci: tuple[float, float]
    baseline_median: float
    candidate_median: float

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dictionary."""
        return asdict(self)


def summarize_pairs(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> PairedSummary:
    """Summarise paired wall times: speed-up and time saved, each with a bootstrap CI.

    Args:
        baseline: Reference wall times, one per pair.
        candidate: Candidate wall times, same pair order.
        confidence: Coverage of every interval. (default: :obj:`0.95`)
        resamples: Bootstrap resamples. (default: :obj:`20000`)
        seed: Bootstrap seed. (default: fixed constant)

    Returns:
        A :class:`PairedSummary`.
    """
    speedups = paired_speedups(baseline, candidate)
    saved = np.asarray(baseline, dtype=np.float64) - np.asarray(candidate, dtype=np.float64)
    options = {"confidence": confidence, "resamples": resamples, "seed": seed}
    return PairedSummary(
        pairs=int(speedups.size),
        speedup_geomean=geometric_mean(speedups),
        speedup_ci=bootstrap_ci(speedups, _geomean_rows, **options),
        saved_mean=float(saved.mean()),
        saved_mean_ci=bootstrap_ci(saved, _mean_rows, **options),
        saved_median=float(np.median(saved)),
        saved_median_ci=bootstrap_ci(saved, _median_rows, **options),
        baseline_median=float(np.median(baseline)),
        candidate_median=float(np.median(candidate)),
    )


def interval_overlap(first: Iterable[Interval], second: Iterable[Interval]) -> float:
    """Sum over all pairs ``(a, b)`` of ``|a ∩ b|``.

    This is FoldPipe's definition of I/O-compute overlap: with download intervals as
    ``first`` and consume intervals as ``second`` it counts every second of downloading
    that happened while the consumer was busy (twice, if two downloads ran at once).

    Args:
        first: ``(start, end)`` intervals.
        second: ``(start, end)`` intervals.

    Returns:
        The summed intersection length.
    """
    second = list(second)
    total = 0.0
    for start_a, end_a in first:
        for start_b, end_b in second:
            total += max(0.0, min(end_a, end_b) - max(start_a, start_b))
    return total


@dataclass(frozen=True)
class TraceOverlap:
    """Aggregate timings of one traced run (seconds).

    Attributes:
        total: Latest finish of any interval (the run starts at 0).
        io: Sum of download durations.
        compute: Sum of consume durations.
        overlap: :func:`interval_overlap` of downloads with consumes.
        wait: Consumer idle time: time before the first consume plus the gaps between
            consecutive consume intervals.
    """

    total: float
    io: float
    compute: float
    overlap: float
    wait: float

    def to_dict(self) -> dict:
        """Plain JSON-serialisable dictionary."""
        return asdict(self)


def trace_overlap(records: Iterable[Mapping[str, float]]) -> TraceOverlap:
    """Compute I/O, compute, overlap and wait from per-shard trace records.

    Args:
        records: Mappings with ``download_start_s``, ``download_finish_s``,
            ``consume_start_s`` and ``consume_finish_s`` (relative to the run start).
            Records whose consume fields are ``None`` (never consumed) only count as I/O.

    Returns:
        A :class:`TraceOverlap`.
    """
    downloads: list[Interval] = []
    consumes: list[Interval] = []
    for record in records:
        download = (record.get("download_start_s"), record.get("download_finish_s"))
        consume = (record.get("consume_start_s"), record.get("consume_finish_s"))
        if None not in download:
            downloads.append(download)
        if None not in consume:
            consumes.append(consume)
    consumes.sort()
    wait = 0.0
    cursor = 0.0
    for start, end in consumes:
        wait += max(0.0, start - cursor)
        cursor = max(cursor, end)
    ends = [end for _, end in downloads + consumes]
    return TraceOverlap(
        total=max(ends, default=0.0),
        io=math.fsum(end - start for start, end in downloads),
        compute=math.fsum(end - start for start, end in consumes),
        overlap=interval_overlap(downloads, consumes),
        wait=wait,
    )
