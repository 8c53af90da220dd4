"""``describe`` and ``verify``: human-facing inspection of one `.atp` file (used by the CLI)."""

from __future__ import annotations

import os
import warnings
from typing import Any

from .codecs import CODEC_NAMES
from .errors import AtpError, RecoveredWriteWarning
from .header import HEADER_SIZE, inspect_slots
from .reader import Reader
from .schema import decode_schema


def _read_head(path: str) -> tuple[bytes, int]:
    with open(path, "rb") as handle:
        return handle.read(HEADER_SIZE), os.fstat(handle.fileno()).st_size


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """Summarise a file's header slots, codec, counts, schema and dead space.

    Args:
        path (str | os.PathLike): An `.atp` file.

    Returns:
        A JSON-serialisable dict with ``path``, ``file_size``, ``slots`` (each with
        ``slot``, ``valid``, ``problem``, ``generation`` …), ``chosen_slot``,
        ``generation``, ``codec``, ``level``, ``record_format``, ``num_molecules``,
        ``total_atoms``, ``positions_dtype``, ``schema`` (list of fields, or None),
        ``index_offset``, ``index_len``, ``schema_offset``, ``schema_len``,
        ``record_bytes`` (stored bytes of committed records), ``stale_bytes``
        (bytes of the data region used by nothing committed, incl. an uncommitted
        tail) and ``uncommitted_tail_bytes``.

    Raises:
        AtpError: The file cannot be opened.
    """
    path = os.fspath(path)
    head, size = _read_head(path)
    slots = []
    for report in inspect_slots(head, size):
        entry: dict[str, Any] = {"slot": report.slot, "valid": report.valid,
                                 "problem": report.problem}
        if report.header is not None:
            h = report.header
            entry.update(generation=h.generation, num_molecules=h.num_molecules,
                         index_offset=h.index_offset, index_len=h.index_len,
                         schema_offset=h.schema_offset, schema_len=h.schema_len,
                         codec=CODEC_NAMES.get(h.codec, f"unknown({h.codec})"),
                         level=h.level, record_format=h.record_format,
                         framed=h.framed, writing=h.writing, ext_offset=h.ext_offset,
                         ext_len=h.ext_len, data_end=h.data_end)
        slots.append(entry)
    with warnings.catch_warnings():
        # describe reports the recovery itself ("recovered")
        warnings.simplefilter("ignore", RecoveredWriteWarning)
        reader = Reader(path, access="pread")
    with reader:
        h = reader.header
        index = reader.index
        record_bytes = int(index["stored"].sum()) if len(index) else 0
        committed = h.committed_end
        live = record_bytes + h.schema_len + h.index_len + h.ext_len
        if h.framed:  # frame headers, metadata frames and the schema frame's head
            live += 20 * len(reader) + sum(20 + f.length for f in reader.metadata_frames)
            live += 24 if h.schema_len else 0
        fields = None
        if reader.schema is not None:
            fields = [{"name": f.name, "kind": f.kind, "tag": f.tag,
                       "dtype": None if f.dtype is None else str(f.dtype),
                       "per_atom": f.per_atom,
                       "shape": None if f.shape is None else list(f.shape)}
                      for f in reader.fields.values()]
        return {
            "path": path,
            "file_size": size,
            "slots": slots,
            "chosen_slot": h.slot,
            "generation": h.generation,
            "codec": reader.codec,
            "level": h.level,
            "record_format": h.record_format,
            "num_molecules": len(reader),
            "total_atoms": int(reader.n_atoms.sum()),
            "positions_dtype": str(reader.positions_dtype),
            "schema": fields,
            "schema_offset": h.schema_offset,
            "schema_len": h.schema_len,
            "index_offset": h.index_offset,
            "index_len": h.index_len,
            "record_bytes": record_bytes,
            "stale_bytes": max(size - HEADER_SIZE - live, 0),
            "uncommitted_tail_bytes": max(size - committed, 0),
            "framed": h.framed,
            "writing": h.writing,
            "recovered": None if not h.writing else {
                "records": len(reader), "data_end": h.data_end,
                "stopped_at": reader._state().recovered.stop},
            "data_end": h.data_end,
            "ext_offset": h.ext_offset,
            "ext_len": h.ext_len,
            "metadata_frames": [{"kind": f.kind, "offset": f.offset, "length": f.length}
                                for f in reader.metadata_frames],
        }


