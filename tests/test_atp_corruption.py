"""Corruption tests for `pyg_atompack.atp`: truncated and bit-flipped files.

Valid files are written by atompack-db and by our writer in two committed
sessions, so that both header slots hold a commit (the newest in slot A with
generation 2, the older in slot B with generation 1). Each damaged copy is then
opened and fully read (``f[i]`` for every i and ``read_batch``). Allowed outcomes:
correct data (possibly the older commit, as the spec decides) or an
:class:`atp.AtpError` naming the file; never another exception type, never a hang.
The file layout is located with an independent struct-based parser.
"""

from __future__ import annotations

import re
import shutil
import struct
import warnings
import zlib
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import atompack
import numpy as np
import pytest
from atp_oracle import (
    ACCESS_MODES,
    CODECS,
    FileSpec,
    MoleculeSpec,
    assert_same_molecule,
    normalize_ours,
    open_reader,
    read_atompack,
    write_file,
)

from pyg_atompack import atp
from pyg_atompack.atp.cache import check_entries

pytestmark = pytest.mark.timeout(120)

SLOT_SIZE = 4096
DATA_START = 8192
# magic, version, generation, data_start, index_offset, index_len, num_molecules, codec,
# (3 zero bytes), level, record_format, schema_offset, schema_len
SLOT = struct.Struct("<4sIQQQQQB3xiIQQ")
Slot = namedtuple("Slot", "magic version generation data_start index_offset index_len "
                          "num_molecules codec level record_format schema_offset schema_len")
INDEX_ENTRY = np.dtype([("offset", "<u8"), ("stored", "<u4"), ("raw", "<u4"), ("n_atoms", "<u4")])
FIRST_SESSION = 3  # molecules committed by the older slot
PROGRAMMING_ERRORS = (NameError, AttributeError, AssertionError, MemoryError, RecursionError)


@dataclass
class Layout:
    """Where the committed structures of a file lie (from the newest and the older slot)."""

    newest_slot: int
    newest: Slot
    older: Slot
    records: np.ndarray  # index entries of the newest commit

    @property
    def newest_end(self) -> int:
        return self.newest.index_offset + self.newest.index_len

    @property
    def older_end(self) -> int:
        return self.older.index_offset + self.older.index_len


def parse_layout(path: Path) -> Layout:
    data = path.read_bytes()
    slots = [Slot(*SLOT.unpack_from(data, offset)) for offset in (0, SLOT_SIZE)]
    newest_slot = 0 if slots[0].generation >= slots[1].generation else 1
    newest, older = slots[newest_slot], slots[1 - newest_slot]
    index_offset, count = newest.index_offset, newest.num_molecules
    records = np.frombuffer(data, INDEX_ENTRY, count=count, offset=index_offset + 8).copy()
    return Layout(newest_slot, newest, older, records)


def _molecule(rng: np.random.Generator, n: int, index: int) -> MoleculeSpec:
    builtins = {
        "energy": float(rng.standard_normal()),
        "forces": rng.standard_normal((n, 3)).astype(np.float32),
        "charges": rng.standard_normal(n),
        "cell": rng.standard_normal((3, 3)),
        "pbc": (True, False, bool(index % 2)),
        "name": f"mol-{index}-ü",
    }
    properties = {"label": f"lab{index}", "score": float(index), "vec": np.arange(4.0) + index,
                  "grid": rng.standard_normal((2, 2, 2)).astype(np.float32)}
    atom_properties = {"tags": np.arange(n, dtype=np.int32),
                       "dipole": rng.standard_normal((n, 3))}
    positions = rng.standard_normal((n, 3)).astype(np.float32)
    numbers = rng.integers(1, 90, size=n, dtype=np.uint8)
    return MoleculeSpec(positions, numbers, builtins, properties, atom_properties)


def build_spec(codec: str) -> FileSpec:
    rng = np.random.default_rng(7)
    sizes = [4, 0, 9, 1, 12, 5]
    molecules = [_molecule(rng, n, i) for i, n in enumerate(sizes)]
    sessions = [molecules[:FIRST_SESSION], molecules[FIRST_SESSION:]]
    return FileSpec(codec, 3, np.float32, sessions, [False, True])


