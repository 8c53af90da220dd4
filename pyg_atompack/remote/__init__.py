"""The remote layer: URL -> remote files, torch-free (issue 30).

For now it holds the one download cache (:mod:`pyg_atompack.remote.cache`): one root
(``$PYG_ATOMPACK_CACHE``, default ``~/.cache/pyg_atompack``), the one function that turns
a name a remote party listed into a local path, the sha256 check, version keys and the
checked, read-only-aware writes every cached file goes through.
"""

from pyg_atompack.remote.cache import (
    CACHE_ENV,
    CachePathError,
    CacheReadOnlyError,
    RemoteNameError,
    cache_root,
    check_sha256,
    local_name,
)

__all__ = [
    "CACHE_ENV",
    "CachePathError",
    "CacheReadOnlyError",
    "RemoteNameError",
    "cache_root",
    "check_sha256",
    "local_name",
]
