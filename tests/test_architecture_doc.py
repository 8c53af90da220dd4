"""docs/architecture.md names every module of the package in its table of modules by layer."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyg_atompack"


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_every_module_has_its_concern_in_the_layer_tables():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = _section(text, "Modules by layer")
    named = set(re.findall(r"`([a-z_/]+\.py)`", section))
    layers = {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    # module paths as the tables write them: relative to the package
    named = {name for name in named if name.split("/")[0] in layers
             or (PACKAGE / name).is_file()} - {"__init__.py"}
    modules = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" and "__pycache__" not in path.parts}
    assert not modules - named, f"modules missing from docs/architecture.md: {modules - named}"
    assert not named - modules, f"docs/architecture.md names modules that do not exist: " \
                                f"{named - modules}"
