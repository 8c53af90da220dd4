"""Errors raised while turning `.atp` data into PyG objects."""

from __future__ import annotations

__all__ = ["PygConversionError", "FieldSelectionError", "BatchAssemblyError"]


class PygConversionError(ValueError):
    """Base class of the errors raised while turning `.atp` data into PyG objects."""


class FieldSelectionError(PygConversionError):
    """A requested field does not exist (the message lists the fields that do)."""


class BatchAssemblyError(PygConversionError):
    """The molecules of a batch cannot be concatenated into one ``Batch``."""
