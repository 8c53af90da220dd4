"""MkDocs hooks: the tutorials from ``notebooks/``, and repository files the pages link.

**Tutorials.** The notebooks of ``notebooks/`` become the site's ``tutorials/``.

The notebooks are kept in ``notebooks/`` without outputs (``build_notebooks.py``
writes them from their sources) and the build never executes them:
``tests/test_notebooks.py`` does, in a kernel of the project's venv, and leaves each
executed copy in ``build/tutorials/``. A page shows that copy, with its printed output
and figures, when its code cells are the repository's (a ``make docs`` after
``make test``); otherwise the repository's notebook, code without outputs, so a stale
run never shows output of code the site does not show.

**Repository files.** A page links a file of the repository outside ``docs/`` the way
it reads on GitHub, e.g. ``![...](../benchmarks/figures/peers.png)`` or
``[script](../benchmarks/peers.py)``; the site publishes each such file (a figure, a
script; not a Markdown page, whose own links MkDocs could not follow) under
``repo/<its path>`` and points the link there, so the figure shows and the strict build
finds the target. A link to a missing file is left alone and fails the build.
"""

from __future__ import annotations

import html as html_lib
import json
import os
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
# tests/test_docs_site.py points this elsewhere to build from the repository's notebooks
EXECUTED_ENV = "PYG_ATOMPACK_EXECUTED_NOTEBOOKS"
EXECUTED_DIR = ROOT / "build" / "tutorials"


def _cell_sources(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] in ("code", "markdown")]


def notebook_to_show(name: str, executed_dir: Path = EXECUTED_DIR) -> Path:
    """The notebook a tutorial page renders: the executed copy if it is current.

    Args:
        name (str): The notebook's file name in ``notebooks/``.
        executed_dir (Path, optional): Where ``tests/test_notebooks.py`` leaves executed
            copies. (default: ``build/tutorials``)

    Returns:
        The executed copy when its cells hold the repository notebook's sources, else
        the repository notebook.
    """
    source = NOTEBOOK_DIR / name
    executed = executed_dir / name
    try:
        if _cell_sources(executed) == _cell_sources(source):
            return executed
    except (OSError, ValueError, KeyError):
        pass  # no copy, or one a killed run left half written
    return source


# src_uri of each tutorial -> whether its page shows an executed copy (set by on_files)
SHOWN_EXECUTED: dict[str, bool] = {}
REPO_PREFIX = "repo"
# an inline Markdown link or image whose target leaves the page's folder: ](../x/y.png)
UP_LINK = re.compile(r"(\]\()(\.\./[^)\s#]+)")


def repository_file(page_uri: str, target: str, docs_dir: Path, root: Path = ROOT) -> str | None:
    """The path from the repository root of a file outside ``docs/`` that a page links.

    Args:
        page_uri (str): The page's path in ``docs/`` (``guides/cli.md``).
        target (str): The link as written (``../../benchmarks/peers.py``).
        docs_dir (Path): The docs folder.
        root (Path, optional): The repository. (default: the one holding this file)

    Returns:
        ``benchmarks/peers.py``, or :obj:`None` when the link stays in ``docs/``,
        leaves the repository, names no file or names a Markdown page.
    """
    path = (docs_dir / posixpath.dirname(page_uri) / target).resolve()
    if (not path.is_relative_to(root.resolve()) or path.is_relative_to(docs_dir.resolve())
            or not path.is_file() or path.suffix == ".md"):
        return None
    return path.relative_to(root.resolve()).as_posix()


