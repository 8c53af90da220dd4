"""``read_batch``: many records into concatenated arrays (layout described in docs/architecture.md).

Fast path: when every requested record has the same layout (same size and atom
count, identical section headers) the records are joined into one ``(B, raw)``
byte matrix and every field is a single strided column copy. Otherwise each
record is decoded on its own and the values are assembled, zero-filling what a
record lacks.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any

import numpy as np

from . import cache as _cache
from . import prefault
from .assemble import assemble, store
from .cache import UNCHECKED
from .codecs import CHECK_ABOVE, CODEC_NONE, decompress
from .errors import (
    CORRUPT_DATA_ERRORS,
    AtpError,
    AtpIndexError,
    AtpValueError,
    RecordDecodeError,
)
from .fields import FieldInfo, builtin_info
from .gather import plan_of, read_mapped, read_single
from .header import HEADER_SIZE
from .preads import CACHED_READ_SECONDS, read_ranges
from .records import Layout, decode_slot
from .structure import read_structured
from .types import SECTION_BUILTINS

if TYPE_CHECKING:
    from .filestate import FileState

ALWAYS = ("n_atoms", "positions", "atomic_numbers")
_U8 = np.dtype("u1")
_U32 = np.dtype("<u4")
_GROUP_MIN = 32  # records per layout group, on average, for a grouped gather


def resolve_fields(all_fields: dict[str, FieldInfo], fields: Sequence[str] | None,
                   name: str) -> dict[str, FieldInfo]:
    """Turn a ``fields=`` argument into the FieldInfos to decode.

    Args:
        all_fields (dict[str, FieldInfo]): The reader's fields.
        fields (Sequence[str] | None): Requested names, or None for all.
        name (str): File name for error messages.

    Returns:
        ``name -> FieldInfo`` of the optional fields to decode.

    Raises:
        AtpValueError: An unknown or ambiguous custom key.
    """
    if fields is None:
        return {k: v for k, v in all_fields.items() if k not in ALWAYS}
    if isinstance(fields, str):
        fields = [fields]
    out: dict[str, FieldInfo] = {}
    for field in fields:
        if field in ALWAYS:
            continue
        if field in all_fields:
            out[field] = all_fields[field]
        elif field in SECTION_BUILTINS:
            out[field] = builtin_info(field)  # a builtin this file never stored: all missing
        else:
            hits = [k for k in (f"properties/{field}", f"atom_properties/{field}")
                    if k in all_fields]
            if len(hits) != 1:
                problem = "is ambiguous (both scopes exist)" if hits else "is not in the file"
                customs = sorted(k for k in all_fields if "/" in k)
                raise AtpValueError(f"{name}: field {field!r} {problem}; custom fields: "
                                    f"{customs}")
            out[hits[0]] = all_fields[hits[0]]
    return out


def _normalize_indices(indices: Any, count: int, name: str) -> np.ndarray:
    """``indices`` as a flat int64 array of in-range non-negative indices.

    Args:
        indices (Any): Integers (list, tuple or array; negative counts from the end).
        count (int): The number of records.
        name (str): File name for error messages.

    Returns:
        The indices (the caller's array itself when it is already valid int64).

    Raises:
        AtpValueError: The indices are not integers.
        AtpIndexError: An index is out of range.
    """
    idx = np.asarray(indices)
    kind = idx.dtype.kind
    if idx.size == 0:
        return np.zeros(0, dtype=np.int64)
    if kind not in "iu":
        raise AtpValueError(f"{name}: indices must be integers, got dtype {idx.dtype}")
    # common case: already in range, nothing to wrap; a flat list of ints is
    # scanned by Python's min/max (cheaper than two numpy reductions at batch sizes)
    flat_list = type(indices) is list and idx.ndim == 1
    if idx.ndim != 1:
        idx = idx.ravel()
    lo, hi = (min(indices), max(indices)) if flat_list else (idx.min(), idx.max())
    if lo >= 0 and hi < count:
        return idx.astype(np.int64, copy=False)
    if kind == "u":  # no negative indices; keep huge values out of int64 wrap-around
        bad = idx >= count
    else:
        idx = idx.astype(np.int64, copy=False)
        idx = np.where(idx < 0, idx + count, idx)
        bad = (idx < 0) | (idx >= count)
    if bad.any():
        first = int(np.asarray(indices).ravel()[np.argmax(bad)])
        raise AtpIndexError(f"{name}: molecule index {first} out of range for {count} "
                            f"molecules")
    return idx.astype(np.int64, copy=False)


def _fetch(st, idx: np.ndarray, entries: np.ndarray, mapped: bool) -> list:
    """Uncompressed bytes of every requested record (slices of the mapping if ``mapped``)."""
    if not len(idx):
        return []
    _cache.check_entries(st, idx, entries)
    off_l, raw_l = entries["offset"].tolist(), entries["raw"].tolist()
    if st.codec == CODEC_NONE and mapped:
        got = operator.itemgetter(*[slice(o, o + r) for o, r in zip(off_l, raw_l)])(st.buf)
        return [got] if len(off_l) == 1 else list(got)
    sto_l = entries["stored"].tolist()
    if mapped:
        recs = [st.read(o, s) for o, s in zip(off_l, sto_l)]
    else:  # not in memory: every read in flight at once (preads.py)
        recs = read_ranges(st.fd, off_l, sto_l, st.name, idx.tolist(), st.pread,
                           probe=st.buf is None)
    if st.codec == CODEC_NONE:
        return recs
    # every declared size against the record bound at once (decompress checks only the
    # atom count of large frames)
    n_l = entries["n_atoms"].tolist()
    bound = _cache.record_bound(st)
    bad = bound.first_excess(entries["n_atoms"], entries["stored"], entries["raw"]) \
        if max(raw_l) > CHECK_ABOVE else None
    if bad is not None:
        raise bound.refusal(n_l[bad], sto_l[bad], raw_l[bad], f"{st.name}: record {int(idx[bad])}")
    return [decompress(st.codec, d, r, f"{st.name}: record {int(i)}", n)
            for d, r, i, n in zip(recs, raw_l, idx, n_l)]


def _use_mapping(st, entries: np.ndarray) -> bool:
    """Whether to read a batch from the mapping: mapped, and (``"auto"``) resident.

    ``"auto"`` probes the first record's pages only: a random batch's records are
    resident about as often as the file's pages are, and a wrong guess costs time,
    never correctness (both paths decode the same bytes). While gathers from the
    mapping are fast (``cache.batch_cold`` false, :func:`_timed`), the probe's
    system call is skipped.
    """
    if st.buf is None:
        return False
    if st.resident is None or not len(entries) or not st.cache.batch_cold:
        return True
    return st.resident(int(entries["offset"][0]), max(int(entries["stored"][0]), 1))


def _timed(st, count: int, gather, *args) -> dict[str, Any]:
    """``gather(*args)`` from the mapping, learning whether it waited for the disk.

    Under ``"auto"``, a gather slower than a page-cache hit per record
    (:data:`~pyg_atompack.atp.preads.CACHED_READ_SECONDS`) sets ``cache.batch_cold``:
    the next batch asks the page cache first (:func:`_use_mapping`) and reads what
    is not there with concurrent ``pread``; a fast one clears it.

    Args:
        st (FileState): The open file.
        count (int): The batch's record count.
        gather (Callable): The gather to run.
        *args (Any): Its arguments.

    Returns:
        dict[str, Any]: What ``gather`` returned.
    """
    if st.resident is None:
        return gather(*args)
    start = perf_counter()
    out = gather(*args)
    st.cache.batch_cold = perf_counter() - start > count * CACHED_READ_SECONDS
    return out


def read_batch(st: FileState, indices: Any, infos: dict[str, FieldInfo]) -> dict[str, Any]:
    """Decode ``indices`` of an open file into the flat batch dict (see module docstring).

    Args:
        st (FileState): The file's :class:`~pyg_atompack.atp.filestate.FileState` (its decode cache
            is read and filled).
        indices (Any): Molecule indices (negative allowed), any order, repeats allowed.
        infos (dict[str, FieldInfo]): The resolved fields to decode (:func:`resolve_fields`).

    Returns:
        The ``read_batch`` dict of :meth:`pyg_atompack.atp.Reader.read_batch`.
    """
    name = st.name
    cache = st.cache
    idx = _normalize_indices(indices, st.count, name)
    if st.frames is not None:  # a framed file: each record's CRC on its first read
        st.frames.check_batch(st, idx)
    if st.u8 is not None and len(idx) and cache.memo is not UNCHECKED:
        # hot path: every record checked before, all of one layout, in memory
        lids = cache.memo_ids[idx]
        first = int(lids[0])
        if first and (lids == first).all():
            offsets = cache.index_columns(st)[0][idx].astype(np.int64)
            if not cache.batch_cold or st.resident is None or \
                    st.resident(int(offsets[0]), 1):
                try:
                    out = _timed(st, len(idx), read_single, st, idx, offsets, first, infos)
                except AtpError:
                    raise
                except CORRUPT_DATA_ERRORS as exc:
                    raise _name_failed_record(st, idx, exc) from exc
                out["n_atoms"] = np.full(len(idx), cache.memo_layouts[first].n_atoms, np.int64)
                return out
    entries = st.index[idx]
    n_atoms = entries["n_atoms"].astype(np.int64)
    mapped = _use_mapping(st, entries)
    try:
        if mapped and st.u8 is not None and len(idx):
            # mapped, uncompressed: gather straight from the file; the page faults of
            # records not read through this mapping before go partly to a second core
            if st.mm is not None:
                prefault.spread(st, idx, entries)
            first = _check_uniform(st, idx, entries)
            if first is not None:  # one known layout (the common case), checked now
                out = _timed(st, len(idx), read_single, st, idx, first[1], first[0], infos)
                out["n_atoms"] = n_atoms
                return out
            if not (n_atoms == n_atoms[0]).all():
                # mixed sizes: one gather per field when the records share a structure
                out = _timed(st, len(idx), _read_structured, st, idx, entries, n_atoms,
                             infos)
                if out is not None:
                    out["n_atoms"] = n_atoms
                    return out
            lids = _checked_layout_ids(st, idx, entries)
            # grouped gathers pay per group: they win for groups of >= 32 records on
            # average (benchmarks/batch_strategies.py: 2 layouts, 256 records 2.0x the
            # per-record decode; 32 records 0.8x), per-record decoding below that
            if lids is not None and ((lids == lids[0]).all()
                                     or _GROUP_MIN * len(np.unique(lids)) <= len(lids)):
                out = _timed(st, len(idx), read_mapped, st, idx, entries["offset"], lids,
                             n_atoms, infos)
                out["n_atoms"] = n_atoms
                return out
        recs = _fetch(st, idx, entries, mapped)
        layouts = _layouts(st, idx, entries, recs)
        if layouts is not None and len(layouts) == 1:
            out = _homogeneous(recs, layouts[0], infos, idx, name)
        else:
            if layouts is None:
                layouts = [cache.layout(st, rec, int(r), int(n), int(i)) for rec, r, n, i in
                           zip(recs, entries["raw"], entries["n_atoms"], idx)]
            out = _heterogeneous(recs, layouts, infos, n_atoms, idx, name, st.pos_dtype)
    except AtpError:
        raise
    except CORRUPT_DATA_ERRORS as exc:  # numpy/struct errors on corrupt records
        raise _name_failed_record(st, idx, exc) from exc
    out["n_atoms"] = n_atoms
    for key in ("properties", "atom_properties", "mask"):
        out.setdefault(key, {})
    return out


def _check_uniform(st, idx: np.ndarray,
                   entries: np.ndarray) -> tuple[int, np.ndarray] | None:
    """Check a batch of records of one known layout at once (few numpy calls).

    The first touch of records of a uniform file: when every entry has the size and
    atom count of a layout this reader knows, and lies inside the file, every
    record's structural bytes are compared with the layout's in one gather, and the
    records are remembered.

    Args:
        st (FileState): The open file (mapped, uncompressed).
        idx (np.ndarray): The batch's record indices.
        entries (np.ndarray): Their index entries.

    Returns:
        tuple[int, np.ndarray] | None: ``(layout id, file offsets as int64)``, or
        :obj:`None` when the batch needs the general path (another size, an entry
        or record that does not check out: that path names the record at fault).
    """
    # At batch sizes a numpy reduction (min, max, all) costs ~1.5 µs, a bytes compare
    # or a builtin over a short list a fraction of that: the checks below use those.
    cache = st.cache
    words = entries.view(_U32).reshape(len(entries), 5)  # offset (2 words), stored, raw, n
    sizes = words[:, 2:]
    first = sizes[0].tobytes()
    # not one size: the general path (the last entry says so for most mixed batches)
    if sizes[-1].tobytes() != first or sizes.tobytes() != first * len(entries):
        return None
    stored, raw, n = sizes[0].tolist()
    layout = cache.layouts.get((raw, n))
    if layout is None or layout.memo_id is None or stored != raw:
        return None
    starts = entries["offset"].astype(np.int64)
    listed = starts.tolist()
    if min(listed) < HEADER_SIZE or max(listed) + raw > st.size:
        return None
    cols, expected = layout.check_arrays()
    if st.u8[starts[:, None] + cols].tobytes() != expected.tobytes() * len(listed):
        return None
    cache.memo_array()[idx] = layout.memo_id
    return layout.memo_id, starts


def _read_structured(st, idx, entries, n_atoms, infos) -> dict[str, Any] | None:
    """``read_batch`` of mixed-size records sharing one structure (structure.py).

    Records verified against a structure before (by an earlier batch) are known
    from the mapping's :class:`StructureMemo`; otherwise the unverified records are
    checked against the structure of the first record (when verified) or the one
    the mapping's last structure (mixed-size files rarely have two), and only when
    they do not fit it against the structure of the first record's own layout
    (built once per layout: ~100 µs, so not once per batch of a fresh reader).
    Returns None when they do not share one or a field needs per-record decoding.
    """
    cache = st.cache
    memo = cache.structure_memo()
    ids = memo.ids[idx]
    sid = int(ids[0])
    offsets = entries["offset"].astype(np.int64)
    if sid and (ids == sid).all():  # every record verified against one structure
        return read_structured(memo.structures[sid], offsets, n_atoms, infos)
    _cache.check_entries(st, idx, entries)
    raw = entries["raw"].astype(np.int64)
    known = memo.structures[sid or -1]
    if known is not None and memo.verify(known, idx, offsets, raw, n_atoms):
        return read_structured(known, offsets, n_atoms, infos)
    if sid:
        return None
    first = int(idx[0])
    lid = int(cache.memo_array()[first])
    if lid:
        layout = cache.memo_layouts[lid]
    else:
        layout = _cache.record(st, first)[2]
        cache.remember(first, layout)
    structure = plan_of(layout, st.u8).structure(layout)
    if structure is None:
        return None
    structure = memo.canonical(structure)
    if structure is known or not memo.verify(structure, idx, offsets, raw, n_atoms):
        return None
    return read_structured(structure, offsets, n_atoms, infos)


def _name_failed_record(st, idx: np.ndarray, exc: Exception) -> AtpError:
    """The error for a batch whose vectorised decode failed, naming the record at fault.

    Only runs on failure: the records are decoded one by one until one fails; its
    own error names the record. When each decodes alone, the message names the
    batch's records instead.
    """
    for i in dict.fromkeys(idx.tolist()):
        try:
            _cache.molecule(st, i)
        except RecordDecodeError as error:
            return RecordDecodeError(f"{error} (in read_batch: {exc})")
        except AtpError as error:  # e.g. the file shrank under a pread reader
            return error
    shown = ", ".join(map(str, idx[:8].tolist())) + (", ..." if len(idx) > 8 else "")
    return RecordDecodeError(f"{st.name}: read_batch of records [{shown}] failed: {exc}")


def _checked_layout_ids(st, idx: np.ndarray, entries: np.ndarray) -> np.ndarray | None:
    """Memo layout id of every record of a mapped uncompressed file, checking new ones.

    Records whose ``(raw size, n_atoms)`` has a known layout are checked together
    by comparing their structural bytes; the rest go through the one-record parse.
    Returns None when some layout could not get an id (more than 65535 layouts).
    """
    cache = st.cache
    memo = cache.memo_array()
    lids = memo[idx]
    if lids.all():
        return lids
    new = np.flatnonzero(lids == 0)
    new_idx, new_entries = idx[new], entries[new]
    _cache.check_entries(st, new_idx, new_entries)
    keys = (new_entries["raw"].astype(np.int64) << 32) | new_entries["n_atoms"]
    # one size in the common case: skip the sort of np.unique
    distinct = [int(keys[0])] if (keys == keys[0]).all() else np.unique(keys).tolist()
    for key in distinct:
        layout = cache.layouts.get((key >> 32, key & 0xFFFFFFFF))
        members = np.flatnonzero(keys == key)
        if layout is not None and layout.memo_id is not None:
            cols, expected = layout.check_arrays()
            starts = new_entries["offset"][members].astype(np.int64)
            ok = (st.u8[starts[:, None] + cols] == expected).all(axis=1)
            memo[new_idx[members[ok]]] = layout.memo_id
            members = members[~ok]
        for j in members.tolist():
            i = int(new_idx[j])
            cache.remember(i, _cache.record(st, i)[2])
    lids = memo[idx]
    return lids if lids.all() else None


def _layouts(st, idx, entries, recs) -> list[Layout] | None:
    """``[layout]`` when all records share one layout, else None.

    Records checked before (by ``reader[i]`` or an earlier batch) are known from the
    reader's per-record memo; the others are checked here in one vectorised compare.
    """
    if not len(idx):
        return []
    raw, n = entries["raw"], entries["n_atoms"]
    if not ((raw == raw[0]).all() and (n == n[0]).all()):
        return None
    cache = st.cache
    layout = cache.layout(st, recs[0], int(raw[0]), int(n[0]), int(idx[0]))
    cache.remember(int(idx[0]), layout)
    memo = cache.memo_array()
    lid = layout.memo_id
    if lid is not None and (memo[idx] == lid).all():
        return [layout]
    if len(recs) > 1:
        matrix = np.frombuffer(b"".join(recs), _U8).reshape(len(recs), -1)
        cols, expected = layout.check_arrays()
        if not (matrix[:, cols] == expected).all():
            return None
    if lid is not None:
        memo[idx] = lid
    return [layout]


def _homogeneous(recs, layout: Layout, infos, idx, name) -> dict[str, Any]:
    count = len(recs)
    n = layout.n_atoms
    if count:
        matrix = np.frombuffer(b"".join(recs), _U8).reshape(count, -1)
    else:
        matrix = np.zeros((0, layout.z_offset + n), _U8)

    def column(offset: int, nbytes: int, dtype: np.dtype) -> np.ndarray:
        return np.ascontiguousarray(matrix[:, offset:offset + nbytes]).view(dtype)

    pos_bytes = 3 * n * layout.pos_dtype.itemsize
    out: dict[str, Any] = {
        "positions": column(4, pos_bytes, layout.pos_dtype).reshape(count * n, 3),
        "atomic_numbers": column(layout.z_offset, n, _U8).reshape(count * n),
    }
    per_record: dict[str, list] = {}
    for field, info in infos.items():
        slot = layout.by_field.get(field)
        if slot is None:
            per_record[field] = [None] * count
            continue
        shape = slot.value_shape
        if shape is not None:  # fixed size: one strided column copy
            nbytes = slot.elem.itemsize * int(np.prod(shape, dtype=np.int64))
            values = column(slot.offset, nbytes, slot.elem)
            if info.per_atom:
                values = values.reshape(count * n, *shape[1:])
            else:
                values = values.reshape(count, *shape)
            store(out, info, values != 0 if slot.to_bool else values, np.ones(count, bool))
        else:
            per_record[field] = [decode_slot(rec, 0, slot, n, (name, int(i)))
                                 for rec, i in zip(recs, idx)]
    for field, values in per_record.items():
        present = [layout.by_field.get(field) is not None] * count
        assemble(out, infos[field], values, present, np.full(count, n, np.int64))
    return out


def _heterogeneous(recs, layouts, infos, n_atoms, idx, name, pos_dtype) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if recs:
        positions = [np.frombuffer(rec, lay.pos_rows, lay.n_atoms, 4)
                     for rec, lay in zip(recs, layouts)]
        numbers = [np.frombuffer(rec, _U8, lay.n_atoms, lay.z_offset)
                   for rec, lay in zip(recs, layouts)]
        out["positions"] = np.concatenate(positions).reshape(-1, 3)
        out["atomic_numbers"] = np.concatenate(numbers)
    else:
        out["positions"] = np.zeros((0, 3), pos_dtype)
        out["atomic_numbers"] = np.zeros(0, _U8)
    for field, info in infos.items():
        values, present = [], []
        for rec, lay, i in zip(recs, layouts, idx):
            slot = lay.by_field.get(field)
            present.append(slot is not None)
            values.append(None if slot is None else
                          decode_slot(rec, 0, slot, lay.n_atoms, (name, int(i))))
        assemble(out, info, values, present, n_atoms)
    return out


def concat_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate ``read_batch`` results of consecutive index runs (e.g. several shards)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key in ("n_atoms", "positions", "atomic_numbers"):
        out[key] = np.concatenate([p[key] for p in parts])
    out["mask"] = {k: np.concatenate([p["mask"][k] for p in parts]) for k in parts[0]["mask"]}
    for key in parts[0]:
        if key in out or key in ("properties", "atom_properties"):
            continue
        out[key] = _concat_values([p[key] for p in parts], [p["n_atoms"] for p in parts])
    for group in ("properties", "atom_properties"):
        out[group] = {k: _concat_values([p[group][k] for p in parts],
                                        [p["n_atoms"] for p in parts],
                                        per_atom=group == "atom_properties")
                      for k in parts[0][group]}
    return out


def _concat_values(chunks: list, n_atoms: list[np.ndarray], per_atom: bool | None = None) -> Any:
    if all(isinstance(c, np.ndarray) for c in chunks) and len({c.shape[1:] for c in chunks}) == 1:
        return np.concatenate(chunks)
    merged: list = []
    for chunk, counts in zip(chunks, n_atoms):
        if isinstance(chunk, np.ndarray) and per_atom:
            bounds = np.cumsum(counts)[:-1]
            merged.extend(np.split(chunk, bounds))
        else:
            merged.extend(list(chunk))
    return merged
