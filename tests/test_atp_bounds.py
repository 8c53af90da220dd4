"""Compressed `.atp` records that declare more than they can hold (issue #33, item 3).

The reported input: an 11 KB zstd file whose index declares a 90 MiB record, its
stored bytes a real zstd frame of zeros (zstd expands up to 32768x, so the codec's own
limit allows it). On ``main`` a read allocated and filled the 90 MiB before the record
was found damaged. The declared size is now checked against what a record of its atom
count can hold under the file's schema before anything is allocated, through every
access path, ``reader[i]`` and ``read_batch`` alike; honest records above the one-shot
limit are decompressed in chunks and read back unchanged.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import lz4.block
import numpy as np
import pytest
import zstandard
from test_cli import run

from pyg_atompack import atp
from pyg_atompack.atp.cache import record_bound
from pyg_atompack.atp.codecs import STREAM_ABOVE, VARIABLE_FLOOR, RecordBound

CLAIM = 90 << 20


def write(path: Path, codec: str, count: int = 40, atoms: int = 3, name: bool = True,
          ) -> Path:
    rng = np.random.default_rng(0)
    with atp.Writer(path, compression=codec) as writer:
        for i in range(count):
            extra = {"name": f"m{i}"} if name else {}
            writer.add(rng.normal(size=(atoms, 3)).astype(np.float32),
                       np.full(atoms, 6, np.uint8), energy=float(i),
                       forces=rng.normal(size=(atoms, 3)).astype(np.float32), **extra)
    return path


def claim(path: Path, record: int, stored: bytes, raw: int, n_atoms: int | None = None,
          ) -> None:
    """Point index entry ``record`` at ``stored`` (appended) with these claims."""
    data = bytearray(path.read_bytes())
    with atp.Reader(path, access="pread") as reader:
        index_offset = reader.header.index_offset
        original_n = int(reader.index[record]["n_atoms"])
    at = index_offset + 8 + 20 * record
    struct.pack_into("<QIII", data, at, len(data), len(stored), raw,
                     original_n if n_atoms is None else n_atoms)
    path.write_bytes(bytes(data) + stored)


def zeros_frame(size: int, content_size: bool) -> bytes:
    compressor = zstandard.ZstdCompressor(level=19, write_content_size=content_size)
    return compressor.compress(bytes(size))


@pytest.fixture()
def reported(tmp_path: Path) -> Path:
    path = write(tmp_path / "small.atp", "zstd", count=10)
    claim(path, 7, zeros_frame(CLAIM, content_size=False), CLAIM)
    return path


def _peak(action) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("access", ["mmap", "pread", "bytes"])
def test_reported_file_is_refused_before_allocating(reported: Path, access: str) -> None:
    assert reported.stat().st_size < 16 * 1024  # the report: 11 KB
    reader = (atp.Reader.from_bytes(reported.read_bytes(), name=reported.name)
              if access == "bytes" else atp.open(reported, access=access))
    with reader:
        assert reader[6].energy == 6.0

        def single() -> None:
            with pytest.raises(atp.AtpError, match=rf"record 7: declares {CLAIM} "
                                                   rf"uncompressed bytes, more than a "
                                                   rf"record of 3 atoms can hold"):
                reader[7]

        def batch() -> None:
            with pytest.raises(atp.AtpError, match="record 7: declares"):
                reader.read_batch([5, 6, 7])

        assert _peak(single) < 1 << 20  # main: 90 MiB
        assert _peak(batch) < 1 << 20


def test_atom_count_claim_stops_after_the_first_kilobytes(tmp_path: Path) -> None:
    """With the index also claiming 8M atoms, the bound allows the size; the frame's
    first bytes state 0 atoms, so decompression stops there."""
    path = write(tmp_path / "atoms.atp", "zstd")
    claim(path, 3, zeros_frame(CLAIM, content_size=True), CLAIM, n_atoms=8 << 20)
    with atp.open(path) as reader:
        def read() -> None:
            with pytest.raises(atp.AtpError, match="record holds 0 atoms but the index "
                                                   "says 8388608"):
                reader[3]
        assert _peak(read) < 1 << 20


def test_frame_longer_than_declared_is_cut_at_the_declared_size(tmp_path: Path) -> None:
    path = write(tmp_path / "long.atp", "zstd")
    with atp.open(path) as reader:
        honest = reader.raw_record(2)
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(
        honest + bytes(64 << 20))
    claim(path, 2, frame, 2 * STREAM_ABOVE)
    with atp.open(path) as reader:
        def read() -> None:
            with pytest.raises(atp.AtpError, match="record 2"):
                reader[2]
        assert _peak(read) < 4 * STREAM_ABOVE  # not the 64 MiB the frame holds


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_honest_large_records_read_back(tmp_path: Path, codec: str) -> None:
    """Records above the one-shot limit (zstd: decompressed in chunks) are unchanged."""
    path = write(tmp_path / "large.atp", codec, count=3, atoms=120_000)
    with atp.open(path) as reader:
        assert int(reader.index[0]["raw"]) > STREAM_ABOVE
        batch = reader.read_batch([0, 1, 2])
        for i in range(3):
            mol = reader[i]
            assert mol.n_atoms == 120_000 and mol.energy == float(i)
        np.testing.assert_array_equal(batch["positions"][:120_000], reader[0].positions)


def test_bound_is_exact_for_a_fixed_schema(tmp_path: Path) -> None:
    """Without strings or tensors the bound is the record's size: nothing to spare."""
    path = write(tmp_path / "fixed.atp", "zstd", name=False)
    with atp.open(path, access="pread") as reader:
        st = reader._state()
        bound = record_bound(st)
        assert not bound.variable
        for entry in reader.index:
            assert bound(int(entry["n_atoms"]), int(entry["stored"])) == int(entry["raw"])
    path = write(tmp_path / "named.atp", "zstd")
    with atp.open(path, access="pread") as reader:
        bound = record_bound(reader._state())
        entry = reader.index[0]
        assert bound.variable
        assert bound(3, int(entry["stored"])) >= VARIABLE_FLOOR + int(entry["raw"]) - 64


