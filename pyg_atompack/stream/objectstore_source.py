"""Shards from an object store: ``s3://bucket/prefix/`` (and ``gs://`` / ``az://``).

The bytes travel through :class:`pyg_atompack.remote.objectstore.ObjectStore`, which
makes its client lazily in each process (fork-safe), pickles without secrets, resumes
interrupted transfers by range under the transport's one
:class:`~pyg_atompack.transport.RetryPolicy` and raises the transport error family.
``.atp`` shards also have range reads (:meth:`ObjectStoreSource.range_reader`), so
:class:`~pyg_atompack.stream.ShardStreamDataset` streams them as record blocks, as it
does over HTTP(S).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from pyg_atompack.remote.objectstore import ObjectInfo, ObjectStore
from pyg_atompack.remote.ranges import ObjectRangeReader
from pyg_atompack.stream.errors import StreamCancelled
from pyg_atompack.stream.sources import CancelToken, ShardInfo
from pyg_atompack.transport.buffers import WritableBuffer, allocate
from pyg_atompack.transport.http import part_count
from pyg_atompack.transport.retry import RetryPolicy

#: Smallest byte range worth its own request when a shard is fetched in parts.


class ObjectStoreSource:
    """``.pt`` / ``.atp`` shards below an object-store prefix, or named by a manifest.

    Args:
        url (str): ``s3://bucket/prefix/`` (every ``.pt`` / ``.atp`` object below it, in POSIX
            path order), ``s3://bucket/prefix/manifest.json`` (the shards it names) or
            one object's URL. A ``manifest.json`` below the prefix supplies sha256
            digests and record counts.
        **storage_options (optional): Options of
            :class:`~pyg_atompack.remote.objectstore.ObjectStore` (``anon``, ``profile``,
            ``endpoint_url``, ``retry`` (a :class:`~pyg_atompack.transport.RetryPolicy`), and fsspec
            options such as ``key`` / ``secret``, which are never pickled).

    The listing happens once, here; DataLoader workers get it pickled (or inherited
    across ``fork``) and each makes its own client on its first fetch.

    Example::

        from pyg_atompack.stream import ObjectStoreSource, ShardStreamDataset

        source = ObjectStoreSource("s3://my-bucket/qm9/train/")  # AWS_* environment
        dataset = ShardStreamDataset(source, shuffle=True, seed=0)
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.store = ObjectStore(url, **storage_options)
        self._shards = tuple(
            ShardInfo(name=o.name, size=o.size, sha256=o.sha256, records=o.records,
                      location=o.url, extra={"etag": o.etag, "generation": o.generation})
            for o in self.store.list()
        )

    @property
    def url(self) -> str:
        """The listed URL."""
        return self.store.url

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy of every request (``ShardStreamDataset(retries=)`` sets it)."""
        return self.store.retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        # a handle of its own, so a shallow copy of this source never changes the original
        self.store = self.store.with_retry(policy)

    def list_shards(self) -> Sequence[ShardInfo]:
        """Return the shards found at construction, sorted by POSIX path."""
        return self._shards

    def _object(self, shard: ShardInfo) -> ObjectInfo:
        return ObjectInfo(name=shard.name, url=shard.location, size=shard.size or 0,
                          etag=shard.extra.get("etag"), sha256=shard.sha256,
                          records=shard.records, generation=shard.extra.get("generation"))

    def range_reader(self, shard: ShardInfo) -> ObjectRangeReader:
        """Range reads of one shard (record blocks of ``.atp`` shards use them).

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.

        Returns:
            A picklable, fork-safe reader pinned to the listed ETag.
        """
        return ObjectRangeReader(self.store, self._object(shard))

    def fetch(self, shard: ShardInfo, cancel: CancelToken) -> WritableBuffer:
        """Download one shard into an anonymous memory map of its listed size.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Aborts the request in flight, and any backoff wait, when
                cancelled.

        Returns:
            The shard's bytes.

        Raises:
            pyg_atompack.transport.TransportError: The shard cannot be retrieved (the
                message names its URL and the cause).
            StreamCancelled: ``cancel`` was cancelled during the transfer.
        """
        obj = self._object(shard)
        buffer = allocate(obj.size)
        self.store.read_into(obj, buffer, cancel=cancel)
        return buffer

    def read_into(self, shard: ShardInfo, buffer: WritableBuffer, start: int, end: int,
                  cancel: CancelToken, progress: Callable[[int], None] | None = None,
                  pin: object | None = None) -> None:
        """Download bytes ``[start, end)`` of one shard into ``buffer[start:end]``.

        One ranged request, conditioned and resumed like :meth:`fetch`; used to hand
        out the first shard's samples as its bytes arrive
        (:class:`~pyg_atompack.stream.arriving.ArrivingShard`).

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            buffer (WritableBuffer): The whole shard's buffer.
            start (int): First byte.
            end (int): One past the last byte.
            cancel (CancelToken): Aborts the request when cancelled.
            progress (Callable[[int], None], optional): Called as bytes land with the offset
                one past the last byte in (bytes ``[start, offset)`` are in).
                (default: :obj:`None`)
            pin (object, optional): Not needed here: every request is conditioned on the
                object's listed version (ETag / generation), so the ranges of one
                download cannot come from two versions. (default: :obj:`None`)
        """
        landed = None
        if progress is not None:
            position = start

            def landed(count: int) -> None:
                nonlocal position
                position += count
                progress(position)
        self.store.read_into(self._object(shard), buffer, start=start, end=end,
                             offset=start, cancel=cancel, progress=landed)

    def fetch_in_parts(self, shard: ShardInfo, cancel: CancelToken,
                       parts: int) -> WritableBuffer:
        """Download one shard as ``parts`` concurrent ranged requests into one buffer.

        Used for every shard a download can split over free connections
        (``ShardStreamDataset(split_shards=)``): stores cap the bandwidth of each
        connection, so parallel ranges arrive sooner. Each part resumes on its own; one
        failed part cancels the others.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Aborts every part when cancelled.
            parts (int): Concurrent requests; fewer when parts would be smaller than
                :data:`~pyg_atompack.transport.http.MIN_PART_BYTES`.

        Returns:
            The shard's bytes.
        """
        obj = self._object(shard)
        parts = part_count(obj.size, parts)
        if parts == 1:
            return self.fetch(shard, cancel)
        buffer = allocate(obj.size)
        bounds = [obj.size * n // parts for n in range(parts + 1)]
        siblings = CancelToken()
        unregister = cancel.on_cancel(siblings.cancel)
        errors: list[BaseException] = []

        def run(number: int) -> None:
            try:
                self.store.read_into(obj, buffer, start=bounds[number],
                                     end=bounds[number + 1], offset=bounds[number],
                                     cancel=siblings)
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller
                errors.append(error)
                siblings.cancel()

        helpers = [threading.Thread(target=run, args=(n,), daemon=True,
                                    name=f"pyg_atompack-s3-part-{n}")
                   for n in range(1, parts)]
        try:
            for helper in helpers:
                helper.start()
            run(0)
        finally:
            for helper in helpers:
                helper.join()
            unregister()
        cancel.raise_if_cancelled()
        failures = [e for e in errors if not isinstance(e, StreamCancelled)]
        if failures:
            raise failures[0]
        return buffer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, shards={len(self._shards)})"
