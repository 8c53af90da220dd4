"""The remote layer: URLs -> remote files and their bytes on local disk, torch-free.

It sits on the transport (:mod:`pyg_atompack.transport`: the HTTP client, retries,
credentials, bounds, integrity, the error family) and below the Hub layer and the
datasets:

* :mod:`~pyg_atompack.remote.cache`: the one download cache: one root
  (``$PYG_ATOMPACK_CACHE``, default ``~/.cache/pyg_atompack``), the one function that turns
  a name a remote party listed into a local path, the sha256 check, version keys and the
  checked, read-only-aware writes every cached file goes through;
* :mod:`~pyg_atompack.remote.files`: :class:`RemoteFile`, the one description of a
  listed file (URL, name, size, sha256, version), whatever backend listed it;
* :mod:`~pyg_atompack.remote.backends`: one backend per URL scheme (list, read a byte
  range, download), chosen by one registry that other packages extend through the
  ``pyg_atompack.backends`` entry points; ``file`` and ``http(s)`` in
  :mod:`~pyg_atompack.remote.http_backend`;
* :mod:`~pyg_atompack.remote.manifest`: the one reader of ``manifest.json``;
* :mod:`~pyg_atompack.remote.objectstore` (with ``objectstore_backends``): object stores
  (``s3://``, ``gs://``, ``az://``) on fsspec, under the transport's retry policy and
  error family;
* :mod:`~pyg_atompack.remote.ranges`, :mod:`~pyg_atompack.remote.atp_meta`,
  :mod:`~pyg_atompack.remote.block_cache`, :mod:`~pyg_atompack.remote.record_reader`:
  record-level reads of big remote `.atp` files (range readers, the metadata cache, the
  bounded disk page cache, :class:`RemoteAtpReader`).
"""

from pyg_atompack.remote.cache import (
    CACHE_ENV,
    CachePathError,
    CacheReadOnlyError,
    RemoteNameError,
    cache_root,
    cached_path,
    check_sha256,
    local_name,
)
from pyg_atompack.remote.files import RemoteFile
from pyg_atompack.remote.record_reader import RemoteAtpReader, open_remote_atp

__all__ = [
    "CACHE_ENV",
    "CachePathError",
    "CacheReadOnlyError",
    "RemoteNameError",
    "cache_root",
    "cached_path",
    "check_sha256",
    "local_name",
    "RemoteAtpReader",
    "RemoteFile",
    "open_remote_atp",
]
