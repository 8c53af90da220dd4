"""Check, and where the code says how, fix the package's docstring dialect: PyG's.

``pyg_atompack`` is read by PyG users, so its docstrings follow the dialect of
PyTorch Geometric's own sources: Google sections, with every ``Args:`` entry typed
and every parameter that has a default marked ``optional`` and its default stated::

    Args:
        root (str): The directory of the dataset.
        cutoff (float, optional): The cutoff distance. Longer descriptions
            continue on lines indented one more level. (default: :obj:`5.0`)
        **kwargs (optional): Additional arguments of :class:`Base`.

and summaries that are capitalised sentences ending with a period. The rules, for
every function, method, class and module docstring under ``pyg_atompack/``:

* an ``Args:`` entry reads ``name (type): Description.``; ``*args`` and
  ``**kwargs`` read ``**kwargs (optional): Description.``;
* a parameter with a default reads ``name (type, optional): ...`` and states its
  default as ``(default: ...)`` somewhere in its description (a value the code
  computes may be stated in words: ``(default: 8 GiB)``); one without a default
  is not ``optional``; a default literal is written ``(default: :obj:`3`)``;
* an entry names a parameter of the signature (for a class: of ``__init__``, or
  the fields of a dataclass or ``NamedTuple``), unless the callable takes
  ``**kwargs``; one parameter per entry;
* summaries and descriptions (of ``Args:``, ``Returns:``, ``Yields:`` and
  ``Raises:`` entries) start with a capital letter (a lower-case first word that
  is an identifier, a parameter's name or a lower-case name such as ``numpy``
  stays as it is) and a summary ends with a period (or ``:``, ``?``, ``!``);
* no docstring line runs past the line length of ``pyproject.toml``.

``--fix`` derives what the code knows: the type from the parameter's annotation
(``Optional[X]`` and ``Union[...]`` written with ``|``; ``| None`` dropped where
the default is :obj:`None`, which ``optional`` already says), ``optional`` and
the ``(default: ...)`` from the signature, capitals and final periods. It keeps
the author's words and any type the author wrote (it may say more than an
annotation of ``Any``), edits nothing but docstrings (checked: the rewritten
module must parse to the same code) and is idempotent (checked: a second pass
must change nothing, else no file is written). What it cannot derive (a
parameter without annotation, a sentinel default, a stale entry) is reported
for a human.

Usage::

    python docs/docstyle.py --check            # exit 1 and list every finding
    python docs/docstyle.py --fix              # rewrite what the code says; list the rest
    python docs/docstyle.py --fix FILE ...     # only these files

The API reference of the documentation site (``docs/api/``) is rendered from these
docstrings at each build (``make docs``), so a fix shows there without another step.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyg_atompack"
ARG_SECTIONS = ("Args:", "Arguments:", "Parameters:", "Keyword Args:", "Keyword Arguments:")
# First words that are right in lower case (names spelled so by their projects).
LOWER_CASE_NAMES = frozenset({
    "atompack", "atompack-db", "metatrain", "numpy", "tqdm", "fsspec", "torch", "zstd",
    "lz4", "boto3", "botocore", "s3fs", "gcsfs", "adlfs", "ase", "pytest", "pip", "git",
    "zlib", "mmap", "pread", "xxhash", "sha256", "pyg", "http", "https", "hf", "s3",
    "gs", "az", "e.g.", "i.e.", "vs",
})
_ENTRY = re.compile(
    r"(?P<name>(?:\\?\*){0,2}[A-Za-z_]\w*)"
    r"(?: \((?P<type>(?:[^()]|\([^()]*\))*)\))?"
    r":(?=\s|$)"
)
_GROUPED = re.compile(r"[A-Za-z_]\w*(?:, [A-Za-z_]\w*)+(?: \([^)]*\))?:(?=\s|$)")
_HAS_DEFAULT = re.compile(r"\(default:\s")
_DEFAULT_NO_COLON = re.compile(r"\(default (?=:obj:|``)")
_DEFAULT_LITERAL = re.compile(r"\(default: ``([^`]+)``\)")
_DEFAULT_SPAN = re.compile(r"\(default:? (?:[^()]|\([^()]*\))*\)")
_ENDS_SENTENCE = re.compile(r"[.!?:][)\"'`*]*$")
_PLAIN_WORD = re.compile(r"([a-z]+(?:-[a-z]+)*)(?=[\s,;:!?)]|\.(?:\s|$)|$)")
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Pow: "**", ast.LShift: "<<"}
# what leads a Raises entry or a typed result: "ValueError: ", "int: ", "str or None: "
_RESULT_LEAD = re.compile(r"[\w.]+(?:\[[^\]]*\])?(?:(?: or |, | \| )[\w.]+(?:\[[^\]]*\])?)*: ")
_FACTORIES = {"list": "[]", "dict": "{}", "tuple": "()", "set": "set()"}


def _line_length() -> int:
    """The ruff line length of the project (100 when ``pyproject.toml`` sets none)."""
    try:
        text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return 100
    match = re.search(r"^line-length\s*=\s*(\d+)", text, re.MULTILINE)
    return int(match.group(1)) if match else 100


LINE_LENGTH = _line_length()


@dataclasses.dataclass(frozen=True)
class Finding:
    """One place where a docstring leaves the dialect.

    Args:
        path (str): The file, as given.
        line (int): The 1-based line of the finding.
        where (str): The qualified name of the documented object.
        message (str): What is wrong.
        fixable (bool): Whether ``--fix`` rewrites it.
    """

    path: str
    line: int
    where: str
    message: str
    fixable: bool

    def __str__(self) -> str:
        mark = "" if self.fixable else " [needs a human]"
        return f"{self.path}:{self.line}: {self.where}: {self.message}{mark}"


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a documented signature.

    Args:
        name (str): The name, without stars.
        annotation (ast.expr, optional): Its annotation. (default: :obj:`None`)
        default (ast.expr, optional): Its default expression. (default: :obj:`None`)
        has_default (bool, optional): Whether the parameter has a default (a
            dataclass ``default_factory`` counts). (default: :obj:`False`)
        stars (str, optional): ``"*"`` or ``"**"`` for ``*args`` and ``**kwargs``.
            (default: :obj:`""`)
    """

    name: str
    annotation: ast.expr | None = None
    default: ast.expr | None = None
    has_default: bool = False
    stars: str = ""


