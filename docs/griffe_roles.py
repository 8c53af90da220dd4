"""Render the reStructuredText bits of PyG's docstring dialect in the Markdown API pages.

The package's docstrings follow PyTorch Geometric's dialect (see ``docs/docstyle.py``):
Google sections, which mkdocstrings parses, but with Sphinx roles (:class:`~x.Y`,
:obj:`None`) and literal blocks introduced by ``::``, which Markdown does not know.
This griffe extension rewrites every docstring of the package once it is loaded:

* a role naming an object becomes an *optional* cross-reference: a link where the
  object is on the site, plain code where it is not (torch, PyG, internal helpers),
  so a reference never fails the strict build and never shows as raw markup;
  a role holding a value (:obj:`None`, :obj:`5.0`) becomes code;
* ``Text::`` followed by an indented block becomes ``Text:`` and a fenced code block
  (highlighted as Python, or as a shell session for command lines);
* a simple table (columns under runs of ``=``) becomes a Markdown table;
* a module constant documented by ``#:`` comments above it (Sphinx's form) gets them
  as its docstring, and a public name bound to another (``Structure = Molecule``)
  says whose name it is, so both have an entry in the reference.

mkdocs.yml loads it as an extension of the mkdocstrings Python handler.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# :role:`target`, :role:`~dotted.target` or :role:`title <target>`
ROLE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<body>[^`]+)`")
IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*")
SECTION_TITLES = {"example", "examples", "note", "notes", "usage", "warning", "warnings"}
SHELL_STARTS = ("$ ", "python ", "pip ", "make ", "pyg-atompack", "torchrun ", "git ", "curl ")


def resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as seen from ``obj``, or :obj:`None`.

    Args:
        obj (griffe.Object): The object whose docstring holds the reference.
        target (str): A dotted name, absolute or relative to ``obj``'s scope.

    Returns:
        The path, or :obj:`None` when griffe cannot resolve it.
    """
    target = target.lstrip(".")
    if target.startswith("pyg_atompack."):
        return target
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except (griffe.NameResolutionError, AttributeError):
        return None
    return f"{path}.{rest}" if rest else path


def rewrite_roles(text: str, obj: griffe.Object) -> str:
    """Replace every Sphinx role of ``text`` by an optional cross-reference or code.

    Args:
        text (str): A docstring.
        obj (griffe.Object): The object it documents (the scope of relative names).

    Returns:
        The docstring in Markdown.
    """
    def replace(match: re.Match) -> str:
        body = match["body"].strip()
        titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
        if titled:
            title, target = titled["title"], titled["target"]
        else:
            target = body.lstrip("~")
            title = target.rsplit(".", 1)[-1] if body.startswith("~") else target
        if match["role"] == "obj" and not IDENTIFIER.fullmatch(target) or target == "None":
            return f"`{body}`"
        path = resolve(obj, target) if IDENTIFIER.fullmatch(target) else None
        if path is None:
            return f"`{title}`"
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    return ROLE.sub(replace, text)


def fence_literal_blocks(text: str) -> str:
    """Turn reStructuredText literal blocks (``Text::`` + indented lines) into fences.

    Args:
        text (str): A docstring.

    Returns:
        The docstring with fenced code blocks.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::") or stripped.endswith(":::"):
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        block_start = i + 1
        while block_start < len(lines) and not lines[block_start].strip():
            block_start += 1
        end = block_start
        while end < len(lines) and (not lines[end].strip()
                                    or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        block = lines[block_start:end]
        while block and not block[-1].strip():
            block.pop()
        if not block:
            out.append(line)
            i += 1
            continue
        lead = stripped[:-2].rstrip()
        # "Example::" would read as a Google section title if left as "Example:"
        if lead.strip().lower() in SECTION_TITLES:
            lead = f"{' ' * indent}*{lead.strip()}:*"
        elif lead.strip():
            lead += ":"
        code_indent = min(len(b) - len(b.lstrip()) for b in block if b.strip())
        code = [b[code_indent:] for b in block]
        language = "bash" if code[0].lstrip().startswith(SHELL_STARTS) else "python"
        pad = " " * indent
        if lead.strip():
            out += [lead, ""]
        out += [f"{pad}```{language}", *(f"{pad}{c}" if c else "" for c in code), f"{pad}```"]
        if end < len(lines):
            out.append("")
        i = end
    return "\n".join(out)


BORDER = re.compile(r"^(?P<indent> *)=+(?: +=+)+ *$")


def markdown_tables(text: str) -> str:
    """Turn reStructuredText simple tables into Markdown tables.

    A simple table is framed by border lines of ``=`` runs, one run a column, with a
    second border under its header row; a cell spans its column's run (the last column
    runs to the end of the line).

    Args:
        text (str): A docstring.

    Returns:
        The docstring with Markdown tables.
    """
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        top = BORDER.match(lines[i])
        ends = [j for j in range(i + 1, len(lines)) if lines[j].strip() == lines[i].strip()]
        if top is None or len(ends) < 2:
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        header, rows = lines[i + 1:ends[0]], lines[ends[0] + 1:ends[1]]
        pad = top["indent"]
        titles = zip(*(_cells(line, starts) for line in header))
        out.append(pad + "| " + " | ".join(" ".join(title) for title in titles) + " |")
        out.append(pad + "|" + "---|" * len(starts))
        out += [pad + "| " + " | ".join(_cells(row, starts)) + " |"
                for row in rows if row.strip()]
        i = ends[1] + 1
    return "\n".join(out)


def _cells(line: str, starts: list[int]) -> list[str]:
    # a cell runs from its column's start to the next one's (the last to the line's end)
    bounds = [*starts[1:], None]
    return [line[a:b].strip().replace("|", "\\|") for a, b in zip(starts, bounds)]


def comment_docstring(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines right above an attribute, or what it is another name for.

    Args:
        obj (griffe.Object): An attribute without a docstring.

    Returns:
        The text for its docstring, or :obj:`None`.
    """
    lines = obj.module.lines if obj.lineno else []
    comment: list[str] = []
    number = (obj.lineno or 1) - 2  # the line above, 0-based
    while 0 <= number < len(lines) and lines[number].strip().startswith("#:"):
        comment.insert(0, lines[number].strip()[2:].strip())
        number -= 1
    if comment:
        return "\n".join(comment)
    value = str(obj.value) if getattr(obj, "value", None) is not None else ""
    if (obj.parent.is_module and IDENTIFIER.fullmatch(value)
            and (path := resolve(obj.parent, value)) is not None):
        return f"Another name for :class:`~{path}`."
    return None


class SphinxRoles(griffe.Extension):
    """Rewrite the package's docstrings from PyG's reStructuredText bits into Markdown."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Rewrite every docstring of a loaded package.

        Args:
            pkg (griffe.Module): The package.
            **kwargs (optional): Other arguments of the event.
        """
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if obj.is_attribute and obj.docstring is None and (text := comment_docstring(obj)):
                obj.docstring = griffe.Docstring(text, parent=obj)
            if obj.docstring is not None:
                obj.docstring.value = rewrite_roles(
                    markdown_tables(fence_literal_blocks(obj.docstring.value)), obj)
            stack.extend(member for member in obj.members.values() if not member.is_alias)