@pytest.fixture(scope="module", params=[(w, c) for w in ("atompack", "ours") for c in CODECS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def valid_file(request, tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """A two-session file and what atompack-db reads from it."""
    writer, codec = request.param
    path = tmp_path_factory.mktemp(f"{writer}_{codec}") / f"valid_{writer}_{codec}.atp"
    spec = build_spec(codec)
    write_file(path, spec, [writer, writer])
    return path, read_atompack(path)


def damaged_copy(source: Path, target_dir: Path, label: str) -> Path:
    target = target_dir / f"damaged_{label}_{source.name}"
    shutil.copyfile(source, target)
    return target


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def patch(path: Path, offset: int, payload: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(payload)


def flip(path: Path, offset: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes()[offset:offset + 1])
    patch(path, offset, bytes([data[0] ^ mask]))


def read_everything(path: Path, access: str) -> list[dict[str, Any]] | atp.AtpError:
    """Open and fully read ``path``; return the molecules or the AtpError raised."""
    try:
        with open_reader(path, access) as f:
            molecules = [normalize_ours(f[i]) for i in range(len(f))]
            f.read_batch(list(range(len(f))))
            f.read_batch(list(range(len(f)))[::-1])
            return molecules
    except atp.AtpError as error:
        assert path.name in str(error), f"error does not name the file: {error}"
        # the reader turns unexpected exceptions on damaged records into AtpErrors; one that
        # wraps a programming error (or an absurd allocation) hides a bug instead
        assert not isinstance(error.__cause__, PROGRAMMING_ERRORS), (
            f"AtpError wraps {type(error.__cause__).__name__}: {error}")
        return error


def expect(path: Path, want: list[dict[str, Any]] | None, what: str) -> None:
    """Assert the outcome in both access modes: ``want`` molecules, or an error when None."""
    for access in ACCESS_MODES:
        got = read_everything(path, access)
        if want is None:
            assert isinstance(got, atp.AtpError), f"{what} ({access}): expected an AtpError"
            continue
        assert not isinstance(got, atp.AtpError), f"{what} ({access}): unexpected {got!r}"
        assert len(got) == len(want), f"{what} ({access}): {len(got)} molecules, want {len(want)}"
        for i, (item, molecule) in enumerate(zip(got, want)):
            assert_same_molecule(item, molecule, f"{what} ({access}) [{i}]")


def expect_error_or_data(path: Path, what: str) -> None:
    """Damage the spec leaves undecided: an AtpError naming the file, or a full read of
    whatever the damaged bytes now say; any other exception (or a hang) fails the test."""
    for access in ACCESS_MODES:
        try:
            read_everything(path, access)
        except Exception as error:  # not an AtpError: report which damage caused it
            raise AssertionError(f"{what} ({access}): {type(error).__name__}: {error}") from error


def truncation_points(path: Path, layout: Layout) -> list[int]:
    size = path.stat().st_size
    points = {0, 1, 4, 8, 100, SLOT_SIZE - 4, SLOT_SIZE - 1, SLOT_SIZE, SLOT_SIZE + 8,
              DATA_START - 4, DATA_START - 1, DATA_START, DATA_START + 1, size - 1}
    for entry in layout.records:
        start, end = int(entry["offset"]), int(entry["offset"] + entry["stored"])
        points |= {start, start + 1, (start + end) // 2, end - 1}
    for slot in (layout.newest, layout.older):
        schema_offset, schema_len = slot.schema_offset, slot.schema_len
        index_offset, index_len = slot.index_offset, slot.index_len
        points |= {schema_offset + k for k in (1, 4, 5, 9, schema_len // 2, schema_len - 1)}
        points |= {index_offset + k for k in (0, 1, 8, 9, 28, index_len - 1)}
    return sorted(p for p in points if 0 <= p < size)


def test_truncation_at_every_boundary(valid_file, tmp_path):
    source, reference = valid_file
    layout = parse_layout(source)
    for point in truncation_points(source, layout):
        path = damaged_copy(source, tmp_path, f"cut{point}")
        truncate(path, point)
        # the newest commit needs everything up to its index end; the older one up to its own
        if point >= layout.newest_end:
            want = reference
        elif point >= layout.older_end:
            want = reference[:FIRST_SESSION]
        else:
            want = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            expect(path, want, f"truncated at {point}")
        cut_short = [w for w in caught if issubclass(w.category, atp.TruncatedCommitWarning)]
        if want is not None and point < layout.newest_end:
            # the fall-back the format allows is taken, but never silently: records are lost
            assert cut_short, f"truncated at {point}: no TruncatedCommitWarning"
            message = str(cut_short[0].message)
            assert message.startswith(f"{path}: the newest commit (generation ")
            assert f"{len(reference)} records" in message
            assert f"{FIRST_SESSION} records) is read" in message
        elif want is not None:
            assert not cut_short, f"truncated at {point}: {cut_short[0].message}"
        path.unlink()


def test_uncommitted_tail_is_invisible_and_may_be_cut(valid_file, tmp_path):
    source, reference = valid_file
    path = damaged_copy(source, tmp_path, "tail")
    db = atompack.Database.open(str(path), mmap=False)
    db.add_molecule(atompack.Molecule.from_arrays(np.zeros((64, 3), np.float32),
                                                  np.ones(64, np.uint8), energy=1.0))
    del db  # never flushed: the record stays an uncommitted tail
    committed_end = parse_layout(source).newest_end
    full_size = path.stat().st_size
    assert full_size > committed_end
    expect(path, reference, "uncommitted tail")
    for point in (full_size - 1, (committed_end + full_size) // 2, committed_end + 1):
        truncate(path, point)
        expect(path, reference, f"tail cut at {point}")


NEWEST_SLOT_OFFSETS = (8, 9, 15, 16, 24, 32, 40, 47, 48, 52, 56, 60, 68, 75, 76, 1000, 4091,
                       4092, 4095)


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_corrupted_newest_slot_falls_back_to_older(valid_file, tmp_path, mask):
    source, reference = valid_file
    layout = parse_layout(source)
    base = layout.newest_slot * SLOT_SIZE
    for offset in NEWEST_SLOT_OFFSETS:
        path = damaged_copy(source, tmp_path, f"slot{offset}")
        flip(path, base + offset, mask)
        expect(path, reference[:FIRST_SESSION], f"newest slot byte {offset} ^ {mask:#x}")
        path.unlink()


def test_damaged_magic_of_slot_a_is_an_error_or_a_fallback(valid_file, tmp_path):
    # atompack refuses the file when the first 8 bytes are damaged; a lenient reader may
    # fall back to slot B instead (spec §2.2) - both are acceptable, nothing else is
    source, reference = valid_file
    layout = parse_layout(source)
    fallback = reference[:FIRST_SESSION] if layout.newest_slot == 0 else reference
    for offset in range(8):
        path = damaged_copy(source, tmp_path, f"magic{offset}")
        flip(path, offset)
        got = read_everything(path, "mmap")
        if not isinstance(got, atp.AtpError):
            assert len(got) == len(fallback)
            for i, (item, molecule) in enumerate(zip(got, fallback)):
                assert_same_molecule(item, molecule, f"magic byte {offset} [{i}]")
        path.unlink()


def test_corrupted_older_slot_is_ignored(valid_file, tmp_path):
    source, reference = valid_file
    base = (1 - parse_layout(source).newest_slot) * SLOT_SIZE
    for offset in NEWEST_SLOT_OFFSETS:
        if base == 0 and offset < 8:
            continue
        path = damaged_copy(source, tmp_path, f"older{offset}")
        flip(path, base + offset)
        expect(path, reference, f"older slot byte {offset}")
        path.unlink()


@pytest.mark.parametrize("offsets", [(40, 40), (4092, 200), (24, 60)])
def test_both_slots_corrupted_is_an_error(valid_file, tmp_path, offsets):
    source, _ = valid_file
    path = damaged_copy(source, tmp_path, "both")
    flip(path, offsets[0])
    flip(path, SLOT_SIZE + offsets[1])
    expect(path, None, f"both slots corrupted at {offsets}")


def _schema_mutations(source: Path, layout: Layout) -> dict[str, tuple[int, bytes]]:
    offset = layout.newest.schema_offset
    block = source.read_bytes()[offset:offset + layout.newest.schema_len]
    (count,) = struct.unpack_from("<I", block, 5)
    assert count > 0
    return {
        "version 2": (offset, struct.pack("<I", 2)),
        "positions tag 9": (offset + 4, b"\x09"),
        "entry count + 1": (offset + 5, struct.pack("<I", count + 1)),
        "entry count - 1": (offset + 5, struct.pack("<I", count - 1)),
        "per_atom flag 2": (offset + 9 + 2, b"\x02"),
        "key length + 200": (offset + 9 + 3, struct.pack("<H", block[12] + 200)),
        "key not UTF-8": (offset + 9 + 13, b"\xff"),
    }


def test_malformed_schema_fails_at_open_without_fallback(valid_file, tmp_path):
    source, _ = valid_file
    layout = parse_layout(source)
    for label, (offset, payload) in _schema_mutations(source, layout).items():
        path = damaged_copy(source, tmp_path, "schema")
        patch(path, offset, payload)
        for access in ACCESS_MODES:
            try:
                open_reader(path, access).close()
            except atp.AtpError as error:
                assert path.name in str(error), f"{label}: error does not name the file: {error}"
            else:
                raise AssertionError(f"schema with {label} opened without error ({access})")
        path.unlink()


def test_schema_byte_flips_never_escape_atp_error(valid_file, tmp_path):
    source, reference = valid_file
    layout = parse_layout(source)
    offset, length = layout.newest.schema_offset, layout.newest.schema_len
    for position in range(offset, offset + length):
        path = damaged_copy(source, tmp_path, f"schemaflip{position}")
        flip(path, position)
        expect_error_or_data(path, f"schema byte {position - offset}")
        path.unlink()


@pytest.mark.parametrize("delta", [1, -1, 2**40])
def test_index_count_mismatch_is_an_error(valid_file, tmp_path, delta):
    source, reference = valid_file
    layout = parse_layout(source)
    path = damaged_copy(source, tmp_path, "count")
    patch(path, layout.newest.index_offset, struct.pack("<Q", len(reference) + delta))
    expect(path, None, f"index prefix count {len(reference)} + {delta}")


@pytest.mark.parametrize("mask", [0x01, 0xFF])
def test_index_byte_flips_never_escape_atp_error(valid_file, tmp_path, mask):
    source, reference = valid_file
    layout = parse_layout(source)
    start = layout.newest.index_offset + 8
    for position in range(start, start + 20 * len(layout.records)):
        path = damaged_copy(source, tmp_path, f"indexflip{position}")
        flip(path, position, mask)
        expect_error_or_data(path, f"index byte {position - start} ^ {mask:#x}")
        path.unlink()


def test_record_byte_flips_never_escape_atp_error(valid_file, tmp_path):
    source, reference = valid_file
    layout = parse_layout(source)
    rng = np.random.default_rng(3)
    for number, entry in enumerate(layout.records):
        start, stored = int(entry["offset"]), int(entry["stored"])
        positions = set(range(start, start + min(stored, 24)))
        positions |= set((start + rng.integers(0, stored, size=12)).tolist())
        for position in sorted(positions):
            path = damaged_copy(source, tmp_path, f"recflip{position}")
            flip(path, position)
            expect_error_or_data(path, f"record {number} byte {position - start}")
            path.unlink()


@pytest.mark.parametrize("victim", [1, 4])
def test_record_decode_failure_names_the_record(valid_file, tmp_path, victim):
    source, reference = valid_file
    layout = parse_layout(source)
    entry = layout.records[victim]
    path = damaged_copy(source, tmp_path, "record")
    if layout.newest.codec == 0:
        # codec none: give the first section (builtin "charges") a type tag that does not exist
        n_atoms = int(entry["n_atoms"])
        tag_at = int(entry["offset"]) + 4 + 13 * n_atoms + 2 + 2 + len(b"charges")
        assert path.read_bytes()[tag_at - 7:tag_at] == b"charges"
        patch(path, tag_at, b"\x63")
    else:
        patch(path, int(entry["offset"]), b"\xff" * int(entry["stored"]))
    for access in ACCESS_MODES:
        with open_reader(path, access) as f:
            for i in range(len(f)):
                if i != victim:
                    assert_same_molecule(normalize_ours(f[i]), reference[i], f"[{i}]")
            for call in (lambda: f[victim], lambda: f.read_batch([0, victim])):
                with pytest.raises(atp.AtpError) as caught:
                    call()
                message = str(caught.value)
                assert path.name in message, message
                assert re.search(rf"\b{victim}\b", message), f"record index missing: {message}"


@pytest.mark.parametrize("where", ["wraps around 2**64", "one byte past the end",
                                   "below the data region"])
def test_an_index_entry_outside_the_file_names_the_record(valid_file, tmp_path, where):
    # a batch checks its entries with unsigned 64-bit sums: an offset near 2**64 makes
    # offset + size wrap around to a small number, which must not pass for "inside"
    source, reference = valid_file
    layout = parse_layout(source)
    victim = 3
    size = source.stat().st_size
    stored = int(layout.records[victim]["stored"])
    offset = {"wraps around 2**64": 2**64 - 16, "one byte past the end": size - stored + 1,
              "below the data region": DATA_START - 1}[where]
    path = damaged_copy(source, tmp_path, "entry")
    patch(path, layout.newest.index_offset + 8 + 20 * victim, struct.pack("<Q", offset))
    for access in ACCESS_MODES:
        with open_reader(path, access) as f:
            assert_same_molecule(normalize_ours(f[0]), reference[0], f"{where} ({access})")
            calls = {"f[i]": lambda: f[victim], "batch": lambda: f.read_batch([0, victim]),
                     "batch of one size": lambda: f.read_batch([victim, victim])}
            for call_name, call in calls.items():
                with pytest.raises(atp.RecordDecodeError) as caught:
                    call()
                message = str(caught.value)
                assert path.name in message, f"{where} ({access}, {call_name}): {message}"
                assert re.search(rf"record {victim}\b", message), \
                    f"{where} ({access}, {call_name}): {message}"


@pytest.mark.parametrize("offset, stored", [(2**64 - 16, 92), (2**64 - 1, 1),
                                            (10_000 - 91, 92), (8191, 92)])
def test_batch_entry_check_refuses_every_range_outside_the_file(offset, stored):
    # the check read_batch runs on its entries, alone: the layers behind it would
    # catch a bad range too, so only this shows that the check itself does
    st = SimpleNamespace(size=10_000, codec=0, name="file.atp")
    entries = np.array([(8192, 92, 92, 5), (offset, stored, stored, 5)], INDEX_ENTRY)
    with pytest.raises(atp.RecordDecodeError, match=r"file\.atp: record 7: stored bytes"):
        check_entries(st, np.array([4, 7]), entries)
    check_entries(st, np.array([4, 7]), entries[[0, 0]])  # inside: no error


@pytest.mark.parametrize("damage", ["section key", "section type tag"])
def test_a_changed_header_amid_records_of_one_size_is_found_by_batches(tmp_path, damage):
    # Records of one size and atom count share a layout; a batch of them is checked
    # in one vectorised compare of every record's structural bytes against the layout's.
    # A record whose section header differs (same size) must fail that compare: it is
    # then decoded by its own header (a renamed builtin section is not energy) or, if
    # that header is invalid, named in the error; never decoded with the layout's
    # offsets as if nothing were different.
    rng = np.random.default_rng(7)
    count, atoms, victim = 40, 8, 23
    energy = rng.standard_normal(count)
    path = tmp_path / "uniform.atp"
    db = atompack.Database(str(path), compression="none", overwrite=True)
    db.add_arrays_batch(rng.standard_normal((count, atoms, 3)).astype(np.float32),
                        rng.integers(1, 90, size=(count, atoms), dtype=np.uint8),
                        energy=energy,
                        forces=rng.standard_normal((count, atoms, 3)).astype(np.float32))
    db.flush()
    del db
    layout = parse_layout(path)
    start = int(layout.records[victim]["offset"])
    record = path.read_bytes()[start:start + int(layout.records[victim]["stored"])]
    key = record.index(b"energy")
    # the key's last letter, or the type tag that follows the key
    patch(path, start + key + (5 if damage == "section key" else 6), b"\x7f")
    for access in ACCESS_MODES:
        with open_reader(path, access) as f:
            f.read_batch(list(range(0, victim)))  # the layout is known and remembered
            for batch in ([victim - 1, victim, victim + 1], list(range(victim, count))):
                if damage == "section key":
                    got = f.read_batch(batch)
                    present = np.array([i != victim for i in batch])
                    assert (got["mask"]["energy"] == present).all(), f"{access}: {batch}"
                    assert np.array_equal(got["energy"][present], energy[batch][present])
                    continue
                with pytest.raises(atp.AtpError) as caught:
                    f.read_batch(batch)
                message = str(caught.value)
                assert path.name in message, f"{damage} ({access}): {message}"
                assert re.search(rf"\b{victim}\b", message), f"{damage} ({access}): {message}"
            good = f.read_batch([victim + 1, victim + 2])
            assert good["positions"].shape == (2 * atoms, 3)


def rewrite_slot(path: Path, slot: int, **changes: int) -> None:
    """Change fields of a header slot and store a valid Adler-32 again (semantic damage)."""
    data = bytearray(path.read_bytes()[slot * SLOT_SIZE:(slot + 1) * SLOT_SIZE])
    fields = Slot(*SLOT.unpack_from(data, 0))._replace(**changes)
    SLOT.pack_into(data, 0, *fields)
    struct.pack_into("<I", data, SLOT_SIZE - 4, zlib.adler32(bytes(data[:SLOT_SIZE - 4])))
    patch(path, slot * SLOT_SIZE, bytes(data))


# checksum-valid newest slots that break one validity rule of spec §2.1 -> the older slot
INVALID_SLOT_CHANGES = {
    "codec 3": lambda s, size: {"codec": 3},
    "data_start below 8192": lambda s, size: {"data_start": DATA_START - 1},
    "data_start past the end": lambda s, size: {"data_start": size + 1},
    "schema_len 0 with an offset": lambda s, size: {"schema_len": 0},
    "schema_offset 0 with a length": lambda s, size: {"schema_offset": 0},
    "schema before data_start": lambda s, size: {"schema_offset": 100},
    "schema past the end": lambda s, size: {"schema_len": size},
    "index_len not 8 + 20 n": lambda s, size: {"index_len": s.index_len + 1},
    "index_offset 0 with molecules": lambda s, size: {"index_offset": 0},
    "index past the end": lambda s, size: {"index_offset": size - 8},
    "num_molecules without index length": lambda s, size: {"num_molecules": s.num_molecules + 1},
    "index before data_start": lambda s, size: {"index_offset": DATA_START - 20},
}


@pytest.mark.parametrize("label", list(INVALID_SLOT_CHANGES))
def test_checksum_valid_but_invalid_newest_slot_falls_back(valid_file, tmp_path, label):
    source, reference = valid_file
    layout = parse_layout(source)
    path = damaged_copy(source, tmp_path, "semantic")
    rewrite_slot(path, layout.newest_slot,
                 **INVALID_SLOT_CHANGES[label](layout.newest, source.stat().st_size))
    expect(path, reference[:FIRST_SESSION], label)


def test_unknown_record_format_in_chosen_slot_is_an_error(valid_file, tmp_path):
    # record_format is checked after choosing the slot: no fallback (spec §2.1)
    source, _ = valid_file
    path = damaged_copy(source, tmp_path, "rf4")
    rewrite_slot(path, parse_layout(source).newest_slot, record_format=4)
    expect(path, None, "record_format 4")


def test_the_higher_generation_wins_and_a_tie_goes_to_slot_a(valid_file, tmp_path):
    source, reference = valid_file
    layout = parse_layout(source)
    assert layout.newest_slot == 0 and layout.newest.generation == 2
    path = damaged_copy(source, tmp_path, "generation")
    rewrite_slot(path, 0, generation=0)  # the slot with the newer data now looks older
    expect(path, reference[:FIRST_SESSION], "slot A generation 0 < slot B generation 1")
    rewrite_slot(path, 0, generation=1)
    expect(path, reference, "generation tie -> slot A")
    rewrite_slot(path, 0, generation=7)
    rewrite_slot(path, 1, generation=7)
    expect(path, reference, "generation tie at 7 -> slot A")
