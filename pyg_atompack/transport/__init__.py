"""Every remote byte of the project: HTTP(S), Hub files and object stores.

This package is torch-free. It owns retries, timeouts, proxies, credentials, range reads,
resumable downloads and verification, and raises one error family
(:class:`TransportError` and its subclasses).
"""

from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    TransportError,
    UnsupportedURLError,
)

__all__ = [
    "TransportError",
    "RemoteNotFoundError",
    "RemoteAuthError",
    "RemoteIntegrityError",
    "RemoteUnavailableError",
    "UnsupportedURLError",
]
