"""Reader behaviour: pickling, fork safety, indices, fields=, masks, from_bytes, bad files."""

from __future__ import annotations

import multiprocessing
import pickle
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from pyg_atompack import atp


@pytest.fixture
def mixed_file(tmp_path):
    """Five molecules with different sizes and sparse fields (heterogeneous layouts)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "mixed.atp"
    with atp.Writer(path) as w:
        for j, n in enumerate((2, 3, 2, 0, 4)):
            kwargs = {"energy": float(j)}
            if j % 2 == 0:
                kwargs["forces"] = rng.normal(size=(n, 3)).astype(np.float32)
                kwargs["properties"] = {"gap": 0.5 * j, "vec": np.full(3, j, np.float64)}
            if j == 1:
                kwargs["name"] = "one"
                kwargs["atom_properties"] = {"q": np.arange(n, dtype=np.float32)}
            w.add(rng.normal(size=(n, 3)).astype(np.float32), np.arange(1, n + 1), **kwargs)
    return path


def test_pickle_reopens_lazily(golden_dir):
    for access in ("mmap", "pread"):
        f = atp.open(golden_dir / "builtins_zstd.atp", access=access)
        blob = pickle.dumps(f)
        assert len(blob) < 1000  # path + options only, no file contents
        g = pickle.loads(blob)
        assert g._st is None
        assert g[3].energy == f[3].energy and len(g) == len(f)
    mem = atp.Reader.from_bytes((golden_dir / "one_atom.atp").read_bytes(), name="one")
    assert pickle.loads(pickle.dumps(mem))[0].positions.tolist() == [[1.0, 2.0, 3.0]]


def _child_energy(reader, conn):
    # the forked child must not reuse the parent's descriptor/mapping
    conn.send((reader._st is None, reader[1].energy))


def test_fork_drops_inherited_state(golden_dir):
    f = atp.open(golden_dir / "builtins_none.atp")
    expected = f[1].energy
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_energy, args=(f, child))
    proc.start()
    dropped, energy = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0 and dropped and energy == expected
    assert f[1].energy == expected  # the parent's state is untouched


def test_indices(golden_dir):
    with atp.open(golden_dir / "builtins_none.atp") as f:
        assert f[-1].energy == f[4].energy and f[np.int64(2)].name == f[2].name
        assert [m.name for m in f[1:3]] == [f[1].name, f[2].name]
        for bad in (5, -6, 10**12):
            with pytest.raises(IndexError, match="out of range"):
                f[bad]
        with pytest.raises(atp.AtpIndexError):
            f.read_batch([0, 5])
        with pytest.raises(atp.AtpValueError):
            f["0"]
        with pytest.raises(atp.AtpValueError):
            f.read_batch([0.5])
        flat = f.read_batch(np.array([-1, 0]))
        assert flat["name"] == [f[4].name, f[0].name]


def test_read_batch_masks_on_heterogeneous_layouts(mixed_file):
    with atp.open(mixed_file) as f:
        flat = f.read_batch([4, 1, 3, 0])
        assert flat["n_atoms"].tolist() == [4, 3, 0, 2]
        assert flat["positions"].shape == (9, 3)
        assert flat["mask"]["forces"].tolist() == [True, False, False, True]
        np.testing.assert_array_equal(flat["forces"][:4], f[4].forces)
        assert not flat["forces"][4:7].any()
        np.testing.assert_array_equal(flat["forces"][7:], f[0].forces)
        assert flat["energy"].tolist() == [4.0, 1.0, 3.0, 0.0]
        assert flat["name"] == [None, "one", None, None]
        assert flat["properties"]["gap"].tolist() == [2.0, 0.0, 0.0, 0.0]
        assert flat["mask"]["properties/gap"].tolist() == [True, False, False, True]
        assert flat["properties"]["vec"].shape == (4, 3)
        q = flat["atom_properties"]["q"]
        assert q.shape == (9,) and q[4:7].tolist() == [0.0, 1.0, 2.0] and not q[:4].any()
        for key, value in flat.items():
            if isinstance(value, np.ndarray):
                assert value.flags.writeable, key


def test_fields_restrict_decoding(tmp_path):
    path = tmp_path / "s.atp"
    with atp.Writer(path) as w:
        for j in range(3):
            w.add(np.zeros((2, 3), np.float32), np.array([1, 2]), energy=float(j), name="abc")
    data = bytearray(path.read_bytes())
    at = data.find(b"abc", 8192)
    data[at] = 0xFF  # an invalid UTF-8 name in record 0
    path.write_bytes(bytes(data))
    with atp.open(path) as f:
        flat = f.read_batch([0, 1, 2], fields=["energy"])
        assert set(flat) == {"n_atoms", "positions", "atomic_numbers", "energy", "properties",
                             "atom_properties", "mask"}
        assert flat["energy"].tolist() == [0.0, 1.0, 2.0]
        with pytest.raises(atp.RecordDecodeError, match=r"record 0.*'name'"):
            f.read_batch([0, 1, 2])
        with pytest.raises(atp.RecordDecodeError, match="record 0"):
            f[0]
        assert f[1].name == "abc"
        assert atp.verify(path) and "record 0" in atp.verify(path)[0]


def test_absent_builtin_field_is_zero_filled(golden_dir):
    with atp.open(golden_dir / "one_atom.atp") as f:
        flat = f.read_batch([0, 0], fields=["forces", "energy"])
        assert flat["forces"].shape == (2, 3) and flat["forces"].dtype == np.float32
        assert not flat["mask"]["forces"].any() and not flat["mask"]["energy"].any()


def test_from_bytes_matches_file(golden_dir):
    path = golden_dir / "custom_props_zstd.atp"
    mem = atp.Reader.from_bytes(path.read_bytes(), name="custom.atp")
    with atp.open(path) as f:
        assert len(mem) == len(f) and mem.fields == f.fields
        for i in range(len(f)):
            a, b = mem[i], f[i]
            np.testing.assert_array_equal(a.positions, b.positions)
            assert a.properties.keys() == b.properties.keys()
    with pytest.raises(atp.NotAtpFileError, match="junk"):
        atp.Reader.from_bytes(b"x" * 9000, name="junk")


def test_from_bytes_can_take_a_bytearray_over_without_copying(golden_dir):
    raw = (golden_dir / "builtins_none.atp").read_bytes()
    owned = bytearray(raw)
    kept = atp.Reader.from_bytes(owned, name="kept.atp", copy=False)
    copied = atp.Reader.from_bytes(owned, name="copied.atp")
    # codec none: positions are views of whichever buffer the reader holds
    assert np.shares_memory(kept[0].positions, np.frombuffer(owned, np.uint8))
    assert not np.shares_memory(copied[0].positions, np.frombuffer(owned, np.uint8))
    with atp.open(golden_dir / "builtins_none.atp") as f:
        for i in range(len(f)):
            np.testing.assert_array_equal(kept[i].positions, f[i].positions)
    # bytes are immutable: never copied, whatever ``copy`` says
    assert not atp.Reader.from_bytes(raw, copy=False)[0].positions.flags.writeable


@pytest.mark.parametrize("name", ["builtins_none.atp", "custom_props_none.atp",
                                  "builtins_zstd.atp"])
def test_dropping_a_reader_frees_its_buffer_without_the_garbage_collector(golden_dir, name):
    import gc

    owned = bytearray((golden_dir / name).read_bytes())
    gc.collect()
    gc.disable()  # a reference cycle would now keep the buffer exported
    try:
        reader = atp.Reader.from_bytes(owned, name=name, copy=False)
        reader[0]
        reader[len(reader) - 1]  # through the first-touch decoder where there is one
        assert (reader._state().cache.touch is None) == name.endswith("_zstd.atp")
        reader.read_batch(range(len(reader)))
        reader.read_batch([0, 0])
        reader[len(reader) - 2]
        del reader
        owned.append(0)  # raises BufferError while any view of the buffer is alive
    finally:
        gc.enable()


def test_n_atoms_comes_from_index_only(tmp_path, golden_dir):
    data = bytearray((golden_dir / "builtins_none.atp").read_bytes())
    data[8192:10402] = bytes(10402 - 8192)  # wipe every record, keep schema + index
    path = tmp_path / "wiped.atp"
    path.write_bytes(bytes(data))
    with atp.open(path) as f:
        assert f.n_atoms.tolist() == [1, 3, 8, 2, 5]
        with pytest.raises(atp.RecordDecodeError, match="record 0.*index says 1"):
            f[0]


def test_close_and_reuse(golden_dir):
    f = atp.open(golden_dir / "builtins_lz4.atp")
    mol = f[0]
    f.close()
    assert mol.positions.sum() == mol.positions.sum()  # arrays stay valid after close
    assert f[1].energy is not None  # reopens lazily
    with f:
        pass
    assert "closed" in repr(f)


@pytest.mark.parametrize("access", ["auto", "mmap"])
def test_arrays_of_a_mapped_file_outlive_close(tmp_path, access):
    # Records of an uncompressed file are views of the mapping; closing the reader
    # must not unmap it under them (that was a segfault: run in a child process).
    path = tmp_path / "plain.atp"
    rng = np.random.default_rng(3)
    with atp.Writer(path) as w:
        for n in (3, 5, 3, 7):
            w.add(rng.normal(size=(n, 3)), np.arange(1, n + 1), energy=float(n),
                  forces=rng.normal(size=(n, 3)))
    script = f"""
