"""Shards served over plain HTTP(S), from a list of URLs or a ``manifest.json``.

Transfers use the standard library's :mod:`http.client` so that a transfer can be
interrupted from another thread (the socket is shut down on cancellation), resumed with a
``Range`` request after a dropped connection, and retried under a :class:`RetryPolicy`.
"""

from __future__ import annotations

import http.client
import json
import logging
import posixpath
import socket
import threading
from collections.abc import Mapping, Sequence
from urllib.parse import unquote, urljoin, urlsplit

from pyg_atompack.stream.buffers import (
    RangeIgnoredError,
    ShardBuffer,
    ShardPart,
    WritableBuffer,
    allocate,
)
from pyg_atompack.stream.errors import ShardFetchError, StreamCancelled
from pyg_atompack.stream.retry import (
    RETRYABLE_STATUSES,
    RetryPolicy,
    TransientError,
    parse_retry_after,
)
from pyg_atompack.stream.sources import CancelToken, ShardInfo, read_manifest_records

logger = logging.getLogger(__name__)

_CHUNK = 1 << 16
_MAX_REDIRECTS = 5
# timeouts, resets, refused connections, truncated bodies, garbled status lines
_TRANSIENT_ERRORS = (OSError, http.client.HTTPException)


def _shutdown(sock: socket.socket) -> None:
    # shutting the socket down wakes a thread blocked in recv() at once (close() does not)
    sock.shutdown(socket.SHUT_RDWR)


def _parse_content_range_start(value: str | None) -> int | None:
    if not value or not value.startswith("bytes "):
        return None
    first = value[len("bytes ") :].split("-", 1)[0]
    return int(first) if first.isdigit() else None


def _open_connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ShardFetchError(f"{url}: only http:// and https:// URLs are supported")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return kind(parts.netloc, timeout=timeout), target


def _transfer_once(url: str, buffer: ShardBuffer | ShardPart, *, headers: Mapping[str, str],
                   name: str, policy: RetryPolicy, cancel: CancelToken) -> None:
    """One attempt: append the (rest of the) body at ``url`` to ``buffer``.

    A :class:`ShardBuffer` that holds some bytes is resumed with
    ``Range: bytes=len(buffer)-`` (a server that ignores the range answers 200 and the
    buffer is restarted); a :class:`ShardPart` always asks for the rest of its range.
    """
    for _ in range(_MAX_REDIRECTS + 1):
        connection, target = _open_connection(url, policy.timeout)
        request_headers = {"Accept-Encoding": "identity", **headers}
        range_header = buffer.range_header()
        if range_header:
            request_headers["Range"] = range_header
        unregister = lambda: None  # noqa: E731 - replaced once a socket exists
        try:
            cancel.raise_if_cancelled()
            connection.connect()
            # keep our own reference: http.client hands the socket to the response object
            # and forgets it, but shutting it down is what wakes a blocked recv()
            unregister = cancel.on_cancel(lambda sock=connection.sock: _shutdown(sock))
            connection.request("GET", target, headers=request_headers)
            response = connection.getresponse()
            status = response.status
            if status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                url = urljoin(url, response.getheader("Location"))
                continue
            if status in RETRYABLE_STATUSES:
                raise TransientError(
                    f"HTTP {status} {response.reason}",
                    retry_after=parse_retry_after(response.getheader("Retry-After")),
                )
            if status == 416 and range_header:
                buffer.restart(None)  # our partial copy no longer matches the file: start over
                raise TransientError("HTTP 416 on resume; restarting the transfer")
            if status == 206 and range_header:
                start = _parse_content_range_start(response.getheader("Content-Range"))
                if start != buffer.position:
                    expected = buffer.position
                    buffer.restart(None)
                    raise TransientError(
                        f"server resumed at byte {start}, expected {expected}; restarting"
                    )
            elif status != 200:
                raise ShardFetchError(f"shard {name}: HTTP {status} {response.reason} for {url}")
            declared = response.getheader("Content-Length")
            declared = int(declared) if declared and declared.isdigit() else None
            if status == 200:  # the whole body (again): into a buffer of its announced size
                buffer.whole_body(declared)
            expected_end = len(buffer) + declared if declared is not None else None
            # read1 hands over whatever has arrived, so a connection dropped mid-body
            # loses no received bytes and the resume starts exactly where it broke
            while chunk := response.read1(_CHUNK):
                cancel.raise_if_cancelled()
                try:
                    buffer.append(chunk)
                except ValueError as error:  # a part's server sent more than asked for
                    raise ShardFetchError(f"shard {name}: {error} ({url})") from None
            cancel.raise_if_cancelled()
            if expected_end is not None and len(buffer) < expected_end:
                # read(n) returns b"" on a body cut short instead of raising IncompleteRead
                raise TransientError(
                    f"connection closed after {len(buffer)} of {expected_end} bytes"
                )
            return
        except _TRANSIENT_ERRORS as error:
            cancel.raise_if_cancelled()  # a shut-down socket looks like a reset
            raise TransientError(f"{type(error).__name__}: {error}") from error
        finally:
            unregister()
            connection.close()
    raise ShardFetchError(f"shard {name}: more than {_MAX_REDIRECTS} redirects from {url}")


