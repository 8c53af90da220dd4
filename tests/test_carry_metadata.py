"""Metadata frames (groups, kinds of newer versions) carried through `.atp` -> `.atp`
conversion, sharding, merging shards into one file, and ``--part I/N`` + merge.

Sources are real files written by ``atp.Writer`` (``add_groups`` / ``add_metadata``, both
layouts) and by the independent test encoder (``tests/atp_framed.py``).
"""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
from atp_framed import Framed, source_of

from pyg_atompack import atp
from pyg_atompack.atp.groups import merge_chunks
from pyg_atompack.cli import main
from pyg_atompack.convert import ConversionNote, ConvertError, WriteOptions, convert
from pyg_atompack.convert.parallel import Part
from pyg_atompack.convert.pipeline import reencode

N = 12
NEWER = b"a frame from a newer version \x00\xff"


def _records(db: atp.Writer, n: int = N) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        k = 2 + i % 3
        db.add(rng.normal(size=(k, 3)), np.full(k, 1 + i % 5, np.uint8), energy=float(i),
               properties={"step": i})


def _groups(db: atp.Writer, offset: int = 0) -> None:
    """Groups inside records 0-3, 4-7, 8-11 (a shard size of 4 never splits them)."""
    o = offset
    db.add_groups("adsorption", [{"adslab": o + 1, "slab": o + 0},
                                 {"adslab": o + 2, "slab": o + 0, "gas": o + 3},
                                 {"adslab": o + 5, "slab": o + 4},
                                 {"adslab": o + 9, "slab": o + 8, "gas": o + 10}],
                  {"y": [0.5, 1.5, 2.5, 3.5], "n": [1, 2, 3, 4], "tag": ["a", "b", "c", "d"]})
    db.add_metadata(99, NEWER)
    db.add_groups("adsorption", [{"adslab": o + 6, "slab": o + 4}],
                  {"y": [4.5], "n": [5], "tag": ["e"]})
    db.add_groups("ordered", [[o + 3, o + 1, o + 2], [o + 7, o + 6], [o + 11]])


def _source(path, framed: bool, compression: str = "zstd"):
    db = atp.Writer(path, compression=compression, framed=framed)
    _records(db)
    _groups(db)
    db.flush()
    db.close()
    return path


def _groupings(path) -> dict:
    """Every grouping of a file or shard directory, records in the whole's numbering."""
    with atp.open(path) as reader:
        merged, start = {}, 0
        for shard in getattr(reader, "shards", None) or [reader]:
            payloads = [(f"{shard.path}", shard.read_metadata(f))
                        for f in shard.metadata_frames if f.kind == 3]
            merged = merge_chunks(payloads, len(shard), start, merged)
            start += len(shard)
        return merged


def _members(groupings: dict) -> dict:
    """Order-free view: grouping -> sorted [(members with roles, column values)]."""
    out = {}
    for name, g in groupings.items():
        rows = []
        for i in range(len(g)):
            lo, hi = g.offsets[i], g.offsets[i + 1]
            roles = [g.roles[r] for r in g.member_roles[lo:hi]] if g.roles else list(range(hi - lo))
            rows.append((sorted(zip(map(str, roles), g.records[lo:hi].tolist())),
                         [g.properties[k][i] for k in g.properties]))
        out[name] = sorted(rows, key=repr)
    return out


def _others(path) -> list[list[bytes]]:
    """Payloads of frames of kinds other than groups, per file."""
    with atp.open(path) as reader:
        return [[bytes(s.read_metadata(f)) for f in s.metadata_frames if f.kind != 3]
                for s in getattr(reader, "shards", None) or [reader]]


def _framed_flags(path) -> list[bool]:
    with atp.open(path) as reader:
        return [s.header.framed for s in getattr(reader, "shards", None) or [reader]]


def _same_records(a, b) -> None:
    with atp.open(a) as ra, atp.open(b) as rb:
        assert len(ra) == len(rb)
        for i in range(len(ra)):
            assert np.array_equal(ra[i].positions, rb[i].positions)
            assert ra[i].energy == rb[i].energy


@pytest.mark.parametrize("framed", [True, False])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_atp_to_atp_keeps_groups_and_unknown_frames(tmp_path, framed, compression):
    src = _source(tmp_path / "src.atp", framed)
    out = tmp_path / "out.atp"
    assert convert(src, out, write_options=WriteOptions(compression=compression)) == N
    _same_records(src, out)
    assert _groupings(out) == _groupings(src)  # same order, chunk for chunk
    assert _others(out) == [[NEWER]]
    assert _framed_flags(out) == [framed]  # the layout follows the source
    with atp.open(out) as a, atp.open(src) as b:  # chunks carried byte for byte
        assert [bytes(a.read_metadata(f)) for f in a.metadata_frames] == \
            [bytes(b.read_metadata(f)) for f in b.metadata_frames]
        assert a.groups["adsorption"][3]["gas"].energy == 10.0