import gc, numpy as np
from pyg_atompack import atp
f = atp.open({str(path)!r}, access={access!r})
one, batch = f[1], f.read_batch([0, 2, 3])
expected = one.positions.copy(), batch["forces"].copy()
f.close(); del f; gc.collect()
assert np.array_equal(one.positions, expected[0])
assert np.array_equal(batch["forces"], expected[1])
print("intact")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert result.stdout.strip() == "intact"


def _slot(header_fields: dict) -> bytes:
    h = atp.Header(**header_fields)
    from pyg_atompack.atp.header import encode_slot
    return encode_slot(h)


def test_bad_files_raise_atp_errors(tmp_path, golden_dir):
    (tmp_path / "short.atp").write_bytes(b"ATPK\x02\x00\x00\x00" + bytes(100))
    with pytest.raises(atp.TruncatedFileError, match="short.atp"):
        atp.open(tmp_path / "short.atp")
    (tmp_path / "empty.atp").write_bytes(b"")
    with pytest.raises(atp.NotAtpFileError):
        atp.open(tmp_path / "empty.atp")
    (tmp_path / "text.atp").write_bytes(b"hello" * 3000)
    with pytest.raises(atp.NotAtpFileError, match="text.atp"):
        atp.open(tmp_path / "text.atp", access="pread")
    # an index entry pointing beyond the end of the file
    data = bytearray((golden_dir / "builtins_none.atp").read_bytes())
    struct.pack_into("<Q", data, 10561 + 8 + 20 * 2, 10**12)
    (tmp_path / "far.atp").write_bytes(bytes(data))
    with atp.open(tmp_path / "far.atp") as f:
        with pytest.raises(atp.RecordDecodeError, match="record 2"):
            f[2]
        with pytest.raises(atp.RecordDecodeError, match="record 2"):
            f.read_batch([0, 2])
        assert f[1].n_atoms == 3
    # a compressed record claiming a 4 GiB raw size is refused before allocation
    data = bytearray((golden_dir / "builtins_zstd.atp").read_bytes())
    struct.pack_into("<I", data, 10512 + 8 + 20 * 1 + 12, 0xFFFFFFF0)
    (tmp_path / "huge.atp").write_bytes(bytes(data))
    with atp.open(tmp_path / "huge.atp") as f, pytest.raises(atp.RecordDecodeError,
                                                             match="record 1"):
        f[1]
    # record format 7 in an otherwise valid slot
    data = bytearray((golden_dir / "one_atom.atp").read_bytes())
    slot = bytearray(data[4096:8192])
    struct.pack_into("<I", slot, 56, 7)
    struct.pack_into("<I", slot, 4092, zlib.adler32(bytes(slot[:4092])))
    data[4096:8192] = slot
    (tmp_path / "rf7.atp").write_bytes(bytes(data))
    with pytest.raises(atp.HeaderError, match="record format 7"):
        atp.open(tmp_path / "rf7.atp")
    with pytest.raises(atp.AtpValueError, match="access"):
        atp.open(golden_dir / "one_atom.atp", access="mmap2")


