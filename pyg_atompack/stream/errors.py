"""The exception family of the streaming layer (defined once, raised everywhere in it).

Failed retrievals are also transport errors (:class:`~pyg_atompack.transport.TransportError`,
an :class:`OSError`), so one ``except TransportError`` catches every failed remote read of
the project, whichever layer reported it.
"""

from __future__ import annotations

from pyg_atompack.transport.errors import RemoteIntegrityError, TransportError


class StreamError(Exception):
    """Base class of every error raised by :mod:`pyg_atompack.stream`."""


class ShardFetchError(StreamError, TransportError):
    """A shard could not be retrieved (after all retries), or a source is misconfigured."""


class ShardIntegrityError(ShardFetchError, RemoteIntegrityError):
    """A shard's bytes do not match the size or sha256 announced by its source."""


class ShardDecodeError(StreamError):
    """A shard's bytes were retrieved but are not a readable ``.pt`` / ``.atp`` payload."""


class UnsafePayloadError(ShardDecodeError):
    """A ``.pt`` shard holds objects that ``torch.load(weights_only=True)`` refuses."""


class RetrievalProcessError(StreamError):
    """The child process that retrieved a stream's shards died or failed unreadably."""


class StreamCancelled(StreamError):
    """Raised inside background work when iteration was closed; never reaches users."""
