"""pyg_atompack: Atompack (.atp) datasets and remote shard streaming for PyTorch Geometric.

The format layer :mod:`pyg_atompack.atp` depends on numpy only. Everything that
needs torch is imported lazily on first attribute access, so that
``import pyg_atompack.atp`` never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY_ATTRIBUTES = {
    "AtompackDataset": "pyg_atompack.data.dataset",
    "AtompackGroupDataset": "pyg_atompack.data.groups",
    "AtompackLoader": "pyg_atompack.data.loader",
    "MemmapDataset": "pyg_atompack.data.memmap",
    "MixedDataset": "pyg_atompack.pyg.mixing",
    "ResumableSampler": "pyg_atompack.pyg.resume",
    "StatefulLoader": "pyg_atompack.pyg.resume",
    "ShardStreamDataset": "pyg_atompack.stream.dataset",
    "SourceOptions": "pyg_atompack.stream.options",
}
_LAZY_MODULES = ("atp", "convert", "stream", "graph", "hub", "data")

__all__ = ["__version__", *_LAZY_ATTRIBUTES, *_LAZY_MODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        module = importlib.import_module(_LAZY_ATTRIBUTES[name])
        return getattr(module, name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"pyg_atompack.{name}")
    raise AttributeError(f"module 'pyg_atompack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
