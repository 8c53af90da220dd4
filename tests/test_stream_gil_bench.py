"""The GIL-bound regime on every change: the consumer that holds the GIL, and a smoke run
of ``benchmarks/stream_overlap.py --quick --consumer gil`` (not a timed assertion)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402

ARMS = ("sequential", "prefetch", "workers2", "foldpipe")


def test_hold_gil_lasts_at_least_as_asked():
    for seconds in (0.0, 0.01, 0.03):
        started = time.perf_counter()
        spent = harness.hold_gil(seconds)
        assert spent >= seconds
        assert time.perf_counter() - started >= spent


def test_hold_gil_starves_a_thread_that_gives_the_gil_up():
    probe = harness.gil_probe(0.1)
    assert probe["units_sleep"] > 0
    # beside a sleeping consumer the thread runs freely; beside the GIL-holding one it
    # waits for the GIL after every step (0.01-0.05 of the units measured on 2 cores)
    assert probe["ratio"] < 0.5, probe


def test_quick_gil_run_measures_every_arm(tmp_path):
    out = tmp_path / "gil.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "stream_overlap.py"), "--quick",
         "--consumer", "gil", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    details = json.loads(out.with_suffix(".json").read_text())
    assert details["setup"]["consumer"] == "gil"
    assert details["gil_probe"]["ratio"] < 0.5  # the consumer really held the GIL
    regime = details["D/C=1.0"]
    # the defaults: prefetch=1, connections chosen by measurement (concurrency=None)
    assert (regime["prefetch"], regime["concurrency"]) == (1, None)
    assert regime["prefetch_stats"]["autotune"]["concurrency"] >= 1
    pairs = details["setup"]["pairs"]
    for arm in ARMS:
        assert len(regime["times"][arm]) == pairs
        assert all(t > 0 and math.isfinite(t) for t in regime["times"][arm])
        # every arm's consumer held the GIL for its steps (4 shards, 40 samples each)
        assert all(b >= 4 * 0.08 for b in regime["consumer_busy_s"][arm])
    for name in ("prefetch_vs_sequential", "workers2_vs_sequential", "foldpipe_vs_sequential",
                 "prefetch_vs_foldpipe", "workers2_vs_foldpipe", "ceiling_vs_sequential",
                 "ceiling_vs_foldpipe"):
        ratio = regime[name]["speedup_geomean"]
        assert math.isfinite(ratio) and ratio > 0, (name, ratio)
    assert math.isfinite(regime["measured_d_over_c"])
    # the stream timed its consumer's steps: one per sample of the prefetch arm
    assert regime["prefetch_stats"]["steps"] == 4 * 40
    assert 0.0 <= regime["prefetch_stats"]["wait_share"] <= 1.0
    report = out.read_text()
    assert "## Arms against sequential and FoldPipe (gil consumer)" in report
