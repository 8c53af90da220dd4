"""metatrain ``MemmapDataset`` directories: the layout (numpy only).

Layout (as written by metatrain's ``MemmapWriter`` and its tutorials)::

    ns.npy      number of structures, a 0-d (or 1-element) integer array
    na.npy      int64 cumulative atom counts, shape (ns + 1,)
    x.bin       float32 positions, (na[-1], 3)
    a.bin       int32 atomic types, (na[-1],)
    c.bin       optional float32 cells, (ns, 3, 3); an axis is periodic when
                its cell row is non-zero; no c.bin means no cell and no pbc
    <key>.bin   float32 targets, per structure (ns, ..., k) or per atom
                (na[-1], ..., k); forces hold F itself, stress is (ns, 3, 3)

Which ``<key>.bin`` means what is not stored by metatrain, so it is a
parameter. Writers of this package add ``pyg_atompack_memmap.json`` naming the
keys and their shapes; metatrain ignores it.

This module imports neither torch nor torch_geometric (numpy and
:mod:`pyg_atompack.atp.types` only), and it lives outside ``data/`` so that a
memmap → `.atp` conversion (:mod:`pyg_atompack.convert.memmap`) never loads the
torch layer: torch_geometric replaces ``torch.index_select`` on import, which
breaks metatrain's TorchScript readers afterwards (docs/guides/converting.md, "Using it next to
metatrain"). :class:`~pyg_atompack.MemmapDataset` (:mod:`pyg_atompack.data.memmap`)
reads through it too.
"""

from __future__ import annotations

import io
import json
import math
import os
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack.atp.types import BUILTINS

__all__ = ["MemmapLayout", "MemmapLayoutError", "MemmapKey", "SIDECAR_NAME", "expand_voigt",
           "load_npy"]

SIDECAR_NAME = "pyg_atompack_memmap.json"
SIDECAR_FORMAT = "pyg_atompack-memmap/1"
# attribute -> metatrain writer's file stem, used when no keys are given
DEFAULT_KEYS = {"energy": "energy", "forces": "energy_forces", "stress": "energy_stress"}
# builtin attribute -> (per_atom, shape of one value), for the numeric labels a target
# file can hold (the geometry comes from x.bin, a.bin and c.bin)
BUILTIN_SHAPES = {name: (field.per_atom, field.shape) for name, field in BUILTINS.items()
                  if not field.geometry and field.shape is not None}


_NPY_HEADERS = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}


def load_npy(raw: bytes | bytearray | memoryview) -> np.ndarray:
    """The array of an ``.npy`` file held in memory, never larger than its bytes.

    ``np.load`` allocates what the header claims before reading: a 100-byte file whose
    header says ``(2**40,)`` raises numpy's ``MemoryError``, and ``(2**28, 3)`` really
    allocates gigabytes. Here the shape is checked against the bytes that follow the
    header first, and the array views those bytes (writable when ``raw`` is a
    :class:`bytearray`).

    Args:
        raw (bytes | bytearray | memoryview): The whole ``.npy`` file.

    Returns:
        The array.

    Raises:
        ValueError: Not a version 1 or 2 ``.npy`` file, a dtype of Python objects, or a
            shape that needs more bytes than follow the header (the message says which).
    """
    handle = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(handle)
        if version not in _NPY_HEADERS:
            raise ValueError(f"unsupported .npy version {version[0]}.{version[1]}")
        shape, fortran_order, dtype = _NPY_HEADERS[version](handle)
    # numpy's header parser: a damaged header dict can also stop its tokenizer
    except (ValueError, SyntaxError, TypeError, tokenize.TokenError) as exc:
        raise ValueError(f"not a readable .npy array ({exc})") from None
    if dtype.hasobject:
        raise ValueError(f"holds Python objects ({dtype}), which are never read")
    start = handle.tell()
    count = math.prod(shape)
    available = len(raw) - start
    if count * dtype.itemsize > available or count > available:
        raise ValueError(f"its header claims shape {shape} of {dtype} "
                         f"({count * dtype.itemsize} bytes), but {available} bytes follow")
    if count == 0:
        return np.empty(shape, dtype=dtype)
    array = np.frombuffer(raw, dtype=dtype, count=count, offset=start)
    return array.reshape(shape, order="F" if fortran_order else "C")


class MemmapLayoutError(ValueError):
    """A memmap directory whose files disagree with each other.

    Args:
        path (str or os.PathLike): The file or directory at fault.
        problem (str): What is wrong.
    """

    def __init__(self, path: str | os.PathLike, problem: str) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class MemmapKey:
    """Where one attribute lives in a memmap directory.

    Args:
        attribute (str): The ``Data`` attribute / structure field it fills.
        stem (str): The file stem (``<stem>.bin``).
        per_atom (bool): Whether rows are atoms (else structures).
        shape (tuple[int, ...]): Shape of one atom's or one structure's value.
    """

    attribute: str
    stem: str
    per_atom: bool
    shape: tuple[int, ...]