# before mkdocs-jupyter's on_files, which claims the .ipynb files it finds
@event_priority(100)
def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add each notebook as ``tutorials/<name>.ipynb``, and the repository files pages link.

    Args:
        files (Files): The site's files.
        config (Any): The MkDocs configuration.
        **kwargs (optional): Other arguments of the event.

    Returns:
        The files with the notebooks added.
    """
    executed_dir = Path(os.environ.get(EXECUTED_ENV) or EXECUTED_DIR)
    for path in sorted(NOTEBOOK_DIR.glob("*.ipynb")):
        shown = notebook_to_show(path.name, executed_dir)
        SHOWN_EXECUTED[f"tutorials/{path.name}"] = shown != path
        files.append(File.generated(config, f"tutorials/{path.name}", abs_src_path=str(shown)))
    docs_dir = Path(config["docs_dir"])
    linked: set[str] = set()
    for file in list(files):
        if file.src_uri.endswith(".md") and file.abs_src_path:
            for _, target in UP_LINK.findall(file.content_string):
                found = repository_file(file.src_uri, target, docs_dir)
                if found is not None and found not in linked:
                    linked.add(found)
                    files.append(File.generated(config, f"{REPO_PREFIX}/{found}",
                                                abs_src_path=str(ROOT / found)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Point a page's links to repository files at their copies under ``repo/``.

    Args:
        markdown (str): The page's Markdown.
        page (Any): The page.
        config (Any): The MkDocs configuration.
        **kwargs (optional): Other arguments of the event.

    Returns:
        The Markdown with those links rewritten.
    """
    docs_dir = Path(config["docs_dir"])
    here = posixpath.dirname(page.file.src_uri)

    def replace(match: re.Match) -> str:
        found = repository_file(page.file.src_uri, match[2], docs_dir)
        if found is None:
            return match[0]
        return match[1] + posixpath.relpath(f"{REPO_PREFIX}/{found}", here or ".")

    return UP_LINK.sub(replace, markdown)


def on_nav(nav: Any, config: Any, files: Files, **kwargs: Any) -> Any:
    """Hand each tutorial's source path to the page mkdocs-jupyter made of it.

    mkdocs-jupyter wraps a notebook's ``File`` in a page file that computes its source
    path from the docs folder; for a notebook added from ``notebooks/`` it has none.

    Args:
        nav (Any): The site's navigation (unchanged).
        config (Any): The MkDocs configuration.
        files (Files): The site's files.
        **kwargs (optional): Other arguments of the event.

    Returns:
        The navigation.
    """
    for file in files:
        inner = vars(file).get("file")  # mkdocs-jupyter's wrapper holds the original
        if file.src_uri.startswith("tutorials/") and inner is not None:
            file.abs_src_path = inner.abs_src_path
    return nav


HEADING = re.compile(r"<h([1-6])[^>]*\bid=\"([^\"]+)\"[^>]*>(.*?)</h\1>", re.S)
ANCHOR_LINK = re.compile(r"<a class=\"anchor-link\".*?</a>", re.S)
TAG = re.compile(r"<[^>]+>")


def _toc_items(items: Any) -> Iterator[Any]:
    for item in items:
        yield item
        yield from _toc_items(item.children)


MATHJAX = re.compile(r"<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->",
                     re.DOTALL)


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """Head a tutorial with its download link and its outputs' origin; fix its contents.

    The page says whether it shows the outputs of the last test run or the code alone,
    and links the notebook mkdocs-jupyter copies beside it.

    mkdocs-jupyter builds the table of contents from the notebook's Markdown without
    the code spans of a title (``2. Write an `.atp` file`` gives "2. Write an file" and
    ``#2-write-an-file``) while the rendered heading keeps them
    (``id="2-write-an-atp-file"``); both list the headings in document order, so the
    n-th entry takes the n-th heading's id and text.

    Args:
        html (str): The page's HTML.
        page (Any): The page.
        **kwargs (optional): Other arguments of the event.

    Returns:
        The HTML, without the template's MathJax loader on tutorials.
    """
    if not page.file.src_uri.startswith("tutorials/") or not page.file.src_uri.endswith(".ipynb"):
        return html
    # mkdocs-jupyter's template loads MathJax from a CDN whatever the notebook holds; the
    # notebooks write their formulas in HTML, and the site loads nothing from elsewhere
    html = MATHJAX.sub("", html)
    items = list(_toc_items(page.toc))
    headings = HEADING.findall(html)
    if len(items) == len(headings):  # otherwise left alone; tests/test_docs_site.py would say
        for item, (_, anchor, inner) in zip(items, headings):
            item.id = anchor
            item.title = html_lib.unescape(TAG.sub("", ANCHOR_LINK.sub("", inner))).strip()
    name = posixpath.basename(page.file.src_uri)
    origin = ("Outputs from the run of <code>tests/test_notebooks.py</code> that checked them."
              if SHOWN_EXECUTED.get(page.file.src_uri) else
              "Shown without outputs: <code>make test</code> executes the notebooks, and a "
              "<code>make docs</code> after it shows what they print and draw.")
    line = (f'<p class="tutorial-origin"><a href="{name}" download>Download the notebook</a>. '
            f"{origin}</p>")
    title_end = html.find("</h1>")  # below the notebook's title, where there is one
    if title_end < 0:
        return f"{line}\n{html}"
    title_end += len("</h1>")
    return f"{html[:title_end]}\n{line}{html[title_end:]}"