def test_truncated_record_names_record_and_field(tmp_path, golden_dir):
    data = bytearray((golden_dir / "builtins_none.atp").read_bytes())
    # record 1 (3 atoms, at 8508): make the first section's payload length absurd
    first_section = 8508 + 4 + 3 * 12 + 3 + 2
    key_len = data[first_section + 1]
    struct.pack_into("<I", data, first_section + 2 + key_len + 1, 10**6)
    (tmp_path / "t.atp").write_bytes(bytes(data))
    with atp.open(tmp_path / "t.atp") as f, pytest.raises(atp.RecordDecodeError,
                                                          match=r"record 1: field 'charges'"):
        f[1]


def test_describe_reports_slots(golden_dir):
    info = atp.describe(golden_dir / "corrupt_newest_slot.atp")
    assert info["chosen_slot"] == "B" and info["slots"][0]["valid"] is False
    assert "checksum" in info["slots"][0]["problem"]
    assert info["schema"][0]["name"] == "positions"


def test_import_does_not_pull_in_torch():
    code = "import sys, pyg_atompack.atp; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bools_are_not_molecule_indices(tmp_path, golden_dir):
    # one rule for f[...] and read_batch: bools are rejected (numpy treats a boolean index
    # as a mask, Python as 0/1; either reading would surprise here)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.atp").write_bytes((golden_dir / "builtins_none.atp").read_bytes())
    for reader in (atp.open(golden_dir / "builtins_none.atp"),
                   atp.open(golden_dir / "builtins_zstd.atp", access="pread"),
                   atp.open(shards)):
        with reader as f:
            for bad in (True, False, np.True_):
                with pytest.raises(atp.AtpValueError, match="must be an integer") as caught:
                    f[bad]
                assert ("builtins" in str(caught.value)) or ("shards" in str(caught.value))
            for bad in ([True], np.array([False, True])):
                with pytest.raises(atp.AtpValueError, match="integers"):
                    f.read_batch(bad)
            assert f[1].energy == f[np.int32(1)].energy  # integers of any kind still work


@pytest.mark.parametrize("access", ["mmap", "pread"])
@pytest.mark.parametrize("bug", [NameError, AttributeError, MemoryError, TypeError])
def test_programming_errors_are_not_reported_as_corruption(golden_dir, monkeypatch, access,
                                                            bug):
    from pyg_atompack.atp import batch, cache, mapped

    def broken(*args, **kwargs):
        raise bug("simulated bug in the decoder")

    # the decoder factories make (decode, checked); parses of earlier readers are
    # forgotten so that their recipes (which hold the real decoders) are made again
    monkeypatch.setattr(mapped, "_decoder", lambda *args: lambda *values: (broken, broken))
    monkeypatch.setattr(cache, "_PARSED", {})
    monkeypatch.setattr(cache, "decode_molecule", broken)
    monkeypatch.setattr(batch, "read_mapped", broken)
    monkeypatch.setattr(batch, "_homogeneous", broken)
    monkeypatch.setattr(batch, "_heterogeneous", broken)
    with atp.open(golden_dir / "builtins_none.atp", access=access) as f:
        with pytest.raises(bug, match="simulated"):
            f[1]
        with pytest.raises(bug, match="simulated"):
            f.read_batch([0, 1, 2])


def test_read_batch_decode_failure_names_the_record(golden_dir, monkeypatch):
    from pyg_atompack.atp import batch

    # the vectorised gather fails on bytes it cannot decode: the error says which record
    with atp.open(golden_dir / "builtins_none.atp") as f:
        good = f.read_batch([0, 1, 2])
        f.close()

        def gather_fails(*args, **kwargs):
            raise ValueError("cannot reshape array")

        monkeypatch.setattr(batch, "read_mapped", gather_fails)
        monkeypatch.setattr(batch, "_homogeneous", gather_fails)
        monkeypatch.setattr(batch, "_heterogeneous", gather_fails)
        with pytest.raises(atp.RecordDecodeError, match=r"records \[2, 0, 1\]") as caught:
            f.read_batch([2, 0, 1])
        assert "builtins_none.atp" in str(caught.value)
        assert isinstance(caught.value.__cause__, ValueError)
    assert len(good["n_atoms"]) == 3


def test_read_batch_on_a_damaged_record_names_it(tmp_path, golden_dir):
    data = bytearray((golden_dir / "builtins_none.atp").read_bytes())
    first_section = 8508 + 4 + 3 * 12 + 3 + 2  # record 1's first section (see above)
    key_len = data[first_section + 1]
    struct.pack_into("<I", data, first_section + 2 + key_len + 1, 10**6)
    (tmp_path / "t.atp").write_bytes(bytes(data))
    for access in ("mmap", "pread"):
        with atp.open(tmp_path / "t.atp", access=access) as f:
            assert len(f.read_batch([0, 2])["n_atoms"]) == 2
            with pytest.raises(atp.RecordDecodeError, match=r"t\.atp: record 1\b"):
                f.read_batch([0, 2, 1])


# ------------------------------------------------------------------ file lists


def _write_small(path, sizes, energy_start=0):
    rng = np.random.default_rng(len(sizes))
    with atp.Writer(path) as w:
        for j, n in enumerate(sizes):
            w.add(rng.normal(size=(n, 3)).astype(np.float32), np.arange(1, n + 1),
                  energy=float(energy_start + j))
    return path


def test_from_paths_reads_files_in_the_given_order(tmp_path):
    first = _write_small(tmp_path / "b.atp", (2, 3), energy_start=0)
    second = _write_small(tmp_path / "a.atp", (4,), energy_start=10)
    for reader in (atp.ShardedReader.from_paths([first, second]),
                   atp.open((str(first), str(second)), access="pread")):
        assert isinstance(reader, atp.ShardedReader)
        assert len(reader) == 3
        assert [m.energy for m in reader] == [0.0, 1.0, 10.0]
        assert reader.locate(2) == (1, 0)
        batch = reader.read_batch([2, 0])
        assert batch["energy"].tolist() == [10.0, 0.0]
        assert batch["n_atoms"].tolist() == [4, 2]
        assert reader.shard_paths == [str(first), str(second)]
        assert str(first) in reader.path and str(second) in reader.path
        clone = pickle.loads(pickle.dumps(reader))
        assert [m.energy for m in clone] == [0.0, 1.0, 10.0]