@dataclasses.dataclass
class Signature:
    """The documented parameters of a callable, by name.

    Args:
        params (dict[str, Param]): The parameters.
        complete (bool): Whether every accepted name is in ``params`` (not so with
            ``**kwargs`` or fields inherited from a base class).
    """

    params: dict[str, Param]
    complete: bool


# ----------------------------------------------------------------------------- signatures

def _function_signature(node: ast.FunctionDef | ast.AsyncFunctionDef,
                        method: bool = False) -> Signature:
    """The parameters of a function; a method's ``self`` or ``cls`` left out."""
    args = node.args
    bound = method and "staticmethod" not in {_decorator_name(d) for d in node.decorator_list}
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults += list(args.defaults)
    params: dict[str, Param] = {}
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        if index == 0 and bound:
            continue
        params[arg.arg] = Param(arg.arg, arg.annotation, default, default is not None)
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        params[arg.arg] = Param(arg.arg, arg.annotation, default, default is not None)
    if args.vararg is not None:
        params[args.vararg.arg] = Param(args.vararg.arg, stars="*")
    if args.kwarg is not None:
        params[args.kwarg.arg] = Param(args.kwarg.arg, stars="**")
    return Signature(params, complete=args.kwarg is None)


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _field_param(name: str, annotation: ast.expr, value: ast.expr | None) -> Param | None:
    """A dataclass field as a parameter, or None for a field that is not one."""
    if isinstance(value, ast.Call) and _decorator_name(value.func) == "field":
        keywords = {k.arg: k.value for k in value.keywords if k.arg}
        init = keywords.get("init")
        if isinstance(init, ast.Constant) and init.value is False:
            return None
        if "default" in keywords:
            return Param(name, annotation, keywords["default"], True)
        if "default_factory" in keywords:
            factory = keywords["default_factory"]
            text = _FACTORIES.get(factory.id) if isinstance(factory, ast.Name) else None
            default = ast.Name(id=text) if text else None
            return Param(name, annotation, default, True)
        return Param(name, annotation)
    return Param(name, annotation, value, value is not None)


