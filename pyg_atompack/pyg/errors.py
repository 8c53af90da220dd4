"""Errors raised while turning `.atp` data and `.pt` files into PyG objects."""

from __future__ import annotations

__all__ = ["PygConversionError", "FieldSelectionError", "BatchAssemblyError",
           "PtPayloadError", "UnsafePtPayloadError"]


class PygConversionError(ValueError):
    """Base class of the errors raised while turning data into PyG objects."""


class FieldSelectionError(PygConversionError):
    """A requested field does not exist (the message lists the fields that do)."""


class BatchAssemblyError(PygConversionError):
    """The molecules of a batch cannot be concatenated into one ``Batch``."""


class PtPayloadError(PygConversionError):
    """The bytes are not a readable ``.pt`` file of PyG samples.

    The message says what is wrong but not which file: the layer that knows the file
    (a shard URL, a path) re-raises it in its own error family, naming the file.
    """


class UnsafePtPayloadError(PtPayloadError):
    """A ``.pt`` file holds objects that ``torch.load(weights_only=True)`` refuses."""