def test_from_paths_rejects_bad_lists(tmp_path):
    good = _write_small(tmp_path / "good.atp", (2,))
    with pytest.raises(atp.AtpValueError, match="empty list"):
        atp.ShardedReader.from_paths([])
    with pytest.raises(atp.AtpValueError, match="list of files"):
        atp.ShardedReader.from_paths(str(good))
    with pytest.raises(atp.AtpValueError, match="access"):
        atp.ShardedReader.from_paths([good], access="nope")
    with pytest.raises(FileNotFoundError, match="missing.atp"):
        atp.open([good, tmp_path / "missing.atp"])
    (tmp_path / "junk.atp").write_bytes(b"not an atp file at all" * 10)
    with pytest.raises(atp.AtpError, match="junk.atp"):
        atp.open([good, tmp_path / "junk.atp"])


# ------------------------------------------------------------------ mixed-size batches


def _expected_batch(reader, indices, fields):
    """read_batch's arrays rebuilt record by record from reader[i]."""
    mols = [reader[i] for i in indices]
    out = {"positions": np.concatenate([m.positions for m in mols]),
           "atomic_numbers": np.concatenate([m.atomic_numbers for m in mols])}
    for field in fields:
        if field.startswith("atom_properties/"):
            out[field] = np.concatenate([m.atom_properties[field.split("/")[1]] for m in mols])
        elif field.startswith("properties/"):
            out[field] = np.stack([np.asarray(m.properties[field.split("/")[1]]) for m in mols])
        elif field in ("forces", "velocities", "charges"):
            out[field] = np.concatenate([getattr(m, field) for m in mols])
        else:
            out[field] = np.stack([np.asarray(getattr(m, field)) for m in mols])
    return out


def _batch_value(batch, field):
    if field.startswith("atom_properties/"):
        return batch["atom_properties"][field.split("/")[1]]
    if field.startswith("properties/"):
        return batch["properties"][field.split("/")[1]]
    return batch[field]


@pytest.mark.parametrize("odd_one", [None, "name", "extra_property", "missing_forces"])
def test_mixed_size_read_batch_matches_records(tmp_path, odd_one, monkeypatch):
    """Records of many sizes (one structure, or one record that breaks it)."""
    from pyg_atompack.atp import batch as atp_batch

    structured = []  # results of the one-gather-per-field path (None: it declined)
    original = atp_batch._read_structured
    monkeypatch.setattr(atp_batch, "_read_structured",
                        lambda *args: structured.append(original(*args)) or structured[-1])
    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(1, 40, size=60)]
    path = tmp_path / "sizes.atp"
    with atp.Writer(path) as w:
        for j, n in enumerate(sizes):
            kwargs = {"energy": float(j), "forces": rng.normal(size=(n, 3)).astype(np.float32),
                      "cell": rng.normal(size=(3, 3)), "pbc": np.array([1, 0, j % 2], bool),
                      "properties": {"vec": np.full(3, j, np.float64), "count": j},
                      "atom_properties": {"q": rng.normal(size=n).astype(np.float32)}}
            if j == 30 and odd_one == "name":
                kwargs["name"] = "different structure"
            if j == 30 and odd_one == "extra_property":
                kwargs["properties"] = {"vec": np.full(3, j, np.float64), "count": j,
                                        "extra": 1.5}
            if j == 30 and odd_one == "missing_forces":
                del kwargs["forces"]
            w.add(rng.normal(size=(n, 3)).astype(np.float32),
                  rng.integers(1, 90, size=n), **kwargs)
    fields = ["energy", "forces", "cell", "pbc", "properties/count", "properties/vec",
              "atom_properties/q"]
    safe = [i for i in range(60) if i != 30]
    for access in ("mmap", "pread"):
        reader = atp.open(path, access=access)
        for indices in (rng.permutation(safe)[:25], np.array(safe[::-1])):
            batch = reader.read_batch(indices, fields=fields)
            expected = _expected_batch(reader, indices, fields)
            assert batch["n_atoms"].tolist() == [sizes[i] for i in indices]
            for key in ("positions", "atomic_numbers", *fields):
                got = _batch_value(batch, key)
                assert got.dtype == expected[key].dtype, key
                np.testing.assert_array_equal(got, expected[key], err_msg=key)
            assert all(mask.all() for mask in batch["mask"].values())
        if access == "mmap":
            assert structured and all(out is not None for out in structured)
        # a batch holding the record that breaks the structure still decodes right
        batch = reader.read_batch([0, 30, 1], fields=["energy", "forces"])
        assert batch["energy"].tolist() == [0.0, 30.0, 1.0]
        forces_30 = batch["forces"][sizes[0]:sizes[0] + sizes[30]]
        if odd_one == "missing_forces":
            assert batch["mask"]["forces"].tolist() == [True, False, True]
            assert not forces_30.any()
        else:
            np.testing.assert_array_equal(forces_30, reader[30].forces)


def test_mixed_size_read_batch_rejects_a_damaged_structure(tmp_path):
    """A header byte flipped in one record: the batch falls back and names the record."""
    path = tmp_path / "damaged.atp"
    with atp.Writer(path) as w:
        for n in (3, 5, 7, 9):
            w.add(np.zeros((n, 3), np.float32), np.ones(n, np.uint8), energy=1.0,
                  forces=np.ones((n, 3), np.float32))
    reader = atp.open(path)
    assert reader.read_batch([0, 1, 2, 3])["forces"].shape == (24, 3)
    offset = int(reader.index["offset"][2])
    raw = bytearray(path.read_bytes())
    raw[offset + 4 + 13 * 7 + 2] = 9  # record 2's first section kind: unknown
    damaged = tmp_path / "damaged2.atp"
    damaged.write_bytes(bytes(raw))
    with atp.open(damaged) as f:
        carried = [f[i].energy is not None for i in range(4)]
        assert carried.count(False) == 1 or f[2].forces is None  # the damage took effect
        batch = f.read_batch([0, 1, 2, 3], fields=["energy", "forces"])
        assert batch["mask"]["energy"].tolist() == carried
        assert batch["mask"]["forces"].tolist() == [f[i].forces is not None for i in range(4)]