@pytest.mark.parametrize("state", ["committed", "writing"])
def test_cli_convert_and_independent_encoder(tmp_path, state):
    plain = tmp_path / "plain.atp"
    db = atp.Writer(plain)
    _records(db, 4)
    db.flush()
    db.close()
    # a groups chunk spelled out with struct: ordered groups [[2, 0], [3]], one int column
    chunk = struct.pack("<II", 1, 1) + struct.pack("<I", 5) + b"pairs" + struct.pack("<I", 0) \
        + struct.pack("<QQ", 2, 3) + struct.pack("<3Q", 0, 2, 3) + struct.pack("<3Q", 2, 0, 3) \
        + struct.pack("<I", 1) + struct.pack("<I", 1) + b"k" + bytes((1,)) \
        + struct.pack("<2q", -7, 8)
    source = source_of(plain)
    items = [("schema",), ("record", 0), ("record", 1), ("meta", 99, NEWER),
             ("record", 2), ("meta", 3, chunk), ("record", 3), ("meta", 1234, b"")]
    src = tmp_path / "encoded.atp"
    framed = Framed(source, items)
    # "writing": a crash before the commit; the reader recovers every frame (with a warning)
    src.write_bytes(framed.committed() if state == "committed" else framed.writing())
    out = tmp_path / "copy.atp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", atp.RecoveredWriteWarning)
        assert main(["convert", str(src), str(out), "-q"]) == 0
    assert main(["verify", str(out), "-q"]) == 0
    with atp.open(out) as reader:
        assert reader.header.framed
        assert [(f.kind, bytes(reader.read_metadata(f))) for f in reader.metadata_frames] == \
            [(99, NEWER), (3, chunk), (1234, b"")]
        pairs = reader.groups["pairs"]
        assert [list(map(int, g.indices)) for g in pairs] == [[2, 0], [3]]
        assert pairs.properties["k"].tolist() == [-7, 8]


def test_shards_renumber_groups_and_copy_unknown_frames(tmp_path):
    src = _source(tmp_path / "src.atp", framed=True)
    out = tmp_path / "shards"
    with pytest.warns(ConversionNote, match=r"src\.atp.*copied unchanged into every shard"):
        convert(src, out, write_options=WriteOptions(shard_size=4))
    _same_records(src, out)
    assert main(["verify", str(out), "-q"]) == 0
    assert _members(_groupings(out)) == _members(_groupings(src))
    assert _others(out) == [[NEWER]] * 3
    with atp.open(out) as reader:  # the sharded reader serves them in the whole's numbering
        group = reader.groups["adsorption"][3]  # the second chunk's group, in shard 1
        assert list(map(int, group.indices.values())) == [6, 4]
        assert group["adslab"].energy == 6.0 and group.properties["tag"] == "e"
    assert _framed_flags(out) == [True] * 3
    with atp.open(out / "shard_00001.atp") as shard:  # records 4..7, renumbered from 0
        g = merge_chunks([("s", shard.read_metadata(f)) for f in shard.metadata_frames
                          if f.kind == 3], len(shard))
        assert g["adsorption"].records.tolist() == [1, 0, 2, 0]
        assert g["ordered"].records.tolist() == [3, 2]
        assert g["adsorption"].properties["tag"] == ["c", "e"]


def test_group_across_shards_is_refused_naming_the_file(tmp_path):
    src = _source(tmp_path / "src.atp", framed=False)
    out = tmp_path / "shards"
    with pytest.raises(ConvertError, match=r"src\.atp.*group 1 of grouping 'adsorption'.*"
                                           r"source record 3 .*records 3\.\.5"):
        convert(src, out, write_options=WriteOptions(shard_size=3))
    assert not out.exists()


def test_damaged_groups_frame_names_the_file(tmp_path):
    src = tmp_path / "bad.atp"
    db = atp.Writer(src, framed=True)
    _records(db, 2)
    db.add_metadata(3, struct.pack("<II", 1, 1) + b"\xff" * 3)
    db.flush()
    db.close()
    with pytest.raises(ConvertError, match=r"bad\.atp: groups frame: truncated") as info:
        convert(src, tmp_path / "out.atp")
    assert str(info.value).count("bad.atp") == 1
    assert not (tmp_path / "out.atp").exists()


def test_damaged_unknown_frame_names_the_file(tmp_path):
    src = _source(tmp_path / "src.atp", framed=True)
    with atp.open(src) as reader:
        at = next(f for f in reader.metadata_frames if f.kind == 99).offset
    data = bytearray(src.read_bytes())
    data[at] ^= 1
    src.write_bytes(data)
    with pytest.raises(ConvertError, match=r"src\.atp: metadata frame of kind 99 at byte "
                                           rf"{at}: CRC-32 mismatch"):
        convert(src, tmp_path / "out", write_options=WriteOptions(shard_size=4))
    assert not (tmp_path / "out").exists()


