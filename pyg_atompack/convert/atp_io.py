"""`.atp` files and shard directories, in and out, through :mod:`pyg_atompack.atp`."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack import atp
from pyg_atompack.atp.frames import FRAME_GROUPS
from pyg_atompack.atp.groups import Grouping, decode_groups, encode_groups, shift_chunk

from .base import StructureReader, StructureWriter
from .errors import ConvertError, note
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


def _open_writer(path: str | os.PathLike, options: WriteOptions,
                 framed: bool = False) -> atp.Writer:
    """A new `.atp` file with the codec and level of ``options`` (framed when asked)."""
    return atp.Writer(path, compression=options.compression, level=options.level,
                      framed=framed)


def _add_frames(writer: atp.Writer, frames: list[tuple[int, bytes]],
                destination: Path) -> None:
    """Write carried metadata frames after the records (groups name existing records)."""
    try:
        for kind, payload in frames:
            writer.add_metadata(kind, payload)
    except (atp.AtpError, ValueError) as exc:
        raise ConvertError(destination, writer_problem(exc)) from exc


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
        self._writer: atp.Writer | None = None  # opened on first use: carry() picks the layout
        self._carried: CarriedMetadata | None = None
        self._first = 0

    def carry(self, metadata: CarriedMetadata, first: int, count: int) -> None:
        """Write ``metadata``'s frames for source records ``first:first + count`` into
        this file (call before the first structure)."""
        metadata.check_outputs([first, first + count], self.path)
        self._carried, self._first = metadata, first

    def _open(self) -> atp.Writer:
        if self._writer is None:
            framed = self._carried is not None and self._carried.framed
            self._writer = _open_writer(self.tmp_path, self.options, framed)
        return self._writer

    def _add(self, structure: Structure) -> None:
        _add_checked(self._open(), structure, self.path, self.count)

    def _finish(self) -> None:
        writer = self._open()
        if self._carried is not None:
            _add_frames(writer, self._carried.frames_for(self._first, self._first + self.count),
                        self.path)
        writer.flush()
        writer.close()

    def _discard(self) -> None:
        if self._writer is not None:
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
        self._carried: CarriedMetadata | None = None
        self._first = 0

    def carry(self, metadata: CarriedMetadata, first: int, count: int) -> None:
        """Write ``metadata``'s frames into each shard, renumbered: shard ``k`` holds source
        records ``first + k * shard_size`` on (call before the first structure).

        Raises:
            ConvertError: A group would straddle two shards (nothing is written).
        """
        bounds = list(range(first, first + count, self.shard_size)) + [first + count]
        metadata.check_outputs(bounds, self.path)
        split = metadata.split_inputs(bounds)
        if split:
            note(f"{self.path}: metadata frames of kinds this version does not know "
                 f"(kinds {', '.join(str(k) for k in metadata.kinds() if k != FRAME_GROUPS)}) "
                 f"of {', '.join(split)} are copied unchanged into every shard holding its "
                 f"records: their contents cannot be renumbered")
        self._carried, self._first, self._count = metadata, first, count

    def _open_shard(self, path: Path) -> None:
        framed = self._carried is not None and self._carried.framed
        self._writer = _open_writer(path, self.options, framed)

    def _add_to_shard(self, structure: Structure) -> None:
        _add_checked(self._writer, structure, self.path, self.count)

    def _close_shard(self) -> None:
        if self._carried is not None:
            start = self._first + len(self._entries) * self.shard_size
            stop = start + self._in_shard
            _add_frames(self._writer, self._carried.frames_for(
                start, stop, last=stop >= self._first + self._count), self.path)
        self._writer.flush()
        self._writer.close()
        self._writer = None

    def _abandon_shard(self) -> None:
        self._writer.close()
        self._writer = None

    def _manifest_extras(self) -> dict[str, Any]:
        return {"compression": self.options.compression, "compression_level": self.options.level}


# ------------------------------------------------------------------ metadata frames
@dataclass
class _Input:
    """One `.atp` file of a source: where its records start in the source and its
    metadata frames ``(kind, payload)`` in directory order."""

    path: str
    start: int
    count: int
    frames: list[tuple[int, bytes]]


class CarriedMetadata:
    """The metadata frames of an `.atp` source, carried into `.atp` outputs.

    Every metadata frame of every input file goes forward (the converting guide,
    "Formats in and out"):

    * **groups** (kind 3) are renumbered: an output holding source records
      ``start:stop`` gets each groups chunk with its members moved to the output's
      numbering (:func:`~pyg_atompack.atp.groups.shift_chunk` when the input file lies
      wholly in the output; the groups inside the output otherwise). A group whose
      members would land in two shards is refused before anything is written: a
      reader resolves a shard's groups within that shard, and a group split in two
      would be two wrong groups;
    * **other kinds** (unknown to this version) are copied byte for byte, from each
      input file in order, into every output holding records of that file: their
      meaning is unknown, so nothing in them is renumbered. When one input file is
      split over several shards each shard gets a copy, and a
      :class:`~pyg_atompack.convert.ConversionNote` says so.

    The output is written framed when any input file is framed (the layout the next
    atompack release reads), else in the 0.4.1 layout with an extensions directory;
    a source without metadata frames is written exactly as before.

    Args:
        name (str): The source as the user named it (in messages).
        inputs (list[_Input]): Its files in record order.
        framed (bool): Whether any input file is framed.
    """

    def __init__(self, name: str, inputs: list[_Input], framed: bool) -> None:
        self.name = name
        self.inputs = inputs
        self.framed = framed
        self._edges = np.zeros(1, np.int64)
        # (input, frame) -> [(name, grouping, groups in output order, cuts per output)]
        self._plans: dict[tuple[int, int], list[tuple[str, Grouping, np.ndarray,
                                                      np.ndarray]]] = {}

    @classmethod
    def of_source(cls, src: str | os.PathLike) -> CarriedMetadata:
        """Read the metadata frames of an `.atp` file or shard directory.

        Args:
            src (str | os.PathLike): The source.

        Returns:
            CarriedMetadata: Its frames (possibly none).

        Raises:
            ConvertError: A file cannot be opened or a frame is damaged (naming the file).
        """
        try:
            reader = atp.open(src)
        except atp.AtpError as exc:
            raise ConvertError(src, str(exc)) from exc
        try:
            files = list(getattr(reader, "shards", None) or [reader])
            inputs, start, framed = [], 0, False
            for shard in files:
                try:
                    frames = [(f.kind, bytes(shard.read_metadata(f)))
                              for f in shard.metadata_frames]
                except atp.AtpError as exc:
                    raise ConvertError(shard.path, _unnamed(exc, shard.path)) from exc
                inputs.append(_Input(str(shard.path), start, len(shard), frames))
                framed = framed or bool(shard.header.framed)
                start += len(shard)
        finally:
            reader.close()
        return cls(str(src), inputs, framed)

    def __bool__(self) -> bool:
        return any(item.frames for item in self.inputs)

    def kinds(self) -> list[int]:
        """Every frame kind present, sorted."""
        return sorted({kind for item in self.inputs for kind, _ in item.frames})

    def _groupings(self, item: _Input, payload: bytes) -> list[tuple[str, Grouping]]:
        try:
            return decode_groups(payload, item.count, f"{item.path}: groups frame")
        except atp.AtpError as exc:
            raise ConvertError(item.path, _unnamed(exc, item.path)) from exc

    def check_outputs(self, bounds: list[int], destination: str | os.PathLike) -> None:
        """Refuse groups that would straddle two outputs, and plan where each group goes.

        Args:
            bounds (list[int]): Source record indices where outputs start, then where
                the last one ends: output ``k`` holds ``bounds[k]:bounds[k + 1]``.
            destination (str | os.PathLike): The destination (in messages).

        Raises:
            ConvertError: A group has members in two outputs, or some members inside
                the converted range and some outside it; names the input file, the
                grouping, the group and the records.
        """
        edges = self._edges = np.asarray(bounds, np.int64)
        after = len(edges) - 1  # "output" of records past the range; -1 before it
        self._plans = {}
        for i, item in enumerate(self.inputs):
            for j, (kind, payload) in enumerate(item.frames):
                if kind != FRAME_GROUPS:
                    continue
                plan = self._plans[i, j] = []
                for name, grouping in self._groupings(item, payload):
                    members = grouping.records + item.start
                    where = np.searchsorted(edges, members, side="right") - 1
                    where[members >= edges[-1]] = after
                    if len(grouping):
                        starts = grouping.offsets[:-1]
                        low = np.minimum.reduceat(where, starts)
                        high = np.maximum.reduceat(where, starts)
                    else:
                        low = high = np.zeros(0, np.int64)
                    split = np.flatnonzero((low != high) & (high >= 0) & (low < after))
                    if len(split):
                        g = int(split[0])
                        lo, hi = grouping.offsets[g], grouping.offsets[g + 1]
                        raise ConvertError(item.path, _split_message(
                            name, g, members[lo:hi], where[lo:hi], edges, destination))
                    # groups sorted by output (stable: file order within one), and where
                    # each output's run begins
                    order = np.argsort(low, kind="stable")
                    cuts = np.searchsorted(low[order], np.arange(-1, after + 1))
                    plan.append((name, grouping, order, cuts))

    def frames_for(self, start: int, stop: int, last: bool = True
                   ) -> list[tuple[int, bytes]]:
        """The metadata frames of the output holding source records ``start:stop``.

        :meth:`check_outputs` must have been given this output's bounds.

        Args:
            start (int): The output's first source record.
            stop (int): One past its last.
            last (bool, optional): Whether no output follows (it takes the frames of
                record-less files at its end). (default: :obj:`True`)

        Returns:
            ``(kind, payload)`` in input order, then directory order.
        """
        k = int(np.searchsorted(self._edges, start, side="right")) - 1
        planned = 0 <= k < len(self._edges) - 1 and \
            (int(self._edges[k]), int(self._edges[k + 1])) == (start, stop)
        if not planned and start != stop:  # an empty output takes whole files only
            raise ValueError(f"{self.name}: records {start}:{stop} are not an output "
                             f"planned by check_outputs")
        out: list[tuple[int, bytes]] = []
        for i, item in enumerate(self.inputs):
            end = item.start + item.count
            if item.count == 0:
                # a file with no records still owns its frames: they go to the output
                # where its records would have started
                if not (start <= item.start < stop or (last and item.start == stop)):
                    continue
            elif end <= start or item.start >= stop:
                continue
            whole = start <= item.start and end <= stop
            for j, (kind, payload) in enumerate(item.frames):
                if kind != FRAME_GROUPS:
                    out.append((kind, payload))
                elif whole:
                    out.append((kind, payload if item.start == start else shift_chunk(
                        payload, item.start - start, item.count, f"{item.path}: groups frame")))
                else:
                    chunk = []
                    for name, grouping, order, cuts in self._plans[i, j]:
                        # cuts[0] starts the groups before the range: output k is k + 1
                        chosen = order[cuts[k + 1]:cuts[k + 2]]
                        if len(chosen) or (len(grouping) == 0 and start <= item.start):
                            chunk.append((name, _take_groups(grouping, chosen,
                                                             item.start - start)))
                    if chunk:
                        out.append((kind, encode_groups(chunk)))
        return out

    def split_inputs(self, bounds: list[int]) -> list[str]:
        """Input files holding frames of other kinds whose records go to several outputs."""
        edges = np.asarray(bounds[1:-1], np.int64)
        return [item.path for item in self.inputs
                if any(kind != FRAME_GROUPS for kind, _ in item.frames)
                and np.any((edges > item.start) & (edges < item.start + item.count))]


def _take_groups(grouping: Grouping, chosen: np.ndarray, shift: int) -> Grouping:
    """Groups ``chosen`` (ascending) of ``grouping``, their records moved by ``shift``;
    the work is proportional to the groups taken, not to the grouping."""
    sizes = np.diff(grouping.offsets)[chosen]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    # member positions: each chosen group's run, laid end to end
    members = (np.arange(offsets[-1], dtype=np.int64)
               + np.repeat(grouping.offsets[chosen] - offsets[:-1], sizes))
    roles = grouping.member_roles[members] if len(grouping.member_roles) \
        else grouping.member_roles
    properties = {key: ([values[int(g)] for g in chosen] if isinstance(values, list)
                        else np.asarray(values)[chosen])
                  for key, values in grouping.properties.items()}
    return Grouping(list(grouping.roles), offsets, grouping.records[members] + shift, roles,
                    properties)


def _unnamed(exc: BaseException, path: str) -> str:
    """The format layer's message without its leading file name (ConvertError adds it)."""
    text = str(exc)
    return text[len(path) + 2:] if text.startswith(f"{path}: ") else text


def _split_message(name: str, group: int, records: np.ndarray, outputs: np.ndarray,
                   edges: np.ndarray, destination: str | os.PathLike) -> str:
    last = len(edges) - 1
    places = ["in another part: outside the records this --part converts" if o < 0 or o >= last
              else f"the shard of source records {int(edges[o])}..{int(edges[o + 1]) - 1}"
              for o in outputs]
    members = ", ".join(f"source record {int(r)} ({p})" for r, p in zip(records, places))
    return (f"group {group} of grouping {name!r} has members in different shards of "
            f"{destination}: {members}. A shard holds whole groups only (readers resolve "
            f"a shard's groups inside it); write one .atp file (no --shard-size), or "
            f"choose a shard size whose boundaries fall between groups")