def _atompack_mixed_file(path, sizes, seed=3):
    """A mixed-size uncompressed file written by atompack-db's ``add_molecules``."""
    import atompack

    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression="none", overwrite=True)
    db.add_molecules([atompack.Molecule.from_arrays(
        rng.normal(size=(n, 3)).astype(np.float32), rng.integers(1, 90, n).astype(np.uint8),
        energy=float(j), forces=rng.normal(size=(n, 3)).astype(np.float32),
        cell=rng.normal(size=(3, 3)), stress=rng.normal(size=(3, 3)),
        pbc=(True, j % 2 == 0, False)) for j, n in enumerate(sizes)])
    db.flush()
    del db
    return path


def _assert_batch_equals_records(reader, indices, batch):
    fields = ["energy", "forces", "cell", "stress", "pbc"]
    expected = _expected_batch(reader, indices, fields)
    assert batch["n_atoms"].tolist() == [len(reader[int(i)].positions) for i in indices]
    for key in ("positions", "atomic_numbers", *fields):
        assert batch[key].dtype == expected[key].dtype, key
        np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)
        assert batch[key].flags.writeable, key


def test_mixed_size_batches_verify_each_record_once(tmp_path, monkeypatch):
    """Records verified against a structure are remembered; later batches skip the byte checks."""
    import atompack

    from pyg_atompack.atp import structure as atp_structure

    sizes = [int(n) for n in np.random.default_rng(5).integers(1, 40, size=50)]
    path = _atompack_mixed_file(tmp_path / "mixed.atp", sizes)
    checked = []  # how many records each structure check looked at
    original = atp_structure.Structure.fits
    monkeypatch.setattr(atp_structure.Structure, "fits",
                        lambda self, offsets, *rest: checked.append(len(offsets)) or
                        original(self, offsets, *rest))
    reference = atompack.Database.open(str(path))
    rng = np.random.default_rng(6)
    with atp.open(path) as f:
        first = rng.permutation(50)[:20]
        _assert_batch_equals_records(f, first, f.read_batch(first))
        assert checked == [20]
        # only the records not seen before are checked, whatever record comes first
        # (structures built from layouts of other atom counts are the same structure)
        second = np.concatenate([first[::-1][:10], np.setdiff1d(np.arange(50), first)[:5]])
        _assert_batch_equals_records(f, second, f.read_batch(second.tolist()))
        assert checked == [20, 5]
        for _ in range(3):
            batch = f.read_batch(second.tolist())
        assert checked == [20, 5]
        flat = reference.get_molecules_flat(second.tolist())
        for key in ("positions", "atomic_numbers", "energy", "forces", "cell", "stress", "pbc"):
            np.testing.assert_array_equal(batch[key], flat[key], err_msg=key)
        # subsets of fields come from the same gathers
        only = f.read_batch(second, fields=["pbc", "forces"])
        assert set(only["mask"]) == {"pbc", "forces"} and "energy" not in only
        np.testing.assert_array_equal(only["forces"], batch["forces"])
        np.testing.assert_array_equal(only["pbc"], batch["pbc"])
        # a new mapping starts with nothing verified
        f.close()
        f.read_batch(second)
        assert checked == [20, 5, 15]


def test_mixed_size_batches_never_remember_a_damaged_record(tmp_path, monkeypatch):
    """A record that does not fit is checked again each time; the batch is decoded per record."""
    from pyg_atompack.atp import batch as atp_batch

    sizes = [3, 5, 7, 9, 11, 4]
    path = _atompack_mixed_file(tmp_path / "ok.atp", sizes)
    offset = int(atp.open(path).index["offset"][2])
    raw = bytearray(path.read_bytes())
    raw[offset + 4 + 13 * 7 + 2] = 9  # record 2's first section kind: unknown
    damaged = tmp_path / "damaged.atp"
    damaged.write_bytes(bytes(raw))
    structured = []
    original = atp_batch._read_structured
    monkeypatch.setattr(atp_batch, "_read_structured",
                        lambda *args: structured.append(original(*args)) or structured[-1])
    with atp.open(damaged) as f:
        healthy = [0, 1, 3, 4, 5]
        _assert_batch_equals_records(f, healthy, f.read_batch(healthy))
        assert structured[-1] is not None
        for indices in ([0, 1, 2, 3], [2, 0, 1], [4, 2]):
            for _ in range(2):  # the second time the healthy ones are remembered
                batch = f.read_batch(indices, fields=["energy", "forces"])
                assert structured[-1] is None  # the damaged record sends it elsewhere
                carries = [f[i].energy is not None for i in indices]
                assert batch["mask"]["energy"].tolist() == carries
                has_forces = [f[i].forces is not None for i in indices]
                assert batch["mask"]["forces"].tolist() == has_forces
        ids = f._st.cache.structures.ids
        assert ids[0] and ids[2] != ids[0]  # never taken for the healthy structure
        _assert_batch_equals_records(f, healthy[::-1], f.read_batch(healthy[::-1]))
        assert structured[-1] is not None


def test_mixed_size_batches_without_free_structure_ids(tmp_path, monkeypatch):
    """Past the id limit a structure is still used, its records checked on every batch."""
    from pyg_atompack.atp import structure as atp_structure

    monkeypatch.setattr(atp_structure.StructureMemo, "MAX_IDS", 0)
    sizes = [int(n) for n in np.random.default_rng(8).integers(1, 30, size=20)]
    path = _atompack_mixed_file(tmp_path / "mixed.atp", sizes)
    checked = []
    original = atp_structure.Structure.fits
    monkeypatch.setattr(atp_structure.Structure, "fits",
                        lambda self, offsets, *rest: checked.append(len(offsets)) or
                        original(self, offsets, *rest))
    with atp.open(path) as f:
        for _ in range(2):
            indices = list(range(19, -1, -2))
            _assert_batch_equals_records(f, indices, f.read_batch(indices))
        assert checked == [10, 10]
        assert not f._st.cache.structures.ids.any()


