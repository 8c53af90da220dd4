"""``open_source(url, options)``: the source a URL names, by the project's one URL rule.

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
from pyg_atompack.stream.options import SourceOptions
from pyg_atompack.stream.sources import LocalSource, RemoteSource, Source


def open_source(url: str | os.PathLike | Source, options: SourceOptions | None = None,
                **storage_options: Any) -> Source:
    """The shard source ``url`` names, carrying ``options``.

    Args:
        url (str | os.PathLike | Source): ``hf://datasets/{repo}[@{revision}]/{path}`` (a directory
            of shards, or one ``.pt`` / ``.atp`` file), ``http(s)://.../manifest.json``, a directory
            URL ending in ``/`` (its ``manifest.json``) or one ``.pt`` / ``.atp`` file URL, an
            object-store URL (``s3://bucket/prefix/``, ``gs://``, ``az://`` where the
            backend is installed), a local directory or glob, or a :class:`Source`
            (returned as it is: its options and storage options are its own, so passing
            either with it raises :class:`ValueError`).
        options (SourceOptions, optional): How a stream fetches, checks and decodes the
            shards; the source keeps them (its ``retries`` go into the backend's retry
            policy now) and a :class:`~pyg_atompack.stream.ShardStreamDataset` over it
            uses them. (default: :obj:`None`)
        **storage_options (optional): Passed to the backend: ``retry``, ``headers`` (HTTP),
            ``token``, ``endpoint``, ``pattern`` (Hub), the object store's options.

    Returns:
        The source (listed once, here).

    Raises:
        UnsupportedURLError: The scheme is unknown, or its backend is not installed.
        ValueError: ``url`` is already a source and ``options`` or storage options were
            given.
    """
    if isinstance(url, Source) and not isinstance(url, (str, os.PathLike)):
        if options is not None or storage_options:
            raise ValueError(f"{url!r} is already a source: give it its options when it is "
                             "made (e.g. RemoteSource(url, options=...)), not to open_source")
        return url
    if url_scheme(url) is None:
        return LocalSource(url, options=options, **storage_options)
    return RemoteSource(url, options=options, **storage_options)
