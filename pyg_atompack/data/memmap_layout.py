"""Deprecated location of :mod:`pyg_atompack.memmap_layout` (moved out of the torch layer)."""

from __future__ import annotations

from pyg_atompack._moved import moved_names

__getattr__ = moved_names(__name__, {
    name: f"pyg_atompack.memmap_layout:{name}"
    for name in ("BUILTIN_SHAPES", "DEFAULT_KEYS", "SIDECAR_FORMAT", "SIDECAR_NAME",
                 "MemmapKey", "MemmapLayout", "MemmapLayoutError", "expand_voigt",
                 "is_memmap_dir")
})