def _class_signature(node: ast.ClassDef) -> Signature | None:
    """The parameters a class is called with, where its body says (else None)."""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
            return _function_signature(item, method=True)
    bases = {_decorator_name(base) for base in node.bases}
    is_tuple = "NamedTuple" in bases
    if not is_tuple and "dataclass" not in {_decorator_name(d) for d in node.decorator_list}:
        return None
    params: dict[str, Param] = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        if "ClassVar" in ast.unparse(item.annotation):
            continue
        param = _field_param(item.target.id, item.annotation, item.value)
        if param is not None:
            params[param.name] = param
    # fields of a base dataclass are not in this body
    own_bases = bases - {"NamedTuple", "Generic", "Protocol", "object", ""}
    return Signature(params, complete=not own_bases)


# ------------------------------------------------------------------------------ rendering

def _strip_typing(node: ast.AST) -> ast.AST:
    """``typing.X`` → ``X``, ``Optional[X]`` → ``X | None``, ``Union[A, B]`` → ``A | B``."""

    class Rewrite(ast.NodeTransformer):
        def visit_Attribute(self, item: ast.Attribute) -> ast.AST:
            self.generic_visit(item)
            if isinstance(item.value, ast.Name) and item.value.id in (
                    "typing", "t", "typing_extensions"):
                return ast.Name(id=item.attr)
            return item

        def visit_Constant(self, item: ast.Constant) -> ast.AST:
            # a string inside an annotation (Literal["a"]) reads with double quotes
            if isinstance(item.value, str):
                return ast.Name(id=json.dumps(item.value))
            return item

        def visit_Subscript(self, item: ast.Subscript) -> ast.AST:
            self.generic_visit(item)
            if isinstance(item.value, ast.Name) and item.value.id in ("Optional", "Union"):
                members = (list(item.slice.elts) if isinstance(item.slice, ast.Tuple)
                           else [item.slice])
                if item.value.id == "Optional":
                    members.append(ast.Constant(value=None))
                result = members[0]
                for member in members[1:]:
                    result = ast.BinOp(left=result, op=ast.BitOr(), right=member)
                return result
            return item

    return Rewrite().visit(node)


def _union_members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    return [node]


def render_type(annotation: ast.expr, default: ast.expr | None = None) -> str | None:
    """The type of an ``Args:`` entry, written from a parameter's annotation.

    Args:
        annotation (ast.expr): The annotation (a string annotation is parsed).
        default (ast.expr, optional): The parameter's default; where it is
            :obj:`None`, ``| None`` is left out (``optional`` says it).
            (default: :obj:`None`)

    Returns:
        The type as text, e.g. ``"int"``, ``"str | os.PathLike"`` or
        ``"Sequence[int]"``; :obj:`None` for a string annotation that does not parse.
    """
    node: ast.AST = annotation
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    members = _union_members(_strip_typing(node))
    if (isinstance(default, ast.Constant) and default.value is None and len(members) > 1):
        members = [m for m in members
                   if not (isinstance(m, ast.Constant) and m.value is None)] or members
    return " | ".join(ast.unparse(m) for m in members)


def render_default(node: ast.expr | None) -> str | None:
    """The ``(default: ...)`` text for a default expression, or None where a human must say.

    Literals, containers of literals, arithmetic on them and public names are
    written as code; calls and private names (sentinels) are not.

    Args:
        node (ast.expr): The default expression.

    Returns:
        E.g. ``"(default: :obj:`3`)"``, or :obj:`None`.
    """
    text = _default_value(node) if node is not None else None
    if text is None or "`" in text or len(text) > 60:
        return None
    return f"(default: :obj:`{text}`)"


