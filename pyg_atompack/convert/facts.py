"""What a published dataset card and manifest say about a set of shards.

One pass over the shards gives the structure and atom counts, the elements
present and every field with its dtype and shape; the field descriptions are
the ones ``pyg-atompack info`` prints (:func:`.summary.describe_atp_fields` for
`.atp`, :func:`.summary.scan` for ``.pt``), turned into JSON-friendly entries.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack.atp.types import ATOM_AXIS_BUILTINS, BUILTINS

#: Units of the builtin fields, the project's convention (docs/guides/local-files.md,
#: ``Data`` attributes).
UNITS = {name: field.unit for name, field in BUILTINS.items() if field.unit is not None}

_PYTHON_DTYPES = {"float": "float64", "int": "int64", "bool": "bool", "str": "str"}
_DESCRIPTION = re.compile(r"^(?P<dtype>[A-Za-z0-9_]+)(?:\[(?P<shape>[^\]]*)\])?")


def field_entry(description: str, per_atom: bool) -> dict[str, Any]:
    """A manifest field entry out of an ``info`` description such as ``float32[n,3]``.

    Args:
        description (str): ``dtype[shape]`` text; ``n`` is the atom axis, ``?`` a dimension that
            varies between structures.
        per_atom (bool): Whether the field has one value per atom.

    Returns:
        ``{"dtype", "shape", "per_atom", "description"}``; ``shape`` lists ints,
        ``"n"`` for the atom axis and ``None`` where it varies; ``dtype`` is
        ``None`` when the structures disagree (``"a | b"`` descriptions).
    """
    text = description.replace("(per atom)", "").replace("(per structure)", "").strip()
    match = _DESCRIPTION.match(text)
    dtype: str | None = None
    shape: list[Any] = []
    if match and "|" not in text:
        dtype = _PYTHON_DTYPES.get(match["dtype"], match["dtype"])
        for dim in (match["shape"] or "").split(","):
            dim = dim.strip()
            if dim:
                shape.append(int(dim) if dim.isdigit() else (None if dim == "?" else dim))
    if dtype == "None":
        dtype = None
    return {"dtype": dtype, "shape": shape, "per_atom": per_atom, "description": text}


def describe_shards(paths: Sequence[Path], shard_format: str, chunk: int = 4096) -> dict[str, Any]:
    """Counts, elements and fields of the shards of one dataset.

    Args:
        paths (Sequence[Path]): The shard files, in the dataset's order.
        shard_format (str): ``"atp"`` or ``"pt"``.
        chunk (int, optional): Records read per ``read_batch`` call for `.atp` shards.
            (default: :obj:`4096`)

    Returns:
        ``structures``, ``atoms``, ``elements`` (chemical symbols, by atomic
        number) and ``fields`` (``name -> field_entry``).
    """
    from ase.data import chemical_symbols

    counts = np.zeros(256, dtype=np.int64)
    structures = atoms = 0
    fields: dict[str, dict[str, Any]] = {}
    if shard_format == "atp":
        from pyg_atompack import atp

        from .summary import describe_atp_fields

        for path in paths:
            with atp.open(path) as reader:
                structures += len(reader)
                atoms += int(reader.n_atoms.sum())
                for start in range(0, len(reader), chunk):
                    batch = reader.read_batch(np.arange(start, min(start + chunk, len(reader))),
                                              fields=[])
                    counts += np.bincount(batch["atomic_numbers"], minlength=256)[:256]
        for name, text in describe_atp_fields(list(paths)).items():
            fields[name] = field_entry(text, text.endswith("(per atom)"))
    else:
        from .registry import open_reader
        from .summary import scan

        for path in paths:
            with open_reader(path, "pt") as reader:
                for structure in reader:
                    numbers = np.asarray(structure.atomic_numbers, dtype=np.int64)
                    counts += np.bincount(numbers, minlength=256)[:256]
            summary = scan(path, format="pt")
            structures += summary["structures"]
            atoms += summary["atoms"]
            for name, (kinds, _count) in summary["fields"].items():
                per_atom = name in ATOM_AXIS_BUILTINS or name.startswith("atom_properties/")
                fields.setdefault(name, field_entry(kinds, per_atom))
    elements = [chemical_symbols[z] if z < len(chemical_symbols) else f"Z{z}"
                for z in np.flatnonzero(counts)]
    return {"structures": structures, "atoms": atoms, "elements": elements, "fields": fields}


def units_of(fields: dict[str, Any]) -> dict[str, str]:
    """The unit of every builtin field present (custom properties carry no unit)."""
    return {name: unit for name, unit in UNITS.items() if name in fields}