def test_shards_merged_into_one_file_shift_groups(tmp_path):
    shards = tmp_path / "in"
    shards.mkdir()
    for k, framed in enumerate([True, False]):
        db = atp.Writer(shards / f"shard_{k:05d}.atp", framed=framed)
        _records(db)
        _groups(db)
        db.flush()
    db.close()
    out = tmp_path / "all.atp"
    convert(shards, out)
    whole = _groupings(out)
    assert whole == _groupings(shards)  # the second shard's records moved by 12
    assert whole["ordered"].records.tolist()[-3:] == [12 + 7, 12 + 6, 12 + 11]
    assert _others(out) == [[NEWER, NEWER]]  # each input's, in input order
    assert _framed_flags(out) == [True]  # framed: one input was


def test_parts_and_merge_equal_one_conversion(tmp_path):
    src = _source(tmp_path / "src.atp", framed=True)
    whole = tmp_path / "whole"
    options = WriteOptions(shard_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionNote)
        convert(src, whole, write_options=options)
        parts = [tmp_path / f"part{i}" for i in range(2)]
        convert(src, parts[0], write_options=options, part=Part(0, 2))
        # the other part as a cluster job runs it: the command line, two reading processes
        assert main(["convert", str(src), str(parts[1]), "--shard-size", "4", "--part", "1/2",
                     "--workers", "2", "-q"]) == 0
    merged = tmp_path / "merged"
    assert main(["merge", str(merged), *map(str, parts), "-q"]) == 0
    for k in range(3):
        name = f"shard_{k:05d}.atp"
        assert (merged / name).read_bytes() == (whole / name).read_bytes()
    assert _members(_groupings(merged)) == _members(_groupings(src))
    # re-encoding a part (what merge does for narrower key types) keeps the frames
    again = tmp_path / "again"
    reencode(parts[1], again, "atp-shards", WriteOptions(shard_size=4, first_shard=2), {})
    assert _groupings(again) == _groupings(parts[1])
    assert _others(again) == _others(parts[1])


def test_part_with_a_group_across_parts_is_refused(tmp_path):
    src = tmp_path / "src.atp"
    db = atp.Writer(src, framed=True)
    _records(db, 8)
    db.add_groups("pair", [[1, 6]])
    db.flush()
    db.close()
    with pytest.raises(ConvertError, match=r"src\.atp.*source record 6 \(in another "
                                           r"part"):
        convert(src, tmp_path / "p0", write_options=WriteOptions(shard_size=4),
                part=Part(0, 2))


def test_formats_without_metadata_say_what_is_left_out(tmp_path, capsys):
    src = _source(tmp_path / "src.atp", framed=True)
    assert main(["shard", str(src), str(tmp_path / "pt"), "--shard-size", "5", "-q"]) == 0
    assert "src.atp: its metadata frames (groups, kind 99) are not written to " \
        f"{tmp_path / 'pt'}: pt-shards has no place for them" in capsys.readouterr().err


@pytest.mark.parametrize("framed", [True, False])
def test_no_metadata_frames_no_change(tmp_path, framed):
    src = tmp_path / "src.atp"
    db = atp.Writer(src, framed=framed)
    _records(db)
    db.flush()
    db.close()
    out, direct = tmp_path / "out.atp", tmp_path / "direct.atp"
    convert(src, out)
    db = atp.Writer(direct)  # what a conversion wrote before metadata was carried
    with atp.open(src) as reader:
        for i in range(len(reader)):
            m = reader[i]
            db.add(m.positions, m.atomic_numbers, energy=m.energy, properties=m.properties)
    db.flush()
    db.close()
    assert out.read_bytes() == direct.read_bytes()


def test_parallel_reading_keeps_the_frames(tmp_path):
    src = _source(tmp_path / "src.atp", framed=False, compression="none")
    one, two = tmp_path / "one.atp", tmp_path / "two.atp"
    convert(src, one)
    convert(src, two, workers=2)
    assert two.read_bytes() == one.read_bytes()
    assert _groupings(two) == _groupings(src) and _others(two) == [[NEWER]]
    assert _framed_flags(two) == [False]  # a 0.4.1 file with a directory stays one


def test_resharding_a_directory_moves_groups_between_files(tmp_path):
    shards = tmp_path / "in"
    shards.mkdir()
    for k in range(2):  # records 0..11 and 12..23
        db = atp.Writer(shards / f"shard_{k:05d}.atp", framed=True)
        _records(db)
        _groups(db)
        db.flush()
        db.close()
    out = tmp_path / "out"
    with pytest.warns(ConversionNote, match="copied unchanged"):
        convert(shards, out, write_options=WriteOptions(shard_size=8))
    assert _members(_groupings(out)) == _members(_groupings(shards))
    # the middle shard (source records 8..15) takes the tail of one input and the head of
    # the other, and a copy of each input's kind-99 frame, in input order
    assert _others(out) == [[NEWER], [NEWER, NEWER], [NEWER]]
    with atp.open(out / "shard_00001.atp") as shard:
        g = merge_chunks([("s", shard.read_metadata(f)) for f in shard.metadata_frames
                          if f.kind == 3], len(shard))
        assert g["ordered"].records.tolist() == [3, 7, 5, 6]  # [11] then [15, 13, 14]
        assert g["adsorption"].properties["tag"] == ["d", "a", "b"]
