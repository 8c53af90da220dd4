"""Framed `.atp` files (the revision after 0.4.1): reading, CRC checks, recovery, verify.

The files come from the independent encoder in ``atp_framed.py``, built from 0.4.1
files' record bytes the way the reference's ``frames.rs`` lays them out (commit
90da9bd35904a3625ab143eeb5cdd8d532a22c78): every codec, record format 3, an
unknown kind-99 frame, torn last frames, a bad CRC mid-file, files never
committed and files cut at every frame boundary.
"""

from __future__ import annotations

import importlib.metadata
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack import atp

sys.path.insert(0, str(Path(__file__).parent))
from atp_framed import (  # noqa: E402
    GOLDEN_CASES,
    GROUPS,
    Framed,
    boundaries,
    golden_bytes,
    source_of,
)

CODECS = ("none", "lz4", "zstd")
FRAMED_GOLDEN = Path(__file__).parent / "data" / "atp_framed"
ACCESS = ("mmap", "pread", "auto", "memory")


def _source_file(path: Path, codec: str, count: int = 12, f64: bool = False) -> Path:
    rng = np.random.default_rng(len(codec) + count)
    dtype = np.float64 if f64 else np.float32
    with atp.Writer(path, compression=codec) as w:
        for i in range(count):
            n = 2 + i % 4
            w.add(rng.random((n, 3)).astype(dtype), rng.integers(1, 90, n), energy=float(i),
                  forces=rng.random((n, 3)).astype(dtype),
                  properties={"tag": f"m{i}"}, atom_properties={"q": rng.random(n)})
    return path


