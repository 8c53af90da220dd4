"""metatrain ``DiskDataset`` zip files, read with ``zipfile`` and numpy only.

Layout: folders ``0/ .. N-1/``, each with ``system.mta`` (itself a zip of
``positions.npy``, ``cell.npy``, ``types.npy``, ``pbc.npy``) and one
``<target>.mts`` per target: an ``np.save``d uint8 array whose bytes are a
metatensor NPZ (``keys.npy``, ``blocks/<b>/values.npy``, ``samples.npy``,
``components/<j>.npy``, ``properties.npy``, gradients under
``blocks/<b>/gradients/<parameter>/``). For the energy target, the
``positions`` gradient is −F and the ``strain`` gradient is stress × volume.

A zip is untrusted input: a few kilobytes of nested deflate streams can inflate to
gigabytes, and an ``.npy`` header can claim any shape. So no member, at any depth
(``N/system.mta``, ``N/<target>.mts`` and the ``.npy`` members inside them), may
declare or inflate to more than :data:`MEMBER_FLOOR` + :data:`MEMBER_RATIO` × the
archive's size, nor may the members of one inner zip together; members are read in
chunks that stop there; an ``.npy`` shape must fit the member's bytes
(:func:`~pyg_atompack.memmap_layout.load_npy`); and every shape is checked before it is
reshaped. Each failure is a :class:`~pyg_atompack.convert.ConvertError` naming the
file, the structure, the member and the field.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from pyg_atompack.memmap_layout import load_npy

from .base import StructureReader
from .errors import note
from .options import ReadOptions
from .structure import Structure

_MEMBER = re.compile(r"^(\d+)/(.+)$")
#: Every member may inflate to this many bytes, whatever the archive's size.
MEMBER_FLOOR = 16 << 20
#: ... plus this many times the archive's size (stored zips, what metatrain writes, hold
#: members of at most 1x; deflated floats ~1-2x).
MEMBER_RATIO = 32
#: What a damaged or hostile zip raises while a member is opened or inflated.
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, OSError,
               NotImplementedError, RuntimeError, ValueError)


class _Unreadable(ValueError):
    """A member or field that cannot be read; the message names it (not the file)."""


def _read_member(archive: zipfile.ZipFile, name: str, budget: int) -> bytearray:
    """The bytes of one member, refused if it declares or inflates to more than ``budget``."""
    info = archive.getinfo(name)  # KeyError for a missing member
    if info.file_size > budget:
        raise _Unreadable(f"{name}: declares {info.file_size} bytes, more than the "
                          f"{budget} bytes a member of this archive may hold")
    out = bytearray()
    try:
        with archive.open(info) as handle:
            while chunk := handle.read(1 << 20):
                out += chunk
                if len(out) > min(budget, info.file_size):  # zipfile stops at the
                    raise _Unreadable(f"{name}: inflates past its declared size")  # latter
    except _ZIP_ERRORS as exc:
        raise _Unreadable(f"{name}: unreadable member ({type(exc).__name__}: {exc})") from None
    return out


def _npz_arrays(payload: bytes | bytearray | memoryview, what: str,
                budget: int) -> dict[str, np.ndarray]:
    """All ``.npy`` members of a zip held in memory, by name without ``.npy``, together
    at most ``budget`` bytes inflated."""
    arrays = {}
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            members = [info for info in archive.infolist() if info.filename.endswith(".npy")]
            for info in members:  # the first member too big is named, before any is read
                if info.file_size > budget:
                    raise _Unreadable(f"{what}: {info.filename} declares {info.file_size} "
                                      f"bytes, more than the {budget} bytes a member of "
                                      f"this archive may hold")
            declared = sum(info.file_size for info in members)
            if declared > budget:
                raise _Unreadable(f"{what}: its arrays declare {declared} bytes, more than "
                                  f"the {budget} bytes a member of this archive may hold")
            for info in members:
                raw = _read_member(archive, info.filename, budget)
                try:
                    arrays[info.filename[:-4]] = load_npy(raw)
                except ValueError as exc:
                    raise _Unreadable(f"{what}: {info.filename}: {exc}") from None
    except _Unreadable:
        raise
    except _ZIP_ERRORS as exc:
        raise _Unreadable(f"{what}: not a readable zip ({type(exc).__name__}: {exc})") from None
    if not arrays:
        raise _Unreadable(f"{what} holds no arrays")
    return arrays


def _shaped(arrays: dict[str, np.ndarray], key: str, what: str, shape: tuple[int | None, ...],
            dtype: Any = np.float64) -> np.ndarray:
    """``arrays[key]`` as ``dtype``, refused unless its shape is ``shape`` (``None``: any)."""
    value = arrays[key]
    if value.ndim != len(shape) or any(want is not None and got != want
                                       for got, want in zip(value.shape, shape)):
        wanted = "(" + ", ".join("n" if size is None else str(size) for size in shape) + ")"
        raise _Unreadable(f"{what}: field {key!r} has shape {value.shape}, expected {wanted}")
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise _Unreadable(f"{what}: field {key!r} is not {np.dtype(dtype)} ({exc})") from None


class DiskDatasetReader(StructureReader):
    """Streams structures out of a metatrain ``DiskDataset`` zip.

    ``energy_key`` names the energy target (default ``energy``, used when
    present; without it, the one target whose values carry position gradients,
    with a :class:`~pyg_atompack.convert.ConversionNote`); its gradients give
    forces and stress. ``forces_key`` and ``stress_key`` may name separate
    per-atom / per-structure targets instead. Every other target becomes a
    custom property (renamed by ``key_map``); a target listed in
    ``skip_targets`` or ``drop_keys`` is not read at all. A custom target with
    gradients is an error (they would be lost), as is a multi-block target.

    Args:
        path (str | os.PathLike): The ``.zip`` file.
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
    """

    format_name = "diskdataset"

    def __init__(self, path: str | os.PathLike, options: ReadOptions | None = None) -> None:
        super().__init__(path, options)
        if not self.path.is_file():
            raise self.error("no such file")
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise self.error(f"not a readable zip file: {exc}") from exc
        #: Most bytes any one member (at any depth) may inflate to.
        self.budget = MEMBER_FLOOR + MEMBER_RATIO * self.path.stat().st_size
        names = set(self._zip.namelist())
        folders: set[int] = set()
        systems: set[int] = set()
        self.targets: list[str] = []
        for name in names:
            match = _MEMBER.match(name)
            if match is None:
                continue
            folder, member = int(match.group(1)), match.group(2)
            folders.add(folder)
            if member == "system.mta":
                systems.add(folder)
            elif folder == 0 and member.endswith(".mts"):
                self.targets.append(member[:-4])
        self.targets.sort()
        if not folders:
            raise self.error("no structure folders (0/system.mta, ...): not a DiskDataset zip")
        self._length = max(folders) + 1
        missing = sorted(set(range(self._length)) - systems)
        if missing:
            shown = ", ".join(f"{i}/system.mta" for i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise self.error(
                f"structure folder(s) missing or incomplete: {shown}{more} "
                f"(folders must run 0..{self._length - 1})"
            )
        self._plan_keys()

    def _plan_keys(self) -> None:
        skipped = set(self.options.skip_targets)
        unknown = sorted(skipped - set(self.targets))
        if unknown:
            known = ", ".join(self.targets) or "none"
            raise self.error(f"--skip-target {', '.join(unknown)}: no such target "
                             f"(targets: {known})")
        available = [t for t in self.targets if t not in self.options.left_out()]
        pinned = self.options.explicit_builtin_keys()
        wanted = dict(pinned)
        if self.options.virial_key is not None:
            wanted["virial"] = self.options.virial_key
        for builtin, key in wanted.items():
            if key not in available:
                known = ", ".join(available) or "none"
                raise self.error(f"key {key!r} (for {builtin}) is not present (targets: {known})")
        gradients = {target: self._gradients_of(target) for target in available}
        self.energy_target = pinned.get("energy", "energy" if "energy" in available else None)
        if self.energy_target is None:
            self.energy_target = self._energy_like_target(gradients, set(pinned.values()))
        self.pinned = {b: k for b, k in pinned.items() if b != "energy"}
        renames = self.options.custom_renames()
        used = {self.energy_target, *self.pinned.values()}
        self.custom_targets = {t: renames.get(t, t) for t in available if t not in used}
        lost = {t: g for t, g in gradients.items() if g and t in self.custom_targets}
        if lost:
            shown = "; ".join(f"target {t!r} has {' and '.join(g)} gradients"
                              for t, g in sorted(lost.items()))
            raise self.error(
                f"{shown}, which only the energy target keeps (as forces and stress); "
                f"choose the energy with --energy-key NAME, or leave a target out with "
                f"--skip-target NAME"
            )

    def _gradients_of(self, target: str) -> list[str]:
        """The gradients (``positions``, ``strain``) the first structure's target carries."""
        arrays = self._tensor_map(0, target)
        prefix = "blocks/0/gradients/"
        return [g for g in ("positions", "strain") if f"{prefix}{g}/values" in arrays]

    def _energy_like_target(self, gradients: dict[str, list[str]],
                            pinned: set[str]) -> str | None:
        """No ``energy`` target: the one target with position gradients is the energy."""
        candidates = sorted(t for t, g in gradients.items() if "positions" in g and t not in pinned)
        if len(candidates) > 1:
            raise self.error(
                f"targets {', '.join(map(repr, candidates))} all carry position gradients "
                "(forces); say which is the energy with --energy-key NAME (and leave the "
                "others out with --skip-target NAME)"
            )
        if not candidates:
            return None
        target = candidates[0]
        note(f"{self.path}: no 'energy' target; target {target!r} carries "
             f"{' and '.join(gradients[target])} gradients, so it is read as the energy "
             f"(forces and stress from its gradients; pass --energy-key to choose otherwise)")
        return target

    @property
    def length(self) -> int:
        return self._length

    def close(self) -> None:
        self._zip.close()

    def _read(self, member: str, index: int) -> bytearray:
        try:
            return _read_member(self._zip, member, self.budget)
        except KeyError:
            raise self.error(f"member {member} is missing", index) from None
        except _Unreadable as exc:
            raise self.error(str(exc), index) from None

    def _tensor_map(self, index: int, target: str) -> dict[str, np.ndarray]:
        member = f"{index}/{target}.mts"
        raw = self._read(member, index)
        try:
            try:
                buffer = load_npy(raw)
            except ValueError as exc:
                raise _Unreadable(f"{member}: not a metatensor buffer ({exc})") from None
            if buffer.dtype != np.uint8 or buffer.ndim != 1:
                raise _Unreadable(f"{member}: not a metatensor buffer (a {buffer.dtype} "
                                  f"array of shape {buffer.shape}, not uint8 bytes)")
            arrays = _npz_arrays(memoryview(buffer), member, self.budget)
        except _Unreadable as exc:
            raise self.error(str(exc), index) from None
        n_blocks = len(arrays.get("keys", ()))
        if n_blocks != 1 or "blocks/0/values" not in arrays:
            raise self.error(
                f"{member}: target {target!r} has {n_blocks} blocks; only single-block "
                f"targets can be converted (leave it out with --skip-target {target})",
                index,
            )
        return arrays

    def _iter_raw(self) -> Iterator[Structure]:
        for index in range(self._length):
            yield self._structure(index)

    def _structure(self, index: int) -> Structure:
        member = f"{index}/system.mta"
        try:
            system = _npz_arrays(self._read(member, index), member, self.budget)
            for field in ("positions", "types"):
                if field not in system:
                    raise _Unreadable(f"{member}: field {field!r} is missing")
            types = _shaped(system, "types", member, (None,), dtype=None)
            if types.dtype.kind not in "iu":
                raise _Unreadable(f"{member}: field 'types' holds {types.dtype}, not integers")
            n_atoms = len(types)
            positions = _shaped(system, "positions", member, (n_atoms, 3))
            cell = (_shaped(system, "cell", member, (3, 3)) if "cell" in system
                    else np.zeros((3, 3)))
            pbc = (_shaped(system, "pbc", member, (3,), dtype=bool) if "pbc" in system
                   else np.zeros(3, dtype=bool))
        except _Unreadable as exc:
            raise self.error(str(exc), index) from None
        has_cell = bool(np.any(cell != 0.0) or pbc.any())
        structure = Structure(
            positions=positions,
            atomic_numbers=types,
            cell=cell if has_cell else None,
            pbc=pbc if has_cell else None,
        )
        if self.energy_target is not None:
            self._energy_and_gradients(structure, index, cell)
        for builtin, target in self.pinned.items():
            per_atom, value = self._target_values(index, target, n_atoms)
            member = f"{index}/{target}.mts"
            if builtin == "stress":
                structure.stress = self._sized(value, 9, member, "stress").reshape(3, 3)
            elif builtin == "name":
                structure.name = str(value)
            elif builtin == "charges":
                structure.charges = self._sized(value, n_atoms, member,
                                                "charges").reshape(n_atoms)
            else:
                setattr(structure, builtin, self._sized(value, 3 * n_atoms, member,
                                                        builtin).reshape(n_atoms, 3))
        for target, name in self.custom_targets.items():
            per_atom, value = self._target_values(index, target, n_atoms)
            if per_atom:
                structure.atom_properties[name] = value
            else:
                structure.properties[name] = float(value) if value.ndim == 0 else value
        return structure

    def _sized(self, value: np.ndarray, size: int, member: str, field: str) -> np.ndarray:
        """``value`` once it is known to hold ``size`` real numbers (before a reshape);
        integers become float64."""
        if value.size != size or value.dtype.kind not in "iuf":
            raise self.error(f"{member}: field {field!r} holds {value.size} {value.dtype} "
                             f"values, expected {size} real numbers")
        return value if value.dtype.kind == "f" else value.astype(np.float64)

    def _target_values(self, index: int, target: str, n_atoms: int) -> tuple[bool, Any]:
        """``(per_atom, value)`` of a single-block target, its rows checked first."""
        member = f"{index}/{target}.mts"
        arrays = self._tensor_map(index, target)
        try:
            return self._values(arrays, n_atoms, member)
        except _Unreadable as exc:
            raise self.error(str(exc), index) from None

    def _energy_and_gradients(self, structure: Structure, index: int, cell: np.ndarray) -> None:
        arrays = self._tensor_map(index, self.energy_target)
        member = f"{index}/{self.energy_target}.mts"
        values = arrays["blocks/0/values"]
        if values.size != 1 or values.dtype.kind not in "biuf":
            raise self.error(
                f"energy target {self.energy_target!r} must hold one value, got {values.shape}",
                index,
            )
        structure.energy = float(values.reshape(()))
        prefix = "blocks/0/gradients/"
        if prefix + "positions/values" in arrays:
            field = prefix + "positions/values"
            samples = arrays.get(prefix + "positions/samples")
            try:
                atoms = _column(samples, "atom", member, prefix + "positions/samples")
                if len(atoms) and (atoms.min() < 0 or atoms.max() >= structure.n_atoms):
                    raise _Unreadable(f"{member}: field {prefix}positions/samples names atoms "
                                      f"outside 0..{structure.n_atoms - 1}")
                grad = self._sized(arrays[field], 3 * len(atoms), member, field)
            except _Unreadable as exc:
                raise self.error(str(exc), index) from None
            grad = grad.reshape(-1, 3)
            forces = np.zeros((structure.n_atoms, 3), dtype=grad.dtype)
            forces[atoms] = -grad  # the gradient is dE/dx = -F
            structure.forces = forces
        if prefix + "strain/values" in arrays:
            volume = abs(float(np.linalg.det(cell)))
            if volume == 0.0:
                raise self.error(
                    f"{index}/{self.energy_target}.mts has a strain gradient but the cell "
                    "volume is 0, so the stress is undefined",
                    index,
                )
            field = prefix + "strain/values"
            structure.stress = self._sized(arrays[field], 9, member, field).reshape(3, 3) / volume

    @staticmethod
    def _values(arrays: dict[str, np.ndarray], n_atoms: int, member: str) -> tuple[bool, Any]:
        """``(per_atom, value)`` of a single-block target, trailing unit axis dropped."""
        values = arrays["blocks/0/values"]
        samples = arrays.get("blocks/0/samples")
        if samples is None or samples.ndim != 1:
            raise _Unreadable(f"{member}: field 'blocks/0/samples' is missing or not a "
                              f"list of labels")
        if values.ndim == 0 or values.shape[0] != len(samples):
            raise _Unreadable(f"{member}: field 'blocks/0/values' has shape {values.shape} "
                              f"for {len(samples)} samples")
        if values.dtype.kind not in "biuf":
            raise _Unreadable(f"{member}: field 'blocks/0/values' holds {values.dtype}, "
                              f"not numbers")
        if values.shape[-1] == 1:
            values = values[..., 0]
        if samples.dtype.names and "atom" in samples.dtype.names:
            atoms = _column(samples, "atom", member, "blocks/0/samples")
            if len(atoms) != n_atoms or not np.array_equal(np.sort(atoms), np.arange(n_atoms)):
                raise _Unreadable(f"{member}: field 'blocks/0/samples' does not name each of "
                                  f"the {n_atoms} atoms once")
            order = np.argsort(atoms, kind="stable")
            return True, values[order]
        if not len(samples):
            raise _Unreadable(f"{member}: field 'blocks/0/values' holds no sample")
        return False, values[0]


def _column(labels: np.ndarray | None, name: str, member: str = "?",
            field: str = "labels") -> np.ndarray:
    """One named column of a metatensor ``Labels`` array (structured or plain)."""
    if labels is not None and labels.ndim == 1 and labels.dtype.names \
            and name in labels.dtype.names:
        try:
            return np.asarray(labels[name], dtype=np.int64)
        except (TypeError, ValueError):
            pass
    raise _Unreadable(f"{member}: field {field!r} has no integer column {name!r}")
