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
    "RangeReader",
    "FileRangeReader",
    "URLRangeReader",
    "HubRangeReader",
    "BlockCache",
    "RemoteAtpReader",
    "open_remote_atp",
    "load_meta",
]

# record blocks and bounded caches for big remote .atp files (issue 14)
from pyg_atompack.transport.atp_meta import load_meta  # noqa: E402
from pyg_atompack.transport.block_cache import BlockCache  # noqa: E402
from pyg_atompack.transport.ranges import (  # noqa: E402
    FileRangeReader,
    HubRangeReader,
    RangeReader,
    URLRangeReader,
)
from pyg_atompack.transport.remote_atp import RemoteAtpReader, open_remote_atp  # noqa: E402
