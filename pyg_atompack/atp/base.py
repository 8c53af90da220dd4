"""The reader contract: what every `.atp` record reader implements (:class:`RecordReader`).

A reader answers a few questions about its records (how many, what fields, how many
atoms each) and decodes one record (``reader[i]``); the batch read
(:meth:`RecordReader.read_batch`) has a default built on that single-record read, so a
new reader works with ``AtompackDataset``, ``AtompackLoader`` and
:meth:`~pyg_atompack.atp.ShardedReader.from_readers` once it implements the four
abstract members. The readers of the package override :meth:`~RecordReader.read_resolved`
with their fast paths (one vectorised gather over a mapped file, one range request per
batch of a remote file, one read per shard): the default is the reference they must
agree with (``tests/test_reader_contract.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from .assemble import assemble
from .batch import _normalize_indices, resolve_fields
from .fields import FieldInfo
from .molecule import Molecule

__all__ = ["RecordReader"]

_R = TypeVar("_R", bound="RecordReader")
_U8 = np.dtype("u1")


class RecordReader(ABC):
    """Base of every `.atp` record reader: local files, directories of shards, in-memory
    images, remote files read by record, the Hub's shards.

    A subclass sets :attr:`name` and implements ``len``, ``reader[i]``, :attr:`fields`
    and :attr:`n_atoms`; everything else has a default here.

    Attributes:
        name (str): How messages name the reader's data (the user's path or URL,
            never a temporary name).
        path (str, optional): The local file or directory, :obj:`None` when the data
            is not a local file.
    """

    name: str
    path: str | None = None

    @abstractmethod
    def __len__(self) -> int:
        """The number of records."""

    @abstractmethod
    def __getitem__(self, i: int) -> Molecule:
        """Decode record ``i`` (negative values count from the end)."""

    @property
    @abstractmethod
    def fields(self) -> dict[str, FieldInfo]:
        """Every field of the records, ``name -> FieldInfo``, positions and atomic numbers
        first."""

    @property
    @abstractmethod
    def n_atoms(self) -> np.ndarray:
        """Atom count of every record (int64), without decoding records."""

    def get(self, i: int) -> Molecule:
        """Decode one record like ``reader[i]``, after any check a per-sample pipeline
        needs first (a local file checks that it did not shrink).

        Args:
            i (int): Record index; negative values count from the end.

        Returns:
            The decoded :class:`Molecule`.
        """
        return self[i]

    def __iter__(self) -> Iterator[Molecule]:
        for i in range(len(self)):
            yield self[i]

    def read_batch(self, indices: Sequence[int] | np.ndarray,
                   fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Decode several records into concatenated arrays.

        Args:
            indices (Sequence[int] | np.ndarray): Record indices (negative allowed), any
                order, repeats allowed.
            fields (Sequence[str], optional): Names to decode besides positions / atomic
                numbers: builtin names, ``properties/<key>``, ``atom_properties/<key>`` or
                an unambiguous bare custom key; :obj:`None` for every field.
                (default: :obj:`None`)

        Returns:
            The flat dict of ``docs/architecture.md``: ``n_atoms``, ``positions``,
            ``atomic_numbers``, the requested fields, ``properties``, ``atom_properties``
            and ``mask``.

        Raises:
            AtpValueError: An unknown or ambiguous field, or indices that are not integers.
            AtpIndexError: An index is out of range.
        """
        return self.read_resolved(indices, resolve_fields(self.fields, fields, self.name))

    def read_resolved(self, indices: Sequence[int] | np.ndarray,
                      infos: dict[str, FieldInfo]) -> dict[str, Any]:
        """:meth:`read_batch` with the fields already resolved (the multi-file readers'
        call). The default decodes record after record with ``reader[i]``.

        Args:
            indices (Sequence[int] | np.ndarray): Record indices (negative allowed), any
                order, repeats allowed.
            infos (dict[str, FieldInfo]): ``name -> FieldInfo`` to decode, e.g. resolved
                against the union of several files' fields.

        Returns:
            The dict of :meth:`read_batch`.
        """
        idx = _normalize_indices(indices, len(self), self.name)
        molecules = [self[i] for i in idx.tolist()]
        n_atoms = np.array([len(m) for m in molecules], dtype=np.int64)
        out: dict[str, Any] = {"n_atoms": n_atoms}
        if molecules:
            out["positions"] = np.concatenate(
                [np.asarray(m.positions).reshape(-1, 3) for m in molecules])
            out["atomic_numbers"] = np.concatenate(
                [np.asarray(m.atomic_numbers) for m in molecules])
        else:
            positions = self.fields.get("positions")
            out["positions"] = np.zeros((0, 3), positions.dtype if positions else np.float32)
            out["atomic_numbers"] = np.zeros(0, _U8)
        for info in infos.values():
            present = [_has(m, info) for m in molecules]
            values = [_value(m, info) if p else None for m, p in zip(molecules, present)]
            assemble(out, info, values, present, n_atoms)
        for key in ("properties", "atom_properties", "mask"):
            out.setdefault(key, {})
        return out

    def close(self) -> None:  # noqa: B027 - a default, not abstract: most hold nothing
        """Release what the reader holds (it reopens lazily on the next access); the
        default holds nothing."""

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _has(molecule: Molecule, info: FieldInfo) -> bool:
    """Whether a record carries a field (a custom value stored as None counts)."""
    if info.kind == "builtin":
        return getattr(molecule, info.name, None) is not None
    scope = molecule.atom_properties if info.kind == "atom" else molecule.properties
    return info.key in scope


def _value(molecule: Molecule, info: FieldInfo) -> Any:
    if info.kind == "builtin":
        return getattr(molecule, info.name)
    scope = molecule.atom_properties if info.kind == "atom" else molecule.properties
    return scope[info.key]
