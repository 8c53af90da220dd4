"""Smoke run of ``benchmarks/loader_handoff.py --quick`` (not a timed assertion)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_loader_handoff_run_measures_every_arm(tmp_path):
    out = tmp_path / "handoff.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader_handoff.py"), "--quick",
         "--arms", "inprocess,workers2,workers2-k1,workers2-pipe", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    details = json.loads(out.with_suffix(".json").read_text())
    for arm in ("inprocess", "workers2", "workers2-k1", "workers2-pipe"):
        assert len(details["rates"][arm]) == 2  # --quick: 2 rounds
        assert all(rate > 0 and math.isfinite(rate) for rate in details["rates"][arm])
        # CPU seconds a batch: the main process always, the workers only where there are
        main, workers = zip(*details["cpu_per_batch_s"][arm])
        assert all(value > 0 for value in main)
        assert all(value > 0 for value in workers) == (arm != "inprocess")
    assert details["ratios"]["inprocess"] == [1.0, 1.0]
    assert "| workers2 |" in out.read_text()
