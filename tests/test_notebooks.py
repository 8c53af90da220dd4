"""Execute every tutorial notebook in a kernel of this environment.

Each notebook runs in a fresh Jupyter kernel started with ``sys.executable`` (the
project's venv): the test writes its own kernelspec into a temporary ``JUPYTER_PATH``
entry, so nothing has to be installed or registered on a fresh clone. The kernel's
working directory and every file it writes live under ``tmp_path``; the executed
notebook is saved there too, never back into the repository, and once its checks pass
into ``build/tutorials/``, where the documentation site takes it from (``docs/hooks.py``:
a ``make docs`` after ``make test`` shows the tutorials with the outputs checked here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
EXECUTED_DIR = ROOT / "build" / "tutorials"
KERNEL_NAME = "pyg-atompack-tests"
# Per-cell limit; a whole notebook is meant to finish in well under a minute.
CELL_TIMEOUT_S = 120

sys.path.insert(0, str(NOTEBOOK_DIR))
import build_notebooks  # noqa: E402

NOTEBOOKS = list(build_notebooks.notebook_sources())

# Text each executed notebook must show (its story's punch lines), by notebook.
EXPECTED_OUTPUT = {
    "01_quickstart.ipynb": ["AtompackDataset(", "DataBatch(", "AtompackLoader"],
    "02_formats.ipynb": ["$ pyg-atompack info", "all checks passed", "shard_00000.atp",
                         "downloaded shards"],
    "03_streaming.ipynb": ["HTTP 503", "retry 1/", "ShardFetchError"],
    "04_schnet_md17.ipynb": ["overlap s", "force MAE"],
}
# How many figures (PNG outputs) each notebook draws at least.
EXPECTED_FIGURES = {
    "01_quickstart.ipynb": 1,
    "02_formats.ipynb": 0,
    "03_streaming.ipynb": 1,
    "04_schnet_md17.ipynb": 2,
}


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory) -> str:
    """A kernelspec for ``sys.executable``, visible through ``JUPYTER_PATH`` only."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    # the notebooks keep their data in tempfile.mkdtemp() folders: put those under
    # pytest's temporary directory, which pytest prunes, instead of the system's /tmp
    kernel_tmp = tmp_path_factory.mktemp("kernel_tmp")
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "pyg_atompack (tests)",
        "language": "python",
        "env": {
            # The inline backend renders with Agg (no display needed) and, unlike plain
            # "Agg", hands every figure to the notebook, so the test can count them.
            "MPLBACKEND": "module://matplotlib_inline.backend_inline",
            # One intra-op thread: CI machines are small and shared, and oversubscribed
            # OpenMP threads make SchNet training an order of magnitude slower.
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(kernel_tmp),
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            # tqdm's notice that this kernel has no ipywidgets (progress bars fall back to
            # text) is about the test kernel, not the tutorial; the executed copies are
            # what the documentation site shows (docs/hooks.py)
            "PYTHONWARNINGS": "ignore:IProgress not found",
        },
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(jupyter_dir))
        patch.setenv("JUPYTER_RUNTIME_DIR", str(jupyter_dir / "runtime"))
        yield KERNEL_NAME


def _output_text(notebook: nbformat.NotebookNode) -> str:
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif output.output_type in ("execute_result", "display_data"):
                parts.append(output.data.get("text/plain", ""))
                parts.append(output.data.get("text/markdown", ""))
    return "\n".join(parts)


def _figure_count(notebook: nbformat.NotebookNode) -> int:
    return sum(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        for output in cell.get("outputs", [])
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name: str, kernel_name: str, tmp_path: Path):
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    work_dir = tmp_path / "cwd"
    work_dir.mkdir()
    client = NotebookClient(
        notebook,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(work_dir)}},
    )
    try:
        client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        nbformat.write(notebook, tmp_path / name)  # keep the evidence next to the test
    text = _output_text(notebook)
    for expected in EXPECTED_OUTPUT[name]:
        assert expected in text, f"{name}: output lacks {expected!r} (see {tmp_path / name})"
    assert _figure_count(notebook) >= EXPECTED_FIGURES[name], f"{name}: figures missing"
    assert list(work_dir.iterdir()) == [], f"{name} wrote into its working directory"
    EXECUTED_DIR.mkdir(parents=True, exist_ok=True)
    # written whole, then renamed: a site build never reads half a notebook
    partial = EXECUTED_DIR / f".{name}.{os.getpid()}"
    nbformat.write(notebook, partial)
    partial.replace(EXECUTED_DIR / name)


def test_notebooks_match_their_sources_and_carry_no_outputs():
    result = subprocess.run(
        [sys.executable, str(NOTEBOOK_DIR / "build_notebooks.py"), "--check"],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    on_disk = sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb"))
    assert on_disk == sorted(NOTEBOOKS)
    for name in NOTEBOOKS:
        notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name


def test_parse_cells_splits_code_and_markdown():
    source = "ignored\n# %% [markdown]\n# Title\n\ntext\n# %%\nx = 1\n\n# %%\nprint(x)\n"
    cells = build_notebooks.parse_cells(source)
    assert [(c.cell_type, c.source) for c in cells] == [
        ("markdown", "# Title\n\ntext"), ("code", "x = 1"), ("code", "print(x)"),
    ]
    with pytest.raises(ValueError, match="empty code cell"):
        build_notebooks.parse_cells("# %%\n\n# %%\nx = 1\n")
