"""Format-independent summaries and checks behind ``info``, ``verify`` and ``head``."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack.atp.types import ATOM_AXIS_BUILTINS

from .errors import ConvertError
from .registry import detect_source_format, open_reader
from .shards import check_manifest, read_manifest
from .structure import BUILTIN_NAMES, Structure


def describe_value(value: Any) -> str:
    """``dtype[shape]`` of an array, or the Python type name of a scalar."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__


def formula(numbers: Iterable[int]) -> str:
    """Hill-like chemical formula (C, H first, then alphabetical) of atomic numbers."""
    from ase.data import chemical_symbols

    counts = Counter(chemical_symbols[int(z)] if 0 <= int(z) < len(chemical_symbols) else f"Z{z}"
                     for z in numbers)
    order = [s for s in ("C", "H") if s in counts] + sorted(s for s in counts if s not in "CH")
    return "".join(f"{s}{counts[s] if counts[s] > 1 else ''}" for s in order)


def summarize_structure(index: int, structure: Structure) -> str:
    """One human-readable line about a structure (for ``head``)."""
    parts = [f"[{index}] {formula(structure.atomic_numbers) or '(no atoms)'}",
             f"n_atoms={structure.n_atoms}"]
    if structure.energy is not None:
        parts.append(f"energy={structure.energy:.6g}")
    if structure.name is not None:
        parts.append(f"name={structure.name!r}")
    fields = [f for f in structure.present_fields() if f not in ("energy", "name")]
    if fields:
        parts.append("fields=" + ",".join(fields))
    customs = [f"{k}:{describe_value(v)}" for k, v in structure.properties.items()]
    customs += [f"{k}:{describe_value(v)}(atom)" for k, v in structure.atom_properties.items()]
    if customs:
        parts.append("props=" + ",".join(customs))
    return "  ".join(parts)


def scan(path: str | os.PathLike, progress: Callable[[int | None], Any] | None = None,
         **reader_kwargs: Any) -> dict[str, Any]:
    """Read every structure of a source and summarise its fields.

    Args:
        path (str or os.PathLike): Any readable source.
        progress (Callable[[int | None], Any], optional): Optional progress bar factory.
            (default: :obj:`None`)
        **reader_kwargs (optional): ``format`` and ``options`` for :func:`open_reader`.

    Returns:
        ``format``, ``structures``, ``atoms``, ``fields`` (``name -> "dtype[shape]"``
        with per-atom shapes as ``[n, ...]`` and the number of structures carrying it).
    """
    fmt = reader_kwargs.pop("format", None) or detect_source_format(path)
    fields: dict[str, dict[str, Any]] = {}
    count = atoms = 0
    with open_reader(path, fmt, **reader_kwargs) as reader:
        bar = progress(reader.length) if progress else None
        for structure in reader:
            count += 1
            atoms += structure.n_atoms
            entries = {"positions": structure.positions, "atomic_numbers": structure.atomic_numbers}
            entries.update({name: getattr(structure, name) for name in BUILTIN_NAMES})
            entries.update({f"properties/{k}": v for k, v in structure.properties.items()})
            entries.update({f"atom_properties/{k}": v
                            for k, v in structure.atom_properties.items()})
            for name, value in entries.items():
                if value is None:
                    continue
                shown = describe_value(value)
                if isinstance(value, np.ndarray) and (
                    name in ATOM_AXIS_BUILTINS
                    or name.startswith("atom_properties/")
                ):
                    shown = f"{value.dtype}[n{','.join([''] + [str(d) for d in value.shape[1:]])}]"
                entry = fields.setdefault(name, {"kinds": set(), "count": 0})
                entry["kinds"].add(shown)
                entry["count"] += 1
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
    return {"format": fmt, "structures": count, "atoms": atoms,
            "fields": {k: (" | ".join(sorted(v["kinds"])), v["count"]) for k, v in fields.items()}}


def _shape_text(dims: Sequence[int | None], per_atom: bool) -> str:
    """``[n,3]``-style text; ``None`` dimensions (they vary) are shown as ``?``."""
    shown = ["n"] if per_atom else []
    shown += ["?" if d is None else str(d) for d in dims]
    return f"[{','.join(shown)}]" if shown else ""


def _common_shape(shapes: set[tuple[int, ...]]) -> tuple[int | None, ...] | None:
    """The dimensions every shape agrees on (``None`` where they differ), or None if the
    ranks differ."""
    if len({len(shape) for shape in shapes}) != 1:
        return None
    return tuple(dims[0] if len(set(dims)) == 1 else None for dims in zip(*shapes))


def _field_value(batch: dict[str, Any], info: Any) -> Any:
    if info.kind == "molecule":
        return batch["properties"].get(info.key)
    if info.kind == "atom":
        return batch["atom_properties"].get(info.key)
    return batch.get(info.name)


def _value_shapes(value: Any, present: np.ndarray, per_atom: bool) -> set[tuple[int, ...]]:
    """Shapes of one field's values in a ``read_batch`` result, atom axis left out."""
    if isinstance(value, np.ndarray):  # one shape for the whole batch
        return {tuple(value.shape[1:])} if present.any() else set()
    arrays = [v for v, p in zip(value, present) if p and isinstance(v, np.ndarray)]
    return {tuple(a.shape[1:] if per_atom else a.shape) for a in arrays}


