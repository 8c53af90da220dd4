"""The writer: byte identity with atompack-db, round trips, append_to, refusals."""

from __future__ import annotations

import shutil

import atompack
import numpy as np
import pytest

from pyg_atompack import atp

CODECS = ("none", "lz4", "zstd")


def _molecules(seed: int = 0, sizes=(1, 3, 8, 2)) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for j, n in enumerate(sizes):
        out.append(dict(
            positions=rng.normal(size=(n, 3)).astype(np.float32),
            atomic_numbers=rng.integers(1, 100, n).astype(np.uint8),
            energy=float(rng.normal()),
            forces=rng.normal(size=(n, 3)).astype(np.float32),
            charges=rng.normal(size=n),
            velocities=rng.normal(size=(n, 3)).astype(np.float32),
            cell=rng.normal(size=(3, 3)),
            stress=rng.normal(size=(3, 3)),
            pbc=(True, j % 2 == 0, False),
            name=f"mol-{j}-ä",
        ))
    return out


def _custom(n: int, seed: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    props = {"p_int": -7, "p_bool": True, "p_float": 2.5, "p_str": "héllo", "p_none": None,
             "p_f64": rng.normal(size=4), "p_f32": rng.normal(size=3).astype(np.float32),
             "p_i32": np.arange(2, dtype=np.int32), "p_i64": np.arange(5),
             "p_vec": rng.normal(size=(2, 3)).astype(np.float32),
             "p_tensor": rng.normal(size=(2, 2, 2)), "energy": 1.0}
    atom = {"a_f32": rng.normal(size=n).astype(np.float32), "a_vec": rng.normal(size=(n, 3)),
            "a_t": np.ones((n, 2), np.int64)}
    return props, atom


def _write_reference(path, mols, compression, customs=True):
    db = atompack.Database(str(path), compression=compression, overwrite=True)
    batch = []
    for j, m in enumerate(mols):
        mol = atompack.Molecule.from_arrays(**m)
        if customs:
            props, atom = _custom(len(m["atomic_numbers"]), j)
            for k, v in props.items():
                mol.set_property(k, v)
            for k, v in atom.items():
                mol.set_property(k, v, scope="atom")
        batch.append(mol)
    db.add_molecules(batch)
    db.flush()
    del db


def _write_ours(path, mols, compression, customs=True):
    with atp.Writer(path, compression=compression, overwrite=True) as w:
        for j, m in enumerate(mols):
            props, atom = _custom(len(m["atomic_numbers"]), j) if customs else ({}, {})
            w.add(**m, properties=props, atom_properties=atom)


@pytest.mark.parametrize("compression", CODECS)
def test_add_matches_atompack_byte_for_byte(tmp_path, compression):
    mols = _molecules()
    _write_reference(tmp_path / "ref.atp", mols, compression)
    _write_ours(tmp_path / "ours.atp", mols, compression)
    ref, ours = atp.open(tmp_path / "ref.atp"), atp.open(tmp_path / "ours.atp")
    for i in range(len(mols)):
        assert ours.raw_record(i) == ref.raw_record(i)
    if compression == "none":
        assert (tmp_path / "ours.atp").read_bytes() == (tmp_path / "ref.atp").read_bytes()


@pytest.mark.parametrize("compression", CODECS)
def test_atompack_reads_what_we_write(tmp_path, compression):
    mols = _molecules(3)
    _write_ours(tmp_path / "ours.atp", mols, compression)
    db = atompack.Database.open(str(tmp_path / "ours.atp"))
    assert len(db) == len(mols)
    for j, m in enumerate(mols):
        got = db[j]
        np.testing.assert_array_equal(got.positions, m["positions"])
        np.testing.assert_array_equal(got.forces, m["forces"])
        np.testing.assert_array_equal(got.cell, m["cell"])
        assert got.energy == m["energy"] and tuple(got.pbc) == m["pbc"]
        props, atom = _custom(len(m["atomic_numbers"]), j)
        assert got.get_property("p_str") == "héllo"
        np.testing.assert_array_equal(got.get_property("p_tensor"), props["p_tensor"])
        np.testing.assert_array_equal(got.get_property("a_vec"), atom["a_vec"])
    assert db.get_molecules_flat([0, 1])["name"] == ["mol-0-ä", "mol-1-ä"]


def _batch_columns(count: int, n: int, seed: int, f64: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    fdt = np.float64 if f64 else np.float32
    return dict(
        positions=rng.normal(size=(count, n, 3)).astype(fdt),
        atomic_numbers=rng.integers(1, 90, (count, n)).astype(np.uint8),
        energy=rng.normal(size=count).astype(np.float32 if f64 else np.float64),
        forces=rng.normal(size=(count, n, 3)).astype(fdt),
        charges=rng.normal(size=(count, n)),
        velocities=rng.normal(size=(count, n, 3)).astype(np.float32),
        cell=rng.normal(size=(count, 3, 3)),
        stress=rng.normal(size=(count, 3, 3)),
        pbc=rng.integers(0, 2, (count, 3)).astype(bool),
        name=[f"b{j}" * (j + 1) for j in range(count)],
        properties={"label": [f"s{j}" for j in range(count)],
                    "gap": rng.normal(size=count), "gap32": rng.normal(size=count).astype(
                        np.float32), "spin": np.arange(count, dtype=np.int32),
                    "desc": rng.normal(size=(count, 5)).astype(np.float32),
                    "vec": rng.normal(size=(count, 2, 3)),
                    "tens": rng.normal(size=(count, 2, 2, 2)).astype(np.float32)},
        atom_properties={"q": rng.normal(size=(count, n)).astype(np.float32),
                         "mag": rng.normal(size=(count, n, 3)),
                         "feat": rng.normal(size=(count, n, 2, 2))},
    )


@pytest.mark.parametrize("f64", [False, True])
def test_add_batch_matches_add_arrays_batch(tmp_path, f64):
    cols = [_batch_columns(4, 3, 1, f64), _batch_columns(2, 5, 2, f64)]
    db = atompack.Database(str(tmp_path / "ref.atp"), compression="none", overwrite=True)
    for c in cols:
        db.add_arrays_batch(**c)
    db.flush()
    del db
    with atp.Writer(tmp_path / "ours.atp") as w:
        for c in cols:
            w.add_batch(**c)
    assert (tmp_path / "ours.atp").read_bytes() == (tmp_path / "ref.atp").read_bytes()
    with atp.open(tmp_path / "ours.atp") as f:
        assert f.record_format == (3 if f64 else 2)
        assert f[5].name == "b1b1"
        flat = f.read_batch([0, 5])
        assert flat["properties"]["label"] == ["s0", "s1"]
        assert flat["properties"]["gap32"].dtype == np.float64  # widened like atompack


@pytest.mark.parametrize("compression", ("lz4", "zstd"))
def test_add_batch_compressed_is_readable_by_atompack(tmp_path, compression):
    cols = _batch_columns(3, 4, 7)
    with atp.Writer(tmp_path / "ours.atp", compression=compression, level=5) as w:
        w.add_batch(**cols)
    db = atompack.Database.open(str(tmp_path / "ours.atp"))
    np.testing.assert_array_equal(db[2].positions, cols["positions"][2])
    np.testing.assert_array_equal(db[1].get_property("tens"), cols["properties"]["tens"][1])
    assert atp.describe(tmp_path / "ours.atp")["level"] == (5 if compression == "zstd" else 0)


def test_empty_files_match_golden(tmp_path, golden_dir):
    w = atp.Writer(tmp_path / "noflush.atp")
    w.close()
    golden = (golden_dir / "empty_noflush.atp").read_bytes()
    assert (tmp_path / "noflush.atp").read_bytes() == golden
    with atp.Writer(tmp_path / "empty.atp"):
        pass
    assert (tmp_path / "empty.atp").read_bytes() == (golden_dir / "empty.atp").read_bytes()


def test_one_atom_matches_golden(tmp_path, golden_dir):
    with atp.Writer(tmp_path / "one.atp") as w:
        w.add(np.array([[1, 2, 3]], np.float32), np.array([6], np.uint8))
    assert (tmp_path / "one.atp").read_bytes() == (golden_dir / "one_atom.atp").read_bytes()


def test_append_to_matches_atompack_reopen(tmp_path):
    mols = _molecules(5, sizes=(2, 3, 1, 4, 2, 1))
    db = atompack.Database(str(tmp_path / "ref.atp"), compression="zstd", overwrite=True)
    db.add_molecules([atompack.Molecule.from_arrays(**m) for m in mols[:3]])
    db.flush()
    del db
    for part in (mols[3:5], mols[5:]):
        db = atompack.Database.open(str(tmp_path / "ref.atp"), mmap=False)
        db.add_molecules([atompack.Molecule.from_arrays(**m) for m in part])
        db.flush()
        del db
    with atp.Writer(tmp_path / "ours.atp", compression="zstd") as w:
        for m in mols[:3]:
            w.add(**m)
    for part in (mols[3:5], mols[5:]):
        with atp.Writer.append_to(tmp_path / "ours.atp") as w:
            for m in part:
                w.add(**m)
    assert (tmp_path / "ours.atp").read_bytes() == (tmp_path / "ref.atp").read_bytes()
    with atp.open(tmp_path / "ours.atp") as f:
        assert f.header.generation == 3 and f.header.slot == "B" and len(f) == 6


def test_append_to_truncates_uncommitted_tail(tmp_path, golden_dir):
    path = tmp_path / "tail.atp"
    shutil.copy(golden_dir / "unflushed_tail.atp", path)
    path.chmod(0o644)
    m = _molecules(9, sizes=(3,))[0]
    with atp.Writer.append_to(path) as w:
        assert len(w) == 2
        w.add(**m)
    db = atompack.Database.open(str(path))
    assert len(db) == 3
    np.testing.assert_array_equal(db[2].positions, m["positions"])
    assert atp.verify(path) == []
    # the first appended record starts where the committed index ended
    with atp.open(path) as f:
        assert int(f.index["offset"][2]) == 9073 + 48


def test_flush_without_changes_bumps_generation(tmp_path):
    path = tmp_path / "a.atp"
    _write_ours(path, _molecules(), "none", customs=False)
    size = path.stat().st_size
    w = atp.Writer.append_to(path)
    w.flush()
    w.close()
    with atp.open(path) as f:
        assert f.header.generation == 2 and f.header.slot == "A"
        assert path.stat().st_size == size + f.header.schema_len + f.header.index_len
        assert len(f) == 4


def test_append_to_schema_less_file_writes_a_schema(tmp_path, golden_dir):
    path = tmp_path / "old.atp"
    shutil.copy(golden_dir / "legacy" / "v021_none.atp", path)
    path.chmod(0o644)
    with atp.open(path) as f:
        first = f[0]
    with atp.Writer.append_to(path) as w:
        w.add(first.positions, first.atomic_numbers, energy=1.0, properties={"p_int": 4})
    with atp.open(path) as f, atp.open(golden_dir / "legacy" / "v031_none.atp") as new:
        assert f.schema is not None and len(f) == 4
        assert f.schema.entries == new.schema.entries
    assert len(atompack.Database.open(str(path))) == 4


def test_context_manager_does_not_commit_on_exception(tmp_path):
    path = tmp_path / "x.atp"
    m = _molecules()[0]
    with pytest.raises(RuntimeError), atp.Writer(path) as w:
        w.add(**m)
        raise RuntimeError("boom")
    with atp.open(path) as f:
        assert len(f) == 0


def test_conflicting_appends_are_refused(tmp_path):
    m = _molecules()[0]
    with atp.Writer(tmp_path / "c.atp") as w:
        w.add(**m, properties={"p": 1})
        with pytest.raises(atp.SchemaError, match="'p'"):
            w.add(**m, properties={"p": "text"})
        with pytest.raises(ValueError, match="float64 positions"):
            w.add(m["positions"].astype(np.float64), m["atomic_numbers"])
        with pytest.raises(atp.SchemaConflictError):
            w.add(**{**m, "forces": m["forces"].astype(np.float64)})
        w.add(**m, properties={"p": 2})
        assert len(w) == 2
    with atp.Writer.append_to(tmp_path / "c.atp") as w, pytest.raises(atp.SchemaConflictError):
        w.add(**m, properties={"p": np.zeros(2)})
    # float64 positions first: the file becomes record format 3 for good
    with atp.Writer(tmp_path / "v3.atp") as w:
        w.add(m["positions"].astype(np.float64), m["atomic_numbers"])
        with pytest.raises(atp.SchemaConflictError, match="positions"):
            w.add(m["positions"], m["atomic_numbers"])
    with atp.open(tmp_path / "v3.atp") as f:
        assert f.record_format == 3 and f[0].positions.dtype == np.float64


def test_values_the_format_cannot_hold(tmp_path):
    pos = np.zeros((2, 3), np.float32)
    z = np.array([1, 8], np.uint8)
    with atp.Writer(tmp_path / "bad.atp") as w:
        cases = [
            (dict(atom_properties={"q": np.zeros(3)}), "n_atoms"),
            (dict(atom_properties={"q": 1.0}), "atom_properties/q"),
            (dict(properties={"k" * 256: 1}), "255"),
            (dict(properties={"f16": np.zeros(2, np.float16)}), "float16"),
            (dict(properties={"obj": object()}), "obj"),
            (dict(forces=np.zeros((3, 3), np.float32)), "forces"),
            (dict(cell=np.zeros(6)), "cell"),
            (dict(properties={"a": 1}, atom_properties={"a": np.zeros(2)}), "both"),
        ]
        for kwargs, match in cases:
            with pytest.raises(atp.AtpValueError, match=match):
                w.add(pos, z, **kwargs)
        with pytest.raises(atp.AtpValueError, match="0..255"):
            w.add(pos, np.array([1, 300]))
        with pytest.raises(atp.AtpValueError, match="positions"):
            w.add(np.zeros((2, 2), np.float32), z)
        with pytest.raises(atp.AtpValueError, match="positions"):
            w.add(np.zeros((2, 3), np.float16), z)
        with pytest.raises(atp.AtpValueError, match="leading dimension"):
            w.add_batch(pos[None], z[None], properties={"x": np.zeros(3)})
        assert len(w) == 0
    with pytest.raises(FileExistsError):
        atp.Writer(tmp_path / "bad.atp")
    with pytest.raises(atp.AtpValueError, match="compression"):
        atp.Writer(tmp_path / "c.atp", compression="gzip")
    with atp.open(tmp_path / "bad.atp") as f, pytest.raises(atp.ReadOnlyError):
        f.add(pos, z)


def test_append_to_refuses_invalid_header(tmp_path, golden_dir):
    path = tmp_path / "broken.atp"
    data = bytearray((golden_dir / "builtins_none.atp").read_bytes())
    data[4095] ^= 0xFF
    data[8191] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(atp.HeaderError, match="no valid header slot"):
        atp.Writer.append_to(path)


def test_value_errors_name_the_molecule_or_batch_range(tmp_path):
    path = tmp_path / "numbered.atp"
    pos = np.zeros((2, 3), np.float32)
    z = np.array([1, 8], np.uint8)
    with atp.Writer(path) as w:
        w.add(pos, z)
        w.add_batch(np.stack([pos, pos]), np.stack([z, z]))
        with pytest.raises(atp.AtpValueError,
                           match=r"numbered\.atp: molecule 3: field 'forces'"):
            w.add(pos, z, forces=np.zeros((3, 3), np.float32))
        with pytest.raises(atp.AtpValueError,
                           match=r"numbered\.atp: molecules 3\.\.6 \(batch of 4\): field 'pbc'"):
            w.add_batch(np.zeros((4, 2, 3), np.float32), np.ones((4, 2), np.uint8),
                        pbc=np.ones((4, 2), bool))
        with pytest.raises(atp.AtpValueError,
                           match=r"numbered\.atp: batch starting at molecule 3: field 'positions'"):
            w.add_batch([[[0, 0, 0]]], [[1]])
        assert len(w) == 3


@pytest.mark.parametrize("call", ["add", "add_batch"])
def test_rejected_key_leaves_the_schema_untouched(tmp_path, call):
    # the key length is checked before the schema lock takes the new field in
    path = tmp_path / "keys.atp"
    long_key = "ü" * 128  # 256 UTF-8 bytes in 128 characters
    with atp.Writer(path) as w:
        with pytest.raises(atp.AtpValueError, match="256 UTF-8 bytes"):
            if call == "add":
                w.add(np.zeros((1, 3), np.float32), [1], properties={long_key: 1.0})
            else:
                w.add_batch(np.zeros((1, 1, 3), np.float32), [[1]],
                            properties={long_key: np.ones(1)})
        w.add(np.zeros((1, 3), np.float32), [1], properties={"ok": 2.0})
    with atp.open(path) as f:
        assert len(f) == 1 and f[0].properties == {"ok": 2.0}
        assert [key for _, key in f.schema.entries] == ["ok"]


def test_a_missing_directory_is_named_as_the_user_wrote_it(tmp_path):
    target = tmp_path / "not-made-yet" / "data.atp"
    with pytest.raises(FileNotFoundError) as raised:
        atp.Writer(target)
    assert str(target) in str(raised.value) and ".writing-" not in str(raised.value)
    assert not (tmp_path / "not-made-yet").exists()
