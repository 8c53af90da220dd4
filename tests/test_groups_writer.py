"""``atp.Writer.add_groups``: upstream's Python tests (atompack-py/tests/test_groups.py at
49a278f) against this writer, and the bytes it writes (one groups frame per call)."""

from __future__ import annotations

import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.atp.frames import FRAME_GROUPS
from pyg_atompack.atp.groups import GroupsError, encode_groups


def _db(path, n: int = 4, framed: bool = True) -> atp.Writer:
    db = atp.Writer(path, compression="zstd", framed=framed)
    for i in range(n):
        db.add(np.array([[float(i), 0.0, 0.0]], np.float32), np.array([6]), energy=float(i))
    return db


@pytest.mark.parametrize("framed", (True, False))
def test_named_groups_round_trip_and_share_records(tmp_path, framed):
    path = tmp_path / "groups.atp"
    db = _db(path, framed=framed)
    db.add_groups("adsorption", [{"adslab": 1, "slab": 0}, {"adslab": 2, "slab": 0, "gas": 3}],
                  {"e_ads": [-1.5, -0.25], "id": ["a", "b"], "n": np.array([2, 3])})
    db.add_groups("ordered", [[3, 1, 2]])
    db.flush()
    db.close()
    for access in ("mmap", "pread"):
        reader = atp.open(path, access=access)
        assert len(reader) == 4 and reader.header.framed == framed
        assert list(reader.groups) == ["adsorption", "ordered"]
        ads = reader.groups["adsorption"]
        assert (ads.name, len(ads), ads.roles) == ("adsorption", 2, ["adslab", "slab", "gas"])
        assert reader.groups["ordered"].roles == []
        props = ads.properties
        assert props["e_ads"].dtype == np.float64 and props["n"].dtype == np.int64
        assert props["id"] == ["a", "b"]
        g = ads[1]
        assert g.indices == {"adslab": 2, "slab": 0, "gas": 3}
        assert g.properties == {"e_ads": -0.25, "id": "b", "n": 3}
        assert g["gas"].energy == 3.0 and list(g) == ["adslab", "slab", "gas"]
        ordered = reader.groups["ordered"][0]
        assert ordered.indices == [3, 1, 2] and [m.energy for m in ordered] == [3.0, 1.0, 2.0]
        # one groups frame per call, its payload byte for byte upstream's chunk
        frames = [f for f in reader.metadata_frames if f.kind == FRAME_GROUPS]
        assert [reader.read_metadata(f) for f in frames] == [
            encode_groups([("adsorption", ads.grouping)]),
            encode_groups([("ordered", reader.groups["ordered"].grouping)])]
    if not framed:  # the file stays a 0.4.1 file: atompack-db 0.4.1 reads its records
        assert atp.verify(path) == []


def test_append_groups_across_sessions(tmp_path):
    path = tmp_path / "groups.atp"
    with _db(path) as db:
        db.add_groups("pairs", [{"a": 0, "b": 1}], {"y": [1.0]})
    with atp.Writer.append_to(path) as db:
        db.add(np.array([[9.0, 0.0, 0.0]], np.float32), np.array([8]))
        db.add_groups("pairs", np.array([[4, -1, 2], [3, 1, -1]]), {"y": np.array([2.0, 3.0])},
                      roles=["a", "c", "b"])
    with atp.Writer.append_to(path) as db:  # a records-only session keeps the groups
        db.add(np.array([[10.0, 0.0, 0.0]], np.float32), np.array([8]))
    pairs = atp.open(path).groups["pairs"]
    assert len(pairs) == 3 and pairs.roles == ["a", "b", "c"]
    assert pairs[1].indices == {"a": 4, "b": 2} and pairs[2].indices == {"a": 3, "c": 1}
    np.testing.assert_array_equal(pairs.properties["y"], [1.0, 2.0, 3.0])


def test_groups_survive_a_crash_and_writing_continues(tmp_path):
    path = tmp_path / "crash.atp"
    db = _db(path)
    db.flush()
    db.add(np.array([[4.0, 0.0, 0.0]], np.float32), np.array([6]), energy=4.0)
    db.add_groups("pairs", [[0, 4]])
    db.close()  # no flush: both slots stay in the writing state
    with pytest.warns(atp.RecoveredWriteWarning):
        reader = atp.open(path)
        assert reader.groups["pairs"][0].indices == [0, 4]
    with pytest.warns(atp.RecoveredWriteWarning), atp.Writer.append_to(path) as db:
        db.add_groups("pairs", [[1, 2]])
    assert atp.open(path).groups["pairs"].grouping.records.tolist() == [0, 4, 1, 2]


