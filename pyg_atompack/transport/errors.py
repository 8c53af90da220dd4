"""The exception family of the transport layer: every failed remote byte raises one of these.

Messages name the URL (with any secret removed: user info, signed query parameters and
tokens never appear) and the cause. Transient causes are retried before an error is
raised; the error then says how many attempts were made.
"""

from __future__ import annotations


class TransportError(OSError):
    """Base class of every error raised by :mod:`pyg_atompack.transport`.

    Args:
        message (str): What failed, naming the (redacted) URL and the cause.
        url (str, optional): The redacted URL of the remote object, if any. (default: :obj:`None`)
        status (int, optional): The HTTP status of the last answer, if any. (default: :obj:`None`)
    """

    def __init__(self, message: str, *, url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RemoteNotFoundError(TransportError, FileNotFoundError):
    """The remote object, bucket or repository does not exist (HTTP 404, ``NoSuchKey``)."""


class RemoteAuthError(TransportError, PermissionError):
    """Credentials are missing, wrong or insufficient (HTTP 401/403, gated repositories)."""


class RemoteIntegrityError(TransportError):
    """Received bytes do not match the size or checksum the listing announced."""


class RemoteUnavailableError(TransportError):
    """A transient cause (timeout, reset, 408, 429, 5xx) persisted through every retry."""


class UnsupportedURLError(TransportError, ValueError):
    """A URL has a scheme no installed backend serves; the message lists the supported ones."""


class RemoteOfflineError(RemoteUnavailableError):
    """``HF_HUB_OFFLINE=1`` forbids the request, and the cache cannot answer instead."""


class RemoteTooLargeError(TransportError):
    """A remote file is larger than the in-memory path can hold; download it to disk."""


class RemoteRangeError(TransportError, ValueError):
    """A byte range outside the remote file was asked for."""