def verify(path: str | os.PathLike) -> list[str]:
    """Check a file completely: both header slots, schema, index and every record.

    Args:
        path (str | os.PathLike): An `.atp` file.

    Returns:
        Human-readable problems; an empty list when the file is sound. Problems
        that do not stop reading (an invalid older slot, an uncommitted tail,
        trailing bytes in a record) are reported too. In a framed file every
        record's and metadata frame's CRC-32 is checked and the groups are decoded;
        a file in the writing state (nothing committed, its records recovered from
        the frames) is a problem, named with the count recovered. The other slot
        of a framed file left in the writing state by the write before the last
        commit is not.
    """
    path = os.fspath(path)
    problems: list[str] = []
    try:
        head, size = _read_head(path)
    except OSError as exc:
        return [f"{path}: cannot read: {exc}"]
    for report in inspect_slots(head, size):
        if not report.valid and report.header is not None and \
                (report.header.generation or report.header.num_molecules):
            problems.append(f"{path}: {report.problem}")
    try:
        with warnings.catch_warnings():  # a recovery is reported as a problem below
            warnings.simplefilter("ignore", RecoveredWriteWarning)
            reader = Reader(path, access="pread")
    except AtpError as exc:
        return problems + [str(exc)]
    with reader:
        h = reader.header
        recovered = reader._state().recovered
        if recovered is not None:
            stop = "" if recovered.stop is None else f"; the scan stopped at {recovered.stop}"
            problems.append(
                f"{path}: in the writing state (nothing committed: a write was interrupted "
                f"or is under way): {len(reader)} records recovered from the frames up to "
                f"byte {h.data_end}{stop}; Writer.append_to(...).flush() commits them")
        elif size > h.committed_end:
            problems.append(f"{path}: {size - h.committed_end} uncommitted bytes after the "
                            f"index (ignored by readers)")
        damaged = False
        for frame in reader.metadata_frames:
            try:
                reader.read_metadata(frame)
            except AtpError as exc:
                problems.append(str(exc))
                damaged = True
        if not damaged:
            try:  # groups frames decode and fit each other and the records
                _ = reader.groups
            except AtpError as exc:
                problems.append(str(exc))
        if h.schema_len:
            try:
                decode_schema(reader._state().read(h.schema_offset, h.schema_len), path)
            except AtpError as exc:
                problems.append(str(exc))
        for i in range(len(reader)):
            try:
                mol = reader[i]
                st = reader._state()
                layout = st.cache.layouts.get((int(reader.index["raw"][i]),
                                         int(reader.index["n_atoms"][i])))
                if layout is not None and layout.trailing:
                    problems.append(f"{path}: record {i}: {layout.trailing} bytes after the "
                                    f"last section")
                # touch lazily checked values (strings, tensors) through their decode
                _ = mol.properties, mol.atom_properties
            except AtpError as exc:
                problems.append(str(exc))
        if reader.schema is not None and len(reader):
            try:
                stored = reader.schema.entries
                rebuilt = reader.rebuild_schema().entries
                for key, entry in rebuilt.items():
                    if key not in stored:
                        problems.append(f"{path}: field {key[1]!r} (kind {key[0]}) is in records "
                                        f"but not in the schema")
                    elif stored[key].signature != entry.signature:
                        problems.append(f"{path}: field {key[1]!r} (kind {key[0]}) differs "
                                        f"from its schema entry")
            except AtpError as exc:
                problems.append(str(exc))
    return list(dict.fromkeys(problems))  # a damaged record fails its decode and the rebuild
