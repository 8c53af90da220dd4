"""The file model and the oracle of the `.atp` differential tests.

A :class:`FileSpec` says what goes into a file (codec, positions dtype, the
molecules of each append session) and what every molecule must read back as
(:attr:`MoleculeSpec.expected`, a plain "normal form" dict). This module writes a
spec with either library (atompack-db, the reference, or our `atp.Writer`), reads
files back into the normal form with either library, and compares normal forms
exactly. The hypothesis strategies drawing specs live in ``atp_strategies.py``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import atompack
import numpy as np

from pyg_atompack import atp
from pyg_atompack.atp import filestate

BUILTIN_KEYS = ("energy", "forces", "charges", "velocities", "cell", "stress", "pbc", "name")
CODECS = ("none", "lz4", "zstd")

@dataclass
class PropertyPlan:
    """How one custom key looks in every molecule of a file.

    Args:
        key: property key (unique across both scopes of the file).
        scope: ``"molecule"`` or ``"atom"``.
        kind: ``none``, ``int``, ``bool``, ``float``, ``str``, ``array``, ``vec3`` or ``tensor``
            (batch files also use ``float32`` / ``int32`` scalar columns).
        dtype: numpy dtype of array kinds.
        shape: per-molecule shape without the atom axis (molecule arrays and fixed tensors).
        ragged: molecule tensors only; the shape changes from molecule to molecule.
    """

    key: str
    scope: str
    kind: str
    dtype: Any = None
    shape: tuple[int, ...] = ()
    ragged: bool = False


@dataclass
class MoleculeSpec:
    """One molecule for the per-molecule write paths.

    Args:
        positions: ``(n, 3)`` float32 or float64.
        atomic_numbers: ``(n,)`` uint8.
        builtins: present builtins only; ``energy`` a Python float, ``pbc`` a tuple, ``name`` a str.
        properties: molecule-scope custom values.
        atom_properties: atom-scope custom values.
    """

    positions: np.ndarray
    atomic_numbers: np.ndarray
    builtins: dict[str, Any]
    properties: dict[str, Any]
    atom_properties: dict[str, Any]

    @property
    def expected(self) -> dict[str, Any]:
        """The normalized value every conforming reader must return."""
        out: dict[str, Any] = {"positions": self.positions, "atomic_numbers": self.atomic_numbers}
        for key in BUILTIN_KEYS:
            out[key] = self.builtins.get(key)
        if out["pbc"] is not None:
            out["pbc"] = tuple(bool(v) for v in out["pbc"])
        out["properties"] = {k: _stored_scalar(v) for k, v in self.properties.items()}
        out["atom_properties"] = dict(self.atom_properties)
        return out


@dataclass
class BatchSpec:
    """One stacked-array batch (one atom count) and what each of its molecules reads back as.

    Args:
        positions: ``(B, n, 3)``.
        atomic_numbers: ``(B, n)`` uint8.
        builtins: present builtin columns (``name`` a list of str).
        properties: molecule-scope columns, leading axis B (strings as a list).
        atom_properties: atom-scope columns ``(B, n, ...)``.
        expected: normalized per-molecule values.
    """

    positions: np.ndarray
    atomic_numbers: np.ndarray
    builtins: dict[str, Any]
    properties: dict[str, Any]
    atom_properties: dict[str, Any]
    expected: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.positions)


@dataclass
class FileSpec:
    """A whole file: created by the first session, each later session appends after reopen.

    Args:
        codec: ``none``, ``lz4`` or ``zstd``.
        level: zstd level (ignored by the other codecs).
        positions_dtype: float32, or float64 (record format 3).
        sessions: per session, a list of :class:`MoleculeSpec` or of :class:`BatchSpec`.
        one_by_one: per session, whether atompack gets ``add_molecule`` calls (else one
            ``add_molecules`` call).
    """

    codec: str
    level: int
    positions_dtype: Any
    sessions: list[list[Any]]
    one_by_one: list[bool]

    @property
    def expected(self) -> list[dict[str, Any]]:
        """Normalized values of all molecules in file order."""
        out: list[dict[str, Any]] = []
        for session in self.sessions:
            for item in session:
                out.extend(item.expected if isinstance(item, BatchSpec) else [item.expected])
        return out


def _stored_scalar(value: Any) -> Any:
    # bools are stored as i64 0/1 (tag 1) and read back as ints
    return int(value) if isinstance(value, bool) else value


# ---------------------------------------------------------------- writing with either library

def _atompack_molecule(spec: MoleculeSpec) -> atompack.Molecule:
    molecule = atompack.Molecule.from_arrays(spec.positions, spec.atomic_numbers, **spec.builtins)
    for key, value in spec.properties.items():
        molecule.set_property(key, value, scope="molecule")
    for key, value in spec.atom_properties.items():
        molecule.set_property(key, value, scope="atom")
    return molecule


def _our_builtins(builtins: dict[str, Any]) -> dict[str, Any]:
    out = dict(builtins)
    if "pbc" in out:
        out["pbc"] = np.asarray(out["pbc"], dtype=bool)
    return out


def write_session_atompack(path: Path, spec: FileSpec, session: int) -> None:
    """Write one session with atompack-db: create (session 0) or reopen to append, then flush."""
    if session == 0:
        db = atompack.Database(str(path), compression=spec.codec, level=spec.level,
                               overwrite=True)
    else:
        db = atompack.Database.open(str(path), mmap=False)
    items = spec.sessions[session]
    if items and isinstance(items[0], BatchSpec):
        for batch in items:
            db.add_arrays_batch(batch.positions, batch.atomic_numbers, **batch.builtins,
                                properties=batch.properties or None,
                                atom_properties=batch.atom_properties or None)
    elif spec.one_by_one[session]:
        for molecule in items:
            db.add_molecule(_atompack_molecule(molecule))
    elif items:
        db.add_molecules([_atompack_molecule(molecule) for molecule in items])
    db.flush()
    del db


def write_session_ours(path: Path, spec: FileSpec, session: int) -> None:
    """Write one session with `atp.Writer`: create (session 0) or `append_to`, then flush."""
    if session == 0:
        writer = atp.Writer(path, compression=spec.codec, level=spec.level, overwrite=True)
    else:
        writer = atp.Writer.append_to(path)
    with writer as w:
        for item in spec.sessions[session]:
            if isinstance(item, BatchSpec):
                w.add_batch(item.positions, item.atomic_numbers, **_our_builtins(item.builtins),
                            properties=item.properties, atom_properties=item.atom_properties)
            else:
                w.add(item.positions, item.atomic_numbers, **_our_builtins(item.builtins),
                      properties=item.properties, atom_properties=item.atom_properties)
        # leaving the block flushes once, like the single flush() of the atompack session


def write_file(path: Path, spec: FileSpec, writers: Sequence[str | None]) -> None:
    """Write the sessions of ``spec``; ``writers[s]`` (``atompack``/``ours``) writes session s,
    ``None`` skips it (already in the file)."""
    for session in range(len(spec.sessions)):
        if writers[session] is None:
            continue
        if writers[session] == "atompack":
            write_session_atompack(path, spec, session)
        else:
            write_session_ours(path, spec, session)


# ---------------------------------------------------------------- reading into one normal form

# "auto-cold": access="auto" with every batch taken for not resident (concurrent preads)
ACCESS_MODES = ("auto", "auto-cold", "mmap", "pread", "bytes")


def open_reader(path: Path, access: str) -> Any:
    """Open ``path`` with our reader: ``auto``/``mmap``/``pread`` file access, ``auto-cold``
    (``auto`` taking every batch for not in memory), or ``bytes`` for `Reader.from_bytes`
    over the whole image (the streaming path)."""
    if access == "bytes":
        return atp.Reader.from_bytes(path.read_bytes(), name=path.name)
    if access in ("auto", "auto-cold"):
        # test files are small: lower the size from which "auto" advises random access
        saved, filestate.RANDOM_ADVICE_BYTES = filestate.RANDOM_ADVICE_BYTES, 0
        try:
            reader = atp.open(path, access="auto")
            reader._state()
        finally:
            filestate.RANDOM_ADVICE_BYTES = saved
        if access == "auto-cold":
            reader._state().resident = lambda offset, length: False
        return reader
    return atp.open(path, access=access)


def _atompack_name(db: atompack.Database, index: int) -> str | None:
    # atompack has no name getter; get_molecules_flat refuses some tensor layouts, so fall
    # back to a property-free copy of the molecule in a scratch file (copied byte-for-byte)
    try:
        return db.get_molecules_flat([index]).get("name", [None])[0]
    except ValueError:
        pass
    owned = db[index].to_owned()
    for key in owned.property_keys():
        owned.delete_property(key)
    with tempfile.TemporaryDirectory() as scratch:
        copy = atompack.Database(str(Path(scratch) / "name.atp"))
        copy.add_molecule(owned)
        copy.flush()
        del copy
        return atompack.Database.open(str(Path(scratch) / "name.atp")).get_molecules_flat(
            [0]).get("name", [None])[0]


def read_atompack(path: Path) -> list[dict[str, Any]]:
    """Every molecule of ``path`` as atompack-db reads it, in the normal form."""
    db = atompack.Database.open(str(path))
    out = []
    for index in range(len(db)):
        molecule = db[index]
        item: dict[str, Any] = {"positions": molecule.positions,
                                "atomic_numbers": molecule.atomic_numbers}
        for key in BUILTIN_KEYS[:-1]:
            item[key] = getattr(molecule, key)
        item["name"] = _atompack_name(db, index)
        for scope, target in (("molecule", "properties"), ("atom", "atom_properties")):
            item[target] = {key: molecule.get_property(key)
                            for key in molecule.property_keys(scope=scope)}
        out.append(item)
    return out


def normalize_ours(molecule: Any) -> dict[str, Any]:
    """One molecule returned by our reader (``f[i]``) in the normal form."""
    item: dict[str, Any] = {"positions": molecule.positions,
                            "atomic_numbers": molecule.atomic_numbers}
    for key in BUILTIN_KEYS:
        item[key] = getattr(molecule, key)
    if item["pbc"] is not None:
        item["pbc"] = tuple(bool(v) for v in np.asarray(item["pbc"]).reshape(-1))
    item["properties"] = dict(molecule.properties)
    item["atom_properties"] = dict(molecule.atom_properties)
    return item


# ---------------------------------------------------------------- exact comparison

def same_values(got: Any, want: Any) -> bool:
    """Exact equality: dtype, shape and every bit (any NaN equals any NaN, -0.0 != 0.0)."""
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if want.dtype.kind != "f":
            return bool(np.array_equal(got, want))
        both_nan = np.isnan(got) & np.isnan(want)
        same_bits = got.view(f"u{want.dtype.itemsize}") == want.view(f"u{want.dtype.itemsize}")
        return bool(np.all(both_nan | same_bits))
    if want is None or isinstance(want, str):
        return got == want and type(got) is type(want)
    if isinstance(want, float):
        if not isinstance(got, float | np.floating):
            return False
        return same_values(np.array([got], np.float64), np.array([want], np.float64))
    if isinstance(want, int):
        return isinstance(got, int | np.integer) and not isinstance(got, bool) and got == want
    if isinstance(want, tuple):
        return tuple(got) == want
    raise TypeError(f"unexpected expected value {want!r}")


def describe(value: Any) -> str:
    """Short text for an assertion message."""
    if isinstance(value, np.ndarray):
        return f"ndarray {value.dtype}{value.shape} {np.array2string(value.ravel()[:6])}"
    return f"{type(value).__name__} {value!r}"[:200]


def assert_same_molecule(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    """Assert two normal-form molecules are identical; the message names field and values."""
    for key in ("positions", "atomic_numbers", *BUILTIN_KEYS):
        if want[key] is None:
            assert got[key] is None, f"{where}: {key} should be absent, got {describe(got[key])}"
        else:
            assert same_values(got[key], want[key]), (
                f"{where}: {key}: got {describe(got[key])}, want {describe(want[key])}")
    for scope in ("properties", "atom_properties"):
        assert sorted(got[scope]) == sorted(want[scope]), (
            f"{where}: {scope} keys {sorted(got[scope])} != {sorted(want[scope])}")
        for key, value in want[scope].items():
            assert same_values(got[scope][key], value), (
                f"{where}: {scope}[{key!r}]: got {describe(got[scope][key])}, "
                f"want {describe(value)}")
