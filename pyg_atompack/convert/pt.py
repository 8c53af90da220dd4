"""PyG ``.pt`` files in, streamable ``.pt`` shards out.

Readers accept what :func:`pyg_atompack.pyg.pt.as_samples` accepts (a list/tuple
of ``Data``, a single ``Data``, an ``InMemoryDataset`` processed file:
``(data, slices)`` or ``(data.to_dict(), slices, data_class)``) and a directory
of shards with a ``pyg_atompack-shards/1`` manifest. Files are read by the
project's one ``.pt`` path, :func:`pyg_atompack.pyg.pt.decode_pt`, over a private
memory map of the file: the usual layouts are indexed in place (no unpickling,
no copy of the file), anything else goes to ``torch.load(weights_only=True)``
with the PyG allow-list, so opening a file cannot run code.

Shards are ``list[Data]`` with the attribute names of ``docs/architecture.md``.
Every tensor owns exactly its own storage: ``torch.save`` writes a tensor's
whole backing storage, so a view into a collated dataset (what
``InMemoryDataset.__getitem__`` returns) would drag the full dataset into each
shard.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data
from torch_geometric.data.data import BaseData

from pyg_atompack.pyg import BUILTIN_FIELDS, record_to_data
from pyg_atompack.pyg.errors import PtPayloadError, UnsafePtPayloadError
from pyg_atompack.pyg.pt import decode_pt

from .base import StructureReader
from .errors import ConvertError, note
from .options import ReadOptions, WriteOptions
from .shards import ShardedWriter, read_manifest
from .structure import Structure, normalise_property

_ATTRIBUTE_TO_FIELD = {attr: field for field, attr in BUILTIN_FIELDS.items()}
_RESERVED = set(_ATTRIBUTE_TO_FIELD) | {"natoms"}


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor whose storage holds exactly its elements."""
    storage_bytes = tensor.untyped_storage().nbytes()
    if tensor.is_contiguous() and storage_bytes == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def structure_to_data(structure: Structure) -> Data:
    """A self-contained ``Data`` (attribute names of the project's table).

    Args:
        structure (Structure): The structure.

    Returns:
        ``Data`` whose tensors own their storage (safe to ``torch.save`` alone).
    """
    data = record_to_data(structure)
    for key, value in list(data.items()):
        if isinstance(value, torch.Tensor):
            data[key] = owned(value)
    return data


