"""Every remote byte of the project: HTTP(S), Hub files and object stores.

This package is torch-free. It owns retries, timeouts, proxies, credentials, range reads,
resumable downloads and verification, and raises one error family
(:class:`TransportError` and its subclasses). :mod:`pyg_atompack.hub` and
:mod:`pyg_atompack.stream` both read through it:

* :mod:`~pyg_atompack.transport.http`: the HTTP(S) client (its own :mod:`httpx` client,
  one per process and never shared across ``fork``, with per-request timeouts, per-hop
  redirects that keep credentials at their origin, retries and ``Range`` resume);
* :mod:`~pyg_atompack.transport.retry`: the one :class:`RetryPolicy`;
* :mod:`~pyg_atompack.transport.integrity`: the one size + sha256 check;
* :mod:`~pyg_atompack.transport.buffers`: download targets (memory maps, parts, files);
* :mod:`~pyg_atompack.transport.urls`: which backend serves which URL scheme;
* :mod:`~pyg_atompack.transport.objectstore`: object stores (``s3://``, and ``gs://`` /
  ``az://`` where gcsfs / adlfs are installed) on fsspec, under the same retry policy
  and error family;
* :mod:`~pyg_atompack.transport.ranges`, :mod:`~pyg_atompack.transport.atp_meta`,
  :mod:`~pyg_atompack.transport.block_cache`, :mod:`~pyg_atompack.transport.remote_atp`:
  record-level reads of big remote `.atp` files (range readers, the metadata cache, the
  bounded disk page cache).
"""

from pyg_atompack._moved import moved_names
from pyg_atompack.transport.credentials import RequestHeaders, bind_headers
from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteOfflineError,
    RemoteRangeError,
    RemoteTooLargeError,
    RemoteUnavailableError,
    TransportError,
    UnsupportedURLError,
)
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy

__all__ = [
    "TransportError",
    "RemoteNotFoundError",
    "RemoteAuthError",
    "RemoteIntegrityError",
    "RemoteUnavailableError",
    "RemoteOfflineError",
    "RemoteRangeError",
    "RemoteTooLargeError",
    "UnsupportedURLError",
    "RetryPolicy",
    "RequestHeaders",
    "bind_headers",
    "redact_url",
    "RemoteAtpReader",
    "open_remote_atp",
]

# record-level reads of big remote .atp files (issue 14)
from pyg_atompack.transport.remote_atp import RemoteAtpReader, open_remote_atp  # noqa: E402

# their plumbing left the public API (kept for one release, with a DeprecationWarning)
__getattr__ = moved_names(__name__, {
    "RangeReader": "pyg_atompack.transport.ranges:RangeReader",
    "FileRangeReader": "pyg_atompack.transport.ranges:FileRangeReader",
    "URLRangeReader": "pyg_atompack.transport.ranges:URLRangeReader",
    "HubRangeReader": "pyg_atompack.transport.ranges:HubRangeReader",
    "ObjectRangeReader": "pyg_atompack.transport.ranges:ObjectRangeReader",
    "BlockCache": "pyg_atompack.transport.block_cache:BlockCache",
    "load_meta": "pyg_atompack.transport.atp_meta:load_meta",
})
