"""The package's docstrings follow PyG's typed dialect, and ``docs/docstyle.py`` keeps them so.

The check runs the tool on ``pyg_atompack/`` as CI does; the rest feeds the rewriter
small modules and asserts what it writes, what it leaves alone and what it reports
for a human.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import docstyle  # noqa: E402


def test_package_docstrings_follow_the_dialect():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "docstyle.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    findings = {re.sub(r":\d+: ", ": ", line).removesuffix(" [needs a human]")
                for line in result.stdout.splitlines() if line.startswith("pyg_atompack/")}
    assert not findings, ("docstrings outside PyG's dialect (python docs/docstyle.py --fix "
                          "repairs most):\n" + "\n".join(sorted(findings)) + result.stderr)
    assert result.returncode == (1 if findings else 0), result.stdout + result.stderr


def fix(source: str) -> tuple[str, list[str]]:
    """Run the rewriter on a dedented module; return the text and what is left."""
    fixed, findings = docstyle.process(textwrap.dedent(source), "m.py", fix=True)
    return fixed, [f"{f.where}: {f.message}" for f in findings]


def test_untyped_entries_take_types_and_defaults_from_the_signature():
    fixed, left = fix('''
        def f(path: str | os.PathLike, size: int = 3, *, name: Optional[str] = None,
              mode: Literal["a", "b"] = "a", span: Union[int, float] = 2**20) -> None:
            """Open a file.

            Args:
                path: The file.
                size: Its size. (default: ``3``)
                name: A label, or None.
                mode: How.
                span: Bytes per read
            """
    ''')
    assert fixed == textwrap.dedent('''
        def f(path: str | os.PathLike, size: int = 3, *, name: Optional[str] = None,
              mode: Literal["a", "b"] = "a", span: Union[int, float] = 2**20) -> None:
            """Open a file.

            Args:
                path (str | os.PathLike): The file.
                size (int, optional): Its size. (default: :obj:`3`)
                name (str, optional): A label, or None. (default: :obj:`None`)
                mode (Literal["a", "b"], optional): How. (default: :obj:`"a"`)
                span (int | float, optional): Bytes per read. (default: :obj:`2**20`)
            """
    ''')
    assert left == []


def test_written_types_and_everything_else_stay_byte_for_byte():
    source = '''
        import os  # a comment   with odd spacing


        class Reader:
            r"""A reader of ``*.atp`` files \\ raw.

            Args:
                path (str or os.PathLike): Kept as the author wrote it, although
                    the annotation says otherwise.
                access (str, optional): How. (default: the mode of :func:`open`)
            """

            def __init__(self, path: os.PathLike, access: str = "auto") -> None:
                self.path = path   # trailing   spaces stay
    '''
    fixed, left = fix(source)
    assert fixed == textwrap.dedent(source)
    assert left == []
    assert docstyle.process(textwrap.dedent(source), "m.py")[1] == []


def test_parameters_without_annotation_are_reported_for_a_human():
    source = '''
        def f(handle, *, size=_UNSET) -> None:
            """Write.

            Args:
                handle: An open file.
                size (int, optional): Bytes.
            """
    '''
    fixed, left = fix(source)
    assert fixed == textwrap.dedent(source)
    assert left == ["f: Args entry 'handle' has no type, and the parameter no annotation",
                    "f: Args entry 'size' does not state its default (and _UNSET needs words)"]


def test_continuation_lines_and_long_lines(monkeypatch):
    # a short limit, so that short sample lines overflow once typed
    monkeypatch.setattr(docstyle, "LINE_LENGTH", 72)
    fixed, left = fix('''
        class Store:
            def list(self, prefix: str, suffixes: tuple[str, ...] = (".atp", ".pt"),
                     options: Mapping[str, Any] | None = None) -> list[str]:
                """list the objects under a prefix

                Args:
                    prefix: The prefix under which every object is listed.
                    suffixes: Keep only these; a description that goes
                        on over a second line, almost to the limit of it.
                    options: The backend's options, passed on untouched.
                """
    ''')
    assert fixed == textwrap.dedent('''
        class Store:
            def list(self, prefix: str, suffixes: tuple[str, ...] = (".atp", ".pt"),
                     options: Mapping[str, Any] | None = None) -> list[str]:
                """List the objects under a prefix.

                Args:
                    prefix (str): The prefix under which every object is listed.
                    suffixes (tuple[str, ...], optional): Keep only these; a
                        description that goes on over a second line, almost to
                        the limit of it. (default: :obj:`(".atp", ".pt")`)
                    options (Mapping[str, Any], optional): The backend's
                        options, passed on untouched. (default: :obj:`None`)
                """
    ''')
    assert left == []
    docstring = fixed.split('"""')[1]
    assert max(len(line) for line in docstring.splitlines()) <= 72
    assert docstyle.process(fixed, "m.py", fix=True)[0] == fixed


def test_star_args_kwargs_and_dataclass_fields():
    fixed, left = fix('''
        @dataclasses.dataclass(frozen=True)
        class Options:
            """Options.

            Args:
                keys: the keys.
                casts: numpy dtypes by key.
                limit: at most this many.
            """

            keys: tuple[str, ...]
            casts: dict[str, str] = dataclasses.field(default_factory=dict)
            limit: ClassVar[int] = 3


        def forward(*args: Any, **kwargs: Any) -> None:
            """Forward everything.

            Args:
                *args: Positional arguments of :func:`target`.
                kwargs: Keyword arguments of :func:`target`.
            """
    ''')
    assert "        keys (tuple[str, ...]): The keys.\n" in fixed
    assert "        casts (dict[str, str], optional): numpy dtypes by key. (default: :obj:`{}`)\n" \
        in fixed
    assert "        *args (optional): Positional arguments of :func:`target`.\n" in fixed
    assert "        **kwargs (optional): Keyword arguments of :func:`target`.\n" in fixed
    # a ClassVar is no parameter: its entry is stale and needs a human
    assert left == ["Options: Args entry 'limit' documents no parameter of the signature",
                    "Options: Args entry 'limit' has no type (and no annotation to take it "
                    "from)"]


