"""`.atp` files and shard directories, in and out, through :mod:`pyg_atompack.atp`."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack import atp

from .base import StructureReader, StructureWriter
from .errors import ConvertError
from .options import ReadOptions, WriteOptions
from .shards import ShardedWriter
from .structure import Structure, as_stress_matrix


class AtpReader(StructureReader):
    """Streams structures out of an `.atp` file or a directory of `.atp` shards.

    Key options name custom properties to promote to builtins (e.g.
    ``energy_key="REF_energy"``) or to rename (``key_map``).

    Args:
        path (str or os.PathLike): The file or directory.
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
    """

    format_name = "atp"

    def __init__(self, path: str | os.PathLike, options: ReadOptions | None = None) -> None:
        super().__init__(path, options)
        try:
            self._reader = atp.open(self.path)
        except atp.AtpError as exc:
            raise ConvertError(self.path, str(exc)) from exc
        except OSError as exc:
            raise ConvertError(self.path, f"cannot open: {exc.strerror or exc}") from exc
        self._pinned = self.options.explicit_builtin_keys()
        self._renames = self.options.custom_renames()

    @property
    def length(self) -> int:
        return len(self._reader)

    def close(self) -> None:
        self._reader.close()

    def _iter_raw(self) -> Iterator[Structure]:
        for index in range(len(self._reader)):
            try:
                # a Molecule is a Structure, and each read gives a fresh one (with dicts
                # of its own) that the key mapping and the units may edit
                structure = self._reader[index]
            except atp.AtpError as exc:
                raise ConvertError(self.path, str(exc), index) from exc
            if self._pinned or self._renames:
                structure = self._remap(structure, index)
            yield structure

    def _remap(self, structure: Structure, index: int) -> Structure:
        properties = dict(structure.properties)
        atom_properties = dict(structure.atom_properties)
        for builtin, key in self._pinned.items():
            if key in properties:
                value = properties.pop(key)
            elif key in atom_properties:
                value = atom_properties.pop(key)
            else:
                raise ConvertError(self.path, f"key {key!r} (for {builtin}) is not present", index)
            if builtin == "energy":
                value = float(np.asarray(value).reshape(()))
            elif builtin == "stress":
                value = as_stress_matrix(value)
            setattr(structure, builtin, value)
        structure.properties = {self._renames.get(k, k): v for k, v in properties.items()}
        structure.atom_properties = {
            self._renames.get(k, k): v for k, v in atom_properties.items()
        }
        return structure


def _atomic_numbers(structure: Structure) -> np.ndarray:
    numbers = np.asarray(structure.atomic_numbers)
    if numbers.size and (numbers.min() < 0 or numbers.max() > 255):
        raise ValueError(f"atomic numbers must lie in 0..255, got {numbers.min()}..{numbers.max()}")
    return numbers.astype(np.uint8, copy=False)


def _positions(structure: Structure) -> np.ndarray:
    positions = np.asarray(structure.positions)
    if positions.dtype not in (np.float32, np.float64):
        positions = positions.astype(np.float64)
    return positions.reshape(structure.n_atoms, 3)


_WRITER_PREFIX = re.compile(r"^.*?\.partial-\d+(/[^:]*)?: (molecule \d+: )?")


def writer_problem(exc: BaseException) -> str:
    """The format layer's message without the temporary file name and record number.

    The caller's :class:`ConvertError` names the user's destination and the
    structure; the hidden ``.NAME.partial-PID`` file means nothing to the user.
    """
    return _WRITER_PREFIX.sub("", str(exc))


def add_structure(writer: Any, structure: Structure) -> None:
    """Append one structure to an open :class:`pyg_atompack.atp.Writer`."""
    writer.add(
        _positions(structure),
        _atomic_numbers(structure),
        energy=structure.energy,
        forces=structure.forces,
        charges=structure.charges,
        velocities=structure.velocities,
        cell=structure.cell,
        stress=structure.stress,
        pbc=structure.pbc,
        name=structure.name,
        properties=structure.properties or None,
        atom_properties=structure.atom_properties or None,
    )


def _open_writer(path: str | os.PathLike, options: WriteOptions) -> atp.Writer:
    """A new `.atp` file with the codec and level of ``options``."""
    return atp.Writer(path, compression=options.compression, level=options.level)


def _add_checked(writer: atp.Writer, structure: Structure, destination: Path,
                 record: int) -> None:
    """:func:`add_structure`, with a value the format cannot hold reported as a
    :class:`ConvertError` naming the user's ``destination`` and ``record``."""
    try:
        add_structure(writer, structure)
    except (atp.AtpError, ValueError, TypeError) as exc:
        raise ConvertError(destination, writer_problem(exc), record) from exc


class AtpWriter(StructureWriter):
    """Writes one `.atp` file.

    Args:
        path (str or os.PathLike): The destination file.
        options (WriteOptions, optional): ``compression`` and ``level``. (default: :obj:`None`)
    """

    format_name = "atp"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self._writer = _open_writer(self.tmp_path, self.options)

    def _add(self, structure: Structure) -> None:
        _add_checked(self._writer, structure, self.path, self.count)

    def _finish(self) -> None:
        self._writer.flush()
        self._writer.close()

    def _discard(self) -> None:
        self._writer.close()


class AtpShardWriter(ShardedWriter):
    """Writes a directory of `.atp` shards plus ``manifest.json``.

    Args:
        path (str or os.PathLike): The destination directory.
        options (WriteOptions, optional): ``shard_size`` records per shard, ``compression``,
            ``level``. (default: :obj:`None`)
    """

    format_name = "atp-shards"
    shard_extension = ".atp"
    shard_format = "atp"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self._writer: Any = None

    def _open_shard(self, path: Path) -> None:
        self._writer = _open_writer(path, self.options)

    def _add_to_shard(self, structure: Structure) -> None:
        _add_checked(self._writer, structure, self.path, self.count)

    def _close_shard(self) -> None:
        self._writer.flush()
        self._writer.close()
        self._writer = None

    def _abandon_shard(self) -> None:
        self._writer.close()
        self._writer = None

    def _manifest_extras(self) -> dict[str, Any]:
        return {"compression": self.options.compression, "compression_level": self.options.level}
