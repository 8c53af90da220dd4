"""Groups in framed files read by ``atp.Reader``: recovery, damage, files without groups.

Files come from ``groups_fixtures.write_framed``, an encoder independent of the package
that lays files out as upstream's writer does (90da9bd).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from groups_fixtures import plain_file, write_framed

from pyg_atompack import atp
from pyg_atompack.atp.groups import Grouping, GroupsError, encode_groups

PAIRS = Grouping(offsets=np.array([0, 2]), records=np.array([0, 4]))


@pytest.fixture
def source(tmp_path):
    return plain_file(tmp_path / "plain.atp", 5)


def test_groups_and_unknown_frames_in_a_committed_file(tmp_path, source):
    path = tmp_path / "f.atp"
    write_framed(path, source, [encode_groups([("pairs", PAIRS)])],
                 extra=[(99, b"from a newer version")])
    for access in ("mmap", "pread"):
        with atp.open(path, access=access) as reader:
            assert [f.kind for f in reader.metadata_frames] == [99, 3]
            assert reader.groups["pairs"].grouping == PAIRS
            assert [m.energy for m in reader.groups["pairs"][0]] == [0.0, 4.0]
    image = atp.Reader.from_bytes(path.read_bytes(), name="image.atp")
    assert image.groups["pairs"][0].indices == [0, 4]


def test_groups_survive_a_crash_before_the_flush(tmp_path, source):
    path = tmp_path / "crashed.atp"
    write_framed(path, source, [encode_groups([("pairs", PAIRS)])], commit=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reader = atp.open(path)
        assert len(reader) == 5
    assert any(issubclass(w.category, atp.RecoveredWriteWarning) for w in caught)
    assert reader.groups["pairs"].grouping == PAIRS


def test_damaged_groups_are_named(tmp_path, source):
    path = tmp_path / "flipped.atp"
    payload = encode_groups([("pairs", PAIRS)])
    write_framed(path, source, [payload])
    data = bytearray(path.read_bytes())
    at = bytes(data).index(payload)
    data[at + len(payload) - 1] ^= 0xFF  # the last record index: the frame's CRC fails
    path.write_bytes(bytes(data))
    with pytest.raises(atp.FrameError, match=r"flipped\.atp: metadata frame of kind 3.*CRC"):
        _ = atp.open(path).groups
    # a well-formed frame whose groups point past the file's records
    path = tmp_path / "range.atp"
    wide = Grouping(offsets=np.array([0, 2]), records=np.array([0, 9]))
    write_framed(path, source, [encode_groups([("pairs", wide)])])
    with pytest.raises(GroupsError, match=r"range\.atp: groups frame at byte \d+: grouping "
                       r"'pairs': group 0: member record 9 is out of range \(the file has 5"):
        _ = atp.open(path).groups


def test_files_without_groups(tmp_path, source):
    for path in (source, tmp_path / "framed.atp"):
        if path != source:
            write_framed(path, source, [])
        groups = atp.open(path).groups
        assert len(groups) == 0 and list(groups) == []
        with pytest.raises(KeyError, match="no grouping named 'missing'"):
            groups["missing"]


def test_verify_names_groups_that_do_not_fit_the_records(tmp_path, source):
    good = tmp_path / "good.atp"
    write_framed(good, source, [encode_groups([("pairs", PAIRS)])])
    assert atp.verify(good) == []
    bad = tmp_path / "bad.atp"
    wide = Grouping(offsets=np.array([0, 2]), records=np.array([0, 9]))
    write_framed(bad, source, [encode_groups([("pairs", wide)])])
    (problem,) = atp.verify(bad)
    assert problem.startswith(f"{bad}: groups frame at byte ") and "record 9" in problem
