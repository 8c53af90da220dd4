"""The exception family of the streaming layer (defined once, raised everywhere in it)."""

from __future__ import annotations


class StreamError(Exception):
    """Base class of every error raised by :mod:`pyg_atompack.stream`."""


class ShardFetchError(StreamError):
    """A shard could not be retrieved (after all retries), or a source is misconfigured."""


class ShardIntegrityError(ShardFetchError):
    """A shard's bytes do not match the size or sha256 announced by its source."""


class ShardDecodeError(StreamError):
    """A shard's bytes were retrieved but are not a readable ``.pt`` / ``.atp`` payload."""


class UnsafePayloadError(ShardDecodeError):
    """A ``.pt`` shard holds objects that ``torch.load(weights_only=True)`` refuses."""


class StreamCancelled(StreamError):
    """Raised inside background work when iteration was closed; never reaches users."""
