"""metatrain ``DiskDataset`` zip files, read with ``zipfile`` and numpy only.

Layout: folders ``0/ .. N-1/``, each with ``system.mta`` (itself a zip of
``positions.npy``, ``cell.npy``, ``types.npy``, ``pbc.npy``) and one
``<target>.mts`` per target: an ``np.save``d uint8 array whose bytes are a
metatensor NPZ (``keys.npy``, ``blocks/<b>/values.npy``, ``samples.npy``,
``components/<j>.npy``, ``properties.npy``, gradients under
``blocks/<b>/gradients/<parameter>/``). For the energy target, the
``positions`` gradient is −F and the ``strain`` gradient is stress × volume.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from .base import StructureReader
from .errors import note
from .options import ReadOptions
from .structure import Structure

_MEMBER = re.compile(r"^(\d+)/(.+)$")


def _npz_arrays(payload: bytes, what: str) -> dict[str, np.ndarray]:
    """All ``.npy`` members of a zip held in memory, by name without ``.npy``."""
    with zipfile.ZipFile(io.BytesIO(payload)) as archive:
        arrays = {}
        for name in archive.namelist():
            if name.endswith(".npy"):
                with archive.open(name) as handle:
                    arrays[name[:-4]] = np.load(handle, allow_pickle=False)
    if not arrays:
        raise ValueError(f"{what} holds no arrays")
    return arrays


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
        except (zipfile.BadZipFile, OSError) as exc:
            raise self.error(f"not a readable zip file: {exc}") from exc
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

    def _read(self, member: str, index: int) -> bytes:
        try:
            return self._zip.read(member)
        except KeyError:
            raise self.error(f"member {member} is missing", index) from None

    def _tensor_map(self, index: int, target: str) -> dict[str, np.ndarray]:
        member = f"{index}/{target}.mts"
        raw = self._read(member, index)
        try:
            buffer = np.load(io.BytesIO(raw), allow_pickle=False)
            arrays = _npz_arrays(np.ascontiguousarray(buffer).tobytes(), member)
        except (ValueError, zipfile.BadZipFile, OSError) as exc:
            raise self.error(f"{member}: not a metatensor buffer ({exc})", index) from exc
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
            system = _npz_arrays(self._read(member, index), member)
            positions = np.asarray(system["positions"], dtype=np.float64)
            types = np.asarray(system["types"])
            cell = np.asarray(system.get("cell", np.zeros((3, 3))), dtype=np.float64)
            pbc = np.asarray(system.get("pbc", np.zeros(3, dtype=bool)), dtype=bool)
        except (KeyError, ValueError, zipfile.BadZipFile) as exc:
            raise self.error(f"{member}: unreadable system ({exc})", index) from exc
        n_atoms = len(types)
        has_cell = bool(np.any(cell != 0.0) or pbc.any())
        structure = Structure(
            positions=positions.reshape(n_atoms, 3),
            atomic_numbers=types,
            cell=cell if has_cell else None,
            pbc=pbc if has_cell else None,
        )
        if self.energy_target is not None:
            self._energy_and_gradients(structure, index, cell)
        for builtin, target in self.pinned.items():
            per_atom, value = self._values(self._tensor_map(index, target), n_atoms)
            if builtin == "stress":
                structure.stress = value.reshape(3, 3)
            elif builtin == "name":
                structure.name = str(value)
            else:
                setattr(structure, builtin, value.reshape(n_atoms, -1).squeeze(-1)
                        if builtin == "charges" else value.reshape(n_atoms, 3))
        for target, name in self.custom_targets.items():
            per_atom, value = self._values(self._tensor_map(index, target), n_atoms)
            if per_atom:
                structure.atom_properties[name] = value
            else:
                structure.properties[name] = float(value) if value.ndim == 0 else value
        return structure

    def _energy_and_gradients(self, structure: Structure, index: int, cell: np.ndarray) -> None:
        arrays = self._tensor_map(index, self.energy_target)
        values = arrays["blocks/0/values"]
        if values.size != 1:
            raise self.error(
                f"energy target {self.energy_target!r} must hold one value, got {values.shape}",
                index,
            )
        structure.energy = float(values.reshape(()))
        prefix = "blocks/0/gradients/"
        if prefix + "positions/values" in arrays:
            grad = arrays[prefix + "positions/values"].reshape(-1, 3)
            atoms = _column(arrays[prefix + "positions/samples"], "atom")
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
            structure.stress = arrays[prefix + "strain/values"].reshape(3, 3) / volume

    @staticmethod
    def _values(arrays: dict[str, np.ndarray], n_atoms: int) -> tuple[bool, Any]:
        """``(per_atom, value)`` of a single-block target, trailing unit axis dropped."""
        values = arrays["blocks/0/values"]
        samples = arrays["blocks/0/samples"]
        if values.shape[-1] == 1:
            values = values[..., 0]
        if samples.dtype.names and "atom" in samples.dtype.names:
            order = np.argsort(_column(samples, "atom"), kind="stable")
            return True, values[order]
        return False, values[0]


def _column(labels: np.ndarray, name: str) -> np.ndarray:
    """One named column of a metatensor ``Labels`` array (structured or plain)."""
    if labels.dtype.names:
        return np.asarray(labels[name], dtype=np.int64)
    raise ValueError(f"labels have no named column {name!r}")