def fetch_url(url: str, *, name: str, policy: RetryPolicy, cancel: CancelToken,
              headers: Mapping[str, str] | None = None) -> WritableBuffer:
    """Download ``url`` completely, retrying transient failures and resuming partial bodies.

    Args:
        url: The address to fetch.
        name: Shard name for messages.
        policy: Retry and timeout settings.
        cancel: Stops the transfer (and any backoff wait) when cancelled.
        headers: Extra request headers (e.g. ``Authorization``).

    Returns:
        The body, in an anonymous memory map of exactly its size when the server
        announced it (see :mod:`pyg_atompack.stream.buffers`), else in a bytearray.

    Raises:
        ShardFetchError: A permanent error, or transient errors outlasting every retry.
    """
    buffer = ShardBuffer(name)
    _transfer_with_retries(url, buffer, name=name, policy=policy, cancel=cancel,
                           headers=headers or {})
    return buffer.take()


def _transfer_with_retries(url: str, buffer: ShardBuffer | ShardPart, *, name: str,
                           policy: RetryPolicy, cancel: CancelToken,
                           headers: Mapping[str, str]) -> None:
    """Fill ``buffer`` from ``url``, retrying transient failures under ``policy``."""
    for attempt in range(policy.retries + 1):
        try:
            _transfer_once(url, buffer, headers=headers, name=name, policy=policy,
                           cancel=cancel)
            if isinstance(buffer, ShardPart) and not buffer.complete:
                raise TransientError(f"range answered short, at byte {buffer.position}")
            return
        except TransientError as error:
            if attempt == policy.retries:
                raise ShardFetchError(
                    f"shard {name}: giving up on {url} after {attempt + 1} attempts: {error}"
                ) from error
            wait = policy.delay(attempt, error.retry_after)
            logger.warning("shard %s: %s; retry %d/%d in %.2fs (resuming at byte %d)",
                           name, error, attempt + 1, policy.retries, wait, buffer.position)
            cancel.sleep(wait)
    raise AssertionError("unreachable")


#: Smallest byte range worth its own connection when a shard is fetched in parts.
MIN_PART_BYTES = 32 << 10


