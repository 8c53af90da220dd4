"""Unit tests of benchmarks/paired_stats.py against hand-computed values."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "paired_stats.py"
_SPEC = importlib.util.spec_from_file_location("paired_stats", _PATH)
paired_stats = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("paired_stats", paired_stats)  # dataclasses look their module up
_SPEC.loader.exec_module(paired_stats)


def _record(download, consume):
    return {
        "download_start_s": download[0],
        "download_finish_s": download[1],
        "consume_start_s": consume[0],
        "consume_finish_s": consume[1],
    }


def test_trace_overlap_hand_computed():
    # shard 0: download [0, 1.5], consume [2, 4.5]; shard 1: download [1.5, 4], consume [5, 8]
    # I/O = 1.5 + 2.5 = 4.0; compute = 2.5 + 3 = 5.5
    # overlap = |[1.5,4] ∩ [2,4.5]| = 2.0 (the other three pairs do not intersect)
    # wait = 2.0 before the first consume + 0.5 gap between consumes = 2.5
    records = [_record((0.0, 1.5), (2.0, 4.5)), _record((1.5, 4.0), (5.0, 8.0))]
    result = paired_stats.trace_overlap(records)
    assert result.io == pytest.approx(4.0)
    assert result.compute == pytest.approx(5.5)
    assert result.overlap == pytest.approx(2.0)
    assert result.wait == pytest.approx(2.5)
    assert result.total == pytest.approx(8.0)
    json.dumps(result.to_dict())


def test_interval_overlap_counts_every_pair():
    # two concurrent downloads both inside one consume interval count twice
    downloads = [(0.0, 2.0), (0.0, 2.0)]
    consumes = [(1.0, 3.0)]
    assert paired_stats.interval_overlap(downloads, consumes) == pytest.approx(2.0)
    assert paired_stats.interval_overlap([(0.0, 1.0)], [(1.0, 2.0)]) == 0.0


def test_trace_overlap_ignores_unconsumed_shards_for_compute():
    records = [_record((0.0, 1.0), (1.0, 2.0)), _record((1.0, 3.0), (None, None))]
    result = paired_stats.trace_overlap(records)
    assert result.io == pytest.approx(3.0)
    assert result.compute == pytest.approx(1.0)
    assert result.overlap == pytest.approx(1.0)


def test_geometric_mean_and_speedups():
    speedups = paired_stats.paired_speedups([4.0, 9.0], [2.0, 1.0])
    np.testing.assert_allclose(speedups, [2.0, 9.0])
    assert paired_stats.geometric_mean(speedups) == pytest.approx(math.sqrt(18.0))


def test_bootstrap_is_deterministic_and_brackets_estimate():
    rng = np.random.default_rng(1)
    sample = rng.lognormal(mean=0.5, sigma=0.1, size=12)
    stat = lambda a: a.mean(axis=1)  # noqa: E731
    first = paired_stats.bootstrap_ci(sample, stat, resamples=2000, seed=3)
    second = paired_stats.bootstrap_ci(sample, stat, resamples=2000, seed=3)
    assert first == second
    assert first[0] < sample.mean() < first[1]


def test_bootstrap_constant_sample_has_zero_width():
    low, high = paired_stats.bootstrap_ci([2.0] * 10, lambda a: a.mean(axis=1))
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)


def test_summarize_pairs_hand_computed():
    baseline = [2.0, 4.0, 6.0]
    candidate = [1.0, 2.0, 3.0]
    summary = paired_stats.summarize_pairs(baseline, candidate, resamples=500)
    assert summary.pairs == 3
    assert summary.speedup_geomean == pytest.approx(2.0)
    assert summary.speedup_ci == pytest.approx((2.0, 2.0))
    assert summary.saved_mean == pytest.approx(2.0)
    assert summary.saved_median == pytest.approx(2.0)
    assert 1.0 <= summary.saved_mean_ci[0] <= 2.0 <= summary.saved_mean_ci[1] <= 3.0
    assert summary.baseline_median == 4.0 and summary.candidate_median == 2.0
    json.dumps(summary.to_dict())


@pytest.mark.parametrize(
    ("baseline", "candidate"),
    [([1.0, 2.0], [1.0]), ([], []), ([1.0, -1.0], [1.0, 1.0]), ([1.0], [0.0])],
)
def test_bad_inputs_are_rejected(baseline, candidate):
    with pytest.raises(ValueError):
        paired_stats.paired_speedups(baseline, candidate)
