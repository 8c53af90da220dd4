"""metatrain ``MemmapDataset`` directories in and out.

The layout itself (and its checks) lives in :mod:`pyg_atompack.memmap_layout`,
shared with :class:`~pyg_atompack.MemmapDataset`. Everything in the layout is
float32 (atomic types int32), so float64 values are rounded when written.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from pyg_atompack.atp.types import PER_ATOM_BUILTINS, SECTION_BUILTINS
from pyg_atompack.memmap_layout import (
    DEFAULT_KEYS,
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    MemmapLayout,
    MemmapLayoutError,
    expand_voigt,
)

from .base import StructureReader, StructureWriter
from .errors import ConvertError, note
from .options import MAPPABLE_BUILTINS, ReadOptions, WriteOptions
from .structure import Structure

# builtin -> file stem written by MemmapWriter (metatrain's writer names for energy)
WRITER_STEMS = {**DEFAULT_KEYS, "charges": "charges", "velocities": "velocities"}
_RESERVED_STEMS = {"x", "a", "c", "ns", "na"}
# per-atom labels, in record order (one file each)
_PER_ATOM_LABELS = tuple(name for name in SECTION_BUILTINS if name in PER_ATOM_BUILTINS)


class MemmapReader(StructureReader):
    """Streams structures out of a metatrain memmap directory.

    Without key options the directory's ``pyg_atompack_memmap.json`` (or
    metatrain's writer names ``energy.bin``, ``energy_forces.bin``,
    ``energy_stress.bin``) decides; without those, a single target ``T.bin``
    with metatrain's gradient files ``T_forces.bin`` / ``T_stress.bin`` is read
    as the energy (with a :class:`~pyg_atompack.convert.ConversionNote`). With
    any key option only the named files are read: ``energy_key``/
    ``forces_key``/``stress_key``/``virial_key`` and ``key_map`` entries name
    file stems (``e`` for ``e.bin``). A ``.bin`` file that would be left
    unread is an error unless ``skip_targets`` names its stem: nothing is
    dropped silently.

    Args:
        path (str or os.PathLike): The memmap directory.
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
    """

    format_name = "memmap"

    def __init__(self, path: str | os.PathLike, options: ReadOptions | None = None) -> None:
        super().__init__(path, options)
        skipped = set(self.options.skip_targets)
        on_disk = {file.stem for file in self.path.glob("*.bin")} - _RESERVED_STEMS
        unknown = sorted(skipped - on_disk)
        if unknown and self.path.is_dir():
            raise self.error(f"--skip-target {', '.join(unknown)}: no such file stem "
                             f"(the directory holds {', '.join(sorted(on_disk)) or 'none'})")
        keys = None
        if self.options.has_key_options():
            keys = dict(self.options.explicit_builtin_keys())
            keys.update({name: stem for stem, name in self.options.custom_renames().items()})
            if self.options.virial_key is not None:
                keys[self.options.virial_key] = self.options.virial_key
        try:
            self.layout = MemmapLayout(self.path, keys)
            if keys is None and self.layout.sidecar is None and not self.layout.keys:
                energy_like = self._energy_like_target(on_disk - skipped)
                if energy_like is not None:
                    self.layout = MemmapLayout(self.path, energy_like)
        except MemmapLayoutError as exc:
            raise ConvertError(exc.path, exc.problem) from exc
        self.layout.keys = [key for key in self.layout.keys if key.stem not in skipped]
        self._refuse_unread(on_disk - skipped - {key.stem for key in self.layout.keys})

    def _energy_like_target(self, stems: set[str]) -> dict[str, str] | None:
        """``energy/forces/stress -> stem`` of the one target metatrain's writer gave
        gradients (``T.bin`` with ``T_forces.bin`` / ``T_stress.bin``), if there is one."""
        targets = sorted(stem for stem in stems
                         if {f"{stem}_forces", f"{stem}_stress"} & stems)
        if len(targets) != 1:
            return None  # none, or several: _refuse_unread names them
        target = targets[0]
        keys = {"energy": target}
        for builtin in ("forces", "stress"):
            if f"{target}_{builtin}" in stems:
                keys[builtin] = f"{target}_{builtin}"
        note(f"{self.path}: no energy.bin; target {target!r} has gradient files "
             f"({', '.join(f'{s}.bin' for s in keys.values() if s != target)}), so it is read "
             f"as the energy with its forces/stress (pass --energy-key to choose otherwise)")
        return keys

    def _refuse_unread(self, unread: set[str]) -> None:
        """Never convert a directory while leaving target files behind unnoticed."""
        if not unread:
            return
        shown = ", ".join(f"{stem}.bin" for stem in sorted(unread))
        raise self.error(
            f"holds {shown}, which the chosen options would not read; keep them with "
            "--energy-key / --forces-key / --stress-key / --virial-key STEM or "
            "--key-map STEM=NAME, or leave them out with --skip-target STEM"
        )

    @property
    def length(self) -> int:
        return len(self.layout)

    def _iter_raw(self) -> Iterator[Structure]:
        for index in range(len(self.layout)):
            values = self.layout.structure(index)
            structure = Structure(
                positions=values.pop("positions"),
                atomic_numbers=values.pop("atomic_numbers"),
                cell=values.pop("cell", None),
                pbc=values.pop("pbc", None),
            )
            for key in self.layout.keys:
                value = values[key.attribute]
                if key.attribute == "energy":
                    structure.energy = float(value.reshape(()))
                elif key.attribute == "stress":
                    structure.stress = expand_voigt(value) if value.shape == (6,) else value
                elif key.attribute in MAPPABLE_BUILTINS:
                    setattr(structure, key.attribute, value)
                elif key.per_atom:
                    structure.atom_properties[key.attribute] = value
                else:
                    structure.properties[key.attribute] = float(value) if value.ndim == 0 else value
            yield structure


class MemmapWriter(StructureWriter):
    """Writes a metatrain memmap directory (plus ``pyg_atompack_memmap.json``).

    The first structure fixes which fields are written; every later structure
    must carry the same numeric fields with the same shapes. Strings and
    ``None`` values have no place in the layout and are left out (with one
    warning per key). Along a non-periodic axis the cell row is written as
    zeros, because the layout derives periodicity from non-zero rows.

    Args:
        path (str or os.PathLike): The destination directory.
        options (WriteOptions, optional): Only ``overwrite`` applies. (default: :obj:`None`)
    """

    format_name = "memmap"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self.tmp_path.mkdir()
        self._files: dict[str, BinaryIO] = {}
        self._counts: list[int] = []
        self._fields: dict[str, tuple[bool, tuple[int, ...], str]] | None = None
        self._any_cell = False
        self._warned: set[str] = set()

    def _file(self, stem: str) -> BinaryIO:
        handle = self._files.get(stem)
        if handle is None:
            handle = open(self.tmp_path / f"{stem}.bin", "wb")  # noqa: SIM115
            self._files[stem] = handle
        return handle

    def _numeric_fields(self, structure: Structure) -> dict[str, tuple[bool, Any]]:
        """``attribute -> (per_atom, value)`` of everything the layout can hold."""
        fields: dict[str, tuple[bool, Any]] = {}
        if structure.energy is not None:
            fields["energy"] = (False, structure.energy)
        for name in _PER_ATOM_LABELS:
            if getattr(structure, name) is not None:
                fields[name] = (True, getattr(structure, name))
        if structure.stress is not None:
            fields["stress"] = (False, structure.stress)
        for key, value in structure.properties.items():
            if isinstance(value, str) or value is None:
                if key not in self._warned:
                    self._warned.add(key)
                    warnings.warn(
                        f"{self.path}: property {key!r} is not numeric and is left out "
                        "of the memmap layout",
                        stacklevel=3,
                    )
                continue
            fields[key] = (False, value)
        for key, value in structure.atom_properties.items():
            fields[key] = (True, value)
        return fields

    def _add(self, structure: Structure) -> None:
        index = self.count
        fields = self._numeric_fields(structure)
        shapes = {
            name: (per_atom, np.shape(value)[1:] if per_atom else np.shape(value))
            for name, (per_atom, value) in fields.items()
        }
        if self._fields is None:
            self._fields = {}
            for name, (per_atom, shape) in shapes.items():
                stem = WRITER_STEMS.get(name, name)
                if stem in _RESERVED_STEMS or "/" in stem or stem.startswith("."):
                    raise ConvertError(self.path, f"key {name!r} cannot be a memmap file name")
                self._fields[name] = (per_atom, shape, stem)
        expected = {name: spec[:2] for name, spec in self._fields.items()}
        if shapes != expected:
            missing = sorted(set(expected) - set(shapes))
            extra = sorted(set(shapes) - set(expected))
            changed = sorted(n for n in set(shapes) & set(expected) if shapes[n] != expected[n])
            detail = "; ".join(
                part
                for part in (
                    f"lacks {', '.join(missing)}" if missing else "",
                    f"has extra {', '.join(extra)}" if extra else "",
                    f"changes the shape of {', '.join(changed)}" if changed else "",
                )
                if part
            )
            raise ConvertError(
                self.path,
                f"a memmap layout needs the same fields in every structure; this one {detail}",
                index,
            )

        n_atoms = structure.n_atoms
        self._counts.append(n_atoms)
        np.asarray(structure.positions, dtype="<f4").reshape(n_atoms, 3).tofile(self._file("x"))
        np.asarray(structure.atomic_numbers, dtype="<i4").reshape(n_atoms).tofile(self._file("a"))
        cell = np.zeros((3, 3), dtype="<f4")
        if structure.cell is not None:
            self._any_cell = True
            cell[:] = structure.cell
            if structure.pbc is not None:
                cell[~np.asarray(structure.pbc, dtype=bool)] = 0.0
        cell.tofile(self._file("c"))
        for name, (_per_atom, value) in fields.items():
            np.asarray(value, dtype="<f4").tofile(self._file(self._fields[name][2]))

    def _close_files(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files = {}

    def _finish(self) -> None:
        self._close_files()
        for stem in ("x", "a"):
            (self.tmp_path / f"{stem}.bin").touch()
        if not self._any_cell:
            (self.tmp_path / "c.bin").unlink(missing_ok=True)
        np.save(self.tmp_path / "ns.npy", np.array(len(self._counts), dtype=np.int64))
        na = np.zeros(len(self._counts) + 1, dtype=np.int64)
        np.cumsum(self._counts, out=na[1:])
        np.save(self.tmp_path / "na.npy", na)
        sidecar = {
            "format": SIDECAR_FORMAT,
            "keys": {
                name: {"stem": stem, "per_atom": per_atom, "shape": list(shape)}
                for name, (per_atom, shape, stem) in (self._fields or {}).items()
            },
        }
        (self.tmp_path / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=1) + "\n")

    def _discard(self) -> None:
        self._close_files()
