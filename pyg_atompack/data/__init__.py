"""Torch and PyG datasets over Atompack data.

* :class:`AtompackDataset`: a ``torch_geometric.data.Dataset`` over memory-mapped
  `.atp` records (files, shard directories, lists of files, Hub locations).
* :class:`AtompackLoader`: a batch-level loader that builds each ``Batch`` from
  one ``read_batch`` call.
* :class:`MemmapDataset`: a dataset over metatrain-style memmap directories.
"""

from __future__ import annotations

import importlib
from typing import Any

from pyg_atompack.data.dataset import AtompackDataset
from pyg_atompack.data.loader import AtompackLoader

__all__ = ["AtompackDataset", "AtompackLoader", "MemmapDataset"]


def __getattr__(name: str) -> Any:
    # MemmapDataset lives in its own module, imported on first use so that this
    # package stays importable (and cheap) without it.
    if name == "MemmapDataset":
        return importlib.import_module("pyg_atompack.data.memmap").MemmapDataset
    raise AttributeError(f"module 'pyg_atompack.data' has no attribute {name!r}")
