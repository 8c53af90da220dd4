"""Deprecated location of :mod:`pyg_atompack.memmap_layout` (moved out of the torch layer)."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from pyg_atompack import memmap_layout

    value = getattr(memmap_layout, name)  # AttributeError for names it never had
    warnings.warn(f"pyg_atompack.data.memmap_layout.{name} moved to "
                  f"pyg_atompack.memmap_layout.{name}; the old path goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return value
