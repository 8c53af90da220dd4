"""Torch and PyG datasets over Atompack data.

* :class:`AtompackDataset`: a ``torch_geometric.data.Dataset`` over memory-mapped
  `.atp` records (files, shard directories, lists of files, Hub locations).
* :class:`AtompackLoader`: a batch-level loader that builds each ``Batch`` from
  one ``read_batch`` call.
* :class:`AtompackGroupDataset`: the groups of one grouping (adsorbate+slab with its
  references, ...), each item one ``Batch`` of its member records.
* :class:`MemmapDataset`: a dataset over metatrain-style memmap directories.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AtompackDataset", "AtompackGroupDataset", "AtompackLoader", "MemmapDataset"]

_MODULES = {
    "AtompackDataset": "pyg_atompack.data.dataset",
    "AtompackGroupDataset": "pyg_atompack.data.groups",
    "AtompackLoader": "pyg_atompack.data.loader",
    "MemmapDataset": "pyg_atompack.data.memmap",
}


def __getattr__(name: str) -> Any:
    # Imported on first use: the converters read memmap directories through
    # memmap_layout without importing torch_geometric (which would replace
    # torch.index_select and break metatrain's readers in the same process).
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'pyg_atompack.data' has no attribute {name!r}")
