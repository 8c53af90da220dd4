"""``benchmarks/gpu_feed.py --smoke`` runs every arm on this machine's device and reports it.

The figures themselves are the benchmark's (``benchmarks/RESULTS.md``); this keeps the
script working where there is no GPU: every loader configuration, ``device=`` with and
without the neighbour graph on the side stream, PyG's ``PrefetchLoader`` and the limit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_feed.py"


def test_smoke_mode_measures_every_arm(tmp_path: Path) -> None:
    out = tmp_path / "feed.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out)],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    (model,) = report["models"]
    assert set(model["arms"]) == {
        "0 workers", "0 workers, device=", "2 workers", "2 workers, device=",
        "0 workers, device= + graph on side stream", "0 workers, PyG PrefetchLoader"}
    assert len(model["limit_runs"]) == 2 and model["limit"] > 0
    for arm, figures in model["arms"].items():
        assert figures["structures_per_s"] > 0, arm
        assert math.isclose(figures["ratio"], figures["structures_per_s"] / model["limit"])
        assert f"  {arm} " in result.stdout