def _default_value(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            if any(c in node.value for c in "\"\\`\n"):
                return None
            return f'"{node.value}"'
        return repr(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _default_value(node.operand)
        return None if inner is None else ast.unparse(node.op).strip() + inner
    if isinstance(node, ast.BinOp):
        left, right = _default_value(node.left), _default_value(node.right)
        if left is None or right is None:
            return None
        # keep the grouping of operands that are sums or products themselves
        if isinstance(node.left, ast.BinOp) and not isinstance(node.left.op, ast.Pow):
            left = f"({left})"
        if isinstance(node.right, ast.BinOp) and not isinstance(node.right.op, ast.Pow):
            right = f"({right})"
        symbol = _OPERATORS.get(type(node.op))
        if symbol is None:
            return None
        # powers bind tightest and are written without spaces, as formatters do
        return f"{left}**{right}" if symbol == "**" else f"{left} {symbol} {right}"
    if isinstance(node, (ast.Name, ast.Attribute)):
        text = ast.unparse(node)
        return None if any(part.startswith("_") for part in text.split(".")) else text
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_default_value(e) for e in node.elts]
        if any(i is None for i in items):
            return None
        if isinstance(node, ast.Set):
            return "{" + ", ".join(items) + "}" if items else "set()"  # type: ignore[arg-type]
        body = ", ".join(items)  # type: ignore[arg-type]
        if isinstance(node, ast.Tuple):
            return f"({body},)" if len(items) == 1 else f"({body})"
        return f"[{body}]"
    if isinstance(node, ast.Dict):
        pairs = [(_default_value(k) if k else None, _default_value(v))
                 for k, v in zip(node.keys, node.values)]
        if any(k is None or v is None for k, v in pairs):
            return None
        return "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    return None


def capitalised(text: str, keep: frozenset[str] = frozenset()) -> str | None:
    """``text`` with its first word capitalised, or None where it should stay.

    A first word is capitalised when it is a plain lower-case word; identifiers
    (``read_batch``, ``np.ndarray``, ``open(...)``), code, names that are right
    in lower case (:data:`LOWER_CASE_NAMES`) and the names in ``keep`` are left
    alone.

    Args:
        text (str): A summary or description, from its first character.
        keep (frozenset[str], optional): More names to leave alone (the
            parameters of the documented callable). (default: :obj:`frozenset()`)

    Returns:
        The capitalised text, or :obj:`None` when nothing is to change.
    """
    match = _PLAIN_WORD.match(text)
    if match is None or match.group(1) in LOWER_CASE_NAMES or match.group(1) in keep:
        return None
    return text[0].upper() + text[1:]


# ------------------------------------------------------------------------------ docstrings

@dataclasses.dataclass
class _Literal:
    """The source of one docstring literal, as editable lines of its content.

    Args:
        first (int): 0-based source line of the opening quotes.
        last (int): 0-based source line of the closing quotes.
        prefix (str): What precedes the content on the first line (indent, quotes).
        suffix (str): What follows the content on the last line (quotes, comments).
        lines (list[str]): The content, one string per source line.
        raw (bool): Whether the literal is a raw string.
        editable (bool): Whether it is one plain triple-quoted literal.
    """

    first: int
    last: int
    prefix: str
    suffix: str
    lines: list[str]
    raw: bool
    editable: bool

    def width(self, index: int) -> int:
        """The source width of content line ``index``, quotes included.

        Args:
            index (int): The content line.

        Returns:
            The number of characters of that source line.
        """
        extra = (len(self.prefix) if index == 0 else 0)
        extra += len(self.suffix) if index == len(self.lines) - 1 else 0
        return len(self.lines[index]) + extra

    def render(self) -> str:
        """The literal's source lines, without the final newline.

        Returns:
            The text that replaces source lines ``first`` to ``last``.
        """
        return self.prefix + "\n".join(self.lines) + self.suffix


def _char_col(line: str, byte_col: int) -> int:
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def _literal(source_lines: list[str], node: ast.Constant) -> _Literal:
    first, last = node.lineno - 1, node.end_lineno - 1  # type: ignore[operator]
    start = _char_col(source_lines[first], node.col_offset)
    end = _char_col(source_lines[last], node.end_col_offset)  # type: ignore[arg-type]
    opening = re.match(r"([rRuU]*)(\"\"\"|'''|\"|')", source_lines[first][start:])
    assert opening is not None, "a docstring starts with quotes"
    quotes = opening.group(2)
    body_start = start + opening.end()
    body_end = end - len(quotes)
    if first == last:
        content = [source_lines[first][body_start:body_end]]
    else:
        content = ([source_lines[first][body_start:]] + source_lines[first + 1:last]
                   + [source_lines[last][:body_end]])
    segment = "\n".join(content)
    editable = (len(quotes) == 3 and quotes not in segment
                and source_lines[last][body_end:end] == quotes)
    return _Literal(first, last, source_lines[first][:body_start], source_lines[last][body_end:],
                    content, "r" in opening.group(1).lower(), editable)


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip(" "))


def _docstring_node(node: ast.AST) -> ast.Constant | None:
    """The docstring literal of a module, class or function, if it has one."""
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        return body[0].value
    return None


_Documented = Iterator[tuple[str, ast.Constant, "Signature | None"]]