def _framed(tmp_path: Path, codec: str, count: int = 12, f64: bool = False,
            meta: bool = True) -> tuple[Framed, Path]:
    src = _source_file(tmp_path / f"src_{codec}_{f64}.atp", codec, count, f64)
    items = [("schema",)] + [("record", i) for i in range(count // 2)]
    if meta:  # a frame "from a newer version" between the records
        items.append(("meta", 99, b"from a newer version"))
    items += [("record", i) for i in range(count // 2, count)]
    return Framed(source_of(src), items), src


def _open(path: Path, access: str) -> atp.Reader:
    if access == "memory":
        return atp.Reader.from_bytes(path.read_bytes(), name=str(path))
    return atp.Reader(path, access=access)


def _same(got: atp.Reader, want: atp.Reader) -> None:
    assert len(got) == len(want)
    everything = list(range(len(want)))
    a, b = got.read_batch(everything), want.read_batch(everything)
    for key in ("n_atoms", "positions", "atomic_numbers", "energy", "forces"):
        assert np.array_equal(a[key], b[key]), key
    assert [m.properties["tag"] for m in got] == [m.properties["tag"] for m in want]
    assert all(np.array_equal(g.atom_properties["q"], w.atom_properties["q"])
               for g, w in zip(got, want))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("access", ACCESS)
def test_committed_framed_file_reads_like_its_records(tmp_path, codec, access):
    framed, src = _framed(tmp_path, codec)
    path = tmp_path / "framed.atp"
    path.write_bytes(framed.committed())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a committed file is read without a word
        reader = _open(path, access)
        _same(reader, atp.Reader(src))
    assert reader.header.framed and not reader.header.writing
    assert [(f.kind, reader.read_metadata(f)) for f in reader.metadata_frames] == \
        [(99, b"from a newer version")]


def test_record_format_3_and_float64_positions(tmp_path):
    framed, src = _framed(tmp_path, "zstd", f64=True)
    path = tmp_path / "framed.atp"
    path.write_bytes(framed.committed())
    reader = atp.Reader(path)
    assert reader.record_format == 3 and reader.positions_dtype == np.float64
    _same(reader, atp.Reader(src))


def test_atompack_041_reads_the_committed_framed_file(tmp_path):
    # the framed revision keeps index and schema readable the 0.4.1 way
    from atp_oracle import assert_same_molecule, normalize_ours, read_atompack

    framed, src = _framed(tmp_path, "lz4")
    path = tmp_path / "framed.atp"
    path.write_bytes(framed.committed())
    want = [normalize_ours(m) for m in atp.Reader(src)]
    for i, (ours, theirs) in enumerate(zip(atp.Reader(path), read_atompack(path), strict=True)):
        assert_same_molecule(normalize_ours(ours), want[i], f"ours {i}")
        assert_same_molecule(theirs, want[i], f"atompack-db {i}")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("access", ("mmap", "pread", "memory"))
def test_a_flipped_payload_byte_fails_naming_file_and_record(tmp_path, codec, access):
    framed, _ = _framed(tmp_path, codec, meta=False)
    good = framed.committed()
    index = atp.Reader.from_bytes(good).index
    for i in range(len(index)):
        data = bytearray(good)
        data[int(index["offset"][i]) + int(index["stored"][i]) // 2] ^= 0x10
        path = tmp_path / f"flipped_{i}.atp"
        path.write_bytes(bytes(data))
        reader = _open(path, access)
        with pytest.raises(atp.FrameError, match=rf"{path}: record {i}: CRC-32 mismatch"):
            reader[i]
        with pytest.raises(atp.FrameError, match=rf"record {i}: CRC"):
            _open(path, access).read_batch([j for j in range(len(index)) if j != i] + [i])
        with pytest.raises(atp.FrameError, match=rf"record {i}: CRC"):
            _open(path, access).raw_record(i)
        other = (i + 1) % len(index)
        assert reader[other].energy == float(other)  # the others still read


def test_a_frame_header_that_disagrees_with_the_index_is_refused(tmp_path):
    framed, _ = _framed(tmp_path, "none", meta=False)
    data = bytearray(framed.committed())
    at = int(atp.Reader.from_bytes(bytes(data)).index["offset"][3]) - 20
    data[at + 12] += 1  # n_atoms in the frame header (the CRC is then wrong too)
    reader = atp.Reader.from_bytes(bytes(data), name="f.atp")
    with pytest.raises(atp.FrameError, match=r"f.atp: record 3: the frame header .* disagrees"):
        reader[3]


def test_remote_by_record_and_record_blocks_check_frames(tmp_path):
    from pyg_atompack.atp.images import block_span, complete_block, plan_blocks
    from pyg_atompack.remote.atp_meta import load_meta
    from pyg_atompack.remote.ranges import FileRangeReader
    from pyg_atompack.remote.record_reader import RemoteAtpReader

    framed, src = _framed(tmp_path, "zstd", count=40)
    path = tmp_path / "framed.atp"
    path.write_bytes(framed.committed())
    remote = RemoteAtpReader(FileRangeReader(path), cache_dir=tmp_path / "cache")
    want = atp.Reader(src)
    assert list(remote.read_batch([3, 39, 7, 3])["energy"]) == [3.0, 39.0, 7.0, 3.0]
    assert remote[25].properties["tag"] == want[25].properties["tag"]
    meta = load_meta(FileRangeReader(path), tmp_path / "cache")
    energies = []
    data = path.read_bytes()
    for first, stop in zip(*(lambda b: (b[:-1], b[1:]))(plan_blocks(meta, 700).tolist())):
        start, length, size = block_span(meta, first, stop)
        image = bytearray(size)
        image[8192:8192 + length] = data[start:start + length]
        complete_block(image, meta, first, stop)
        block = atp.Reader.from_bytes(image, copy=False)
        assert block.header.framed
        energies += block.read_batch(range(len(block)))["energy"].tolist()
    assert energies == [float(i) for i in range(40)]

    damaged = bytearray(data)
    damaged[int(meta.index["offset"][30]) + 3] ^= 1
    bad = tmp_path / "bad.atp"
    bad.write_bytes(bytes(damaged))
    remote = RemoteAtpReader(FileRangeReader(bad), cache_dir=tmp_path / "cache2")
    with pytest.raises(atp.FrameError, match=r"bad.atp: record 30: CRC-32"):
        remote.read_batch([2, 30])
    assert remote[29].energy == 29.0


def test_shard_stream_reads_framed_shards_whole_and_in_blocks(tmp_path):
    from pyg_atompack.remote.ranges import FileRangeReader
    from pyg_atompack.stream import LocalSource, ShardStreamDataset, SourceOptions

    shards = tmp_path / "shards"
    shards.mkdir()
    framed, _ = _framed(tmp_path, "lz4", count=30)
    for s in range(2):  # the same records twice: energies 0..29 in each shard
        (shards / f"part_{s}.atp").write_bytes(framed.committed())
    local = LocalSource(shards)

    class Ranged:
        def list_shards(self):
            return local.list_shards()

        def fetch(self, shard, cancel):
            return local.fetch(shard, cancel)

        def range_reader(self, shard):
            return FileRangeReader(shard.file.url)

    whole = ShardStreamDataset(local, options=SourceOptions(cache_dir=tmp_path / "c1"))
    blocks = ShardStreamDataset(Ranged(),
                                options=SourceOptions(block_bytes=1 << 10,
                                                      cache_dir=tmp_path / "c2"))
    assert blocks.blocks is not None
    for dataset in (whole, blocks):
        got = sorted(int(s.energy.item()) for s in dataset)
        assert got == sorted(list(range(30)) * 2)


# ---------------------------------------------------------------- the writing state
def _recovered(path: Path, access: str = "mmap") -> tuple[atp.Reader, str]:
    with pytest.warns(atp.RecoveredWriteWarning) as caught:
        reader = _open(path, access)
    assert len(caught) == 1
    return reader, str(caught[0].message)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("access", ACCESS)
def test_never_committed_file_is_recovered_with_a_warning(tmp_path, codec, access):
    framed, src = _framed(tmp_path, codec)
    path = tmp_path / "writing.atp"
    path.write_bytes(framed.writing())
    reader, message = _recovered(path, access)
    assert f"{path}: the file is in the writing state" in message
    assert "recovered 12 records" in message and "to the end of the file" in message
    _same(reader, atp.Reader(src))
    assert [f.kind for f in reader.metadata_frames] == [99]
    assert reader.header.writing and reader.schema is not None


def test_torn_last_frame_and_bad_crc_mid_file_end_the_recovery(tmp_path):
    framed, src = _framed(tmp_path, "none", meta=False)
    full = framed.writing()
    path = tmp_path / "torn.atp"
    path.write_bytes(full[:-3])  # the last frame is cut short
    reader, message = _recovered(path)
    assert len(reader) == 11 and "recovered 11 records" in message
    assert "incomplete frame" in message
    # flip one payload byte of the 4th record: its checksum fails, the scan stops there
    offset = int(reader.index["offset"][3])
    data = bytearray(full)
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    reader, message = _recovered(path)
    assert [m.energy for m in reader] == [0.0, 1.0, 2.0]
    assert f"found a frame at byte {offset - 20} that fails its CRC-32" in message


def test_cut_at_every_frame_boundary(tmp_path):
    framed, src = _framed(tmp_path, "zstd")
    want = atp.Reader(src)
    full = framed.writing()
    kinds = [item[0] if item[0] != "meta" else item[1] for item in framed.items]
    path = tmp_path / "cut.atp"
    for k, end in enumerate(boundaries(framed)):
        for cut in (end, end + 7):  # whole frames, or whole frames and a torn next one
            path.write_bytes(full[:cut])
            reader, message = _recovered(path)
            expected = kinds[:k + 1].count("record")
            assert len(reader) == expected, (k, cut)
            assert f"recovered {expected} records" in message
            for i in range(expected):
                assert reader[i].energy == want[i].energy
            assert [f.kind for f in reader.metadata_frames] == \
                ([99] if 99 in kinds[:k + 1] else [])


def test_every_groups_frame_is_kept_in_a_recovery(tmp_path):
    # each add_groups call is one groups frame (a chunk) and a grouping is its chunks in
    # file order (extensions.rs at 90da9bd): a recovery keeps them all
    framed, _ = _framed(tmp_path, "none", meta=False)
    framed.items += [("meta", GROUPS, b"old"), ("meta", 99, b"x"), ("meta", GROUPS, b"new")]
    path = tmp_path / "w.atp"
    path.write_bytes(framed.writing())
    reader, _ = _recovered(path)
    assert [(f.kind, reader.read_metadata(f)) for f in reader.metadata_frames] == \
        [(GROUPS, b"old"), (99, b"x"), (GROUPS, b"new")]


def test_remote_readers_refuse_the_writing_state_naming_the_file(tmp_path):
    from pyg_atompack.remote.ranges import FileRangeReader
    from pyg_atompack.remote.record_reader import RemoteAtpReader

    framed, _ = _framed(tmp_path, "none")
    path = tmp_path / "w.atp"
    path.write_bytes(framed.writing())
    remote = RemoteAtpReader(FileRangeReader(path), cache_dir=tmp_path / "cache")
    with pytest.raises(atp.HeaderError, match=rf"{path}: the file is in the writing state"):
        len(remote)


def test_unknown_header_flags_are_refused(tmp_path):
    from atp_framed import slot

    framed, _ = _framed(tmp_path, "none")
    data = framed.committed()
    bad = slot(9, flags=1 | 8) * 2 + data[8192:]
    with pytest.raises(atp.HeaderError, match="unknown header flags 0x9"):
        atp.Reader.from_bytes(bad, name="f.atp")


@pytest.mark.skipif(
    tuple(int(p) for p in importlib.metadata.version("atompack-db").split(".")[:3])
    <= (0, 4, 1), reason="atompack-db 0.4.1 writes no framed files")
def test_differential_against_a_framed_atompack_db(tmp_path):  # pragma: no cover
    import atompack
    from atp_oracle import normalize_ours, read_atompack

    path = tmp_path / "theirs.atp"
    db = atompack.Database(str(path), overwrite=True)
    rng = np.random.default_rng(1)
    for i in range(20):
        mol = atompack.Molecule(rng.random((3, 3)).astype(np.float32), np.array([1, 6, 8],
                                                                                np.uint8))
        mol.energy = float(i)
        db.add_molecule(mol)
    db.flush()
    reader = atp.Reader(path)
    assert reader.header.framed
    assert [normalize_ours(m)["energy"] for m in reader] == \
        [m["energy"] for m in read_atompack(path)]
    assert atp.verify(path) == []
    # and the other way: our framed writes (committed, then in the writing state)
    ours = tmp_path / "ours.atp"
    with atp.Writer(ours, compression="zstd", framed=True) as w:
        for m in reader:
            w.add(m.positions, m.atomic_numbers, energy=m.energy)
    assert [m["energy"] for m in read_atompack(ours)] == [float(i) for i in range(20)]
    w = atp.Writer.append_to(ours)
    w.add(np.zeros((1, 3), np.float32), [1], energy=20.0)
    w.close()  # a crash: their open recovers the frames
    assert [m["energy"] for m in read_atompack(ours)] == [float(i) for i in range(21)]


# ---------------------------------------------------------------- verify
def test_verify_passes_a_good_framed_file_and_names_a_damaged_record(tmp_path):
    framed, _ = _framed(tmp_path, "zstd")
    good = tmp_path / "good.atp"
    good.write_bytes(framed.committed())
    assert atp.verify(good) == []
    facts = atp.describe(good)
    assert facts["framed"] and not facts["writing"] and facts["stale_bytes"] == 0
    assert facts["metadata_frames"][0]["kind"] == 99
    assert sorted(slot["writing"] for slot in facts["slots"]) == [False, True]

    data = bytearray(framed.committed())
    offset = int(atp.Reader(good).index["offset"][5])
    data[offset + 1] ^= 0x01
    bad = tmp_path / "bad.atp"
    bad.write_bytes(bytes(data))
    problems = atp.verify(bad)
    assert len(problems) == 1 and problems[0].startswith(f"{bad}: record 5: CRC-32 mismatch")

    data = bytearray(framed.committed())
    meta = atp.Reader(good).metadata_frames[0]
    data[meta.offset] ^= 0x01
    bad.write_bytes(bytes(data))
    assert atp.verify(bad) == [
        f"{bad}: metadata frame of kind 99 at byte {meta.offset}: CRC-32 mismatch "
        f"(frame says {problem_crc(framed)}, the bytes give "
        f"{atp_crc(bytes(data), meta.offset, meta.length)}): the payload is damaged"]


def problem_crc(framed: Framed) -> str:
    import struct

    data = framed.committed()
    meta = atp.Reader.from_bytes(data).metadata_frames[0]
    return f"{struct.unpack_from('<I', data, meta.offset - 4)[0]:#010x}"


def atp_crc(data: bytes, offset: int, length: int) -> str:
    import zlib

    return f"{zlib.crc32(data[offset - 20:offset - 4] + data[offset:offset + length]):#010x}"


def test_verify_names_a_file_in_the_writing_state(tmp_path):
    framed, _ = _framed(tmp_path, "lz4")
    path = tmp_path / "writing.atp"
    path.write_bytes(framed.writing()[:-5])
    problems = atp.verify(path)
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: in the writing state")
    assert "11 records recovered" in problems[0] and "incomplete frame" in problems[0]


def test_cli_verify_understands_frames(tmp_path):
    import subprocess

    framed, _ = _framed(tmp_path, "none")
    good = tmp_path / "good.atp"
    good.write_bytes(framed.committed())
    data = bytearray(framed.committed())
    data[int(atp.Reader(good).index["offset"][2]) + 4] ^= 0x40
    bad = tmp_path / "bad.atp"
    bad.write_bytes(bytes(data))

    def run(path):
        return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", "verify", str(path)],
                              capture_output=True, text=True, timeout=300)

    ok = run(good)
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    failed = run(bad)
    assert failed.returncode != 0
    assert f"{bad}: record 2: CRC-32 mismatch" in failed.stdout + failed.stderr


# ---------------------------------------------------------------- golden framed files
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_framed_golden_files(golden_dir, name):
    from atp_oracle import assert_same_molecule, normalize_ours, read_atompack

    path = FRAMED_GOLDEN / name
    assert path.read_bytes() == golden_bytes(golden_dir, name)  # encoder unchanged
    source = atp.Reader(golden_dir / GOLDEN_CASES[name][0])
    committed = GOLDEN_CASES[name][1] == "committed"
    want = [normalize_ours(m) for m in source][:len(source) - (0 if committed else 1)]
    for access in ACCESS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reader = _open(path, access)
        recovered = [w for w in caught if issubclass(w.category, atp.RecoveredWriteWarning)]
        assert len(recovered) == (0 if committed else 1)
        assert len(reader) == len(want)
        for i, mol in enumerate(reader):
            assert_same_molecule(normalize_ours(mol), want[i], f"{name} {access} {i}")
        batch = reader.read_batch(range(len(reader)))
        assert np.array_equal(batch["positions"],
                              source.read_batch(range(len(want)))["positions"])
        assert [(f.kind, reader.read_metadata(f)) for f in reader.metadata_frames] == \
            [(99, b"a frame from a newer version")]
    problems = atp.verify(path)
    facts = atp.describe(path)
    if committed:
        assert problems == [] and not facts["writing"]
        for i, theirs in enumerate(read_atompack(path)):  # atompack-db 0.4.1 reads it too
            assert_same_molecule(theirs, want[i], f"atompack-db {name} {i}")
    else:
        assert len(problems) == 1 and "in the writing state" in problems[0]
        assert facts["writing"] and facts["recovered"]["records"] == len(want)
        assert "incomplete frame" in facts["recovered"]["stopped_at"]
