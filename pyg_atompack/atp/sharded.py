"""One logical dataset over a directory of `.atp` shards (spec §11)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import batch as _batch
from .base import RecordReader
from .errors import AtpValueError
from .fields import FieldInfo
from .groups import Groups, read_groups
from .index import molecule_index
from .molecule import Molecule
from .reader import ACCESS_MODES, Reader
from .readonly import ReadOnlyReader
from .reorder import reorder_flat


def find_shards(root: str | os.PathLike) -> list[Path]:
    """Every ``*.atp`` below ``root``, ordered by POSIX relative path string.

    Args:
        root (str | os.PathLike): The dataset directory.

    Returns:
        Absolute shard paths in global-index order.
    """
    root = Path(root)
    found = [p for p in root.rglob("*.atp") if p.is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _check_access(access: str) -> None:
    if access not in ACCESS_MODES:
        raise AtpValueError(f"access must be one of {ACCESS_MODES}, got {access!r}")


class ShardedReader(ReadOnlyReader):
    """Concatenation of the shards of a directory (or of a file list), indexed globally.

    Use :meth:`from_paths` for an explicit list of files.

    Args:
        root (str | os.PathLike): Directory holding the shards (searched recursively).
        access (str, optional): ``"auto"``, ``"mmap"`` or ``"pread"``, passed to every shard.
            (default: :obj:`"auto"`)

    Raises:
        AtpValueError: The directory holds no ``.atp`` file.
        AtpError: A shard is unreadable (the message names it).
    """

    def __init__(self, root: str | os.PathLike, access: str = "auto") -> None:
        _check_access(access)
        name = os.fspath(root)
        paths = find_shards(root)
        if not paths:
            raise AtpValueError(f"{name}: no .atp files below this directory")
        self._open_shards(name, paths, access)

    @classmethod
    def from_paths(cls, paths: Sequence[str | os.PathLike],
                   access: str = "auto") -> ShardedReader:
        """One logical dataset over an explicit list of files, in the given order.

        Args:
            paths (Sequence[str | os.PathLike]): The `.atp` files; molecule ``0`` is the first
                file's first record.
            access (str, optional): ``"auto"``, ``"mmap"`` or ``"pread"``, passed to every file.
                (default: :obj:`"auto"`)

        Returns:
            A reader indexing the files' molecules globally; its :attr:`path` is a
            bracketed list of the files (used in error messages).

        Raises:
            AtpValueError: ``paths`` is empty, a string, or ``access`` is unknown.
            FileNotFoundError: A file does not exist (the message names it).
            AtpError: A file is unreadable (the message names it).
        """
        if isinstance(paths, (str, bytes, os.PathLike)):
            raise AtpValueError(f"from_paths needs a list of files, got the single path "
                                f"{os.fspath(paths)!r}")
        _check_access(access)
        files = [Path(p) for p in paths]
        if not files:
            raise AtpValueError("from_paths needs at least one .atp file, got an empty list")
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(f"{str(path)!r}: no such .atp file")
        shown = [str(p) for p in files]
        name = "[" + (", ".join(shown) if len(shown) <= 3 else
                      f"{shown[0]}, ... {len(shown) - 2} more ..., {shown[-1]}") + "]"
        reader = cls.__new__(cls)
        reader._open_shards(name, files, access)
        return reader

    @classmethod
    def from_readers(cls, readers: Sequence[RecordReader],
                     name: str | None = None) -> ShardedReader:
        """One logical dataset over already opened shard readers, in the given order.

        The shard *opener* is the caller's: local :class:`Reader` objects (mmap, pread,
        in-memory images) or remote ones such as
        :class:`pyg_atompack.remote.record_reader.RemoteAtpReader`; the global index and
        the batching are this class's for all of them: each shard is read once per
        batch (its ``read_resolved(indices, infos)``, so a remote shard fetches all its
        records of the batch together).

        Args:
            readers (Sequence[RecordReader]): The shard readers (any
                :class:`~pyg_atompack.atp.RecordReader`).
            name (str, optional): How messages name the dataset. (default: a bracketed list of the
                shard names)

        Returns:
            The reader.

        Raises:
            AtpValueError: ``readers`` is empty, or holds something that is not a
                :class:`~pyg_atompack.atp.RecordReader`.
        """
        readers = list(readers)
        if not readers:
            raise AtpValueError("from_readers needs at least one shard reader")
        strangers = [r for r in readers if not isinstance(r, RecordReader)]
        if strangers:
            raise AtpValueError(f"from_readers takes RecordReader objects; shard "
                                f"{readers.index(strangers[0])} is a "
                                f"{type(strangers[0]).__name__}")
        shown = [r.name for r in readers]
        if name is None:
            name = "[" + (", ".join(shown) if len(shown) <= 3 else
                          f"{shown[0]}, ... {len(shown) - 2} more ..., {shown[-1]}") + "]"
        reader = cls.__new__(cls)
        reader._open_shards(name, readers, getattr(readers[0], "access", "remote"), opened=True)
        return reader

    def _open_shards(self, name: str, paths: Sequence[Any], access: str,
                     opened: bool = False) -> None:
        self.name = name
        self._access = access
        self._shards = list(paths) if opened else [Reader(p, access=access) for p in paths]
        self._starts = np.concatenate([[0], np.cumsum([len(s) for s in self._shards])])
        self._starts_list = self._starts.tolist()
        self._fields: dict[str, FieldInfo] | None = None
        self._n_atoms: np.ndarray | None = None

    @property
    def shards(self) -> list[Reader]:
        """The shard readers in global order."""
        return list(self._shards)

    @property
    def shard_paths(self) -> list[str]:
        """Shard file paths in global order (None for shards that are not local files)."""
        return [s.path for s in self._shards]

    @property
    def path(self) -> str:
        """The dataset directory (a bracketed file list for :meth:`from_paths`)."""
        return self.name

    def __len__(self) -> int:
        return self._starts_list[-1]

    def locate(self, i: int) -> tuple[int, int]:
        """Finds the shard holding a global molecule index.

        Args:
            i (int): Global molecule index; negative values count from the end.

        Returns:
            tuple[int, int]: ``(shard number, index inside that shard)``.

        Raises:
            AtpIndexError: If ``i`` is out of range.
        """
        i = molecule_index(i, self._starts_list[-1], self.name)
        shard = bisect.bisect_right(self._starts_list, i) - 1
        return shard, i - self._starts_list[shard]

    def __getitem__(self, i: int) -> Molecule:
        shard, local = self.locate(i)
        return self._shards[shard][local]

    def get(self, i: int) -> Molecule:
        """Decode one molecule like ``reader[i]``, through its shard's checked :meth:`Reader.get`.

        Args:
            i (int): Global molecule index; negative values count from the end.

        Returns:
            The decoded :class:`Molecule`.
        """
        shard, local = self.locate(i)
        return self._shards[shard].get(local)

    def __iter__(self) -> Iterator[Molecule]:
        for shard in self._shards:
            yield from shard

    @property
    def n_atoms(self) -> np.ndarray:
        """Atom count of every molecule (int64), from the shard indexes."""
        if self._n_atoms is None:
            self._n_atoms = np.concatenate([s.n_atoms for s in self._shards])
        return self._n_atoms

    @property
    def fields(self) -> dict[str, FieldInfo]:
        """Union of the shards' fields (the first shard defining a name wins)."""
        if self._fields is None:
            merged: dict[str, FieldInfo] = {}
            for shard in self._shards:
                for name, info in shard.fields.items():
                    merged.setdefault(name, info)
            self._fields = merged
        return self._fields

    def read_resolved(self, indices: Sequence[int] | np.ndarray,
                      infos: dict[str, FieldInfo]) -> dict[str, Any]:
        """Decodes several molecules across shards into concatenated arrays, each shard
        read once (:meth:`RecordReader.read_batch` resolves the fields and calls this).

        Args:
            indices (Sequence[int] | np.ndarray): Global molecule indices, in the order
                the result should follow (they may span shards and repeat).
            infos (dict[str, FieldInfo]): ``name -> FieldInfo`` to decode.

        Returns:
            dict[str, Any]: The same layout as :meth:`Reader.read_batch`.

        Raises:
            AtpIndexError: If an index is out of range.
        """
        idx = _batch._normalize_indices(indices, len(self), self.name)
        if not len(idx):
            return self._shards[0].read_resolved(idx, infos)
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        # one read per shard, whatever the order: a remote shard then fetches all its
        # records of the batch together; the result is put back in the asked order
        order = np.argsort(shard_of, kind="stable")
        grouped = shard_of[order]
        cuts = np.flatnonzero(np.diff(grouped)) + 1
        parts = []
        for run in np.split(order, cuts):
            shard = int(shard_of[run[0]])
            local = idx[run] - self._starts[shard]
            parts.append(self._shards[shard].read_resolved(local, infos))
        flat = _batch.concat_batches(parts)
        if len(parts) == 1 or not (np.diff(order) < 0).any():
            return flat
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return reorder_flat(flat, inverse)

    @property
    def groups(self) -> Groups:
        """The groupings of the dataset: each shard's groups with their records moved to
        the global numbering, groupings of one name concatenated shard after shard.

        Read on first access (the groups frames of every shard; nothing else).

        Raises:
            GroupsError: A shard's groups frame is damaged, or a shard's groups do not
                fit those of the shards before it (names the shard and frame).
        """
        groups = getattr(self, "_groups", None)
        if groups is None:
            groups = self._groups = read_groups(self, [
                (self._groups_of(k), self._starts_list[k]) for k in range(len(self._shards))])
        return groups

    def _groups_of(self, shard: int) -> Any:
        """The reader whose metadata frames hold shard ``shard``'s groups."""
        return self._shards[shard]

    def close(self) -> None:
        """Close every shard (they reopen lazily on the next access)."""
        for shard in self._shards:
            shard.close()

    def _read_only_message(self) -> str:
        return f"{self.name}: sharded datasets are read-only"

    def __repr__(self) -> str:
        return (f"ShardedReader({self.name!r}, shards={len(self._shards)}, "
                f"molecules={len(self)}, access={self._access!r})")
