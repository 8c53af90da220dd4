"""``.atp`` shards of an object-store prefix, as one reader for :class:`AtompackDataset`.

:func:`open_objectstore_atp` lists the prefix (one request), downloads every ``.atp``
shard into the cache, verified against its listed size and the manifest's sha256 (a
shard already cached is not fetched again), and opens the local copies as one
:class:`~pyg_atompack.atp.ShardedReader` in POSIX path order. The result is what
``AtompackDataset`` gives for the same shards on disk::

    reader = open_objectstore_atp("s3://bucket/qm9/train/")
    dataset = AtompackDataset(reader)
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pyg_atompack import atp
from pyg_atompack.transport.errors import RemoteNotFoundError
from pyg_atompack.transport.objectstore import ObjectStore


def open_objectstore_atp(url: str, *, cache_dir: str | os.PathLike | None = None,
                         access: str = "mmap", max_workers: int = 4,
                         **storage_options: Any) -> atp.ShardedReader:
    """Open the ``.atp`` shards below an object-store URL from verified local copies.

    Args:
        url: ``s3://bucket/prefix/``, a ``manifest.json`` URL or one ``.atp`` object.
        cache_dir: Download cache root.
            (default: :func:`~pyg_atompack.transport.objectstore.default_cache_dir`)
        access: ``atp`` access mode of the local copies. (default: ``"mmap"``)
        max_workers: Shards downloaded at once. (default: 4)
        **storage_options: :class:`~pyg_atompack.transport.objectstore.ObjectStore`
            options (``anon``, ``profile``, ``endpoint_url``, ...).

    Returns:
        One reader over every shard, in POSIX path order.

    Raises:
        RemoteNotFoundError: No ``.atp`` object at ``url``.
        pyg_atompack.transport.TransportError: A listing or download failed, or a shard
            does not match its listing (nothing unverified stays in the cache).
    """
    store = ObjectStore(url, **storage_options)
    objects = store.list(suffixes=(".atp",))
    if not objects:  # pragma: no cover - list() raises first
        raise RemoteNotFoundError(f"{store.url}: no .atp objects", url=store.url)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(objects)))) as pool:
        paths = list(pool.map(lambda obj: store.download(obj, cache_dir), objects))
    return atp.ShardedReader.from_paths(paths, access=access)
