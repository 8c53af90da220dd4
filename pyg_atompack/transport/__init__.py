"""Bytes over the network: the HTTP(S) client and what every transfer obeys.

This package is torch-free and knows nothing of listings, caches or formats (the remote
layer, :mod:`pyg_atompack.remote`, builds on it). It owns:

* :mod:`~pyg_atompack.transport.http`: the HTTP(S) client (its own :mod:`httpx` client,
  one per process and never shared across ``fork``), with per-request timeouts, per-hop
  redirects and prompt cancellation;
* :mod:`~pyg_atompack.transport.transfers`: the bodies over it, with retries and ``Range``
  resume, one version per download, every body bounded by its listed size and every
  transfer by a deadline;
* :mod:`~pyg_atompack.transport.credentials`: request headers whose credentials are
  bound to the origins they were given for (:func:`bind_headers`);
* :mod:`~pyg_atompack.transport.retry`: the one :class:`RetryPolicy`;
* :mod:`~pyg_atompack.transport.integrity`: the one size + sha256 check;
* :mod:`~pyg_atompack.transport.buffers`: download targets (memory maps, parts, files);
* :mod:`~pyg_atompack.transport.redact`: URLs without secrets, for every message;
* :mod:`~pyg_atompack.transport.errors`: the one error family (:class:`TransportError`).
"""

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
]