def is_memmap_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory with the memmap index files."""
    path = Path(path)
    return path.is_dir() and (path / "ns.npy").is_file() and (path / "na.npy").is_file()


class MemmapLayout:
    """Checks a memmap directory once and slices single structures out of it.

    Arrays are memory-mapped lazily, so the object pickles cheaply (each
    DataLoader worker maps the files itself).

    Args:
        path (str or os.PathLike): The directory.
        keys (Mapping[str, str] or Sequence[str], optional): Which targets to read: ``None`` takes
            the keys of ``pyg_atompack_memmap.json`` when present, else metatrain's writer names
            (``energy.bin``, ``energy_forces.bin``, ``energy_stress.bin``) that exist. A mapping is
            ``attribute -> stem`` and a sequence lists stems used as attribute names; a stem may
            end in ``@atom`` or ``@structure`` to settle whether its rows are atoms or structures.
            Named files must exist. (default: :obj:`None`)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Mapping[str, str] | Sequence[str] | None = None,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MemmapLayoutError(self.path, "not a directory")
        self.ns = self._load_ns()
        self.na = self._load_na()
        self.total_atoms = int(self.na[-1])
        self._check_size("x.bin", self.total_atoms * 3 * 4, f"{self.total_atoms} atoms × 3")
        self._check_size("a.bin", self.total_atoms * 4, f"{self.total_atoms} atoms")
        self.has_cell = (self.path / "c.bin").is_file()
        if self.has_cell:
            self._check_size("c.bin", self.ns * 9 * 4, f"{self.ns} structures × 3 × 3")
        self.sidecar = self._load_sidecar()
        self.keys = self._resolve_keys(keys)
        self._arrays: dict[str, np.ndarray] = {}

    # ----------------------------------------------------------------- checks
    @staticmethod
    def _load_npy(file: Path) -> np.ndarray:
        """An index file, within its bytes (:func:`load_npy`)."""
        try:
            return load_npy(file.read_bytes())
        except (OSError, ValueError) as exc:
            raise MemmapLayoutError(file, f"unreadable: {exc}") from exc

    def _load_ns(self) -> int:
        file = self.path / "ns.npy"
        ns = self._load_npy(file)
        if ns.shape not in ((), (1,)) or ns.dtype.kind not in "iu":
            raise MemmapLayoutError(file, f"expected one integer, got {ns.dtype} {ns.shape}")
        if int(ns.reshape(())) < 0:
            raise MemmapLayoutError(file, f"a negative structure count ({int(ns.reshape(()))})")
        return int(ns.reshape(()))

    def _load_na(self) -> np.ndarray:
        file = self.path / "na.npy"
        na = self._load_npy(file)
        if na.shape != (self.ns + 1,) or na.dtype.kind not in "iu":
            raise MemmapLayoutError(
                file, f"expected {self.ns + 1} integers (ns + 1), got {na.dtype} {na.shape}"
            )
        if na.dtype.kind == "u" and na.dtype.itemsize == 8 and np.any(na > np.iinfo(np.int64).max):
            raise MemmapLayoutError(file, "atom counts beyond int64")
        na = na.astype(np.int64)
        if na[0] != 0 or np.any(np.diff(na) < 0):
            raise MemmapLayoutError(file, "cumulative atom counts must start at 0 and not decrease")
        return na

    def _check_size(self, name: str, expected: int, what: str) -> None:
        file = self.path / name
        if not file.is_file():
            raise MemmapLayoutError(file, "missing")
        size = file.stat().st_size
        if size != expected:
            raise MemmapLayoutError(
                file,
                f"holds {size} bytes but na.npy/ns.npy imply {expected} ({what} float32/int32)",
            )

    def _load_sidecar(self) -> dict[str, Any] | None:
        file = self.path / SIDECAR_NAME
        if not file.is_file():
            return None
        try:
            sidecar = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise MemmapLayoutError(file, f"unreadable: {exc}") from exc
        if sidecar.get("format") != SIDECAR_FORMAT:
            return None
        return sidecar

    def _resolve_keys(self, keys: Mapping[str, str] | Sequence[str] | None) -> list[MemmapKey]:
        if keys is None:
            if self.sidecar is not None:
                described = []
                for attr, spec in self.sidecar.get("keys", {}).items():
                    rows = "atom" if spec["per_atom"] else "structure"
                    stem = f"{spec['stem']}@{rows}"
                    described.append(self._describe_key(attr, stem, tuple(spec["shape"])))
                return described
            return [
                self._describe_key(attr, stem)
                for attr, stem in DEFAULT_KEYS.items()
                if (self.path / f"{stem}.bin").is_file()
            ]
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, Mapping):
            keys = {stem.split("@")[0]: stem for stem in keys}
        return [self._describe_key(attr, stem) for attr, stem in keys.items()]

    def _describe_key(
        self, attribute: str, stem: str, shape: tuple[int, ...] | None = None
    ) -> MemmapKey:
        stem, _, rows = stem.partition("@")
        if rows not in ("", "atom", "structure"):
            raise MemmapLayoutError(self.path, f"key {stem!r}: unknown row kind @{rows}")
        file = self.path / f"{stem}.bin"
        if not file.is_file():
            raise MemmapLayoutError(file, f"key {stem!r} is not present")
        n_values = file.stat().st_size // 4
        if file.stat().st_size % 4:
            raise MemmapLayoutError(file, "size is not a whole number of float32 values")
        if attribute in BUILTIN_SHAPES:
            per_atom, builtin_shape = BUILTIN_SHAPES[attribute]
            rows_count = self.total_atoms if per_atom else self.ns
            expected = rows_count * int(np.prod(builtin_shape, dtype=np.int64))
            if attribute == "stress" and n_values == self.ns * 6:
                return MemmapKey(attribute, stem, False, (6,))  # Voigt, expanded on read
            if n_values != expected:
                unit = "atoms" if per_atom else "structures"
                raise MemmapLayoutError(
                    file,
                    f"{attribute} needs {rows_count} {unit} × {builtin_shape or 1} float32 "
                    f"values, found {n_values}",
                )
            return MemmapKey(attribute, stem, per_atom, builtin_shape)
        if shape is not None:
            per_atom = rows == "atom"
        else:
            fits_atoms = self.total_atoms > 0 and n_values % self.total_atoms == 0
            fits_structures = self.ns > 0 and n_values % self.ns == 0
            if rows:
                per_atom = rows == "atom"
            elif fits_atoms and fits_structures and self.total_atoms != self.ns:
                raise MemmapLayoutError(
                    file,
                    f"key {stem!r} could hold per-atom or per-structure values; "
                    f"write it as {stem}@atom or {stem}@structure",
                )
            else:
                per_atom = fits_atoms and not fits_structures
            rows_count = self.total_atoms if per_atom else self.ns
            if rows_count == 0 or n_values % rows_count:
                raise MemmapLayoutError(
                    file, f"{n_values} values do not split into {rows_count} rows"
                )
            width = n_values // rows_count
            shape = () if width == 1 else (width,)
        return MemmapKey(attribute, stem, per_atom, tuple(shape))

    # ---------------------------------------------------------------- access
    def _array(self, stem: str, rows: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        array = self._arrays.get(stem)
        if array is None:
            file = self.path / f"{stem}.bin"
            if rows == 0:
                array = np.zeros((0, *shape), dtype=dtype)
            else:
                array = np.memmap(file, dtype=dtype, mode="r", shape=(rows, *shape))
            self._arrays[stem] = array
        return array

    def __len__(self) -> int:
        return self.ns

    def structure(self, index: int) -> dict[str, Any]:
        """Owned arrays of one structure.

        Args:
            index (int): Structure index, ``0 <= index < ns`` (negative counts back).

        Returns:
            ``positions`` (float32), ``atomic_numbers``, ``cell``/``pbc`` (when
            ``c.bin`` exists) and one entry per key.
        """
        if index < 0:
            index += self.ns
        if not 0 <= index < self.ns:
            raise IndexError(f"{self.path}: structure {index} out of range for {self.ns}")
        start, stop = int(self.na[index]), int(self.na[index + 1])
        values: dict[str, Any] = {
            "positions": np.array(self._array("x", self.total_atoms, (3,), "<f4")[start:stop]),
            "atomic_numbers": np.array(self._array("a", self.total_atoms, (), "<i4")[start:stop]),
        }
        if self.has_cell:
            cell = np.array(self._array("c", self.ns, (3, 3), "<f4")[index])
            values["cell"] = cell
            values["pbc"] = np.any(cell != 0.0, axis=1)
        for key in self.keys:
            rows = self.total_atoms if key.per_atom else self.ns
            array = self._array(key.stem, rows, key.shape, "<f4")
            values[key.attribute] = (
                np.array(array[start:stop]) if key.per_atom else np.array(array[index])
            )
        return values

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_arrays"] = {}  # memory maps are re-created in the unpickling process
        return state

    def __repr__(self) -> str:
        keys = ", ".join(f"{k.attribute}={k.stem}.bin" for k in self.keys)
        return f"MemmapLayout({str(self.path)!r}, ns={self.ns}, keys=[{keys}])"


def expand_voigt(voigt: np.ndarray) -> np.ndarray:
    """ASE-order Voigt ``xx, yy, zz, yz, xz, xy`` to a symmetric 3×3 tensor."""
    xx, yy, zz, yz, xz, xy = voigt
    return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]], dtype=voigt.dtype)