def load_pt(path: str | os.PathLike) -> Sequence[BaseData]:
    """The samples of a ``.pt`` file, read safely (no pickle can run code).

    The file is memory-mapped copy-on-write, so the indexed layouts are read in place
    and pages are loaded as samples are taken.

    Args:
        path (str | os.PathLike): The file.

    Returns:
        Its samples (``len`` and integer indexing).

    Raises:
        ConvertError: If the file cannot be read safely or at all.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # ACCESS_COPY: a private, writable view (samples may be written to) that
            # never writes back to the file
            buffer = (mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size
                      else bytearray())
    except OSError as exc:
        raise ConvertError(path, f"cannot read it: {exc}") from exc
    try:
        return decode_pt(buffer)
    except UnsafePtPayloadError as exc:
        raise ConvertError(path, f"torch.load(weights_only=True) refused it: {exc}") from None
    except PtPayloadError as exc:
        raise ConvertError(path, str(exc)) from exc


def data_to_structure(data: Data, *, path: str | os.PathLike = "?", index: int = 0,
                      options: ReadOptions | None = None) -> Structure:
    """Turn one ``Data`` back into a :class:`Structure`.

    Builtin attributes (``z``, ``pos``, ``energy``, ...) fill the builtins
    (PyG's MD17 ``force`` too, see :func:`uses_pyg_force_name`);
    ``prop_<key>``/``atom_<key>`` collisions are undone; node-level tensors
    become atom properties, anything else a per-structure property (a leading
    graph dimension of 1 is dropped).

    Args:
        data (Data): The graph.
        path (str | os.PathLike, optional): Source file, for error messages. (default: :obj:`"?"`)
        index (int, optional): Position in the source, for error messages. (default: :obj:`0`)
        options (ReadOptions, optional): Key mapping (``key_map``, ``energy_key``, ...).
            (default: :obj:`None`)

    Returns:
        The structure.
    """
    options = options if options is not None else ReadOptions()
    attributes = dict(data.items())
    if uses_pyg_force_name(attributes, options):
        attributes["forces"] = attributes.pop("force")
    for builtin, key in options.explicit_builtin_keys().items():
        if key not in attributes:
            raise ConvertError(path, f"key {key!r} (for {builtin}) is not present", index)
        attributes[BUILTIN_FIELDS.get(builtin, builtin)] = attributes.pop(key)
    if "z" not in attributes or "pos" not in attributes:
        raise ConvertError(path, "a Data needs 'z' and 'pos' to be a structure", index)
    renames = options.custom_renames()
    positions = _numpy(attributes.pop("pos"))
    numbers = _numpy(attributes.pop("z"))
    n_atoms = len(numbers)
    attributes.pop("natoms", None)
    structure = Structure(positions=positions, atomic_numbers=numbers)
    for attr, field in _ATTRIBUTE_TO_FIELD.items():
        if field in ("positions", "atomic_numbers") or attr not in attributes:
            continue
        value = attributes.pop(attr)
        if field == "name":
            structure.name = str(value)
        elif field == "energy":
            structure.energy = float(_numpy(value).reshape(()))
        elif field in ("cell", "stress"):
            setattr(structure, field, _numpy(value).reshape(3, 3))
        elif field == "pbc":
            structure.pbc = _numpy(value).reshape(3).astype(bool)
        else:
            setattr(structure, field, _numpy(value))
    for key, value in attributes.items():
        node_level = (
            isinstance(value, torch.Tensor) and value.dim() >= 1
            and value.size(0) == n_atoms and data.is_node_attr(key)
        )
        # undo the prefix that record_to_data gives keys colliding with builtins
        prefix = "atom_" if node_level else "prop_"
        name = key[5:] if key.startswith(prefix) and key[5:] in _RESERVED else key
        name = renames.get(key, name)
        try:
            if node_level:
                structure.atom_properties[name] = _numpy(value)
            else:
                if isinstance(value, torch.Tensor):
                    value = _numpy(value)
                    if value.ndim >= 1 and value.shape[0] == 1:
                        value = value[0]
                structure.properties[name] = normalise_property(value)
        except TypeError as exc:
            raise ConvertError(path, f"attribute {key!r}: {exc}", index) from exc
    return structure


def uses_pyg_force_name(attributes: Any, options: ReadOptions) -> bool:
    """Whether a graph names its forces ``force`` as PyG's ``MD17`` does.

    Such a ``force`` is stored as the ``forces`` builtin of the project's
    table (the read side can name it back with ``names="pyg-md17"``), unless
    the user mapped keys onto the forces or renamed ``force`` themselves.
    """
    return ("force" in attributes and "forces" not in attributes
            and "forces" not in options.explicit_builtin_keys()
            and "force" not in options.key_map)


def _numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    return np.asarray(value)


class PtReader(StructureReader):
    """Streams structures out of a ``.pt`` file or a directory of ``.pt`` shards.

    Args:
        path (str | os.PathLike): The file or shard directory.
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
    """

    format_name = "pt"

    def __init__(self, path: str | os.PathLike, options: ReadOptions | None = None) -> None:
        super().__init__(path, options)
        if self.path.is_dir():
            manifest = read_manifest(self.path)
            if manifest is None:
                raise self.error("directory has no pyg_atompack-shards/1 manifest.json")
            self.files = [self.path / shard["name"] for shard in manifest["shards"]]
            self._length = int(manifest["total_records"])
        elif self.path.is_file():
            self.files = [self.path]
            self._length = None
        else:
            raise self.error("no such file or directory")
        self._first: Any = None

    @property
    def length(self) -> int | None:
        if self._length is None:
            self._first = load_pt(self.path)
            self._length = len(self._first)
        return self._length

    def _iter_raw(self) -> Iterator[Structure]:
        index = 0
        for file in self.files:
            if not file.is_file():
                raise ConvertError(file, "shard listed in manifest.json is missing")
            items = self._first if self._first is not None and file == self.path else None
            if items is None:
                items = load_pt(file)
            if len(items) and index == 0 and uses_pyg_force_name(items[0], self.options):
                note(f"{file}: graphs name their forces 'force' (PyG's MD17 convention); "
                     "they are stored as 'forces' (read them back as 'force' with "
                     "names=\"pyg-md17\")")
            for position in range(len(items)):
                yield data_to_structure(items[position], path=file, index=index,
                                        options=self.options)
                index += 1


class PtShardWriter(ShardedWriter):
    """Writes ``.pt`` shards (``list[Data]``) and their ``manifest.json``.

    Args:
        path (str | os.PathLike): The destination directory.
        options (WriteOptions, optional): ``shard_size`` structures per shard (default: 1000).
    """

    format_name = "pt-shards"
    shard_extension = ".pt"
    shard_format = "pt"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self._items: list[Data] = []
        self._shard_path: Path | None = None

    def _open_shard(self, path: Path) -> None:
        self._shard_path = path
        self._items = []

    def _add_to_shard(self, structure: Structure) -> None:
        self._items.append(structure_to_data(structure))

    def _close_shard(self) -> None:
        torch.save(self._items, self._shard_path)
        self._items = []

    def _abandon_shard(self) -> None:
        self._items = []
