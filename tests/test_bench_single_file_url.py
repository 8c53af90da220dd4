"""benchmarks/single_file_url.py --quick: one 65 MB `.atp` file behind a single http URL.

Runs the benchmark's reduced mode end to end (a loopback server in its own process,
every measurement in a child process) and checks what it establishes besides timings:
the single-file URL is streamed by record blocks, every record is seen exactly once
(one process and two DataLoader workers), random access through the page cache keeps
the cache on disk under ``cache_bytes`` plus a page and returns the same batches as the
local file. Timings and memory figures are written to the report, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "single_file_url.py"

pytestmark = pytest.mark.slow


def test_quick_run_streams_blocks_exactly_once_and_bounds_the_cache(tmp_path):
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path),
                          "--out", str(out)], capture_output=True, text=True, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    stream, random = results["stream"], results["random"]
    assert [r["workers"] for r in stream] == [0, 2]
    for r in stream:
        assert r["blocks"] > 1 and r["shard_size"] == results["file_bytes"]
        assert r["count"] == results["records"] and r["exactly_once"], r
    (r,) = random
    assert r["reader"] == "RemoteAtpReader" and r["equal_to_local"]
    assert r["evicted"] > 0  # the bound was reached: the cache is a quarter of the file
    assert r["peak_pages"] <= results["cache_bytes"] + r["page_bytes"]
    text = out.read_text()
    assert "exactly once" in text and "equal to local" in text
