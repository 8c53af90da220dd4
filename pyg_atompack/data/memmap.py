"""A PyG ``Dataset`` over metatrain ``MemmapDataset`` directories.

The layout and its checks are in :mod:`pyg_atompack.memmap_layout`
(numpy only, shared with the converters).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

from torch_geometric.data import Data, Dataset

from pyg_atompack.atp.molecule import Molecule
from pyg_atompack.atp.types import BUILTINS, SECTION_BUILTINS
from pyg_atompack.memmap_layout import (
    BUILTIN_SHAPES,
    DEFAULT_KEYS,
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    MemmapKey,
    MemmapLayout,
    MemmapLayoutError,
    expand_voigt,
    is_memmap_dir,
)
from pyg_atompack.pyg import record_to_data, resolve_names
from pyg_atompack.pyg.handoff import install_in_worker

__all__ = [
    "BUILTIN_SHAPES",
    "DEFAULT_KEYS",
    "SIDECAR_FORMAT",
    "SIDECAR_NAME",
    "MemmapDataset",
    "MemmapKey",
    "MemmapLayout",
    "MemmapLayoutError",
    "expand_voigt",
    "is_memmap_dir",
]

# the builtin sections a layout can fill (all but the name)
_ARRAY_BUILTINS = tuple(name for name in SECTION_BUILTINS if BUILTINS[name].shape is not None)


class MemmapDataset(Dataset):
    r"""A PyG dataset over a metatrain ``MemmapDataset`` directory.

    Graphs carry the attribute names of :class:`~pyg_atompack.AtompackDataset`:
    ``z``, ``pos``, ``natoms``, ``cell``/``pbc`` when the directory has a
    ``c.bin``, ``energy``/``forces``/``stress`` and custom keys as configured.

    Args:
        path (str or os.PathLike): The memmap directory.
        keys (Mapping[str, str] or Sequence[str], optional): Targets to read,
            ``attribute -> file stem`` (see :class:`MemmapLayout`); :obj:`None`
            takes the directory's own description or metatrain's writer names.
            (default: :obj:`None`)
        transform (callable, optional): Applied to each ``Data`` on access.
            (default: :obj:`None`)
        rename (Mapping[str, str], optional): Give attributes other names, e.g.
            ``{"forces": "force"}`` (see :class:`~pyg_atompack.AtompackDataset`).
            (default: :obj:`None`)
        names (str, optional): A naming preset such as ``"pyg-md17"``.
            (default: :obj:`None`)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Mapping[str, str] | Sequence[str] | None = None,
        transform: Callable[[Data], Data] | None = None,
        rename: Mapping[str, str] | None = None,
        names: str | None = None,
    ) -> None:
        self.names = resolve_names(rename, names)
        self.layout = MemmapLayout(path, keys)
        super().__init__(root=None, transform=transform)

    def len(self) -> int:
        return len(self.layout)

    def get(self, idx: int) -> Data:
        install_in_worker()  # in a DataLoader worker, batches leave packed (pyg.handoff)
        values = self.layout.structure(int(idx))
        stress = values.get("stress")
        if stress is not None and stress.shape == (6,):
            values["stress"] = expand_voigt(stress)
        builtins = {name: values.pop(name, None) for name in _ARRAY_BUILTINS}
        if builtins["energy"] is not None:
            builtins["energy"] = builtins["energy"].reshape(())
        record = Molecule(
            positions=values.pop("positions"),
            atomic_numbers=values.pop("atomic_numbers"),
            **builtins,
            atom_properties={k.attribute: values[k.attribute] for k in self.layout.keys
                             if k.per_atom and k.attribute in values},
            properties={k.attribute: values[k.attribute] for k in self.layout.keys
                        if not k.per_atom and k.attribute in values},
        )
        data = record_to_data(record)
        return data if self.names is None else self.names.apply(data)

    def __repr__(self) -> str:
        keys = ", ".join(k.attribute for k in self.layout.keys)
        return f"{type(self).__name__}({len(self)}, path={str(self.layout.path)!r}, keys=[{keys}])"