def _documented(tree: ast.Module) -> _Documented:
    """``(qualified name, docstring node, signature)`` of every docstring of a module."""

    def walk(node: ast.AST, prefix: str) -> _Documented:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                doc = _docstring_node(child)
                if doc is not None:
                    signature = (_class_signature(child) if isinstance(child, ast.ClassDef)
                                 else _function_signature(
                                     child, method=isinstance(node, ast.ClassDef)))
                    yield name, doc, signature
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)

    doc = _docstring_node(tree)
    if doc is not None:
        yield "<module>", doc, None
    yield from walk(tree, "")


@dataclasses.dataclass
class _Entry:
    start: int  # content line of the entry's name
    end: int  # last non-blank content line of the entry


def _arg_sections(lines: list[str], headers: Sequence[str] = ARG_SECTIONS
                  ) -> Iterator[tuple[int, int, list[_Entry]]]:
    """``(header line, entry indent, entries)`` of each section named in ``headers``."""
    index = 0
    while index < len(lines):
        if lines[index].strip() not in headers:
            index += 1
            continue
        header_indent = _indent(lines[index])
        entries: list[_Entry] = []
        entry_indent = None
        cursor = index + 1
        while cursor < len(lines):
            text = lines[cursor]
            if text.strip():
                indent = _indent(text)
                if indent <= header_indent:
                    break
                if entry_indent is None:
                    entry_indent = indent
                if indent <= entry_indent:
                    entries.append(_Entry(cursor, cursor))
                elif entries:
                    entries[-1].end = cursor
            cursor += 1
        yield index, entry_indent or 0, entries
        index = cursor


