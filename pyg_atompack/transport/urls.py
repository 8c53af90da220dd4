"""Which backend serves which URL: the one rule every entry point follows.

``AtompackDataset(url)``, ``ShardStreamDataset(url)``, ``stream.open_source(url)`` and the
command line's ``info`` / ``verify`` / ``head`` look a URL's scheme up here. A string with
``scheme://`` is never treated as a local path; an unknown scheme raises
:class:`UnsupportedURLError` naming it and the supported ones.

Built in: ``hf://`` (:mod:`pyg_atompack.hub`) and ``http://`` / ``https://``
(:mod:`pyg_atompack.transport.http`). Object stores join :data:`OBJECT_STORES` with one
line each, naming the client library they need and what to install; until that library
is installed, their URLs raise :class:`UnsupportedURLError` saying so. Object-store URLs
are served by :mod:`pyg_atompack.transport.objectstore` (``list_objects``, ``read_range``,
``download``) and, for streams, by ``ObjectStoreSource``.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from pyg_atompack.transport.errors import UnsupportedURLError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class Backend:
    """An object-store backend.

    Attributes:
        module: The client library the scheme needs (e.g. ``"s3fs"``), looked up without
            importing it.
        install: What to install for it, e.g. ``"pip install s3fs"``.
    """

    module: str
    install: str


#: Object-store schemes -> their backend (the one place a new store joins).
OBJECT_STORES: dict[str, Backend] = {
    "s3": Backend("s3fs", "pip install s3fs"),
    "gs": Backend("gcsfs", "pip install gcsfs"),
    "gcs": Backend("gcsfs", "pip install gcsfs"),
    "az": Backend("adlfs", "pip install adlfs"),
    "abfs": Backend("adlfs", "pip install adlfs"),
}

BUILTIN_SCHEMES = ("hf", "http", "https")


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


def supported_schemes() -> tuple[str, ...]:
    """Every scheme this installation knows (object stores whether installed or not)."""
    return (*BUILTIN_SCHEMES, *OBJECT_STORES)


def check_scheme(url: str) -> str:
    """The scheme of ``url``, if some backend knows it.

    Args:
        url (str): A ``scheme://`` URL.

    Returns:
        The lower-case scheme.

    Raises:
        UnsupportedURLError: No backend serves it; the message lists the supported ones.
    """
    scheme = url_scheme(url)
    if scheme not in supported_schemes():
        raise UnsupportedURLError(
            f"{url!r}: unsupported URL scheme {scheme + '://' if scheme else '(none)'}; "
            f"supported: {', '.join(s + '://' for s in supported_schemes())}", url=url)
    return scheme


def object_store(url: str) -> Backend:
    """The backend of an object-store URL, once its client library is known to be installed.

    Args:
        url (str): An ``s3://``, ``gs://`` or ``az://`` URL.

    Returns:
        The scheme's :class:`Backend`.

    Raises:
        UnsupportedURLError: The scheme is no object store, or the library its backend
            needs is not installed; the message says what to install.
    """
    scheme = check_scheme(url)
    backend = OBJECT_STORES.get(scheme)
    if backend is None:
        raise UnsupportedURLError(f"{url!r}: {scheme}:// is not an object-store URL", url=url)
    try:
        # found, not imported: the client is imported when the first request needs it
        found = importlib.util.find_spec(backend.module) is not None
    except ImportError:  # a dotted name whose parent package is missing
        found = False
    if not found:
        raise UnsupportedURLError(
            f"{url!r}: {scheme}:// URLs need the object-store backend ({backend.module}), "
            f"which is not installed here; {backend.install}", url=url)
    return backend
