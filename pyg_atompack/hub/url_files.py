"""Remote ``.atp`` files served over plain HTTP(S), opened like a Hub directory.

An ``http(s)://`` URL names a ``.atp`` / ``.pt`` file, a ``manifest.json`` written by the
converter (names relative to it, with sizes and sha256), or a directory ending in ``/``
that holds one. The files become :class:`~pyg_atompack.hub.RemoteFile` entries with
``repo_type="url"`` and no repository, so :class:`~pyg_atompack.hub.HubAtpReader` reads
them exactly as it reads a Hub directory: header range reads when opening, verified
downloads into the cache on first use. No Hub token is ever sent to such a URL; pass
``headers=`` for a server that needs credentials (they stay at that server's origin).

Cache (:mod:`pyg_atompack.remote.cache`): one folder per URL directory,
``{root}/http/{host}--{hash of the directory URL}/``. Files with a sha256 in the manifest
are content-addressed (``blobs/{sha256}``); files without one go to
``versions/{version key}/{file name}``, keyed by the version the server names (the ETag,
else Last-Modified) and downloaded pinned to it, so a file rewritten at the same size is
fetched again. A file's local name is the last component of its URL's path, decoded;
an absolute manifest entry (``https://mirror/x.atp``, a supported mirror) is stored the
same way, under the folder of its own origin and directory. Manifest names and digests are
checked when the manifest is read (:mod:`pyg_atompack.remote.manifest`).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Mapping
from urllib.parse import unquote, urljoin, urlsplit

from pyg_atompack.hub.errors import HubNoShardsError, HubTransferError
from pyg_atompack.hub.remote import HUB_POLICY, RemoteFile
from pyg_atompack.hub.transfer import cached_path
from pyg_atompack.remote.manifest import MANIFEST_NAME, ManifestError, read_manifest_records
from pyg_atompack.transport import http as transport
from pyg_atompack.transport.credentials import bind_headers
from pyg_atompack.transport.errors import TransportError, UnsupportedURLError
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy

_SUFFIXES = (".atp", ".pt")


def _folder_key(url: str) -> str:
    # one cache folder per URL directory, named readably and made unique by a hash; the
    # host is reduced to safe characters (the hash keeps folders apart)
    parts = urlsplit(url)
    directory = posixpath.dirname(parts.path)
    digest = hashlib.sha256(f"{parts.scheme}://{parts.netloc}{directory}".encode()).hexdigest()
    host = re.sub(r"[^A-Za-z0-9.-]", "_", parts.hostname or "host")[:64]
    return f"{host}--{digest[:16]}"


def _entry(url: str, name: str, size: int, sha256: str | None,
           version: str | None = None) -> RemoteFile:
    entry = RemoteFile(path=name, size=size, sha256=sha256, url=url, revision="",
                       repo_id=_folder_key(url), repo_type="url", version=version)
    cached_path(entry)  # its local name is checked now, at listing, not in a download
    return entry


def list_url_files(url: str, *, pattern_suffix: str | None = ".atp",
                   headers: Mapping[str, str] | None = None,
                   policy: RetryPolicy | None = None) -> list[RemoteFile]:
    """The files an ``http(s)://`` URL names, with sizes (and sha256 from a manifest).

    Args:
        url (str): A ``.atp`` / ``.pt`` file, a ``manifest.json``, or a directory ending in ``/``
            holding a ``manifest.json``.
        pattern_suffix (str | None, optional): Keep only manifest entries with this suffix
            (``None``: all). (default: :obj:`".atp"`)
        headers (Mapping[str, str], optional): Request headers (credentials stay at the URL's
            origin). (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts. (default: the Hub default)

    Returns:
        The files, in manifest order (a single file: one entry).

    Raises:
        UnsupportedURLError: The URL names none of the above.
        RemoteNameError: A manifest name or sha256 cannot safely name a file.
        HubNoShardsError: The manifest lists no file with the suffix.
        HubTransferError: The server could not be read (after retries).
    """
    policy = policy or HUB_POLICY
    headers = bind_headers(headers, url)  # the user's URL, not what its manifest names
    path = unquote(urlsplit(url).path)
    name = posixpath.basename(path)
    where = redact_url(url)
    try:
        if name.endswith(_SUFFIXES):
            found = transport.probe(url, policy=policy, headers=headers)
            if found.size is None:
                raise HubTransferError(f"{where}: the server does not tell the file's size",
                                       url=where)
            return [_entry(url, name, found.size, None, found.validator)]
        if path.endswith("/"):
            url = urljoin(url, MANIFEST_NAME)
        elif name != MANIFEST_NAME:
            raise UnsupportedURLError(
                f"{where}: an http(s) URL must name a .atp or .pt file, a manifest.json, or "
                f"a directory ending in '/' that holds a manifest.json", url=where)
        body = transport.fetch(url, policy=policy, headers=headers,
                               limit=transport.DOCUMENT_LIMIT)
    except (HubTransferError, UnsupportedURLError):
        raise
    except TransportError as error:
        raise HubTransferError(str(error), url=error.url, status=error.status) from error
    try:
        document = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise HubTransferError(f"{redact_url(url)}: manifest is not valid JSON: {error}",
                               url=redact_url(url)) from error
    try:
        entries = read_manifest_records(document, url)  # names and sha256 checked there
    except ManifestError as error:
        raise HubTransferError(str(error), url=redact_url(url)) from error
    files = []
    for entry_name, entry in entries.items():
        if pattern_suffix and not entry_name.endswith(pattern_suffix):
            continue
        if not isinstance(entry.get("bytes"), int):
            raise HubTransferError(f"{redact_url(url)}: shard {entry_name!r} has no 'bytes' "
                                   f"size in the manifest", url=redact_url(url))
        files.append(_entry(urljoin(url, entry_name), entry_name, entry["bytes"],
                            entry.get("sha256")))
    if not files:
        raise HubNoShardsError(f"{redact_url(url)}: the manifest lists no "
                               f"{pattern_suffix or ''} file")
    return files


def open_url_atp(url: str, *, cache_dir: str | os.PathLike | None = None, verify: bool = True,
                 access: str = "mmap", policy: RetryPolicy | None = None, max_workers: int = 8):
    """Open the ``.atp`` file(s) an ``http(s)://`` URL names, without downloading them.

    One manifest read (or one size probe of a single file) and one 8192-byte header range
    read per shard; shards are downloaded, verified, into the cache on first use.

    Args:
        url (str): See :func:`list_url_files`.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        verify (bool, optional): Verify each download against the manifest's sha256.
            (default: :obj:`True`)
        access (str, optional): ``atp.open`` access mode of downloaded shards.
            (default: :obj:`"mmap"`)
        policy (RetryPolicy, optional): Retries and timeouts. (default: the Hub default)
        max_workers (int, optional): Parallel header reads. (default: :obj:`8`)

    Returns:
        A :class:`~pyg_atompack.hub.HubAtpReader` named by the (redacted) URL.
    """
    from pyg_atompack.hub.atp_reader import HubAtpReader

    return HubAtpReader(list_url_files(url, policy=policy), cache_dir=cache_dir, token=False,
                        verify=verify, access=access, policy=policy, name=redact_url(url),
                        max_workers=max_workers)


def open_remote_atp(url: str, **options):
    """Open remote ``.atp`` data named by any supported URL, lazily (the one URL rule).

    ``hf://`` goes to :func:`~pyg_atompack.hub.open_hub_atp`, ``http(s)://`` to
    :func:`open_url_atp`, object-store schemes to their backend's ``open_atp``
    (see :mod:`pyg_atompack.remote.urls`).

    Args:
        url (str): The URL.
        **options (optional): ``cache_dir``, ``verify``, ``access``, ``policy`` and, for ``hf://``,
            ``token`` / ``endpoint``; object stores take their storage options.

    Returns:
        A reader with the ``atp`` reader interface.

    Raises:
        UnsupportedURLError: The scheme is unknown, or its backend is not installed.
    """
    from pyg_atompack.remote.urls import check_scheme, object_store

    scheme = check_scheme(url)
    if scheme == "hf":
        from pyg_atompack.hub.atp_reader import open_hub_atp
        from pyg_atompack.hub.uri import parse_hf_uri

        location = parse_hf_uri(url)
        return open_hub_atp(location.repo_id, location.path_in_repo,
                            revision=location.revision, repo_type=location.repo_type,
                            **options)
    if scheme in ("http", "https"):
        return open_url_atp(url, **options)
    object_store(url)  # the backend is installed (else: what to install)
    return open_object_store_atp(url, **options)


def open_object_store_atp(url: str, *, cache_dir: str | os.PathLike | None = None,
                          verify: bool = True, access: str = "mmap",
                          policy: RetryPolicy | None = None, max_workers: int = 8,
                          **storage_options):
    """Open the ``.atp`` objects below an object-store URL, without downloading them.

    The backend (:mod:`pyg_atompack.remote.objectstore`) lists them (sizes, ETags, and
    sha256 from a ``manifest.json``), reads each header with a range read and keeps the
    verified downloads in its cache; its handle travels with the reader (no secrets).

    Args:
        url (str): ``s3://bucket/prefix/`` (or one object, or a ``manifest.json``).
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        verify (bool, optional): Kept for the signature of the other openers; the backend always
            verifies. (default: :obj:`True`)
        access (str, optional): ``atp.open`` access mode of downloaded shards.
            (default: :obj:`"mmap"`)
        policy (RetryPolicy, optional): Retries and timeouts of every request (the backend's
            ``retry``). (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
        max_workers (int, optional): Parallel header reads. (default: :obj:`8`)
        **storage_options (optional): The backend's options (``endpoint_url``, ``profile``, ...).

    Returns:
        A :class:`~pyg_atompack.hub.HubAtpReader` named by the URL.
    """
    from pyg_atompack.hub.atp_reader import HubAtpReader
    from pyg_atompack.remote.objectstore import list_objects

    if policy is not None:
        storage_options["retry"] = policy
    store, objects = list_objects(url, suffixes=(".atp",), **storage_options)
    shards = [RemoteFile(path=o.name, size=o.size, sha256=o.sha256, url=o.url, revision="",
                         repo_id="", repo_type="object", blob_id=o.etag,
                         version=o.generation) for o in objects]
    if not shards:
        raise HubNoShardsError(f"{redact_url(url)}: no .atp object below this URL")
    return HubAtpReader(shards, cache_dir=cache_dir, token=False, verify=verify, access=access,
                        store=store, name=redact_url(url), max_workers=max_workers)
