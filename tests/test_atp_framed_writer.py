"""Writing framed `.atp` files (``Writer(framed=True)``) and carrying metadata frames.

Mirrors the reference's tests in ``atompack/src/storage/frames.rs`` (LeMaterial/atompack,
commit 90da9bd35904a3625ab143eeb5cdd8d532a22c78): unflushed writes survive a crash,
torn and corrupted frames end the recovery, frequent flushes leave no dead bytes, a
flush without changes writes nothing, recovery restores the schema, unframed files
keep appending after their commit; plus byte equality with the independent encoder
of ``atp_framed.py`` and metadata frames (an unknown kind 99) kept by ``append_to``.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.atp.frames import FRAME_GROUPS

sys.path.insert(0, str(Path(__file__).parent))
from atp_framed import Framed, source_of  # noqa: E402

FRAMED, WRITING = 1, 2
OPAQUE = 98  # a metadata kind this version does not decode


def _add(writer: atp.Writer, xs: range) -> None:
    for x in xs:
        writer.add(np.array([[x, 0, 0]], np.float32), [6])


def _xs(path: Path) -> list[float]:
    return [float(m.positions[0, 0]) for m in atp.Reader(path)]


def _slots(path: Path) -> list[tuple[int, int, int]]:
    data = path.read_bytes()
    return [(struct.unpack_from("<Q", data, at + 24)[0], struct.unpack_from("<Q", data, at + 40)[0],
             struct.unpack_from("<I", data, at + 92)[0]) for at in (0, 4096)]


def _recovering(call):
    with pytest.warns(atp.RecoveredWriteWarning):
        return call()


def test_unflushed_writes_survive_a_crash(tmp_path):
    path = tmp_path / "f.atp"
    db = atp.Writer(path, compression="zstd", framed=True)
    _add(db, range(3))
    db.flush()
    _add(db, range(3, 5))
    db.add_groups("pairs", [[0, 4]])
    db.close()  # a crash: no flush
    for index_offset, count, flags in _slots(path):
        assert (index_offset, count, flags) == (0, (1 << 64) - 1, FRAMED | WRITING)
    reader = _recovering(lambda: atp.Reader(path))
    assert [float(m.positions[0, 0]) for m in reader] == [0, 1, 2, 3, 4]
    assert [f.kind for f in reader.metadata_frames] == [FRAME_GROUPS]
    assert list(reader.groups) == ["pairs"]

    db = _recovering(lambda: atp.Writer.append_to(path))
    _add(db, range(5, 6))
    db.flush()
    db.close()
    assert _xs(path) == [0, 1, 2, 3, 4, 5]
    reader = atp.Reader(path)
    assert [f.kind for f in reader.metadata_frames] == [FRAME_GROUPS]
    assert list(reader.groups) == ["pairs"]
    assert [s[2] for s in _slots(path)].count(FRAMED) == 1
    assert atp.verify(path) == []


def test_torn_and_corrupted_frames_end_the_recovery(tmp_path):
    path = tmp_path / "f.atp"
    db = atp.Writer(path, framed=True)
    _add(db, range(3))
    db.flush()
    _add(db, range(3, 5))
    fourth = int(db._pending[0]["offset"][0])
    db.close()
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # the last frame is cut short
    assert _recovering(lambda: _xs(path)) == [0, 1, 2, 3]
    damaged = bytearray(data[:-3])
    damaged[fourth] ^= 0xFF  # one payload byte of the 4th record: its checksum fails
    path.write_bytes(bytes(damaged))
    assert _recovering(lambda: _xs(path)) == [0, 1, 2]
    db = _recovering(lambda: atp.Writer.append_to(path))
    _add(db, range(7, 8))  # writing continues after the last valid frame
    db.flush()
    db.close()
    assert _xs(path) == [0, 1, 2, 7]
    assert atp.verify(path) == []


def test_frequent_flushes_leave_no_dead_bytes(tmp_path):
    once, often = tmp_path / "once.atp", tmp_path / "often.atp"
    with atp.Writer(once, compression="zstd", framed=True) as db:
        _add(db, range(50))
    with atp.Writer(often, compression="zstd", framed=True) as db:
        for x in range(50):
            _add(db, range(x, x + 1))
            db.flush()
    assert often.stat().st_size == once.stat().st_size
    assert _xs(often) == _xs(once) == list(range(50))
    assert atp.describe(often)["stale_bytes"] == 0


def test_flush_without_changes_writes_nothing(tmp_path):
    path = tmp_path / "f.atp"
    with atp.Writer(path, framed=True) as db:
        _add(db, range(2))
    before = path.read_bytes()
    with atp.Writer.append_to(path) as db:
        db.flush()
    assert path.read_bytes() == before


def test_recovery_restores_the_schema(tmp_path):
    path = tmp_path / "f.atp"
    db = atp.Writer(path, framed=True)
    db.add(np.array([[0.1, 0.2, 0.3]]), [6], forces=np.array([[1.0, 2.0, 3.0]]))
    assert db.record_format == 3
    db.close()  # a crash before the first flush
    reader = _recovering(lambda: atp.Reader(path))
    assert reader.record_format == 3 and reader.positions_dtype == np.float64
    got = reader[0]
    assert got.positions.tolist() == [[0.1, 0.2, 0.3]] and got.forces.dtype == np.float64
    assert got.forces.tolist() == [[1.0, 2.0, 3.0]]
    db = _recovering(lambda: atp.Writer.append_to(path))
    assert db.record_format == 3
    db.add(np.array([[1.0, 1.0, 1.0]]), [8], forces=np.zeros((1, 3)))
    db.flush()
    db.close()
    assert len(atp.Reader(path)) == 2 and atp.verify(path) == []


def test_unframed_files_keep_appending_after_their_commit(tmp_path):
    path = tmp_path / "f.atp"
    with atp.Writer(path) as db:  # the default: the 0.4.1 layout
        _add(db, range(2))
    committed = path.stat().st_size
    db = atp.Writer.append_to(path)
    _add(db, range(2, 3))
    assert all(s[2] == 0 for s in _slots(path))  # no writing state
    db.flush()
    db.close()
    assert path.stat().st_size > committed  # the old index stays in place
    assert _xs(path) == [0, 1, 2] and not atp.Reader(path).header.framed


@pytest.mark.parametrize("codec", ("none", "lz4", "zstd"))
def test_framed_writes_equal_the_independent_encoder_and_atompack_041_reads_them(tmp_path,
                                                                                 codec):
    from atp_oracle import assert_same_molecule, normalize_ours, read_atompack

    rng = np.random.default_rng(3)
    molecules = [dict(positions=rng.random((2 + i % 3, 3), dtype=np.float32),
                      atomic_numbers=np.arange(1, 3 + i % 3), energy=float(i),
                      properties={"name": f"m{i}"}) for i in range(9)]
    for framed in (False, True):
        with atp.Writer(tmp_path / f"{framed}.atp", compression=codec, framed=framed) as w:
            for m in molecules:
                w.add(**m)
    items = [("schema",)] + [("record", i) for i in range(9)]
    want = Framed(source_of(tmp_path / "False.atp"), items).committed()
    assert (tmp_path / "True.atp").read_bytes() == want
    ours = [normalize_ours(m) for m in atp.Reader(tmp_path / "False.atp")]
    for i, theirs in enumerate(read_atompack(tmp_path / "True.atp")):
        assert_same_molecule(theirs, ours[i], f"atompack-db, record {i}")


@pytest.mark.parametrize("framed", (False, True))
def test_append_to_keeps_every_metadata_frame(tmp_path, framed):
    path = tmp_path / "f.atp"
    with atp.Writer(path, compression="lz4", framed=framed) as db:
        _add(db, range(3))
        db.add_metadata(99, b"from a newer version")
        db.add_metadata(OPAQUE, b"opaque v1")
    for step in range(3):
        with atp.Writer.append_to(path) as db:
            assert [f.kind for f in db.metadata_frames] == [99, OPAQUE]
            _add(db, range(3 + step, 4 + step))
    with atp.Writer.append_to(path) as db:
        db.add_metadata(OPAQUE, b"opaque v2", replace=True)
    reader = atp.Reader(path)
    assert _xs(path) == [0, 1, 2, 3, 4, 5]
    assert [(f.kind, reader.read_metadata(f)) for f in reader.metadata_frames] == \
        [(99, b"from a newer version"), (OPAQUE, b"opaque v2")]
    assert reader.header.framed == framed and atp.verify(path) == []


def test_metadata_kinds_of_records_and_schemas_are_refused(tmp_path):
    with atp.Writer(tmp_path / "f.atp", framed=True) as db:
        for kind in (1, 2, -1, 1 << 32):
            with pytest.raises(atp.AtpValueError, match=f"kind {kind} is not allowed"):
                db.add_metadata(kind, b"")


@pytest.mark.parametrize("framed", (False, True))
def test_a_rewrite_carries_every_metadata_frame(tmp_path, framed):
    from pyg_atompack.atp.extensions import copy_metadata

    source = tmp_path / "source.atp"
    with atp.Writer(source, compression="zstd", framed=True) as db:
        _add(db, range(4))
        db.add_metadata(OPAQUE, b"opaque")
        db.add_metadata(99, b"from a newer version")
    rewritten = tmp_path / "rewritten.atp"
    with atp.Reader(source) as reader, \
            atp.Writer(rewritten, compression="lz4", framed=framed) as db:
        for mol in reader:
            db.add(mol.positions, mol.atomic_numbers)
        copy_metadata(reader, db)
    reader = atp.Reader(rewritten)
    assert _xs(rewritten) == [0, 1, 2, 3] and reader.header.framed == framed
    assert [(f.kind, reader.read_metadata(f)) for f in reader.metadata_frames] == \
        [(OPAQUE, b"opaque"), (99, b"from a newer version")]
