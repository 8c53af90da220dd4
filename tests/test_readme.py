"""The README's Python examples run as written (keeps the README true)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
# a fenced block whose info string is exactly "python"; "python notest" marks the
# examples that need the network (the Hugging Face Hub)
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def test_readme_has_runnable_examples():
    blocks = _BLOCK.findall(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3, "the README lost its runnable examples"


def test_readme_python_examples_run_in_order(tmp_path):
    blocks = _BLOCK.findall(README.read_text(encoding="utf-8"))
    script = tmp_path / "readme_examples.py"
    # one script, in README order: later examples use the files earlier ones wrote
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # what the examples print: the file's length, the name, and batches
    assert "101 water -14.2" in result.stdout
    assert "Batch" in result.stdout and "DataBatch" in result.stdout
    assert "overlap_s" in result.stdout
    assert (tmp_path / "water_shards" / "manifest.json").is_file()