def test_read_batch_index_forms(golden_dir):
    with atp.open(golden_dir / "builtins_none.atp") as f:
        names = [f[i].name for i in range(5)]
        for indices in ([4, -5, 2], (4, 0, -3), np.array([4, 0, 2], np.uint16),
                        np.array([[4], [0], [2]]), [np.int32(4), np.int64(0), 2]):
            assert f.read_batch(indices)["name"] == [names[4], names[0], names[2]]
        for bad in ([0, -6], np.array([0, 2**63 + 1], np.uint64), [[0], [5]]):
            with pytest.raises(atp.AtpIndexError, match="out of range"):
                f.read_batch(bad)
        assert f.read_batch([])["positions"].shape == (0, 3)


# ---------------------------------------------------------------- access="auto" and preads
@pytest.fixture
def random_advice(monkeypatch):
    """Make "auto" treat the small test files as large (random advice, residency probe)."""
    from pyg_atompack.atp import filestate

    monkeypatch.setattr(filestate, "RANDOM_ADVICE_BYTES", 0)


def _cold(reader, pread=None):
    """Make ``reader`` take every batch for not in memory (and read through ``pread``)."""
    st = reader._state()
    st.resident = lambda offset, length: False
    if pread is not None:
        st.pread = pread
    return reader


def _assert_same_batches(got, want, keys):
    for key in keys:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.parametrize("name", ["builtins_none.atp", "builtins_zstd.atp",
                                  "custom_props_none.atp", "sparse_builtins.atp"])
def test_auto_reads_equal_mmap_and_atompack_on_and_off_the_page_cache(golden_dir, name,
                                                                     random_advice):
    import atompack

    path = golden_dir / name
    db = atompack.Database.open(str(path))
    with atp.open(path, access="mmap") as plain, atp.open(path) as auto, \
            _cold(atp.open(path, access="auto")) as cold, atp.open(path, access="pread") as pr:
        assert auto.access == "auto"
        count = len(plain)
        indices = np.random.default_rng(1).integers(0, count, 3 * count).tolist()
        want = plain.read_batch(indices)
        for reader in (auto, cold, pr):
            got = reader.read_batch(indices)
            assert set(got) == set(want)
            _assert_same_batches(got, want, ("n_atoms", "positions", "atomic_numbers"))
            for key in want["mask"]:
                np.testing.assert_array_equal(got["mask"][key], want["mask"][key])
            for i in indices[:8]:
                assert np.array_equal(reader[i].positions, np.asarray(db[i].positions))
                assert np.array_equal(reader[i].atomic_numbers,
                                      np.asarray(db[i].atomic_numbers))
        # iteration reads ahead under "auto"; the molecules are the same
        for mine, theirs in zip(auto, plain, strict=True):
            assert np.array_equal(mine.positions, theirs.positions)
        if "custom" not in name and "sparse" not in name:
            flat = db.get_molecules_flat(indices)
            _assert_same_batches(cold.read_batch(indices), flat,
                                 [k for k in flat if isinstance(flat[k], np.ndarray)])


def test_cold_mixed_size_batches_equal_atompack(tmp_path, random_advice):
    import atompack

    sizes = [int(n) for n in np.random.default_rng(2).integers(1, 30, size=40)]
    path = _atompack_mixed_file(tmp_path / "mixed.atp", sizes)
    flat_ref = atompack.Database.open(str(path))
    indices = np.random.default_rng(3).permutation(40)[:25].tolist()
    with _cold(atp.open(path)) as cold, atp.open(path, access="mmap") as plain:
        got = cold.read_batch(indices)
        _assert_batch_equals_records(plain, indices, got)
        flat = flat_ref.get_molecules_flat(indices)
        _assert_same_batches(got, flat, ("positions", "atomic_numbers", "energy", "forces",
                                         "cell", "stress", "pbc"))


def test_batch_reads_of_records_off_the_page_cache_are_in_flight_together(tmp_path,
                                                                         random_advice):
    """Two reads must be pending at once, or the barrier breaks (nothing is timed)."""
    import os
    import threading
    import time

    barrier = threading.Barrier(2, timeout=20)
    calls = []

    def pread(fd, length, offset):
        calls.append(offset)
        if len(calls) == 1:
            time.sleep(0.002)  # storage latency: the "pread" reader's timed probe sees it
        elif len(calls) <= 3:
            barrier.wait()  # returns only once another read is in flight
        return os.pread(fd, length, offset)

    path = _write_small(tmp_path / "many.atp", [3] * 16)
    with atp.open(path, access="mmap") as plain:
        count = len(plain)
        scattered = list(range(0, count, 2))[::-1]  # no two records adjacent
        want = plain.read_batch(scattered)
        for reader in (_cold(atp.open(path), pread), atp.open(path, access="pread")):
            if reader.access == "pread":
                reader._state().pread = pread
            calls.clear()
            barrier.reset()
            _assert_same_batches(reader.read_batch(scattered), want,
                                 ("positions", "atomic_numbers", "energy"))
            assert len(calls) == len(scattered)
            # adjacent records are one read: a sequential scan is one large pread
            calls.clear()
            barrier.abort()  # no waiting below
            reader._state().pread = lambda fd, n, off: calls.append(off) or os.pread(fd, n, off)
            _assert_same_batches(reader.read_batch(range(count)), plain.read_batch(range(count)),
                                 ("positions", "energy"))
            assert len(calls) == 1
            reader.close()
            barrier = threading.Barrier(2, timeout=20)


def test_short_concurrent_read_names_file_and_record(golden_dir):
    path = golden_dir / "builtins_none.atp"
    with _cold(atp.open(path), pread=lambda fd, n, off: b"\0" * (n - 1)) as f, \
            pytest.raises(atp.TruncatedFileError, match=r"builtins_none\.atp: record 2: short"):
        f.read_batch([2, 0])


def test_auto_keeps_read_ahead_for_small_files(golden_dir):
    with atp.open(golden_dir / "builtins_none.atp") as f:
        assert f.access == "auto"
        st = f._state()
        assert st.access == "mmap" and st.resident is None  # plain map, kernel read-ahead


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="mincore")
def test_auto_probes_residency_of_the_mapping(golden_dir, random_advice):
    path = golden_dir / "builtins_none.atp"
    with atp.open(path) as f:
        f.read_batch([0, 1])
        st = f._state()
        offset = int(f.index["offset"][0])
        assert st.resident(offset, int(f.index["raw"][0])) is True


