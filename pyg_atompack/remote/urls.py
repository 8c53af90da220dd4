"""Which backend serves which URL: the one rule every entry point follows.

``AtompackDataset(url)``, ``ShardStreamDataset(url)``, ``stream.open_source(url)`` and the
command line's ``info`` / ``verify`` / ``head`` look a URL's scheme up here. A string with
``scheme://`` is never treated as a local path; an unknown scheme raises
:class:`UnsupportedURLError` naming it and the supported ones.

Built in: ``hf://`` (:mod:`pyg_atompack.hub`) and ``http://`` / ``https://``
(:mod:`pyg_atompack.transport.http`). Object stores join :data:`OBJECT_STORES` with one
line each, naming the module that serves them and what to install; until that module
can be imported, their URLs raise :class:`UnsupportedURLError` saying so (and until the
store's client library is installed, the module's first request does, naming it).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

from pyg_atompack.transport.errors import UnsupportedURLError
from pyg_atompack.transport.redact import redact_url

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class Backend:
    """An object-store backend.

    Attributes:
        module: The torch-free module serving the scheme (``list_objects``,
            ``read_range``, ``download``); streams wrap it in ``ObjectStoreSource``.
        install: What to install for it, e.g. ``"pip install s3fs"``.
    """

    module: str
    install: str


#: Object-store schemes -> their backend (the one place a new store joins).
OBJECT_STORES: dict[str, Backend] = {
    "s3": Backend("pyg_atompack.remote.objectstore", "pip install s3fs"),
    "gs": Backend("pyg_atompack.remote.objectstore", "pip install gcsfs"),
    "gcs": Backend("pyg_atompack.remote.objectstore", "pip install gcsfs"),
    "az": Backend("pyg_atompack.remote.objectstore", "pip install adlfs"),
    "abfs": Backend("pyg_atompack.remote.objectstore", "pip install adlfs"),
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
        where = redact_url(url)
        raise UnsupportedURLError(
            f"{where!r}: unsupported URL scheme {scheme + '://' if scheme else '(none)'}; "
            f"supported: {', '.join(s + '://' for s in supported_schemes())}", url=where)
    return scheme


def object_store(url: str):
    """The module serving an object-store URL.

    Args:
        url (str): An ``s3://``, ``gs://`` or ``az://`` URL.

    Returns:
        The imported backend module.

    Raises:
        UnsupportedURLError: The scheme is no object store, or its backend (or the
            library it needs) is not installed; the message says what to install.
    """
    scheme = check_scheme(url)
    backend = OBJECT_STORES.get(scheme)
    where = redact_url(url)
    if backend is None:
        raise UnsupportedURLError(f"{where!r}: {scheme}:// is not an object-store URL",
                                  url=where)
    try:
        return importlib.import_module(backend.module)
    except ImportError as error:
        raise UnsupportedURLError(
            f"{where!r}: {scheme}:// URLs need the object-store backend ({backend.module}), "
            f"which cannot be imported here ({error}); {backend.install}", url=where
        ) from error