class _Checker:
    """Finds, and with ``fix`` repairs, the findings of one docstring."""

    def __init__(self, path: str, where: str, literal: _Literal, signature: Signature | None,
                 fix: bool) -> None:
        self.path, self.where, self.lit, self.signature = path, where, literal, signature
        self.fix = fix and literal.editable
        self.findings: list[Finding] = []
        # a description may start with a parameter's name, which keeps its spelling
        self.names = frozenset(signature.params) if signature else frozenset()

    def report(self, index: int, message: str, fixable: bool) -> None:
        fixable = fixable and self.lit.editable
        line = self.lit.first + index + 1
        self.findings.append(Finding(self.path, line, self.where, message, fixable))

    def fits(self, index: int, text: str) -> bool:
        extra = self.lit.width(index) - len(self.lit.lines[index])
        return len(text) + extra <= LINE_LENGTH

    def can_insert(self, text: str) -> bool:
        # a backslash in a non-raw literal would change the docstring's value
        return self.lit.raw or "\\" not in text

    # ------------------------------------------------------------------ summary
    def check_summary(self) -> None:
        lines = self.lit.lines
        first = next((i for i, text in enumerate(lines) if text.strip()), None)
        if first is None:
            return
        text = lines[first]
        lead = len(text) - len(text.lstrip())
        if lines[first].strip() in ARG_SECTIONS:
            return
        new = capitalised(text[lead:], self.names)
        if new is not None:
            self.report(first, "summary does not start with a capital letter", True)
            if self.fix:
                lines[first] = text[:lead] + new
        last = first
        while last + 1 < len(lines) and lines[last + 1].strip():
            last += 1
        ending = lines[last].rstrip()
        if not _ENDS_SENTENCE.search(ending):
            fixable = self.fits(last, ending + ".")
            self.report(last, "summary does not end with a period", fixable)
            if self.fix and fixable:
                lines[last] = ending + "." + lines[last][len(ending):]

    # ------------------------------------------------------ returns, yields, raises
    def check_results(self) -> None:
        """Descriptions under ``Returns:``, ``Yields:`` and ``Raises:`` start with a capital.

        A ``Raises:`` entry reads ``Error: Description.``; a result may lead with
        its type (``int: The count.``), whose description is then the one checked.
        """
        for header, _, entries in _arg_sections(self.lit.lines,
                                                ("Returns:", "Yields:", "Raises:")):
            raises = self.lit.lines[header].strip() == "Raises:"
            # a result is one paragraph, whose later lines may share its indent
            for entry in entries if raises else entries[:1]:
                text = self.lit.lines[entry.start]
                lead = _RESULT_LEAD.match(text.strip())
                if raises and lead is None:
                    continue
                start = _indent(text) + (lead.end() if lead else 0)
                new = capitalised(text[start:], self.names)
                if new is None:
                    continue
                self.report(entry.start, "description does not start with a capital letter",
                            True)
                if self.fix:
                    self.lit.lines[entry.start] = text[:start] + new

    # --------------------------------------------------------------------- args
    def check_args(self) -> None:
        # entries are handled bottom-up, so that inserted lines do not move the rest
        sections = list(_arg_sections(self.lit.lines))
        for header, entry_indent, entries in reversed(sections):
            if self.lit.lines[header].strip() != "Args:":
                # a second section of the name would split one list in two
                alone = all(self.lit.lines[h].strip() != "Args:" for h, _, _ in sections)
                self.report(header, f"section {self.lit.lines[header].strip()!r} is "
                                    "written 'Args:'", alone)
                if self.fix and alone:
                    text = self.lit.lines[header]
                    self.lit.lines[header] = text[:_indent(text)] + "Args:"
            continuation = next(
                (_indent(self.lit.lines[i]) for e in entries for i in range(e.start + 1, e.end + 1)
                 if self.lit.lines[i].strip()), entry_indent + 4)
            for entry in reversed(entries):
                self.check_entry(entry, entry_indent, continuation)

    def check_entry(self, entry: _Entry, indent: int, continuation: int) -> None:
        lines = self.lit.lines
        text = lines[entry.start]
        stripped = text.strip()
        if _indent(text) != indent:
            self.report(entry.start, "Args entry is not indented like the others", False)
            return
        match = _ENTRY.match(stripped)
        if match is None:
            what = ("one entry per parameter" if _GROUPED.match(stripped)
                    else "not an Args entry ('name (type): Description.')")
            self.report(entry.start, f"{what}: {stripped[:40]!r}", False)
            return
        written = match.group("name")
        bare = written.replace("\\", "").lstrip("*")
        type_text = match.group("type")
        rest = stripped[match.end():]
        param = self.signature.params.get(bare) if self.signature else None
        name = written
        new_type = type_text
        label = f"Args entry {bare!r}"

        if param is None:
            if self.signature is not None and self.signature.complete:
                self.report(entry.start, f"{label} documents no parameter of the signature",
                            False)
            if type_text is None:
                self.report(entry.start, f"{label} has no type (and no annotation to take "
                                         "it from)", False)
        elif param.stars:
            name = written if written.replace("\\", "").startswith("*") else param.stars + bare
            if type_text is None:
                new_type = "optional"
                self.report(entry.start, f"{label} is written '{param.stars}{bare} (optional):'",
                            True)
            elif name != written:
                self.report(entry.start, f"{label} is written '{param.stars}{bare}'", True)
        else:
            new_type = self.entry_type(entry.start, label, param, type_text)
        if self.fix:
            tail = f" ({new_type})" if new_type is not None else ""
            lines[entry.start] = " " * indent + name + tail + ":" + rest
        self.check_description(entry, label, rest, bare)
        if param is not None and not param.stars and param.has_default:
            self.check_default(entry, label, param, continuation)
        self.check_width(entry, label, continuation)

    def entry_type(self, index: int, label: str, param: Param, type_text: str | None
                   ) -> str | None:
        """The type an entry should carry (or the written one, where none can be derived)."""
        optional = type_text is not None and (type_text == "optional"
                                              or type_text.endswith(", optional"))
        base = type_text
        if type_text is not None and optional:
            base = None if type_text == "optional" else type_text[: -len(", optional")]
        if base is None:
            base = (render_type(param.annotation, param.default)
                    if param.annotation is not None else None)
            if base is None:
                self.report(index, f"{label} has no type, and the parameter no annotation",
                            False)
                return type_text
            self.report(index, f"{label} has no type (the annotation says {base!r})", True)
        if param.has_default and not optional:
            if type_text is not None:
                self.report(index, f"{label} has a default: its type ends with ', optional'",
                            True)
        elif not param.has_default and optional:
            self.report(index, f"{label} is marked optional but has no default", True)
        return f"{base}, optional" if param.has_default else base

    def check_description(self, entry: _Entry, label: str, rest: str, name: str) -> None:
        description = rest.lstrip()
        if not description:
            return
        # "name: name used in messages" is the word; another parameter's name is code
        new = capitalised(description, self.names - {name})
        if new is None:
            return
        self.report(entry.start, f"{label}: its description does not start with a capital "
                                 "letter", True)
        if self.fix:
            text = self.lit.lines[entry.start]
            at = len(text) - len(description)
            self.lit.lines[entry.start] = text[:at] + new

    def check_default(self, entry: _Entry, label: str, param: Param, continuation: int) -> None:
        lines = self.lit.lines
        body = "\n".join(lines[entry.start:entry.end + 1])
        if _HAS_DEFAULT.search(body):
            literal = _DEFAULT_LITERAL.search(body)
            if literal is not None:
                self.report(entry.start, f"{label}: a default literal is written "
                                         "(default: :obj:`...`)", True)
                if self.fix:
                    self.replace_in_entry(entry, literal.group(0),
                                          f"(default: :obj:`{literal.group(1)}`)")
            return
        if _DEFAULT_NO_COLON.search(body):
            self.report(entry.start, f"{label}: the default is written '(default: ...)'", True)
            if self.fix:
                self.replace_in_entry(entry, "(default ", "(default: ")
            return
        default = render_default(param.default)
        if default is None or not self.can_insert(default):
            self.report(entry.start, f"{label} does not state its default (and "
                                     f"{ast.unparse(param.default) if param.default else '?'} "
                                     "needs words)", False)
            return
        self.report(entry.start, f"{label} does not state its default {default}", True)
        if not self.fix:
            return
        last = entry.end
        ending = lines[last].rstrip()
        if ending.endswith(":"):
            self.report(last, f"{label}: description ends with ':', default not added", False)
            return
        # after a list or a literal block the default is a paragraph of its own
        prose = _Checker.joinable("", lines[last]) and not any(
            "::" in lines[i] for i in range(entry.start, last + 1))
        if not prose:
            self.insert(last + 1, "")
            self.insert(last + 2, " " * continuation + default)
            entry.end += 2
            return
        if not _ENDS_SENTENCE.search(ending) and not ending.endswith(","):
            ending += "."
        if self.fits(last, f"{ending} {default}"):
            lines[last] = f"{ending} {default}" + lines[last][len(lines[last].rstrip()):]
        else:
            lines[last] = ending + lines[last][len(lines[last].rstrip()):]
            self.insert(last + 1, " " * continuation + default)
            entry.end += 1

    def replace_in_entry(self, entry: _Entry, old: str, new: str) -> None:
        for index in range(entry.start, entry.end + 1):
            if old in self.lit.lines[index]:
                self.lit.lines[index] = self.lit.lines[index].replace(old, new, 1)
                return

    def insert(self, index: int, text: str) -> None:
        self.lit.lines.insert(index, text)

    def check_width(self, entry: _Entry, label: str, continuation: int) -> None:
        """Wrap lines the fix made too long (their words move to the next line)."""
        if not self.fix:
            return
        index = entry.start
        while index <= entry.end:
            text = self.lit.lines[index]
            if self.fits(index, text):
                index += 1
                continue
            split = _split_point(text, LINE_LENGTH - (self.lit.width(index) - len(text)),
                                 floor=text.find(":") + 1 if index == entry.start
                                 else _indent(text) + 1)
            if split is None:
                self.report(index, f"{label}: line too long, and no place to wrap it", False)
                index += 1
                continue
            head, moved = text[:split].rstrip(), text[split:].strip()
            self.lit.lines[index] = head
            following = index + 1
            if following <= entry.end and self.joinable(head, self.lit.lines[following]):
                # the moved words lead the next line, which is wrapped in its turn
                self.lit.lines[following] = (" " * _indent(self.lit.lines[following]) + moved
                                             + " " + self.lit.lines[following].strip())
            else:
                self.insert(following, " " * continuation + moved)
                entry.end += 1
            index += 1

    @staticmethod
    def joinable(head: str, following: str) -> bool:
        """Whether words may flow from a line into ``following`` (plain prose only).

        Args:
            head (str): What stays of the wrapped line.
            following (str): The next line of the entry.

        Returns:
            :obj:`False` for a blank line, a list item, a doctest, a directive or
            a literal block, whose layout is not prose.
        """
        text = following.strip()
        return bool(text) and not head.rstrip().endswith("::") and not text.startswith(
            ("- ", "* ", ">>>", "...", "..", "|", "+"))