@pytest.mark.parametrize("access", ["auto", "mmap"])
def test_first_touch_check_in_place_refuses_a_record_of_another_structure(
        tmp_path, access, random_advice):
    """A record of a known size whose section headers differ is parsed, not trusted."""
    path = _write_small(tmp_path / "same.atp", [4, 4, 4])
    with atp.open(path, access="mmap") as f:
        f[0]
        layout = next(iter(f._state().cache.layouts.values()))
        offset = int(f.index["offset"][2])
        target = offset + layout.spans[1][0]
    data = bytearray(path.read_bytes())
    data[target] ^= 0xFF
    path.write_bytes(bytes(data))
    with atp.open(path, access=access) as f:
        assert f[0].energy == 0.0 and f[1].energy == 1.0  # same layout, checked in place
        with pytest.raises(atp.AtpError, match="record 2"):
            f[2]


@pytest.mark.parametrize("access", ["auto", "mmap", "pread"])
def test_records_of_one_size_and_two_structures_decode_in_any_order(tmp_path, access):
    """Records of the same size and atom count whose section keys differ each decode
    with their own structure, whichever was touched before (a first touch checks
    against the last size's layout first)."""
    path = tmp_path / "two.atp"
    keys = ["aa" if j % 3 else "bb" for j in range(12)]
    with atp.Writer(path) as w:
        for j, key in enumerate(keys):
            w.add(np.full((4, 3), j, np.float32), np.arange(1, 5), energy=float(j),
                  properties={key: float(j)})
    order = np.random.default_rng(0).permutation(len(keys)).tolist()
    for indices in (range(len(keys)), order):
        with atp.open(path, access=access) as f:
            assert len(set(zip(f.index["raw"].tolist(), f.index["n_atoms"].tolist()))) == 1
            for i in indices:
                mol = f[i]
                assert mol.properties == {keys[i]: float(i)}, i
                assert mol.energy == float(i) and mol.positions[0, 0] == i
            for i in indices:  # and once checked
                assert f[i].properties == {keys[i]: float(i)}, i


def test_auto_reads_the_index_into_the_page_cache_at_open(golden_dir, random_advice,
                                                          monkeypatch):
    """Not resident: one read through the descriptor at open (random f[i] then never
    waits for an index page); resident: nothing read."""
    import os

    from pyg_atompack.atp import filestate

    path = golden_dir / "builtins_none.atp"
    reads = []
    original = os.preadv

    def counting(fd, buffers, offset):
        reads.append((offset, sum(len(b) for b in buffers)))
        return original(fd, buffers, offset)

    monkeypatch.setattr(filestate.os, "preadv", counting)
    for in_memory in (False, True):
        monkeypatch.setattr(filestate, "resident", lambda address, offset, length,
                            in_memory=in_memory: in_memory)
        reads.clear()
        with atp.open(path) as f:
            header = f.header
            assert f[2].energy is not None
        assert reads == ([] if in_memory else [(header.index_offset, header.index_len)])