@pytest.mark.parametrize(
    ("members", "properties", "error"),
    [
        ([[0, 4]], None, GroupsError),  # record does not exist
        ([[0, -2]], None, GroupsError),  # negative index
        ([[]], None, GroupsError),  # empty group
        ([{"a": 0}, [1]], None, TypeError),  # mixed named/ordered
        ([[0], [1]], {"y": [1.0]}, GroupsError),  # one value per group
        ([[0]], {"y": [{"x": 1}]}, TypeError),  # unsupported value
    ],
)
def test_invalid_groups_are_rejected_without_side_effects(tmp_path, members, properties,
                                                          error):
    path = tmp_path / "bad.atp"
    with _db(path) as db:
        with pytest.raises(error, match=r"bad\.atp: add_groups\('g'\)"):
            db.add_groups("g", members, properties)
        assert db.metadata_frames == []
    assert list(atp.open(path).groups) == []
    assert issubclass(GroupsError, ValueError)


def test_group_errors(tmp_path):
    path = tmp_path / "groups.atp"
    with _db(path) as db:
        db.add_groups("g", [[0, 1]], {"y": [1.0]})
        with pytest.raises(ValueError, match="properties"):
            db.add_groups("g", [[2]], {"z": [1.0]})
        with pytest.raises(ValueError, match="entries"):
            db.add_groups("h", [[0, 1]], roles=["a"])
    reader = atp.open(path)
    for bad in (1, -2, [0, 1]):
        with pytest.raises(IndexError):
            reader.groups["g"][bad]
    with pytest.raises(atp.ReadOnlyError, match="read-only"):
        reader.add_groups("g", [[0]], {"y": [1.0]})


def test_framed_writer_with_groups_equals_the_independent_encoder(tmp_path):
    # the whole file, byte for byte: upstream's layout (mod.rs, frames.rs, extensions.rs at
    # 90da9bd) as tests/groups_fixtures.py writes it from a 0.4.1 file's records
    from groups_fixtures import plain_file, write_framed

    plain = plain_file(tmp_path / "plain.atp", 5)
    rng = np.random.default_rng(0)  # plain_file's molecules again
    with atp.Writer(tmp_path / "ours.atp", compression="zstd", framed=True) as db:
        for i in range(5):
            k = i % 3 + 1
            db.add(rng.normal(size=(k, 3)).astype(np.float32), np.full(k, 6 + i % 3),
                   energy=float(i), forces=rng.normal(size=(k, 3)).astype(np.float32))
        db.add_metadata(99, b"from a newer version")
        db.add_groups("adsorption", [{"adslab": 1, "slab": 0}], {"e": [0.5]})
        db.add_groups("ordered", [[3, 1, 2]])
    reader = atp.open(tmp_path / "ours.atp")
    chunks = [encode_groups([("adsorption", reader.groups["adsorption"].grouping)]),
              encode_groups([("ordered", reader.groups["ordered"].grouping)])]
    write_framed(tmp_path / "want.atp", plain, chunks, extra=[(99, b"from a newer version")])
    assert (tmp_path / "ours.atp").read_bytes() == (tmp_path / "want.atp").read_bytes()


def _atompack_newer_than_041() -> bool:
    import importlib.metadata

    try:
        version = importlib.metadata.version("atompack-db")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit()) > (0, 4, 1)


@pytest.mark.skipif(not _atompack_newer_than_041(),
                    reason="atompack-db 0.4.1 has no groups (runs with a newer release)")
def test_differential_groups_against_atompack_db(tmp_path):  # pragma: no cover
    import atompack

    members = [{"adslab": 1, "slab": 0}, {"adslab": 2, "slab": 0, "gas": 3}]
    columns = {"e_ads": [-1.5, -0.25], "id": ["a", "b"], "n": np.array([2, 3])}
    theirs = tmp_path / "theirs.atp"
    db = atompack.Database(str(theirs), compression="zstd")
    for i in range(4):
        mol = atompack.Molecule(np.array([[float(i), 0.0, 0.0]], np.float32),
                                np.array([6], np.uint8))
        mol.energy = float(i)
        db.add_molecule(mol)
    db.add_groups("adsorption", members, columns)
    db.flush()
    ours = atp.open(theirs).groups["adsorption"]  # ours reads theirs
    assert ours[1].indices == {"adslab": 2, "slab": 0, "gas": 3}
    assert ours[1].properties == {"e_ads": -0.25, "id": "b", "n": 3}
    mine = tmp_path / "ours.atp"
    with _db(mine) as w:
        w.add_groups("adsorption", members, columns)
    groups = atompack.Database.open(str(mine)).groups["adsorption"]  # theirs reads ours
    assert groups[1].indices == {"adslab": 2, "slab": 0, "gas": 3}
    assert groups[1].properties == {"e_ads": -0.25, "id": "b", "n": 3}


def test_cli_info_lists_the_groupings(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "groups.atp"
    with _db(path) as db:
        db.add_groups("adsorption", [{"adslab": 1, "slab": 0}, {"adslab": 2, "slab": 0}],
                      {"e_ads": [-1.5, -0.25]})
        db.add_groups("ordered", [[3, 1, 2]])
    out = subprocess.run([sys.executable, "-m", "pyg_atompack.cli", "info", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "groupings:\n  adsorption: 2 groups, 4 members, roles adslab, slab; columns: " \
           "e_ads\n  ordered: 1 groups, 3 members, ordered; columns: none" in out