def _split_point(text: str, limit: int, floor: int) -> int | None:
    """Where to break ``text`` to keep it within ``limit``.

    A space outside inline code and outside a ``(default: ...)``, which PyG keeps
    on one line.
    """
    kept = [m.span() for m in _DEFAULT_SPAN.finditer(text)]
    best = None
    ticks = 0
    for position, char in enumerate(text):
        if char == "`":
            ticks += 1
        elif (char == " " and ticks % 2 == 0 and floor < position <= limit
              and not any(start < position < stop for start, stop in kept)):
            best = position
    return best


def _code_without_docstrings(tree: ast.Module) -> str:
    for node in ast.walk(tree):
        if _docstring_node(node) is not None:
            node.body[0] = ast.Expr(value=ast.Constant(value=""))  # type: ignore[attr-defined]
    return ast.dump(tree)


def process(source: str, path: str = "<source>", fix: bool = False) -> tuple[str, list[Finding]]:
    """Check (and with ``fix`` rewrite) every docstring of one module's source.

    Args:
        source (str): The module's source.
        path (str, optional): The name used in findings. (default: :obj:`"<source>"`)
        fix (bool, optional): Return the source with every fixable finding fixed.
            (default: :obj:`False`)

    Returns:
        The (possibly rewritten) source and the findings of the original; with
        ``fix``, only those that remain for a human.

    Raises:
        RuntimeError: If a fix would change code, or a second pass would change
            the result again (a bug in this tool; nothing should be written).
    """
    tree = ast.parse(source)
    source_lines = source.split("\n")
    findings: list[Finding] = []
    literals = []
    for where, doc, signature in _documented(tree):
        literal = _literal(source_lines, doc)
        checker = _Checker(path, where, literal, signature, fix)
        checker.check_args()
        checker.check_results()
        checker.check_summary()
        findings += checker.findings
        literals.append(literal)
    findings.sort(key=lambda f: (f.line, f.message))
    if not fix:
        return source, findings
    for literal in sorted(literals, key=lambda lit: lit.first, reverse=True):
        source_lines[literal.first:literal.last + 1] = literal.render().split("\n")
    fixed = "\n".join(source_lines)
    if fixed == source:
        return source, [f for f in findings if not f.fixable]
    if _code_without_docstrings(ast.parse(fixed)) != _code_without_docstrings(ast.parse(source)):
        raise RuntimeError(f"{path}: the docstring fix would change code; nothing written")
    again, remaining = process(fixed, path, fix=True)
    if again != fixed:
        raise RuntimeError(f"{path}: a second fix pass changes the result; nothing written")
    return fixed, remaining


