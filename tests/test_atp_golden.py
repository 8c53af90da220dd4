"""Every golden file written by atompack-db reads back exactly as expected.json says."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.atp import cache

ACCESS = ("mmap", "pread", "memory")
BUILTIN_ARRAYS = ("forces", "charges", "velocities", "cell", "stress")


def _golden_files(expected: dict) -> list[str]:
    return sorted(expected["files"])


def _open(golden_dir, rel: str, access: str):
    path = golden_dir / rel
    if access == "memory":
        return atp.Reader.from_bytes(path.read_bytes(), name=rel)
    return atp.open(path, access=access)


def _assert_array(actual, value, dtype: str, where: str) -> None:
    assert isinstance(actual, np.ndarray), where
    assert actual.dtype == np.dtype(dtype), f"{where}: {actual.dtype} != {dtype}"
    np.testing.assert_array_equal(actual, np.asarray(value, dtype=dtype).reshape(actual.shape),
                                  err_msg=where)
    assert actual.shape == np.asarray(value, dtype=dtype).shape or actual.size == 0, where


def _assert_custom(actual, spec: dict, where: str) -> None:
    kind = spec["kind"]
    if kind == "none":
        assert actual is None, where
    elif kind == "int":
        assert type(actual) is int and actual == spec["value"], where
    elif kind == "float":
        assert type(actual) is float and actual == spec["value"], where
    elif kind == "str":
        assert type(actual) is str and actual == spec["value"], where
    else:
        assert isinstance(actual, np.ndarray), where
        assert actual.dtype == np.dtype(spec["dtype"]), where
        assert list(actual.shape) == spec["shape"], where
        np.testing.assert_array_equal(actual, np.asarray(spec["value"], dtype=spec["dtype"])
                                      .reshape(spec["shape"]), err_msg=where)


def assert_molecule(mol: atp.Molecule, exp: dict, where: str) -> None:
    """Compare one decoded molecule with its expected.json entry."""
    assert mol.n_atoms == exp["n_atoms"], where
    _assert_array(mol.positions, exp["positions"], exp["positions_dtype"], f"{where} positions")
    assert mol.positions.shape == (exp["n_atoms"], 3)
    _assert_array(mol.atomic_numbers, exp["atomic_numbers"], "uint8", f"{where} Z")
    if "energy" in exp:
        assert type(mol.energy) is float and mol.energy == exp["energy"], where
    else:
        assert mol.energy is None, where
    for key in BUILTIN_ARRAYS:
        if key in exp:
            _assert_array(getattr(mol, key), exp[key], exp[f"{key}_dtype"], f"{where} {key}")
            expected_shape = np.asarray(exp[key]).shape
            if key in ("forces", "velocities"):
                expected_shape = (exp["n_atoms"], 3)
            assert getattr(mol, key).shape == expected_shape, f"{where} {key}"
        else:
            assert getattr(mol, key) is None, f"{where} {key}"
    if "pbc" in exp:
        assert mol.pbc == tuple(exp["pbc"]), where
    else:
        assert mol.pbc is None, where
    assert mol.name == exp.get("name"), where
    props = exp.get("properties", {})
    assert sorted(mol.properties) == sorted(props), where
    for key, spec in props.items():
        _assert_custom(mol.properties[key], spec, f"{where} properties/{key}")
    atom_props = exp.get("atom_properties", {})
    assert sorted(mol.atom_properties) == sorted(atom_props), where
    for key, spec in atom_props.items():
        _assert_custom(mol.atom_properties[key], spec, f"{where} atom_properties/{key}")


@pytest.mark.parametrize("access", ACCESS)
def test_every_golden_molecule(golden_dir, golden_expected, access):
    for rel in _golden_files(golden_expected):
        spec = golden_expected["files"][rel]
        with _open(golden_dir, rel, access) as f:
            assert len(f) == spec["n_molecules"], rel
            np.testing.assert_array_equal(
                f.n_atoms, [m["n_atoms"] for m in spec["molecules"]])
            assert f.n_atoms.dtype == np.int64
            for i, exp in enumerate(spec["molecules"]):
                assert_molecule(f[i], exp, f"{rel}[{i}] via {access}")
                assert_molecule(f[i - len(f)], exp, f"{rel}[{i - len(f)}] via {access}")


def test_pread_arrays_are_writable_and_mmap_views_read_only(golden_dir):
    with atp.open(golden_dir / "builtins_none.atp", access="pread") as f:
        assert f[2].positions.flags.writeable and f[2].forces.flags.writeable
    with atp.open(golden_dir / "builtins_zstd.atp", access="pread") as f:
        assert f[2].positions.flags.writeable
    with atp.open(golden_dir / "builtins_none.atp") as f:
        assert not f[2].positions.flags.writeable


def _expected_batch_value(exp_mols, key):
    return [m.get(key) for m in exp_mols]


@pytest.mark.parametrize("access", ACCESS)
def test_read_batch_matches_expected(golden_dir, golden_expected, access):
    for rel in _golden_files(golden_expected):
        spec = golden_expected["files"][rel]
        mols = spec["molecules"]
        if not mols:
            continue
        order = list(range(len(mols)))[::-1] + [0]
        with _open(golden_dir, rel, access) as f:
            flat = f.read_batch(order)
            counts = [mols[i]["n_atoms"] for i in order]
            np.testing.assert_array_equal(flat["n_atoms"], counts)
            starts = np.concatenate([[0], np.cumsum(counts)])
            for j, i in enumerate(order):
                exp = mols[i]
                a, b = starts[j], starts[j + 1]
                where = f"{rel} batch row {j} (molecule {i}) via {access}"
                _assert_array(flat["positions"][a:b], exp["positions"],
                              exp["positions_dtype"], where)
                _assert_array(flat["atomic_numbers"][a:b], exp["atomic_numbers"], "uint8", where)
                for key in ("forces", "charges", "velocities"):
                    if key in exp:
                        assert flat["mask"][key][j], where
                        _assert_array(flat[key][a:b], exp[key], exp[f"{key}_dtype"], where)
                    elif key in flat:
                        assert not flat["mask"][key][j], where
                        assert not np.any(flat[key][a:b]), where
                for key in ("cell", "stress"):
                    if key in exp:
                        _assert_array(flat[key][j], exp[key], exp[f"{key}_dtype"], where)
                    elif key in flat:
                        assert not flat["mask"][key][j] and not np.any(flat[key][j]), where
                if "energy" in exp:
                    assert flat["energy"][j] == exp["energy"] and flat["mask"]["energy"][j]
                elif "energy" in flat:
                    assert flat["energy"][j] == 0 and not flat["mask"]["energy"][j], where
                if "pbc" in exp:
                    assert flat["pbc"].dtype == bool
                    assert tuple(flat["pbc"][j]) == tuple(exp["pbc"]), where
                if "name" in flat:
                    assert flat["name"][j] == exp.get("name"), where
                for group in ("properties", "atom_properties"):
                    for key, pspec in exp.get(group, {}).items():
                        value = flat[group][key]
                        assert flat["mask"][f"{group}/{key}"][j], where
                        if group == "atom_properties":
                            got = value[j] if isinstance(value, list) else value[a:b]
                        else:
                            got = value[j]
                        if isinstance(got, np.generic):
                            got = got.item()
                        if pspec["kind"] in ("int", "float") and not isinstance(value, list):
                            assert got == pspec["value"], where
                        else:
                            _assert_custom(got, pspec, f"{where} {group}/{key}")


def test_read_batch_sparse_builtins_zero_fills_and_masks(golden_dir):
    # atompack's get_molecules_flat fails on [0, 1, 2]; we zero-fill and report the mask
    with atp.open(golden_dir / "sparse_builtins.atp") as f:
        flat = f.read_batch([0, 1, 2])
        assert flat["mask"]["forces"].tolist() == [True, False, True]
        counts = flat["n_atoms"].tolist()
        assert flat["forces"].shape == (sum(counts), 3)
        assert not flat["forces"][counts[0]:counts[0] + counts[1]].any()
        assert flat["name"][1] is None
        assert flat["mask"]["energy"].all()


def test_read_batch_fields_restrict_output(golden_dir):
    with atp.open(golden_dir / "custom_props_none.atp") as f:
        flat = f.read_batch([2, 0], fields=["energy", "p_str", "atom_properties/a_vec3f32"])
        assert set(flat) == {"n_atoms", "positions", "atomic_numbers", "energy", "properties",
                             "atom_properties", "mask"}
        assert flat["properties"] == {"p_str": [m.properties["p_str"] for m in (f[2], f[0])]}
        assert flat["atom_properties"]["a_vec3f32"].shape == (6, 3)
        assert set(flat["mask"]) == {"energy", "properties/p_str", "atom_properties/a_vec3f32"}
        # p_ragged has different shapes per molecule: returned as a list
        ragged = f.read_batch([0, 1, 2], fields=["p_ragged", "p_int"])
        assert isinstance(ragged["properties"]["p_ragged"], list)
        assert ragged["mask"]["properties/p_int"].tolist() == [True, True, False]
        assert ragged["properties"]["p_int"][2] == 0
        with pytest.raises(atp.AtpValueError, match="nope"):
            f.read_batch([0], fields=["nope"])


def test_format_facts(golden_dir, golden_expected):
    for rel in _golden_files(golden_expected):
        facts = golden_expected["files"][rel]["format_facts"]
        with atp.open(golden_dir / rel) as f:
            h = f.header
            assert h.slot == facts["chosen_slot"], rel
            assert h.generation == facts["generation"], rel
            assert f.codec == facts["codec"] and h.level == facts["codec_level_field"], rel
            assert h.record_format == facts["record_format"], rel
            assert (h.schema_offset, h.schema_len) == (facts["schema_offset"],
                                                       facts["schema_len"]), rel
            assert (h.index_offset, h.index_len) == (facts["index_offset"],
                                                     facts["index_len"]), rel
            assert f.index.tolist() == [tuple(e) for e in facts["index"]], rel
            if facts.get("schema_sections") is not None:
                entries = [[e.kind, e.key, e.tag, e.per_atom, e.elem_bytes, e.slot_bytes]
                           for e in f.schema.sorted_entries()]
                assert entries == facts["schema_sections"], rel
                assert f.schema.positions_tag == facts["positions_type_tag"], rel
            else:
                assert f.schema is None, rel
            for i, sections in enumerate(facts.get("record_sections", [])):
                layout = cache.record(f._state(), i)[2]
                assert [[s.kind, s.key, s.tag] for s in layout.slots] == sections, rel


def test_schema_less_fields_are_rebuilt_from_records(golden_dir, golden_expected):
    with atp.open(golden_dir / "legacy" / "v021_none.atp") as old, \
            atp.open(golden_dir / "legacy" / "v031_none.atp") as new:
        assert old.schema is None
        assert old.fields == new.fields
        assert "properties/p_str" in old.fields
        assert old.fields["properties/p_f64arr"].shape == (3,)


def test_sharded_directory(golden_dir, golden_expected):
    spec = golden_expected["sharded_reader"]
    for access in ("mmap", "pread"):
        with atp.open(golden_dir / "sharded", access=access) as f:
            assert isinstance(f, atp.ShardedReader)
            assert len(f) == spec["n_molecules"]
            rel = [str(p.relative_to(golden_dir)) for p in atp.find_shards(golden_dir / "sharded")]
            assert rel == spec["shard_order"]
            assert [f[i].energy for i in range(len(f))] == spec["energies"]
            assert f[-1].energy == spec["energies"][-1]
            flat = f.read_batch([5, 0, 3, 1])
            np.testing.assert_array_equal(flat["energy"],
                                          [spec["energies"][i] for i in (5, 0, 3, 1)])
            assert flat["positions"].shape == (8, 3)
            assert f.n_atoms.tolist() == [2] * 6
            restored = pickle.loads(pickle.dumps(f))
            assert restored[4].energy == spec["energies"][4]
            with pytest.raises(atp.AtpIndexError):
                f[6]


def test_special_files(golden_dir):
    with atp.open(golden_dir / "empty_noflush.atp") as f:
        assert len(f) == 0 and f.header.slot == "A" and f.header.generation == 0
        flat = f.read_batch([])
        assert flat["positions"].shape == (0, 3)
        with pytest.raises(atp.AtpIndexError):
            f[0]
    with atp.open(golden_dir / "empty.atp") as f:
        assert len(f) == 0 and f.n_atoms.shape == (0,)
    with atp.open(golden_dir / "corrupt_newest_slot.atp") as f:
        assert len(f) == 1 and f.header.slot == "B"
    with atp.open(golden_dir / "unflushed_tail.atp") as f:
        assert len(f) == 2
        with pytest.raises(IndexError):
            f[2]
    with atp.open(golden_dir / "zero_atoms.atp") as f:
        assert f[0].positions.shape == (0, 3) and f[0].atomic_numbers.shape == (0,)
        flat = f.read_batch([0, 1, 0])
        assert flat["positions"].shape == (2, 3) and flat["energy"].shape == (3,)


def test_describe_and_verify(golden_dir, golden_expected):
    for rel in _golden_files(golden_expected):
        info = atp.describe(golden_dir / rel)
        facts = golden_expected["files"][rel]["format_facts"]
        assert info["chosen_slot"] == facts["chosen_slot"]
        assert info["num_molecules"] == facts["num_molecules"]
        assert info["file_size"] == golden_expected["files"][rel]["size_bytes"]
        problems = atp.verify(golden_dir / rel)
        if rel == "corrupt_newest_slot.atp":
            assert any("slot A" in p and "checksum" in p for p in problems), problems
        elif rel == "unflushed_tail.atp":
            assert any("uncommitted" in p for p in problems), problems
        else:
            assert problems == [], (rel, problems)
    info = atp.describe(golden_dir / "append_reopen_zstd.atp")
    assert info["stale_bytes"] > 0 and info["uncommitted_tail_bytes"] == 0
    assert [s["valid"] for s in info["slots"]] == [True, True]