def test_lz4_claim_beyond_the_bound(tmp_path: Path) -> None:
    path = write(tmp_path / "lz4.atp", "lz4", name=False)
    stored = lz4.block.compress(bytes(1 << 20), store_size=False)
    claim(path, 1, stored, 1 << 20)
    with atp.open(path) as reader, pytest.raises(atp.AtpError, match="record 1: declares"):
        reader[1]


def test_schemaless_files_are_bounded_with_every_builtin_at_its_widest() -> None:
    bound = RecordBound(None, 4)
    assert bound.variable
    assert bound(3, 100) == bound.fixed + 3 * (13 + 56) + VARIABLE_FLOOR + 64 * 100


@pytest.mark.parametrize("command", ["convert", "head", "verify"])
def test_cli(reported: Path, tmp_path: Path, command: str) -> None:
    """convert and head exit 2 with one line; verify reports the record (exit 1, its
    documented code for a damaged .atp) naming it, without a traceback."""
    extra = [tmp_path / "out.atp"] if command == "convert" else []
    result = run(command, reported, *(["-n", "10"] if command == "head" else []), *extra)
    text = result.stdout + result.stderr
    assert "Traceback" not in text
    assert "record 7: declares" in text, text
    if command == "verify":
        assert result.returncode == 1
    else:
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("pyg-atompack: error: "), lines
    assert not (tmp_path / "out.atp").exists()


def test_lz4_atom_count_claim_stops_before_allocating(tmp_path: Path) -> None:
    path = write(tmp_path / "lz4.atp", "lz4", name=False)
    zeros = 20 << 20
    claim(path, 3, lz4.block.compress(bytes(zeros), store_size=False), zeros, n_atoms=8 << 20)
    with atp.open(path) as reader:
        def read() -> None:
            with pytest.raises(atp.AtpError, match="record holds 0 atoms but the index "
                                                   "says 8388608"):
                reader[3]
        assert _peak(read) < 1 << 20


@pytest.mark.parametrize("data", [struct.pack("<I", 7) + bytes(5000), bytes(range(256)) * 9,
                                  b"abcd" * 300, struct.pack("<I", 123456) + b"xyz"])
@pytest.mark.parametrize("mode", ["default", "high_compression"])
def test_lz4_head_matches_the_block(data: bytes, mode: str) -> None:
    from pyg_atompack.atp.codecs import _lz4_head

    assert _lz4_head(lz4.block.compress(data, store_size=False, mode=mode), 4) == data[:4]
