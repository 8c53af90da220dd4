"""benchmarks/headline.py: a tiny real run builds the headline table and writes the README's.

The run measures small files for a second or so (``--tiny``): the figures mean
nothing, so none is asserted; what is checked is that each row gets its figure from
the script that measured it, that a source left out says so, that ``--reprint``
gives the same table from the saved JSON, and that ``--readme`` replaces exactly what
lies between the markers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "headline.py"

pytestmark = pytest.mark.slow


def _rows(table: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")]
            for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_tiny_run_fills_the_rows_and_rewrites_only_the_marked_table(tmp_path):
    results = tmp_path / "headline.json"
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbefore\n<!-- headline:start -->\nold table\n"
                      "<!-- headline:end -->\nafter\n", encoding="utf-8")
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--skip", "schnet", "peers",
                          "--results", str(results), "--readme", str(readme)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(run.stdout)
    assert len(rows) == 7
    number = r"\d+\.\d+×"
    for _what, cell, script in rows[:4]:  # the four read regimes of cold_read.py
        assert script == "`benchmarks/cold_read.py`"
        assert re.fullmatch(rf"{number} / {number} / {number}|(– / – / {number})", cell), cell
    assert re.fullmatch(number, rows[4][1]), rows[4]
    assert [row[1] for row in rows[5:]] == ["not run", "not run"]
    saved = json.loads(results.read_text(encoding="utf-8"))
    assert set(saved["figures"]) == {"reads", "loader"}
    assert saved["meta"]["mode"] == "tiny" and saved["meta"]["versions"]["atompack-db"]

    text = readme.read_text(encoding="utf-8")
    # the README gets a line pointing to the benchmark page above the table
    assert text.startswith("# title\n\nbefore\n<!-- headline:start -->\nOurs ÷ the reference")
    assert "(docs/benchmarks.md)" in text
    assert text.endswith("<!-- headline:end -->\nafter\n") and "old table" not in text
    assert run.stdout.strip() in text

    again = subprocess.run([sys.executable, str(SCRIPT), "--reprint", "--results", str(results)],
                           capture_output=True, text=True, timeout=120, check=True)
    assert again.stdout == run.stdout


def test_a_readme_without_markers_is_refused_by_name(tmp_path):
    results = tmp_path / "headline.json"
    results.write_text(json.dumps({"meta": {
        "date": "d", "machine": "m", "load": 0.0, "minutes": 0.0, "mode": "quick",
        "mode_flag": "--quick", "versions": {"x": "1"}}, "figures": {}}), encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n", encoding="utf-8")
    run = subprocess.run([sys.executable, str(SCRIPT), "--reprint", "--results", str(results),
                          "--readme", str(readme)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert run.returncode == 2
    assert "README.md: the markers <!-- headline:start -->" in run.stderr
    assert readme.read_text(encoding="utf-8") == "no markers here\n"
