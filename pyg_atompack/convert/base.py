"""Base classes of every reader and writer, and the all-or-nothing output rule.

A writer never touches its destination until it is complete: it writes to a
hidden temporary sibling (``.NAME.partial-PID``) and renames it into place in
:meth:`StructureWriter.close`. If anything fails, :meth:`StructureWriter.abort`
removes the temporary output, so a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

from .errors import ConvertError
from .options import ReadOptions, WriteOptions
from .structure import Structure
from .virial import virial_to_stress


class StructureReader(ABC):
    """Streams :class:`Structure` objects out of one source.

    Subclasses implement :meth:`_iter_raw` (values in the source's units, keys
    already mapped); iteration turns a ``virial_key`` into the stress and
    applies the unit conversion of the options.

    Args:
        path (str | os.PathLike): The source file or directory.
        options (ReadOptions, optional): Key mapping and units (default: :class:`ReadOptions`).
    """

    #: Registry name of the format, set by subclasses.
    format_name = "?"

    def __init__(self, path: str | os.PathLike, options: ReadOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options if options is not None else ReadOptions()

    @property
    def length(self) -> int | None:
        """Number of structures when known without reading them all, else ``None``."""
        return None

    @abstractmethod
    def _iter_raw(self) -> Iterator[Structure]:
        """Yield the structures in source units."""

    def __iter__(self) -> Iterator[Structure]:
        units = self.options.units
        virial_key = self.options.virial_key
        for index, structure in enumerate(self._iter_raw()):
            if virial_key is not None:
                # in source units: the stress is then scaled like any other stress
                structure = virial_to_stress(structure, virial_key, index, str(self.path))
            yield units.apply(structure)

    def close(self) -> None:
        """Release open files (the default holds none)."""
        return None

    def __enter__(self) -> StructureReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def error(self, problem: str, index: int | None = None) -> ConvertError:
        """Build a :class:`ConvertError` about this source, for the caller to raise.

        Args:
            problem (str): What is wrong, in words.
            index (int, optional): The structure index inside the source, when the problem is about
                one structure. (default: :obj:`None`)

        Returns:
            The error; its message names this reader's path and, if given, the index.
        """
        return ConvertError(self.path, problem, index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, length={self.length})"


class StructureWriter(ABC):
    """Consumes :class:`Structure` objects into one destination.

    Use as a context manager: a normal exit publishes the output, an exception
    discards it.

    Args:
        path (str | os.PathLike): The destination file or directory.
        options (WriteOptions, optional): Codec, sharding and overwrite settings.
            (default: :obj:`None`)
    """

    format_name = "?"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        self.path = Path(path)
        self.options = options if options is not None else WriteOptions()
        if self.path.exists() and not self.options.overwrite:
            raise ConvertError(self.path, "destination already exists (use overwrite to replace)")
        if not self.path.parent.is_dir():
            raise ConvertError(self.path, f"parent directory {self.path.parent} does not exist")
        self.tmp_path = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        _remove(self.tmp_path)
        self.count = 0
        self._closed = False

    def add(self, structure: Structure) -> None:
        """Append one structure to the output.

        Args:
            structure (Structure): The structure to write.

        Raises:
            ConvertError: The destination cannot store the structure (the message
                names the destination and the structure's position in the output).
        """
        self._add(structure)
        self.count += 1

    @abstractmethod
    def _add(self, structure: Structure) -> None:
        """Write one structure to the temporary output."""

    @abstractmethod
    def _finish(self) -> None:
        """Complete the temporary output (flush, write indexes)."""

    def _discard(self) -> None:
        """Close open handles before the temporary output is removed."""
        return None

    def close(self) -> None:
        """Complete the output and move it to its final name."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish()
        except BaseException:
            self._discard()
            _remove(self.tmp_path)
            raise
        _publish(self.tmp_path, self.path)

    def abort(self) -> None:
        """Drop everything written so far; the destination is left untouched."""
        if self._closed:
            return
        self._closed = True
        try:
            self._discard()
        finally:
            _remove(self.tmp_path)

    def __enter__(self) -> StructureWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, count={self.count})"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _publish(tmp_path: Path, final_path: Path) -> None:
    """Rename ``tmp_path`` onto ``final_path``, replacing an older output."""
    if final_path.exists():
        # Move the old output aside first so the swap itself is one rename.
        old = final_path.with_name(f".{final_path.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(final_path, old)
        os.replace(tmp_path, final_path)
        _remove(old)
    else:
        os.replace(tmp_path, final_path)
