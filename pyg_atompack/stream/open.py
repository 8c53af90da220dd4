"""``open_source(url)``: the source a URL names, by the project's one URL rule.

The scheme decides (:mod:`pyg_atompack.remote.urls`): ``hf://`` gives a
:class:`~pyg_atompack.stream.HubSource`, ``http(s)://`` an
:class:`~pyg_atompack.stream.HTTPSource`, object-store schemes an
:class:`~pyg_atompack.stream.ObjectStoreSource`. A string without ``scheme://`` is a local
directory or glob (:class:`~pyg_atompack.stream.LocalSource`).
"""

from __future__ import annotations

import os
import posixpath
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from pyg_atompack.remote.urls import check_scheme, object_store, url_scheme
from pyg_atompack.stream.sources import MANIFEST_NAME, SHARD_SUFFIXES, LocalSource, Source
from pyg_atompack.transport.errors import UnsupportedURLError
from pyg_atompack.transport.redact import redact_url


def open_source(url: str | os.PathLike | Source, **storage_options: Any) -> Source:
    """The shard source ``url`` names.

    Args:
        url (str | os.PathLike | Source): ``hf://datasets/{repo}[@{revision}]/{path}`` (a directory
            of shards, or one ``.pt`` / ``.atp`` file), ``http(s)://.../manifest.json``, a directory
            URL ending in ``/`` (its ``manifest.json``) or one ``.pt`` / ``.atp`` file URL, an
            object-store URL (``s3://bucket/prefix/``, ``gs://``, ``az://`` where the
            backend is installed), a local directory or glob, or a :class:`Source`
            (returned as it is).
        **storage_options (optional): Passed to the source: ``retry``, ``headers`` (HTTP),
            ``token``, ``endpoint``, ``pattern`` (Hub), the object store's options.

    Returns:
        The source (listed once, here).

    Raises:
        UnsupportedURLError: The scheme is unknown, or its backend is not installed.
    """
    if isinstance(url, Source) and not isinstance(url, (str, os.PathLike)):
        return url
    scheme = url_scheme(url)
    if scheme is None:
        return LocalSource(url, **storage_options)
    check_scheme(url)
    if scheme == "hf":
        from pyg_atompack.hub import parse_hf_uri
        from pyg_atompack.stream.hub_source import HubSource

        location = parse_hf_uri(url)
        path = location.path_in_repo
        options = dict(storage_options)
        if path.endswith(SHARD_SUFFIXES):  # one file: list its directory, match its name
            path, _, name = path.rpartition("/")
            options.setdefault("pattern", name)
        else:
            options.setdefault("pattern", "*")
            options.setdefault("suffixes", SHARD_SUFFIXES)
        return HubSource(location.repo_id, path, revision=location.revision or "main",
                         repo_type=location.repo_type, **options)
    if scheme in ("http", "https"):
        from pyg_atompack.stream.http import HTTPSource

        path = unquote(urlsplit(url).path)
        name = posixpath.basename(path)
        if path.endswith("/"):
            return HTTPSource(urljoin(url, MANIFEST_NAME), **storage_options)
        if name == MANIFEST_NAME:
            return HTTPSource(url, **storage_options)
        if name.endswith(SHARD_SUFFIXES):
            return HTTPSource([url], **storage_options)
        where = redact_url(url)
        raise UnsupportedURLError(
            f"{where!r}: an http(s) URL must name a manifest.json, a directory ending in '/' "
            f"that holds one, or a .pt / .atp file", url=where)
    object_store(url)  # the backend is installed (else: what to install)
    from pyg_atompack.stream.objectstore_source import ObjectStoreSource

    return ObjectStoreSource(url, **storage_options)
