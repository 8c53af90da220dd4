"""One type per key across a conversion: promotion, --cast, --drop-key, real conflicts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import ase.io
import atompack
import metatrain
import numpy as np
import pytest
from ase import Atoms

from pyg_atompack import atp
from pyg_atompack.cli import main
from pyg_atompack.convert import ConversionNote, ConvertError, ReadOptions, convert

# metatrain ships the reduced QM9 set of its tests inside the package: the first
# structure has mu=0 (an integer for ASE), the later ones floats.
QM9 = Path(metatrain.__file__).parent / "llpr" / "tests" / "qm9_reduced_100.xyz"


def _run_cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def cli(capsys):
    """The command line in this process: ``(exit code, stderr)`` of one call."""

    def run(*args: object) -> SimpleNamespace:
        code = main([str(arg) for arg in args])
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)

    return run


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)


def test_real_qm9_converts_with_mu_promoted_where_the_reference_fails(tmp_path):
    assert QM9.is_file(), "metatrain's qm9_reduced_100.xyz is part of the fixture"
    frames = ase.io.read(QM9, ":")
    assert np.asarray(frames[0].info["mu"]).dtype.kind == "i"
    assert np.asarray(frames[1].info["mu"]).dtype.kind == "f"

    # The reference writer stops at the second structure.
    db = atompack.Database(str(tmp_path / "reference.atp"))
    with pytest.raises(ValueError, match="mu"):
        atompack.add_ase_batch(db, frames)

    result = _run_cli("convert", QM9, tmp_path / "qm9.atp", "--energy-key", "U0")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1
    assert "'mu' promoted from an integer to a float for the whole file" in notes[0]
    assert "qm9.atp" in notes[0] and ".partial-" not in notes[0]
    with atp.open(tmp_path / "qm9.atp") as reader:
        assert len(reader) == len(frames)
        for i, atoms in enumerate(frames):
            mol = reader[i]
            assert mol.energy == atoms.info["U0"]
            assert isinstance(mol.properties["mu"], float)
            assert mol.properties["mu"] == float(atoms.info["mu"])
            assert mol.properties["alpha"] == atoms.info["alpha"]
            np.testing.assert_array_equal(mol.positions, atoms.positions)
    assert _leftovers(tmp_path) == []


def _write_xyz(path: Path, values: list) -> None:
    frames = []
    for i, value in enumerate(values):
        atoms = Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.7 + 0.01 * i]])
        atoms.info["label"] = value
        frames.append(atoms)
    ase.io.write(path, frames, format="extxyz")


def test_string_next_to_number_names_the_users_file_structure_key_and_types(tmp_path, cli):
    _write_xyz(tmp_path / "in.xyz", [1.5, 2.5, "high"])
    result = cli("convert", tmp_path / "in.xyz", tmp_path / "out.atp")
    assert result.returncode == 2
    message = result.stderr.strip()
    assert str(tmp_path / "out.atp") in message
    assert "(structure 2)" in message and "'label'" in message
    assert "holds a string" in message and "structure 0 holds a float" in message
    assert "--drop-key label" in message
    assert ".partial-" not in message
    assert not (tmp_path / "out.atp").exists() and _leftovers(tmp_path) == []

    # --drop-key keeps everything else
    result = cli("convert", tmp_path / "in.xyz", tmp_path / "out.atp", "--drop-key", "label")
    assert result.returncode == 0, result.stderr
    with atp.open(tmp_path / "out.atp") as reader:
        assert len(reader) == 3 and "properties/label" not in reader.fields


def test_cast_settles_a_key_without_promotion_notes(tmp_path):
    _write_xyz(tmp_path / "in.xyz", [1, 2, 3])
    with _no_notes():
        convert(tmp_path / "in.xyz", tmp_path / "out.atp",
                read_options=ReadOptions(casts={"label": "float64"}))
    with atp.open(tmp_path / "out.atp") as reader:
        assert [reader[i].properties["label"] for i in range(3)] == [1.0, 2.0, 3.0]
        assert all(isinstance(reader[i].properties["label"], float) for i in range(3))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ReadOptions(casts={"label": "complex"})
    # an integer cast that would change a value is refused, naming the key and structure
    _write_xyz(tmp_path / "frac.xyz", [1.0, 2.5])
    with pytest.raises(ConvertError, match=r"\(structure 1\): key 'label'.*cannot be cast "
                                           r"to int64.*not a whole number"):
        convert(tmp_path / "frac.xyz", tmp_path / "frac.atp",
                read_options=ReadOptions(casts={"label": "int64"}))
    assert not (tmp_path / "frac.atp").exists()


class _no_notes:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._catch.__exit__(*exc)
        notes = [r for r in self.records if issubclass(r.category, ConversionNote)]
        assert notes == [], [str(n.message) for n in notes]


def test_array_dtype_and_scalar_to_one_element_array_promotion_through_the_api(tmp_path):
    import torch
    from torch_geometric.data import Data

    graphs = []
    for i in range(4):
        graphs.append(Data(
            z=torch.tensor([1, 1]), pos=torch.zeros(2, 3, dtype=torch.float64),
            # a float32 vector, later float64; an integer, later a one-element array;
            # a per-atom int32 column, later float64
            vec=(torch.arange(3) + i).to(torch.float32 if i < 2 else torch.float64)[None],
            one=torch.tensor([i]) if i != 3 else torch.tensor([[3.5]], dtype=torch.float64),
            w=(torch.arange(2) * (1 if i == 0 else 1.5)).to(
                torch.int32 if i == 0 else torch.float64),
            # a builtin: float32 forces first, float64 later; a ragged tensor stays ragged
            forces=torch.full((2, 3), 0.5 + i, dtype=torch.float32 if i < 1 else torch.float64),
            t=torch.zeros(1, 2 + i, 2),
        ))
    torch.save(graphs, tmp_path / "in.pt")
    with pytest.warns(ConversionNote) as caught:
        convert(tmp_path / "in.pt", tmp_path / "out.atp")
    notes = [str(w.message) for w in caught if issubclass(w.category, ConversionNote)]
    assert any("'vec' promoted from a float32 array of shape (3,) to a float64 array" in n
               for n in notes)
    assert any("'one' promoted from an integer to a float64 array of shape (1,)" in n
               for n in notes)
    assert any("'w' promoted from a per-atom int32 array of shape (n,) to a per-atom "
               "float64 array" in n for n in notes)
    assert any("'forces' promoted from a per-atom float32 array of shape (n, 3)" in n
               for n in notes)
    with atp.open(tmp_path / "out.atp") as out:
        for i in range(4):
            mol = out[i]
            assert mol.forces.dtype == np.float64 and (mol.forces == 0.5 + i).all()
            assert mol.properties["t"].shape == (2 + i, 2)
            assert mol.properties["vec"].dtype == np.float64
            np.testing.assert_array_equal(mol.properties["vec"], np.arange(3) + i)
            np.testing.assert_array_equal(mol.properties["one"], [i if i != 3 else 3.5])
            np.testing.assert_array_equal(mol.atom_properties["w"],
                                          np.arange(2) * (1 if i == 0 else 1.5))


def test_vectors_of_different_lengths_are_a_conflict_in_words(tmp_path):
    frames = []
    for i in range(2):
        atoms = Atoms("H", positions=[[0, 0, 0]])
        atoms.info["v"] = np.zeros(3 + i)
        frames.append(atoms)
    ase.io.write(tmp_path / "in.xyz", frames, format="extxyz")
    with pytest.raises(ConvertError) as caught:
        convert(tmp_path / "in.xyz", tmp_path / "out.atp")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'out.atp'} (structure 1)")
    assert "a float64 array of shape (4,)" in message
    assert "a float64 array of shape (3,)" in message
    assert _leftovers(tmp_path) == []


def test_convert_help_shows_the_new_options(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert", "--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    for option in ("--drop-key KEY", "--cast KEY=DTYPE", "--virial-key K",
                   "--skip-target NAME"):
        assert option in shown, option


def test_format_errors_reach_the_user_without_the_temporary_name(tmp_path):
    from pyg_atompack.convert.atp_io import writer_problem

    hidden = tmp_path / ".out.atp.partial-123"
    with atp.Writer(hidden) as writer:
        writer.add(np.zeros((1, 3)), np.array([1], dtype=np.uint8), properties={"k": 1})
        with pytest.raises(atp.AtpError) as caught:
            writer.add(np.zeros((1, 3)), np.array([1], dtype=np.uint8), properties={"k": "s"})
    assert ".partial-123" in str(caught.value)
    problem = writer_problem(caught.value)
    assert ".partial-" not in problem and problem.startswith("molecule field 'k'")
