"""One backend per URL scheme, chosen by one registry that other packages can extend.

Every entry point that takes a URL (``AtompackDataset(url)``, ``ShardStreamDataset(url)``,
``stream.open_source(url)``, ``hub.open_remote_atp(url)``, the command line's ``info`` /
``verify`` / ``head``) opens its backend here, with :func:`open_backend`. A backend is
bound to the URL it was opened for and its options, and does three things on the one
file type, :class:`~pyg_atompack.remote.RemoteFile`:

* ``list(suffixes)``: the files the URL names (a file, a directory or prefix, a
  ``manifest.json``), sorted as listed; the entries of a manifest read on the way stay in
  ``backend.manifest`` (record counts);
* ``read_into(file, out, start, cancel=None, progress=None, pin=None)``: bytes
  ``[start, start + len(out))`` of a listed file into ``out``, bounded, retried and
  pinned to the listed version;
* ``download(file, cache_dir=None, verify=True)``: a verified copy in the one cache
  (:func:`~pyg_atompack.remote.cache.cached_path`), or the file itself when it is local;

plus ``range_reader(file)``, the :class:`~pyg_atompack.remote.ranges.RangeReader` record
reads use, ``read_all(file)`` (the whole file in memory, where the protocol has a plain
download) and ``retry``, the policy of every request. A string without ``scheme://`` is
a local path (the local files' backend; ``file://`` is no supported scheme); a scheme no
backend serves raises :class:`~pyg_atompack.transport.UnsupportedURLError` naming the
supported ones.

Built in: local paths and ``http`` / ``https`` (:mod:`pyg_atompack.remote.http_backend`),
``s3``, ``gs`` / ``gcs``, ``az`` / ``abfs``
(:class:`~pyg_atompack.remote.objectstore.ObjectStore`). The Hub's ``hf`` backend lives
with the Hub API and registers itself when :mod:`pyg_atompack.hub` is imported
(:func:`register_backend`). Another package adds a scheme through the entry-point group
:data:`ENTRY_POINT_GROUP`, e.g. in its ``pyproject.toml``::

    [project.entry-points."pyg_atompack.backends"]
    mem = "my_package.backend:MemoryBackend"

where ``MemoryBackend(url, **options)`` implements the methods above (subclass
:class:`~pyg_atompack.remote.files.Backend` for the shared parts: ``download``,
``read_all``, ``range_reader``). Entry points are read once, on the first lookup
of a scheme no built-in backend serves.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from typing import Any

from pyg_atompack.transport.errors import UnsupportedURLError
from pyg_atompack.transport.redact import redact_url

__all__ = ["ENTRY_POINT_GROUP", "backend_class", "open_backend", "register_backend",
           "supported_schemes", "url_scheme"]

#: The entry-point group through which other packages add backends.
ENTRY_POINT_GROUP = "pyg_atompack.backends"

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_OBJECT_STORES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
_registered: dict[str, Callable[..., Any]] = {}
_entry_points: dict[str, Any] | None = None
_lock = threading.Lock()


def url_scheme(value: object) -> str | None:
    """The lower-case scheme of a ``scheme://...`` string, else ``None`` (a local path).

    Args:
        value (object): Anything a user passed as a source.

    Returns:
        The scheme, or ``None`` for non-strings and strings without ``://``.
    """
    if not isinstance(value, str):
        return None
    match = _URL.match(value)
    return match.group(1).lower() if match else None


def register_backend(scheme: str, factory: Callable[..., Any]) -> None:
    """Serve ``scheme://`` URLs with ``factory(url, **options)`` in this process.

    Args:
        scheme (str): The scheme, e.g. ``"hf"``.
        factory (Callable[..., Any]): A :class:`Backend` class or anything building one.
    """
    _registered[scheme.lower()] = factory


def _plugins() -> dict[str, Any]:
    global _entry_points
    with _lock:
        if _entry_points is None:
            from importlib.metadata import entry_points

            _entry_points = {point.name.lower(): point
                             for point in entry_points(group=ENTRY_POINT_GROUP)}
        return _entry_points


def supported_schemes() -> tuple[str, ...]:
    """Every scheme this installation serves (object stores whether installed or not)."""
    return tuple(dict.fromkeys(("http", "https", *_registered, *_OBJECT_STORES, *_plugins())))


def backend_class(url: str) -> Callable[..., Any]:
    """What serves ``url``'s scheme (a string without ``scheme://`` is a local path).

    Args:
        url (str): A URL or local path.

    Returns:
        The backend factory.

    Raises:
        UnsupportedURLError: No backend serves the scheme; the message lists those that do.
    """
    scheme = url_scheme(url)
    if scheme in (None, "http", "https"):
        from pyg_atompack.remote.http_backend import FileBackend, HTTPBackend

        return FileBackend if scheme is None else HTTPBackend
    if scheme in _registered:
        return _registered[scheme]
    if scheme in _OBJECT_STORES:
        from pyg_atompack.remote.objectstore import ObjectStore

        return ObjectStore
    point = _plugins().get(scheme)
    if point is not None:
        return point.load()
    where = redact_url(url)
    raise UnsupportedURLError(
        f"{where!r}: unsupported URL scheme {scheme}://; supported: "
        f"{', '.join(s + '://' for s in supported_schemes())}", url=where)


def open_backend(url: str | os.PathLike, **options: Any) -> Any:
    """The backend serving ``url``, opened with ``options``.

    Args:
        url (str | os.PathLike): A URL or a local path.
        **options (optional): The backend's options (``retry`` for all; ``headers`` for
            http(s); ``token``, ``endpoint`` for ``hf://``; the store's options).

    Returns:
        The backend, bound to ``url``.

    Raises:
        UnsupportedURLError: No backend serves the scheme.
    """
    url = os.fspath(url)
    return backend_class(url)(url, **options)