def test_auto_asks_for_a_records_pages_before_its_first_touch_only(tmp_path, random_advice,
                                                                    monkeypatch):
    """While first touches wait for the disk, each asks for its record's pages first;
    only after ``FAST_TOUCHES_TO_WARM`` touches in a row served from memory do the
    next ones skip the request. From then on one touch in ``TIMED_TOUCH_EVERY`` is
    timed, and one slow timed touch brings the requests back. Nothing is timed for
    real: the clock is replaced, and the readings it gave are counted."""
    from pyg_atompack.atp import cache, filestate

    warm, every = cache.FAST_TOUCHES_TO_WARM, cache.TIMED_TOUCH_EVERY
    asked = []
    monkeypatch.setattr(filestate.FileState, "prefetch_record",
                        lambda self, offset, length: asked.append((offset, length)))
    count = 2 * warm + every + 1
    path = _write_small(tmp_path / "same.atp", [4] * count)
    read = []

    def clock(durations):
        """perf_counter for timed touches taking ``durations`` seconds, one after another."""
        now, readings = 0.0, []
        for duration in durations:
            readings += [now, now + duration]
            now += duration + 1.0
        readings = iter(readings)
        return lambda: read.append(1) or next(readings)

    slow, fast = 1.0, 0.0
    # record 0 is the first of its size (not timed); while cold, every touch is timed
    missed = warm + every  # the first timed touch once warm
    patterns = {
        "every touch waits": ([slow] * (count - 1), list(range(count)), count - 1),
        # records 1..warm timed, then one in ``every``
        "every touch is fast": ([fast] * count, list(range(warm + 1)),
                                warm + (count - 1 - warm) // every),
        # one hit amid misses changes nothing
        "a hit amid misses": ([slow, fast, slow] + [slow] * count, list(range(count)),
                              count - 1),
        # warm, untimed touches, then a timed miss (not asked for): requests again
        # from the next record until ``warm`` fast ones in a row
        "a miss after warming": ([fast] * warm + [slow] + [fast] * count,
                                 list(range(warm + 1)) + list(range(missed + 1, count)),
                                 warm + 1 + (count - 1 - missed)),
    }
    for name, (durations, want, timed) in patterns.items():
        monkeypatch.setattr(cache, "perf_counter", clock(durations))
        asked.clear()
        read.clear()
        with atp.open(path) as f:
            for i in range(count):
                assert f[i].energy == float(i)
            for i in range(count):  # checked before: no touch, no request
                assert f[i].energy == float(i)
            entries = f.index
        assert asked == [(int(entries["offset"][i]), int(entries["raw"][i])) for i in want], \
            name
        assert len(read) == 2 * timed, name
    asked.clear()
    with atp.open(path, access="mmap") as f:  # the plain map keeps the kernel's read-ahead
        f[0]
        f[1]
    assert asked == []


def test_a_new_record_size_asks_for_its_pages_only_while_first_touches_wait(
        tmp_path, random_advice, monkeypatch):
    """The first record of a size new to the reader follows the same rule as the
    others: it asks for its pages while first touches wait for the disk, and not once
    they are served from memory (a mixed-size file has hundreds of sizes). The clock
    is replaced."""
    import itertools

    from pyg_atompack.atp import cache, filestate

    warm = cache.FAST_TOUCHES_TO_WARM
    asked = []
    monkeypatch.setattr(filestate.FileState, "prefetch_record",
                        lambda self, offset, length: asked.append(offset))
    sizes = [4] * (warm + 1) + [5, 6, 6]
    path = _write_small(tmp_path / "sizes.atp", sizes)
    with atp.open(path, access="mmap") as f:  # every size parsed once in the process
        [f[i] for i in range(len(sizes))]
    for step, want in ((1.0, list(range(len(sizes)))), (0.0, list(range(warm + 1)))):
        clock = itertools.count(0.0, step)  # every touch takes ``step`` seconds
        monkeypatch.setattr(cache, "perf_counter", lambda clock=clock: next(clock))
        asked.clear()
        with atp.open(path) as f:
            for i in range(len(sizes)):
                assert f[i].energy == float(i)
            offsets = f.index["offset"]
        assert asked == [int(offsets[i]) for i in want]


def test_a_size_parsed_for_the_first_time_asks_for_its_pages_once(tmp_path, random_advice,
                                                                   monkeypatch):
    """A record of a size no reader has parsed yet goes from the in-place first touch
    to the full parse without asking for its pages a second time (each request is a
    system call; a mixed-size file has hundreds of sizes)."""
    import itertools

    from pyg_atompack.atp import cache, filestate

    asked = []
    monkeypatch.setattr(filestate.FileState, "prefetch_record",
                        lambda self, offset, length: asked.append(offset))
    monkeypatch.setattr(cache, "_PARSED", {})
    clock = itertools.count(0.0, 1.0)  # every touch waits
    monkeypatch.setattr(cache, "perf_counter", lambda: next(clock))
    sizes = [3, 5, 7, 5, 3]
    path = _write_small(tmp_path / "sizes.atp", sizes)
    with atp.open(path) as f:
        f[0]  # the reader's first record (its memo is made on the way)
        asked.clear()
        for i in range(1, len(sizes)):
            assert f[i].energy == float(i)
        offsets = f.index["offset"]
    assert asked == [int(offsets[i]) for i in range(1, len(sizes))]


def test_fresh_readers_reuse_parsed_layouts_only_after_checking_them(tmp_path, monkeypatch):
    """A second reader of records of the same sizes does not parse them again; a record
    whose structural bytes differ from the known parse is parsed (and refused) anyway."""
    from pyg_atompack.atp import cache

    parsed = []
    original = cache.build_layout
    monkeypatch.setattr(cache, "build_layout",
                        lambda rec, n, *rest: parsed.append(n) or original(rec, n, *rest))
    monkeypatch.setattr(cache, "_PARSED", {})
    sizes = [3, 5, 7, 5]
    path = _write_small(tmp_path / "sizes.atp", sizes)
    for access in ("mmap", "pread", "mmap"):
        with atp.open(path, access=access) as f:
            assert [f[i].energy for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
            assert f.read_batch([3, 0, 2])["energy"].tolist() == [3.0, 0.0, 2.0]
    assert parsed == [3, 5, 7]  # once per size, whatever the reader
    with atp.open(path) as f:
        f[1]
        layout = f._state().cache.layouts[(int(f.index["raw"][1]), 5)]
        target = int(f.index["offset"][1]) + layout.spans[1][0]
    data = bytearray(path.read_bytes())
    data[target] ^= 0xFF  # record 1's section count: another structure, same size
    path.write_bytes(bytes(data))
    with atp.open(path) as f:
        assert f[3].energy == 3.0  # same size, known parse, checked
        with pytest.raises(atp.AtpError, match="record 1"):
            f[1]


def test_batches_ask_the_page_cache_only_after_a_slow_gather(tmp_path, monkeypatch,
                                                            random_advice):
    """Gathers from the mapping that are as fast as page-cache hits skip the residency
    probe of the next batch; a slow one (the disk) makes the next batch probe again, and
    a batch the probe finds out of memory is read with pread. Nothing is timed: the
    clock is replaced."""
    import itertools
    import os

    from pyg_atompack.atp import batch

    path = _write_small(tmp_path / "same.atp", [4] * 8)
    with atp.open(path) as f:
        st = f._state()
        probes = []
        answer = [True]
        st.resident = lambda offset, length: probes.append(offset) or answer[0]
        reads = []
        st.pread = lambda fd, n, off: reads.append(off) or os.pread(fd, n, off)
        for step, wanted in ((0.0, 1), (1.0, 4)):
            clock = itertools.count(0.0, step)  # every gather takes ``step`` seconds
            monkeypatch.setattr(batch, "perf_counter", lambda clock=clock: next(clock))
            st.cache.batch_cold = True
            probes.clear()
            for first in range(4):  # first touches, then records checked before
                got = f.read_batch([first, first + 4])
                assert got["energy"].tolist() == [float(first), float(first + 4)]
            assert len(probes) == wanted  # fast: only the first batch asked
        answer[0] = False  # the pages went (the last gather was slow): read with pread
        assert f.read_batch([1, 6])["energy"].tolist() == [1.0, 6.0]
        assert len(probes) > 4 and len(reads) == 2  # asked, and read both records


def test_a_batch_checks_its_own_index_entries(tmp_path):
    """A fresh reader checks the index entries of the records a batch reads (not the
    whole index): a damaged entry fails the batch that reads it, naming file and record,
    and leaves the other records readable."""
    import struct

    path = _write_small(tmp_path / "entries.atp", [3] * 6)
    with atp.open(path) as f:
        index_offset = f.header.index_offset
        size = path.stat().st_size
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, index_offset + 8 + 20 * 4, size + 64)  # record 4's offset
    path.write_bytes(bytes(data))
    for access in ("auto", "mmap", "pread"):
        with atp.open(path, access=access) as f:
            assert f.read_batch([0, 1, 5])["energy"].tolist() == [0.0, 1.0, 5.0]
            with pytest.raises(atp.RecordDecodeError, match=r"entries\.atp: record 4"):
                f.read_batch([2, 4])
            with pytest.raises(atp.RecordDecodeError, match=r"entries\.atp: record 4"):
                f[4]
            assert f[3].energy == 3.0