def test_optional_means_has_a_default_and_summaries_read_as_sentences():
    fixed, left = fix('''
        def g(pairs: list[str] | None, level: int = 3) -> None:
            """numpy arrays in, a ``Data`` out

            Args:
                pairs (list[str], optional): ``KEY=VALUE`` strings.
                level (int): Zstd level.
            """


        def h() -> None:
            """read_batch of one record; an identifier stays lower case."""
    ''')
    assert '"""numpy arrays in, a ``Data`` out.\n' in fixed
    assert "pairs (list[str]): ``KEY=VALUE`` strings.\n" in fixed
    assert "level (int, optional): Zstd level. (default: :obj:`3`)\n" in fixed
    assert '"""read_batch of one record; an identifier stays lower case."""' in fixed
    assert left == []


def test_check_lists_every_fix_and_fixing_is_idempotent():
    source = textwrap.dedent('''
        def f(url: str, retries: int = 2) -> None:
            """fetch.

            Args:
                url: The address.
                retries: how often.
            """
    ''')
    same, findings = docstyle.process(source, "m.py")
    assert same == source
    assert [(f.line, f.message, f.fixable) for f in findings] == [
        (3, "summary does not start with a capital letter", True),
        (6, "Args entry 'url' has no type (the annotation says 'str')", True),
        (7, "Args entry 'retries' does not state its default (default: :obj:`2`)", True),
        (7, "Args entry 'retries' has no type (the annotation says 'int')", True),
        (7, "Args entry 'retries': its description does not start with a capital letter", True),
    ]
    fixed, left = docstyle.process(source, "m.py", fix=True)
    assert left == [] and docstyle.process(fixed, "m.py")[1] == []
    assert docstyle.process(fixed, "m.py", fix=True)[0] == fixed


def test_command_line_fix_and_check(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text('def f(x: int) -> int:\n    """Double.\n\n    Args:\n'
                      '        x: A number.\n    """\n    return 2 * x\n', encoding="utf-8")
    tool = [sys.executable, str(ROOT / "docs" / "docstyle.py")]
    check = subprocess.run([*tool, "--check", str(module)], capture_output=True, text=True)
    assert check.returncode == 1 and "Args entry 'x' has no type" in check.stdout
    fixed = subprocess.run([*tool, "--fix", str(module)], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "        x (int): A number.\n" in module.read_text(encoding="utf-8")
    again = subprocess.run([*tool, "--check", str(module)], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == ""


def test_self_and_cls_are_left_out_of_methods_only():
    fixed, left = fix('''
        def members(cls: type) -> list[str]:
            """Names of a class.

            Args:
                cls: The class.
            """


        class C:
            @classmethod
            def make(cls, size: int) -> C:
                """Build one.

                Args:
                    size: How big.
                """

            @staticmethod
            def pick(self: str) -> str:
                """A static method whose first parameter is a parameter.

                Args:
                    self: A name.
                """
    ''')
    assert "        cls (type): The class.\n" in fixed
    assert "            size (int): How big.\n" in fixed
    assert "            self (str): A name.\n" in fixed
    assert left == []


def test_wrapping_leaves_lists_and_literal_blocks_alone(monkeypatch):
    monkeypatch.setattr(docstyle, "LINE_LENGTH", 60)
    fixed, left = fix('''
        def f(mode: str = "a") -> None:
            """Pick.

            Args:
                mode: One of these, and a rather long explanation::
                    - ``"a"``: first
                    - ``"b"``: second
            """
    ''')
    assert fixed == textwrap.dedent('''
        def f(mode: str = "a") -> None:
            """Pick.

            Args:
                mode (str, optional): One of these, and a rather
                    long explanation::
                    - ``"a"``: first
                    - ``"b"``: second

                    (default: :obj:`"a"`)
            """
    ''')
    assert left == []


def test_other_section_names_become_args():
    fixed, left = fix('''
        def f(x: int) -> None:
            """Use x.

            Parameters:
                x: A number.
            """
    ''')
    assert "    Args:\n        x (int): A number.\n" in fixed and left == []


def test_raises_and_returns_descriptions_are_capitalised():
    fixed, left = fix('''
        def f(x: int) -> int:
            """Check x.

            Args:
                x: A number.

            Returns:
                int: the same number, checked: a long description that wraps
                onto a second line at the same indent.

            Raises:
                ValueError, TypeError: x is not a number.
                pyg_atompack.atp.AtpError: never.
            """
    ''')
    assert ("        int: The same number, checked: a long description that wraps\n"
            "        onto a second line at the same indent.\n") in fixed
    # a parameter's name stays as it is spelled
    assert "        ValueError, TypeError: x is not a number.\n" in fixed
    assert "        pyg_atompack.atp.AtpError: Never.\n" in fixed
    assert left == []


def test_a_description_may_start_with_its_own_name_but_not_another():
    fixed, _ = fix('''
        def f(name: str, size: int) -> None:
            """Name a thing.

            Args:
                name: name used in messages.
                size: name bytes at most.
            """
    ''')
    assert "        name (str): Name used in messages.\n" in fixed
    assert "        size (int): name bytes at most.\n" in fixed
