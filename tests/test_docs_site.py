"""The documentation site builds strictly, its links hold, and its API reference is complete.

One strict build (``mkdocs build --strict``: any warning, e.g. a nav entry or a Markdown
link to a missing page or anchor, fails it) runs per test session into a temporary
folder; the tests then read the HTML it wrote. The link check reads every page: each
relative ``href``/``src`` must name a file of the site and each ``#fragment`` an ``id``
on the page it points to (pages MkDocs does not check itself: the API reference, the
rendered notebooks, raw HTML). External links are not fetched.

The API reference is generated from the docstrings, so the docstrings are checked here
too: every public name has one, with an ``Args:`` section when it takes arguments.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import griffe_roles  # noqa: E402
import hooks  # noqa: E402

# the modules whose __all__ is the public API, each with a page under docs/api/
PUBLIC_MODULES = {
    "pyg_atompack": "pyg_atompack",
    "pyg_atompack.atp": "atp",
    "pyg_atompack.convert": "convert",
    "pyg_atompack.stream": "stream",
    "pyg_atompack.pyg": "pyg",
    "pyg_atompack.remote": "remote",
    "pyg_atompack.remote.backends": "remote",
    "pyg_atompack.data": "pyg_atompack",  # its classes are the top level's
    "pyg_atompack.graph": "graph",
    "pyg_atompack.hub": "hub",
    "pyg_atompack.transport": "transport",
}
NOTEBOOKS = sorted(path.name for path in (ROOT / "notebooks").glob("*.ipynb"))


def build_site(site_dir: Path, executed_dir: Path) -> subprocess.CompletedProcess:
    """Build the site strictly, as ``make docs`` does, into ``site_dir``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1",
           "PYG_ATOMPACK_EXECUTED_NOTEBOOKS": str(executed_dir)}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    # the repository's notebooks (no outputs), whatever an earlier test run left in build/
    result = build_site(site_dir, tmp_path_factory.mktemp("no-executed-notebooks"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return site_dir


class _PageParser(HTMLParser):
    """The ids a page defines and the links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name in ("id", "name") if tag == "a" else ("id",):
            if values.get(name):
                self.ids.add(values[name])
        for name in ("href", "src"):
            if values.get(name) is not None and tag in ("a", "img", "link", "script", "source"):
                self.links.append(values[name])


def _parse(page: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def _target(site_dir: Path, page: Path, path: str) -> Path:
    if path.startswith("/"):  # the 404 page links from the site's root
        target = (site_dir / unquote(path).lstrip("/")).resolve()
    else:
        target = (page.parent / unquote(path)).resolve() if path else page
    return target / "index.html" if target.is_dir() else target


def broken_links(site_dir: Path) -> list[str]:
    """Every relative link of a built site that names no file, or no anchor on its page.

    Args:
        site_dir (Path): The built site.

    Returns:
        ``"page: link (why)"`` lines, sorted.
    """
    pages = {page.resolve(): _parse(page) for page in site_dir.rglob("*.html")}
    problems = []
    for page, parsed in pages.items():
        for link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")):
                continue  # external: not fetched
            where = f"{page.relative_to(site_dir.resolve())}: {link}"
            target = _target(site_dir, page, parts.path)
            if not target.is_file():
                problems.append(f"{where} (no such file)")
            elif (parts.fragment and target.suffix == ".html"
                  and unquote(parts.fragment) not in pages[target].ids):
                problems.append(f"{where} (no such anchor)")
    return sorted(problems)


def test_the_site_builds_strictly_with_every_page_of_the_nav(site: Path):
    for page in ["index.html", "getting-started/index.html", "guides/streaming/index.html",
                 "guarantees/index.html", "benchmarks/index.html", "atp-format/index.html",
                 "architecture/index.html", "api/index.html",
                 *(f"api/{name}/index.html" for name in PUBLIC_MODULES.values()),
                 *(f"tutorials/{Path(name).stem}/index.html" for name in NOTEBOOKS)]:
        assert (site / page).is_file(), page
    # the tools kept in docs/ are not published
    assert not list(site.glob("*.py"))


def test_internal_links_and_anchors_resolve(site: Path):
    assert broken_links(site) == []


FOREIGN_LOAD = re.compile(
    r"<(?:script|img|iframe)\b[^>]*\bsrc=[\"']?(?:https?:)?//"
    r"|<link\b[^>]*\bhref=[\"']?(?:https?:)?//"
    r"|@import\s+(?:url\()?[\"']?(?:https?:)?//", re.IGNORECASE)


def test_no_page_loads_anything_from_another_origin(site: Path):
    # a reader offline, or behind a firewall, gets every page whole; nobody learns who
    # reads it (fonts, scripts, stylesheets and formulas all come with the site)
    pages = sorted(site.rglob("*.html")) + sorted(site.rglob("*.css"))
    assert len(pages) > 20
    loading = [f"{path.relative_to(site)}: {match.group(0)}" for path in pages
               for match in FOREIGN_LOAD.finditer(path.read_text(encoding="utf-8"))]
    assert loading == []
    streaming = (site / "tutorials" / "03_streaming" / "index.html").read_text(encoding="utf-8")
    assert "T<sub>sequential</sub>" in streaming and "MathJax" not in streaming


def test_link_check_finds_missing_pages_and_anchors(tmp_path: Path):
    (tmp_path / "guide").mkdir()
    (tmp_path / "index.html").write_text(
        '<h1 id="top">x</h1><a href="guide/">ok</a> <a href="guide/#setup">ok</a>'
        '<a href="#top">ok</a> <a href="https://pyg.org/#nowhere">external</a>'
        '<a href="gone/">broken</a> <a href="guide/#missing">broken</a><img src="a.png">')
    (tmp_path / "guide" / "index.html").write_text('<h2 id="setup">Setup</h2>')
    assert broken_links(tmp_path) == [
        "index.html: a.png (no such file)",
        "index.html: gone/ (no such file)",
        "index.html: guide/#missing (no such anchor)",
    ]


def _ids(site: Path, page: str) -> set[str]:
    return _parse(site / page).ids


def test_every_public_name_has_an_entry_in_the_api_reference(site: Path):
    anchors = set().union(*(_ids(site, f"api/{page}/index.html")
                            for page in PUBLIC_MODULES.values()))
    modules = {name: importlib.import_module(name) for name in PUBLIC_MODULES}
    missing = []
    for module_name, module in modules.items():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or name == "__version__":
                continue
            # documented under this module, where it is defined, or under another public
            # module that exports the same object
            homes = {f"{module_name}.{name}",
                     f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"}
            homes |= {f"{other}.{name}" for other, m in modules.items()
                      if getattr(m, name, None) is obj}
            if not homes & anchors:
                missing.append(f"{module_name}.{name}")
    assert missing == []


def test_the_api_reference_renders_pyg_docstrings(site: Path):
    page = (site / "api" / "pyg_atompack" / "index.html").read_text(encoding="utf-8")
    # the Args: section of AtompackDataset as a parameter table, typed, with defaults
    assert "pyg_atompack.data.dataset.AtompackDataset" in page
    assert "<th>Name</th>" in page and "<code>root</code>" in page
    for path in (site / "api").rglob("*.html"):
        text = path.read_text(encoding="utf-8")
        # no raw reStructuredText left: roles became links or code, literal blocks fences
        assert not re.search(r":[a-z]+:<code>", text), path
    stream = (site / "api" / "stream" / "index.html").read_text(encoding="utf-8")
    # a role naming a documented object is a link to it
    assert 'href="#pyg_atompack.stream.ShardStreamDataset"' in stream


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_notebook_is_a_tutorial_page(site: Path, name: str):
    notebook = json.loads((ROOT / "notebooks" / name).read_text(encoding="utf-8"))
    page = (site / "tutorials" / Path(name).stem / "index.html").read_text(encoding="utf-8")
    code = next(c for c in notebook["cells"] if c["cell_type"] == "code")
    first_line = "".join(code["source"]).splitlines()[0]
    words = [w for w in first_line.replace("(", " ").split() if w.isidentifier()]
    assert words and all(word in page for word in words), (name, first_line)
    assert 'class="jp-Notebook' in page or "jupyter-wrapper" in page
    # built from the repository's notebook: the page says so and links it for download
    assert "Shown without outputs" in page and f'href="{name}" download' in page


def test_a_tutorial_shows_the_executed_copy_only_while_it_is_current(tmp_path: Path):
    name = NOTEBOOKS[0]
    source = ROOT / "notebooks" / name
    assert hooks.notebook_to_show(name, tmp_path) == source  # nothing executed yet
    notebook = json.loads(source.read_text(encoding="utf-8"))
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "ran\n"}]
    (tmp_path / name).write_text(json.dumps(notebook), encoding="utf-8")
    assert hooks.notebook_to_show(name, tmp_path) == tmp_path / name
    notebook["cells"][-1]["source"] = "print('code the repository no longer has')"
    (tmp_path / name).write_text(json.dumps(notebook), encoding="utf-8")
    assert hooks.notebook_to_show(name, tmp_path) == source
    (tmp_path / name).write_text('{"cells": [', encoding="utf-8")  # half written
    assert hooks.notebook_to_show(name, tmp_path) == source


def test_a_tutorial_page_gets_its_headings_ids_and_titles_in_its_contents():
    def entry(anchor: str, title: str, *children) -> types.SimpleNamespace:
        return types.SimpleNamespace(id=anchor, title=title, children=list(children))

    # what mkdocs-jupyter slugs from the Markdown: the code span of a title is lost
    toc = [entry("quick-start", "Quick start", entry("2-write-an-file", "2. Write an  file"))]
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="tutorials/01_q.ipynb"),
                                 toc=toc)
    html = ('<h1 id="quick-start">Quick start<a class="anchor-link" href="#quick-start">¶</a>'
            '</h1><h2 id="2-write-an-atp-file">2. Write an <code>.atp</code> file'
            '<a class="anchor-link" href="#2-write-an-atp-file">¶</a></h2><p>text</p>')
    out = hooks.on_page_content(html, page)
    child = toc[0].children[0]
    assert (child.id, child.title) == ("2-write-an-atp-file", "2. Write an .atp file")
    # the download link and the origin of the outputs sit below the title
    assert out.index("</h1>") < out.index('href="01_q.ipynb" download') < out.index("<h2")
    other = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="guides/gpu.md"), toc=[])
    assert hooks.on_page_content(html, other) == html


def test_links_to_repository_files_point_at_their_published_copies(tmp_path: Path):
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "benchmarks" / "figures").mkdir(parents=True)
    (tmp_path / "benchmarks" / "figures" / "peers.png").write_bytes(b"png")
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# results")
    docs = tmp_path / "docs"
    found = hooks.repository_file("guides/gpu.md", "../../benchmarks/figures/peers.png", docs,
                                  tmp_path)
    assert found == "benchmarks/figures/peers.png"
    # a Markdown page, a missing file, a file in docs/ and one outside the repository stay
    for target in ("../../benchmarks/RESULTS.md", "../../benchmarks/gone.png",
                   "../index.md", "../../../elsewhere.png"):
        assert hooks.repository_file("guides/gpu.md", target, docs, tmp_path) is None
    page = types.SimpleNamespace(file=types.SimpleNamespace(src_uri="benchmarks.md"))
    text = "see [the CLI](../pyg_atompack/cli.py) and [x](../gone.py)"
    assert hooks.on_page_markdown(text, page, {"docs_dir": str(ROOT / "docs")}) == (
        "see [the CLI](repo/pyg_atompack/cli.py) and [x](../gone.py)")


def test_sphinx_roles_and_literal_blocks_become_markdown():
    class Scope:  # stands in for a griffe object: resolves names of its module
        def resolve(self, name: str) -> str:
            if name == "Reader":
                return "pyg_atompack.atp.Reader"
            raise griffe_roles.griffe.NameResolutionError(name)

    text = ("Reads :class:`Reader` rows, :meth:`~Reader.read_batch` too, not "
            ":class:`torch_geometric.data.Data`; (default: :obj:`None`, :obj:`5.0`)")
    assert griffe_roles.rewrite_roles(text, Scope()) == (
        'Reads <autoref identifier="pyg_atompack.atp.Reader" optional><code>Reader</code>'
        '</autoref> rows, <autoref identifier="pyg_atompack.atp.Reader.read_batch" optional>'
        "<code>read_batch</code></autoref> too, not `torch_geometric.data.Data`; "
        "(default: `None`, `5.0`)")
    doc = textwrap.dedent("""\
        Summary.

        Example::

            stream = open_source(url)

        Usage::

            python docs/docstyle.py --check
        More text.""")
    assert griffe_roles.fence_literal_blocks(doc) == textwrap.dedent("""\
        Summary.

        *Example:*

        ```python
        stream = open_source(url)
        ```

        *Usage:*

        ```bash
        python docs/docstyle.py --check
        ```

        More text.""")


def test_simple_tables_become_markdown_tables():
    doc = textwrap.dedent("""\
        Attributes:

        ==========  ======  ======================
        attribute   shape   source
        ==========  ======  ======================
        ``z``       ``[N]`` atomic numbers
        ``pos``     [N, 3]  positions | in Å
        ==========  ======  ======================

        After.""")
    assert griffe_roles.markdown_tables(doc) == textwrap.dedent("""\
        Attributes:

        | attribute | shape | source |
        |---|---|---|
        | ``z`` | ``[N]`` | atomic numbers |
        | ``pos`` | [N, 3] | positions \\| in Å |

        After.""")
    # a lone line of = runs (no closing borders) is left as it is
    assert griffe_roles.markdown_tables("a\n===  ===\nb") == "a\n===  ===\nb"


# ------------------------------------------------- docstrings of the public API

# Known public names without a Google-style docstring: none, and it must stay so.
# (A ratchet: a new gap fails the test, and so does a fixed one left on this list.)
KNOWN_DOCSTRING_GAPS: set[str] = set()


def _exported(base: type) -> bool:
    """Whether ``base`` is in its package's ``__all__`` (documented on its own)."""
    package = sys.modules.get(base.__module__.rsplit(".", 1)[0])
    return base.__name__ in getattr(package, "__all__", ())


def public_members(cls: type) -> Iterator[tuple[str, Any, str]]:
    """Public methods and properties a class defines or inherits from a private base.

    Members of bases outside the package, or exported themselves, are left out; those
    of an unexported base class of the package belong to the class's own interface.
    """
    owners = [cls]
    for base in cls.__mro__[1:]:
        if not base.__module__.startswith("pyg_atompack.") or _exported(base):
            break
        owners.append(base)
    seen: set[str] = set()
    for name, member in (item for owner in owners for item in vars(owner).items()):
        if name.startswith("_") or name in seen:
            continue
        seen.add(name)
        if isinstance(member, property):
            yield name, member, "property"
        elif isinstance(member, (classmethod, staticmethod)):
            yield name, member.__func__, "method"
        elif inspect.isfunction(member):
            yield name, member, "method"


def _takes_arguments(obj: Any) -> bool:
    try:
        parameters = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    # a bare (*args, **kwargs) signature forwards to something documented elsewhere
    return any(p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in parameters)


def object_problems(obj: Any, where: str) -> list[str]:
    """Docstring findings for one exported class or function."""
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return [f"{where}: no docstring"]
    if not inspect.isclass(obj):
        return [f"{where}: no Args section"] if _takes_arguments(obj) and "Args:" not in doc else []
    problems = []
    init = vars(obj).get("__init__")
    init_doc = (inspect.getdoc(init) or "") if init is not None else ""
    # a dataclass documents its generated __init__ by its fields
    sections = ("Args:", "Attributes:") if dataclasses.is_dataclass(obj) else ("Args:",)
    if init is not None and _takes_arguments(init) and not any(
            section in doc + init_doc for section in sections):
        problems.append(f"{where}: no Args section")
    for name, member, kind in public_members(obj):
        if any(name in vars(base) for base in obj.__mro__[1:]):
            continue  # an override inherits its base's documentation (PyG's Dataset.get)
        function = member.fget if kind == "property" else member
        member_doc = inspect.getdoc(function) or ""
        if not member_doc:
            problems.append(f"{where}.{name}: no docstring")
        elif kind != "property" and _takes_arguments(function) and "Args:" not in member_doc:
            problems.append(f"{where}.{name}: no Args section")
    return problems


def docstring_problems() -> list[str]:
    """One ``"module.Name[.member]: problem"`` line per public name missing Google style."""
    problems: set[str] = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.ismodule(obj) and (inspect.isclass(obj) or callable(obj)):
                where = f"{obj.__module__}.{getattr(obj, '__qualname__', name)}"
                problems.update(object_problems(obj, where))
    return sorted(problems)


def test_public_names_have_google_style_docstrings():
    problems = set(docstring_problems())
    new = sorted(problems - KNOWN_DOCSTRING_GAPS)
    fixed = sorted(KNOWN_DOCSTRING_GAPS - problems)
    assert not new, "public names without a Google-style docstring:\n" + "\n".join(new)
    assert not fixed, "fixed (remove from KNOWN_DOCSTRING_GAPS):\n" + "\n".join(fixed)


def test_docstring_check_catches_missing_sections():
    class Undocumented:
        def method(self, value):
            return value

    class Documented:
        """A class.

        Args:
            size: How many.
        """

        def __init__(self, size: int) -> None:
            self.size = size

        def grow(self, by: int) -> None:
            """Grows without saying by what."""

        def __len__(self) -> int:  # private and dunder members are not checked
            return self.size

    def bare(value):
        """Does something, but does not say with what."""

    assert object_problems(Undocumented, "U") == ["U: no docstring"]
    assert object_problems(Documented, "D") == ["D.grow: no Args section"]
    assert object_problems(bare, "f") == ["f: no Args section"]
    assert object_problems(docstring_problems, "g") == []  # no arguments
    Undocumented.__doc__ = "Now documented."
    assert object_problems(Undocumented, "U") == ["U.method: no docstring"]