def fetch_url_in_parts(url: str, *, size: int, parts: int, name: str, policy: RetryPolicy,
                       cancel: CancelToken,
                       headers: Mapping[str, str] | None = None) -> WritableBuffer:
    """Download ``url`` as ``parts`` concurrent byte ranges into one buffer.

    Servers (and CDNs) often cap the bandwidth of each connection; a shard fetched over
    several connections at once then arrives several times faster. Each part retries
    and resumes on its own. A server that ignores range requests gets one plain
    download instead.

    Args:
        url: The address to fetch.
        size: The body's length in bytes (from the listing).
        parts: Concurrent connections; fewer when parts would be smaller than
            :data:`MIN_PART_BYTES`.
        name: Shard name for messages.
        policy: Retry and timeout settings, for each part.
        cancel: Stops every part (and any backoff wait) when cancelled.
        headers: Extra request headers.

    Returns:
        The body, in an anonymous memory map.

    Raises:
        ShardFetchError: A part failed permanently or outlasted every retry.
        StreamCancelled: ``cancel`` was cancelled meanwhile.
    """
    parts = max(1, min(parts, size // MIN_PART_BYTES))
    if parts == 1:
        return fetch_url(url, name=name, policy=policy, cancel=cancel, headers=headers)
    buffer = allocate(size)
    bounds = [size * number // parts for number in range(parts + 1)]
    pieces = [ShardPart(buffer, bounds[n], bounds[n + 1]) for n in range(parts)]
    errors: list[BaseException] = []
    # one failed part stops its siblings; closing the iteration stops them all
    siblings = CancelToken()
    unregister = cancel.on_cancel(siblings.cancel)

    def run(piece: ShardPart) -> None:
        try:
            _transfer_with_retries(url, piece, name=name, policy=policy, cancel=siblings,
                                   headers=headers or {})
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the caller
            errors.append(error)
            siblings.cancel()

    helpers = [threading.Thread(target=run, args=(piece,), daemon=True,
                                name=f"pyg_atompack-part-{number}")
               for number, piece in enumerate(pieces[1:], start=1)]
    try:
        for helper in helpers:
            helper.start()
        run(pieces[0])
    finally:
        for helper in helpers:
            helper.join()
        unregister()
    cancel.raise_if_cancelled()
    failures = [error for error in errors if not isinstance(error, StreamCancelled)]
    if any(isinstance(error, RangeIgnoredError) for error in failures):
        logger.info("shard %s: the server ignores byte ranges; one download instead", name)
        return fetch_url(url, name=name, policy=policy, cancel=cancel, headers=headers)
    if failures:
        raise failures[0]
    return buffer


def _name_from_url(url: str) -> str:
    return unquote(posixpath.basename(urlsplit(url).path)) or url


class URLShardSource:
    """Base of the sources whose shards are plain URLs listed once at construction.

    Subclasses fill ``_shards`` (a tuple of :class:`ShardInfo` whose ``location`` is
    the URL), ``headers`` and ``retry``; listing and fetching are shared.
    """

    _shards: tuple[ShardInfo, ...]
    headers: dict[str, str]
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
            shard: One entry of :meth:`list_shards`.
            cancel: Stops the transfer, and any backoff wait, when cancelled.

        Returns:
            The shard's bytes.

        Raises:
            ShardFetchError: A permanent HTTP error, or transient errors outlasting
                every retry (the message names the shard and the URL).
            StreamCancelled: ``cancel`` was cancelled during the transfer.
        """
        return fetch_url(shard.location, name=shard.name, policy=self.retry, cancel=cancel,
                         headers=self.headers)

    def fetch_in_parts(self, shard: ShardInfo, cancel: CancelToken,
                       parts: int) -> WritableBuffer:
        """Download one shard over ``parts`` concurrent range requests.

        Used for the first shard of an iteration, which nothing else can overlap (see
        :func:`fetch_url_in_parts`). Without a known size it is one plain download.

        Args:
            shard: One entry of :meth:`list_shards`.
            cancel: Stops every part, and any backoff wait, when cancelled.
            parts: Concurrent connections.

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
        urls_or_manifest: Either a list of shard URLs, or the URL of a ``manifest.json``
            written by the converter. The manifest has the shape
            ``{"shards": [{"name": "train-00000.pt", "records": 1000, "bytes": 123456,
            "sha256": "..."}, ...]}``; names are resolved relative to the manifest URL,
            and sizes, record counts and checksums come from it.
        headers: Extra request headers, e.g. ``{"Authorization": "Bearer ..."}``.
        retry: Retry and timeout policy. (default: :class:`RetryPolicy()`)

    Interrupted transfers are resumed with ``Range`` requests; 429 and 5xx answers,
    timeouts and connection resets are retried with exponential backoff and jitter.
    """

    def __init__(self, urls_or_manifest: str | Sequence[str], *,
                 headers: Mapping[str, str] | None = None, retry: RetryPolicy | None = None):
        self.headers = dict(headers or {})
        self.retry = retry or RetryPolicy()
        if isinstance(urls_or_manifest, str):
            self.manifest_url = urls_or_manifest
            self._shards = self._list_manifest(urls_or_manifest)
        else:
            self.manifest_url = None
            urls = list(urls_or_manifest)
            if not urls:
                raise ShardFetchError("HTTPSource needs at least one URL")
            self._shards = tuple(ShardInfo(name=_name_from_url(u), location=u) for u in urls)

    def _list_manifest(self, url: str) -> tuple[ShardInfo, ...]:
        body = fetch_url(url, name="manifest.json", policy=self.retry, cancel=CancelToken(),
                         headers=self.headers)
        try:
            document = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ShardFetchError(f"{url}: manifest is not valid JSON: {error}") from error
        entries = read_manifest_records(document, url)
        if not entries:
            raise ShardFetchError(f"{url}: manifest lists no shards (expected a 'shards' list)")
        return tuple(
            ShardInfo(name=name, size=entry.get("bytes"), sha256=entry.get("sha256"),
                      records=entry.get("records"), location=urljoin(url, name))
            for name, entry in entries.items()
        )

    def __repr__(self) -> str:
        origin = self.manifest_url or f"{len(self._shards)} URLs"
        return f"{type(self).__name__}({origin!r}, shards={len(self._shards)})"