def describe_atp_fields(files: Sequence[Path], chunk: int = 4096) -> dict[str, str]:
    """How ``info`` shows the type of every field of `.atp` files.

    Scalars show their dtype (``float64``), fixed-shape values their dtype and shape
    (``float64[3]``; per-atom values with a leading ``n``: ``float32[n,3]``), strings
    ``str`` and always-None values ``None``. The schema does not fix the shape of
    tensor values, so those records are read (``chunk`` at a time, only the tensor
    fields): a shape that varies between records is shown with ``?`` for the varying
    dimensions and marked ``ragged``.

    Args:
        files (Sequence[Path]): `.atp` files (e.g. the shards of one dataset), read in this order.
        chunk (int, optional): Records decoded per ``read_batch`` call when scanning tensor fields.
            (default: :obj:`4096`)

    Returns:
        ``{field name: description}`` in schema order, each description ending with
        ``(per atom)`` or ``(per structure)``.
    """
    from pyg_atompack import atp
    from pyg_atompack.atp.types import TAG_NONE, TAG_STR

    infos: dict[str, Any] = {}
    tensor_shapes: dict[str, set[tuple[int, ...]]] = {}
    for file in files:
        with atp.open(file) as reader:
            for name, info in reader.fields.items():
                infos.setdefault(name, info)
            tensors = [info for info in reader.fields.values()
                       if info.shape is None and info.dtype is not None]
            for start in range(0, len(reader) if tensors else 0, chunk):
                indices = np.arange(start, min(start + chunk, len(reader)))
                batch = reader.read_batch(indices, fields=[info.name for info in tensors])
                for info in tensors:
                    found = _value_shapes(_field_value(batch, info), batch["mask"][info.name],
                                          info.per_atom)
                    tensor_shapes.setdefault(info.name, set()).update(found)
    described = {}
    for name, info in infos.items():
        scope = "(per atom)" if info.per_atom else "(per structure)"
        if info.tag == TAG_STR:
            kind = "str"
        elif info.tag == TAG_NONE or info.dtype is None:
            kind = "None"
        elif info.shape is not None:
            kind = f"{info.dtype}{_shape_text(info.shape, info.per_atom)}"
        else:
            shapes = tensor_shapes.get(name, set())
            common = _common_shape(shapes) if shapes else None
            if common is None:  # never present, or ranks differ
                kind = f"{info.dtype}{_shape_text([], info.per_atom)} tensor"
                kind += " ragged" if shapes else ""
            else:
                kind = f"{info.dtype}{_shape_text(common, info.per_atom)}"
                kind += " ragged" if len(shapes) > 1 else ""
        described[name] = f"{kind} {scope}"
    return described


def directory_size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def verify_source(path: str | os.PathLike,
                  progress: Callable[[int | None], Any] | None = None,
                  src_format: str | None = None, *,
                  raise_unreadable: bool = False) -> tuple[int, list[str]]:
    """Check a source thoroughly: format-level checks, manifest checksums, every record.

    For `.atp` sources the format layer's ``atp.verify`` checks both header
    slots, the schema and the index; then every structure is decoded.

    Args:
        path (str or os.PathLike): Any readable source.
        progress (Callable[[int | None], Any], optional): Optional progress bar factory.
            (default: :obj:`None`)
        src_format (str, optional): The format when the name does not tell (e.g. ``"atp"`` for a
            cached download named by its checksum). (default: detected from the path)
        raise_unreadable (bool, optional): Raise the :class:`ConvertError` of a source
            whose structures cannot be decoded (a ``.pt``, zip or memmap source that is not
            what it claims) instead of reporting it as a problem. (default: :obj:`False`)

    Returns:
        ``(structures decoded, problems)``; no problems means the source is sound.
    """
    path = Path(path)
    fmt = src_format or detect_source_format(path)
    problems: list[str] = []
    if path.is_dir() and read_manifest(path) is not None:
        problems += check_manifest(path)
    if fmt == "atp":
        # atp.verify already decodes every record of every shard
        problems += _atp_problems(path)
        if problems:
            return 0, problems
        from pyg_atompack import atp

        with atp.open(path) as reader:
            return len(reader), problems
    if problems:
        return 0, problems
    count = 0
    try:
        with open_reader(path, fmt) as reader:
            bar = progress(reader.length) if progress else None
            for _structure in reader:
                count += 1
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
    except ConvertError as exc:
        if raise_unreadable:
            raise
        problems.append(str(exc))
    return count, problems


def _atp_problems(path: Path) -> list[str]:
    from pyg_atompack import atp

    verify = getattr(atp, "verify", None)
    if verify is None:
        return []
    targets = [path] if path.is_file() else sorted(path.rglob("*.atp"), key=lambda p: p.as_posix())
    problems: list[str] = []
    for target in targets:
        try:
            report = verify(target)
        except (atp.AtpError, OSError) as exc:
            problems.append(str(exc))
            continue
        problems += _report_problems(report, target)
    return problems


def _report_problems(report: Any, target: Path) -> list[str]:
    """Problems out of whatever ``atp.verify`` returns (list, dict or report object)."""
    if report is None or report is True:
        return []
    if report is False:
        return [f"{target}: verification failed"]
    if isinstance(report, str):
        return [report] if report else []
    if isinstance(report, dict):
        report = report.get("problems", report.get("errors", []))
    elif hasattr(report, "problems"):
        report = report.problems
    elif hasattr(report, "errors"):
        report = report.errors
    return [p if str(target) in str(p) else f"{target}: {p}" for p in map(str, report)]
