"""Shards served over plain HTTP(S), from a list of URLs or a ``manifest.json``.

Every byte goes through :mod:`pyg_atompack.transport.http` (one client, retry policy,
redirect rule and resume logic for the whole project); this module turns its errors
into the streaming layer's :class:`ShardFetchError` naming the shard.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from urllib.parse import unquote, urljoin, urlsplit

from pyg_atompack.stream.errors import ShardFetchError, ShardIntegrityError
from pyg_atompack.stream.sources import CancelToken, ShardInfo, read_manifest_records
from pyg_atompack.transport import http as transport
from pyg_atompack.transport.buffers import ShardPart, WritableBuffer
from pyg_atompack.transport.credentials import RequestHeaders, bind_headers
from pyg_atompack.transport.errors import RemoteIntegrityError, TransportError
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy

logger = logging.getLogger(__name__)

#: Smallest byte range worth its own connection when a shard is fetched in parts.
MIN_PART_BYTES = transport.MIN_PART_BYTES


def shard_error(name: str, error: TransportError) -> ShardFetchError:
    """The streaming error for a failed transfer of shard ``name``.

    Args:
        name (str): The shard.
        error (TransportError): What the transport raised (its message names the redacted URL).

    Returns:
        A :class:`ShardFetchError` with the transport error's ``url`` and ``status``
        (a :class:`ShardIntegrityError` for bytes that do not match the listing).
    """
    kind = ShardIntegrityError if isinstance(error, RemoteIntegrityError) else ShardFetchError
    return kind(f"shard {name}: {error}", url=error.url, status=error.status)


def fetch_url(url: str, *, name: str, policy: RetryPolicy, cancel: CancelToken,
              headers: RequestHeaders | Mapping[str, str] | None = None,
              size: int | None = None,
              limit: int = transport.UNLISTED_LIMIT) -> WritableBuffer:
    """Download ``url`` completely, retrying transient failures and resuming partial bodies.

    Args:
        url (str): The address to fetch.
        name (str): Shard name for messages.
        policy (RetryPolicy): Retry and timeout settings.
        cancel (CancelToken): Stops the transfer (and any backoff wait) when cancelled.
        headers (RequestHeaders | Mapping[str, str], optional): Request headers, credentials
            bound to their origins. (default: :obj:`None`)
        size (int, optional): The listed size: no more bytes are accepted.
            (default: unknown)
        limit (int, optional): The most bytes accepted when ``size`` is unknown.
            (default: :data:`~pyg_atompack.transport.http.UNLISTED_LIMIT`)

    Returns:
        The body, in an anonymous memory map of exactly its size when the server
        announced it (see :mod:`pyg_atompack.transport.buffers`), else in a bytearray.

    Raises:
        ShardFetchError: A permanent error, or transient errors outlasting every retry.
        StreamCancelled: ``cancel`` was cancelled meanwhile.
    """
    try:
        return transport.fetch(url, policy=policy, cancel=cancel, headers=headers, size=size,
                               limit=limit)
    except TransportError as error:
        raise shard_error(name, error) from error


def fetch_url_in_parts(url: str, *, size: int, parts: int, name: str, policy: RetryPolicy,
                       cancel: CancelToken,
                       headers: RequestHeaders | Mapping[str, str] | None = None
                       ) -> WritableBuffer:
    """Download ``url`` as ``parts`` concurrent byte ranges into one buffer.

    See :func:`pyg_atompack.transport.http.fetch_in_parts`.

    Args:
        url (str): The address to fetch.
        size (int): The body's length in bytes (from the listing).
        parts (int): Concurrent connections.
        name (str): Shard name for messages.
        policy (RetryPolicy): Retry and timeout settings, for each part.
        cancel (CancelToken): Stops every part (and any backoff wait) when cancelled.
        headers (Mapping[str, str], optional): Extra request headers. (default: :obj:`None`)

    Returns:
        The body, in an anonymous memory map.

    Raises:
        ShardFetchError: A part failed permanently or outlasted every retry.
        StreamCancelled: ``cancel`` was cancelled meanwhile.
    """
    try:
        return transport.fetch_in_parts(url, size=size, parts=parts, policy=policy,
                                        cancel=cancel, headers=headers,
                                        make_token=CancelToken)
    except TransportError as error:
        raise shard_error(name, error) from error


def _name_from_url(url: str) -> str:
    return unquote(posixpath.basename(urlsplit(url).path)) or url


class URLShardSource:
    """Base of the sources whose shards are plain URLs listed once at construction.

    Subclasses fill ``_shards`` (a tuple of :class:`ShardInfo` whose ``location`` is
    the URL), ``headers`` and ``retry``; listing and fetching are shared.
    """

    _shards: tuple[ShardInfo, ...]
    headers: RequestHeaders
    retry: RetryPolicy

    def list_shards(self) -> Sequence[ShardInfo]:
        """Return the shards, in the order they were listed at construction."""
        return self._shards

    def fetch(self, shard: ShardInfo, cancel: CancelToken) -> WritableBuffer:
        """Download one shard (see :func:`fetch_url`).

        Transient failures (timeouts, resets, HTTP 429/5xx) are retried with the
        source's :class:`RetryPolicy`; a retried transfer resumes from the bytes already
        received when the server supports ranges.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Stops the transfer, and any backoff wait, when cancelled.

        Returns:
            The shard's bytes.

        Raises:
            ShardFetchError: A permanent HTTP error, or transient errors outlasting
                every retry (the message names the shard and the URL).
            StreamCancelled: ``cancel`` was cancelled during the transfer.
        """
        return fetch_url(shard.location, name=shard.name, policy=self.retry, cancel=cancel,
                         headers=self.headers, size=shard.size)

    def read_into(self, shard: ShardInfo, buffer: WritableBuffer, start: int, end: int,
                  cancel: CancelToken, progress: Callable[[int], None] | None = None,
                  pin: transport.VersionPin | None = None) -> None:
        """Download bytes ``[start, end)`` of one shard into ``buffer[start:end]``.

        One range request, retried and resumed like :meth:`fetch`; used to hand out
        the first shard's samples as its bytes arrive
        (:class:`~pyg_atompack.stream.arriving.ArrivingShard`).

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            buffer (WritableBuffer): The whole shard's buffer.
            start (int): First byte.
            end (int): One past the last byte.
            cancel (CancelToken): Stops the transfer, and any backoff wait, when cancelled.
            progress (Callable[[int], None], optional): Called as bytes land with the offset
                one past the last byte in (bytes ``[start, offset)`` are in).
                (default: :obj:`None`)
            pin (VersionPin, optional): Shared by the ranges of one download: a range from
                another version of the file (``ETag`` / ``Last-Modified``) is refused.
                (default: :obj:`None`: this range's own)

        Raises:
            ShardFetchError: As for :meth:`fetch`.
            RangeIgnoredError: The server answered with the whole body.
        """
        try:
            transport.fill(shard.location, ShardPart(buffer, start, end, on_data=progress,
                                                     file_size=shard.size),
                           policy=self.retry, cancel=cancel, headers=self.headers, pin=pin)
        except TransportError as error:
            raise shard_error(shard.name, error) from error

    def fetch_in_parts(self, shard: ShardInfo, cancel: CancelToken,
                       parts: int) -> WritableBuffer:
        """Download one shard over ``parts`` concurrent range requests.

        Used for every shard a download can split over free connections (see
        ``ShardStreamDataset(split_shards=)`` and :func:`fetch_url_in_parts`). Without
        a known size it is one plain download.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Stops every part, and any backoff wait, when cancelled.
            parts (int): Concurrent connections.

        Returns:
            The shard's bytes.
        """
        if shard.size is None:
            return self.fetch(shard, cancel)
        return fetch_url_in_parts(shard.location, size=shard.size, parts=parts,
                                  name=shard.name, policy=self.retry, cancel=cancel,
                                  headers=self.headers)


class HTTPSource(URLShardSource):
    """Shards fetched over HTTP(S).

    Args:
        urls_or_manifest (str | Sequence[str]): Either a list of shard URLs, or the URL of a
            ``manifest.json`` written by the converter. The manifest has the shape
            ``{"shards": [{"name": "train-00000.pt", "records": 1000, "bytes": 123456,
            "sha256": "..."}, ...]}``; names are resolved relative to the manifest URL,
            and sizes, record counts and checksums come from it.
        headers (Mapping[str, str], optional): Extra request headers, e.g. ``{"Authorization":
            "Bearer ..."}``. Credentials go only to the origins of the URLs given here: a
            manifest entry naming another host, or a redirect elsewhere, is read without
            them. (default: :obj:`None`)
        retry (RetryPolicy, optional): Retry and timeout policy. (default: :class:`RetryPolicy()`)

    Interrupted transfers are resumed with ``Range`` requests; 429 and 5xx answers,
    timeouts and connection resets are retried with exponential backoff and jitter. Shards
    listed without a size (a list of URLs, manifest entries without ``bytes``) are asked
    for it (and for their version) once, here, so that every download is bounded by it and
    big ``.atp`` files can be read by record blocks.
    """

    def __init__(self, urls_or_manifest: str | Sequence[str], *,
                 headers: Mapping[str, str] | None = None, retry: RetryPolicy | None = None):
        self.headers = bind_headers(headers, urls_or_manifest)
        self.retry = retry or RetryPolicy()
        if isinstance(urls_or_manifest, str):
            self.manifest_url = urls_or_manifest
            shards = self._list_manifest(urls_or_manifest)
        else:
            self.manifest_url = None
            urls = list(urls_or_manifest)
            if not urls:
                raise ShardFetchError("HTTPSource needs at least one URL")
            shards = tuple(ShardInfo(name=_name_from_url(u), location=u) for u in urls)
        self._shards = self._with_sizes(shards)

    def _list_manifest(self, url: str) -> tuple[ShardInfo, ...]:
        where = redact_url(url)
        body = fetch_url(url, name="manifest.json", policy=self.retry, cancel=CancelToken(),
                         headers=self.headers, limit=transport.DOCUMENT_LIMIT)
        try:
            document = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ShardFetchError(f"{where}: manifest is not valid JSON: {error}",
                                  url=where) from error
        entries = read_manifest_records(document, where)
        if not entries:
            raise ShardFetchError(f"{where}: manifest lists no shards (expected a 'shards' list)",
                                  url=where)
        return tuple(
            ShardInfo(name=name, size=entry.get("bytes"), sha256=entry.get("sha256"),
                      records=entry.get("records"), location=urljoin(url, name))
            for name, entry in entries.items()
        )

    def _with_sizes(self, shards: tuple[ShardInfo, ...]) -> tuple[ShardInfo, ...]:
        """``shards``, each one listed without a size asked for it (a one-byte range)."""
        unsized = [shard for shard in shards if shard.size is None]
        if not unsized:
            return shards

        def ask(shard: ShardInfo) -> ShardInfo:
            try:
                found = transport.probe(shard.location, policy=self.retry, headers=self.headers)
            except TransportError:
                # its download fails the same way, where on_error= decides what happens
                return shard
            return replace(shard, size=found.size) if found.size is not None else shard

        with ThreadPoolExecutor(min(8, len(unsized))) as pool:
            asked = iter(list(pool.map(ask, unsized)))
        return tuple(next(asked) if shard.size is None else shard for shard in shards)

    def __repr__(self) -> str:
        origin = redact_url(self.manifest_url) if self.manifest_url else \
            f"{len(self._shards)} URLs"
        return f"{type(self).__name__}({origin!r}, shards={len(self._shards)})"
