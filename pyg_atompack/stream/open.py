"""``open_source(url)``: the source a URL names, by the project's one URL rule.

The scheme chooses the backend (:mod:`pyg_atompack.remote.backends`: ``hf://``, ``http(s)://``,
object stores, schemes other packages register); every URL gives one
:class:`~pyg_atompack.stream.RemoteSource` over it. A string without ``scheme://`` is a
local directory or glob (:class:`~pyg_atompack.stream.LocalSource`).
"""

from __future__ import annotations

import os
from typing import Any

# imported for its side effect too: the Hub registers the hf:// backend
from pyg_atompack import hub  # noqa: F401
from pyg_atompack.remote.backends import url_scheme
from pyg_atompack.stream.sources import LocalSource, RemoteSource, Source


def open_source(url: str | os.PathLike | Source, **storage_options: Any) -> Source:
    """The shard source ``url`` names.

    Args:
        url (str | os.PathLike | Source): ``hf://datasets/{repo}[@{revision}]/{path}`` (a directory
            of shards, or one ``.pt`` / ``.atp`` file), ``http(s)://.../manifest.json``, a directory
            URL ending in ``/`` (its ``manifest.json``) or one ``.pt`` / ``.atp`` file URL, an
            object-store URL (``s3://bucket/prefix/``, ``gs://``, ``az://`` where the
            backend is installed), a local directory or glob, or a :class:`Source`
            (returned as it is).
        **storage_options (optional): Passed to the backend: ``retry``, ``headers`` (HTTP),
            ``token``, ``endpoint``, ``pattern`` (Hub), the object store's options.

    Returns:
        The source (listed once, here).

    Raises:
        UnsupportedURLError: The scheme is unknown, or its backend is not installed.
    """
    if isinstance(url, Source) and not isinstance(url, (str, os.PathLike)):
        return url
    if url_scheme(url) is None:
        return LocalSource(url, **storage_options)
    return RemoteSource(url, **storage_options)
