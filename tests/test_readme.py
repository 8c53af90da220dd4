"""The Python examples of the README and of the documentation pages run as written.

Every fenced block whose info string is exactly ``python`` runs; a block that cannot run
here (it needs the Hugging Face Hub, a bucket, a package the project does not install)
has an HTML comment ``<!-- notest: why -->`` on the line before its fence, which
neither GitHub nor the documentation site shows (an info string such as
``python notest`` would stop MkDocs from rendering the block as code); such blocks must
still parse. ``<!-- sketch -->`` marks an outline of an API that is not Python
(``docs/architecture.md``). The blocks of one page run in order as one script, so later ones use
what earlier ones defined or wrote; the guides run in a folder holding the files that
``docs/getting-started.md`` writes (``water.atp``, ``water_shards/``), as their readers'
would. Every call of ``ShardStreamDataset`` and ``SourceOptions`` in any block, run or
not, is checked against the real signature, so no page shows a keyword that does not
exist.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GETTING_STARTED = DOCS / "getting-started.md"
# what getting-started.md leaves behind for the guides
SHARED_FILES = ("water.atp", "water_shards")

_FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_MARK = re.compile(r"<!--\s*(?P<mode>notest|sketch)\b[^>]*-->\s*$")

# page (relative to the repository) -> strings its examples print
EXPECTED_OUTPUT = {
    "README.md": ["Batch", "atoms at most"],
    "docs/getting-started.md": ["101 water -14.2", "DataBatch", "overlap_s"],
    "docs/guides/local-files.md": ["torch.Size([6, 3]) torch.float32"],
    "docs/guides/converting.md": ["101 structures in"],
    "docs/guides/streaming.md": ["wait_share"],
    "docs/guides/resuming.md": ["molecules left in the epoch", "molecules left on a new grid"],
    "docs/guides/training-at-scale.md": ["atoms at most"],
    "docs/guides/groups.md": ["groups: 4"],
    "docs/guides/remote-data.md": ["structures streamed over HTTP"],
}


def python_blocks(text: str) -> list[tuple[str, str]]:
    """Return ``(code, mode)`` for every ``python`` block of a Markdown page, in order;
    ``mode`` is ``"run"``, ``"notest"`` (compiles, does not run) or ``"sketch"``."""
    blocks = []
    for match in _FENCE.finditer(text):
        if match["info"].strip() != "python":
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        blocks.append((match["code"], mark["mode"] if mark else "run"))
    return blocks


def pages() -> list[Path]:
    """The README and every Markdown page under docs/ that holds a Python block."""
    found = [README, *sorted(DOCS.rglob("*.md"))]
    return [page for page in found if python_blocks(page.read_text(encoding="utf-8"))]


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _run(page: Path, cwd: Path) -> subprocess.CompletedProcess:
    code = [block for block, mode in python_blocks(page.read_text(encoding="utf-8"))
            if mode == "run"]
    script = cwd / f"_{page.stem}_examples.py"
    script.write_text("\n\n".join(code), encoding="utf-8")
    result = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (f"{_name(page)}:\n" + result.stdout[-3000:]
                                    + result.stderr[-3000:])
    for expected in EXPECTED_OUTPUT.get(_name(page), []):
        assert expected in result.stdout, f"{_name(page)} no longer prints {expected!r}"
    return result


@pytest.fixture(scope="module")
def started(tmp_path_factory) -> Path:
    """A folder holding what Getting started writes, as a reader who ran it has."""
    folder = tmp_path_factory.mktemp("getting_started")
    _run(GETTING_STARTED, folder)
    return folder


def test_every_page_with_examples_has_runnable_ones():
    assert README in pages() and GETTING_STARTED in pages()
    for page in pages():
        blocks = python_blocks(page.read_text(encoding="utf-8"))
        if _name(page) in EXPECTED_OUTPUT:
            assert any(mode == "run" for _, mode in blocks), (
                f"{_name(page)} lost its runnable examples")


@pytest.mark.parametrize("page", [README, *sorted(DOCS.rglob("*.md"))], ids=_name)
def test_python_blocks_have_a_plain_info_string(page):
    # MkDocs renders a fence whose info string has a second word as plain text
    infos = [m["info"].strip() for m in _FENCE.finditer(page.read_text(encoding="utf-8"))]
    odd = [info for info in infos if info.startswith("python") and info != "python"]
    assert not odd, (f"{_name(page)}: python blocks with info strings {odd}: mark one that "
                     "cannot run with <!-- notest: why --> on the line before it instead")


def test_readme_examples_run_on_their_own(tmp_path):
    _run(README, tmp_path)


def test_getting_started_writes_the_files_the_guides_use(started):
    assert (started / "water.atp").is_file()
    assert (started / "water_shards" / "manifest.json").is_file()


@pytest.mark.parametrize("page", [p for p in pages() if p not in (README, GETTING_STARTED)],
                         ids=_name)
def test_page_examples_run_in_order(page, started, tmp_path):
    for name in SHARED_FILES:
        if (started / name).is_dir():
            shutil.copytree(started / name, tmp_path / name)
        else:
            shutil.copy2(started / name, tmp_path / name)
    _run(page, tmp_path)


def _keywords(page: Path, callee: str) -> list[tuple[set[str], str]]:
    found = []
    for code, mode in python_blocks(page.read_text(encoding="utf-8")):
        if mode == "sketch":
            continue
        tree = ast.parse(code)  # blocks that do not run must still be Python
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name == callee:
                    found.append(({k.arg for k in node.keywords if k.arg}, code))
    return found


@pytest.mark.parametrize("page", pages(), ids=_name)
def test_examples_use_only_keywords_that_exist(page):
    from pyg_atompack import stream

    allowed = {"ShardStreamDataset": set(inspect.signature(stream.ShardStreamDataset).parameters)}
    if hasattr(stream, "SourceOptions"):
        allowed["SourceOptions"] = {f.name for f in dataclasses.fields(stream.SourceOptions)}
    for callee, names in allowed.items():
        for keywords, code in _keywords(page, callee):
            unknown = keywords - names
            assert not unknown, (f"{_name(page)}: {callee} has no keyword {sorted(unknown)} "
                                 f"in\n{code}")