def module_paths(paths: Sequence[str]) -> list[Path]:
    """The Python files to process: the given ones (directories searched), or the package.

    Args:
        paths (Sequence[str]): Files or directories; empty for ``pyg_atompack/``.

    Returns:
        The ``.py`` files, sorted.
    """
    roots = [Path(p) for p in paths] or [PACKAGE]
    files: set[Path] = set()
    for root in roots:
        files.update(root.rglob("*.py") if root.is_dir() else [root])
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    """Check or fix the docstrings of the package (or of the given files).

    Args:
        argv (list[str], optional): Command-line arguments; :obj:`None` reads
            ``sys.argv[1:]``. (default: :obj:`None`)

    Returns:
        The exit status: 0, or 1 when findings remain.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list findings, write nothing")
    mode.add_argument("--fix", action="store_true", help="rewrite what the code says")
    parser.add_argument("paths", nargs="*", help="files or directories (default: the package)")
    args = parser.parse_args(argv)
    remaining: list[Finding] = []
    changed = []
    for path in module_paths(args.paths):
        resolved = path.resolve()
        shown = str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)
        try:
            source = path.read_text(encoding="utf-8")
            if "\r" in source:
                raise ValueError("CR line endings")
            new, findings = process(source, shown, fix=args.fix)
        except (UnicodeDecodeError, SyntaxError, ValueError, RuntimeError) as exc:
            # one unreadable module must not stop an unattended run over the others
            remaining.append(Finding(shown, getattr(exc, "lineno", None) or 1, "<module>",
                                     f"not processed: {exc}", False))
            continue
        remaining += findings
        if new != source:
            path.write_text(new, encoding="utf-8")
            changed.append(shown)
    for finding in remaining:
        print(finding)
    if args.fix:
        print(f"rewrote {len(changed)} file(s); {len(remaining)} finding(s) need a human")
    elif remaining:
        fixable = sum(f.fixable for f in remaining)
        print(f"{len(remaining)} finding(s), {fixable} fixable with: python docs/docstyle.py --fix")
    return 1 if remaining else 0


if __name__ == "__main__":
    sys.exit(main())
