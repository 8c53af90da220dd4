"""HTTP(S) bodies: whole files, byte ranges, probes and JSON documents, retried and resumed.

Each transfer is a loop of attempts (:func:`~pyg_atompack.transport.retry.with_retries`)
around one request of :func:`pyg_atompack.transport.http.open_response` (its client,
redirect rule and cancellation):

* **resume**: a dropped body is resumed with a ``Range`` request from the byte where it
  broke; a server that ignores the range starts the sink over;
* **one version per download**: every request of one download (a resume, the parts of a
  file fetched over several connections or as it arrives) must come from the version of
  the file the first answer named (:class:`VersionPin`);
* **bounded bodies**: no body exceeds the listed size (a ``Content-Range`` total that
  differs is refused), an unlisted file :data:`UNLISTED_LIMIT`, a document
  :data:`DOCUMENT_LIMIT`;
* **parts**: :func:`part_count` says over how many connections a body is fetched.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pyg_atompack.transport.buffers import (
    BodyOverrunError,
    FileSink,
    RangeIgnoredError,
    ShardBuffer,
    ShardPart,
    WritableBuffer,
)
from pyg_atompack.transport.credentials import RequestHeaders, request_headers
from pyg_atompack.transport.errors import (
    RemoteIntegrityError,
    RemoteTooLargeError,
    TransportError,
)
from pyg_atompack.transport.http import NEVER, Cancel, open_response, permanent_error
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy, TransferClock, TransientError, with_retries

__all__ = ["DOCUMENT_LIMIT", "MIN_PART_BYTES", "UNLISTED_LIMIT", "Probe", "VersionPin", "fetch",
           "fetch_range", "fill", "part_count", "probe", "request_json", "response_validator"]

#: Smallest byte range worth its own connection when a file is fetched in parts.
MIN_PART_BYTES = 32 << 10


def part_count(size: int, parts: int, min_part: int = MIN_PART_BYTES) -> int:
    """How many concurrent ranges a body of ``size`` bytes is fetched over.

    Args:
        size (int): The body's length in bytes.
        parts (int): The connections allowed.
        min_part (int, optional): The smallest range worth its own connection.
            (default: :data:`MIN_PART_BYTES`)

    Returns:
        ``parts``, fewer when ranges would be smaller than ``min_part``, at least 1.
    """
    return max(1, min(parts, size // min_part))


def _content_range_start(value: str | None) -> int | None:
    if not value or not value.startswith("bytes "):
        return None
    first = value[len("bytes "):].split("-", 1)[0]
    return int(first) if first.isdigit() else None


def _check_file_size(url: str, sink: ShardBuffer | ShardPart | FileSink,
                     headers: Mapping[str, str], status: int) -> None:
    """Refuse an answer whose ``Content-Range`` total differs from the listed size.

    A file that shrank or grew after it was listed would otherwise end in a range
    answered short (or HTTP 416), retried as if the connection had dropped.
    """
    expected = getattr(sink, "file_size", None)
    total = (headers.get("Content-Range") or "").rpartition("/")[2]
    if expected is not None and total.isdigit() and int(total) != expected:
        raise RemoteIntegrityError(
            f"{redact_url(url)}: size {int(total)} bytes, expected {expected}; the source "
            f"may have changed since it was listed", url=redact_url(url), status=status)


def response_validator(headers: Mapping[str, str]) -> str | None:
    """What identifies the version of a file a response comes from.

    Args:
        headers (Mapping[str, str]): The response headers.

    Returns:
        str: The ``ETag`` (weak or strong, as sent), else ``"modified <Last-Modified>"``,
        else :obj:`None` (the server tells neither).
    """
    etag = (headers.get("ETag") or "").strip()
    if etag:
        return etag
    modified = (headers.get("Last-Modified") or "").strip()
    return f"modified {modified}" if modified else None


class VersionPin:
    """The one version of a file that every request of one download must come from.

    A download made of several requests (a resume after a dropped connection, the
    byte ranges of a file fetched over several connections or as it arrives) would
    otherwise splice two versions of a file rewritten meanwhile. The first answer
    that names its version (:func:`response_validator`) pins it, unless a version was
    given; an answer naming another is refused. Thread-safe: the parts of one
    download share a pin.

    Args:
        version (str, optional): The version the bytes must come from; :obj:`None` takes
            the first answer's. (default: :obj:`None`)
    """

    def __init__(self, version: str | None = None) -> None:
        self.version = version
        self._lock = threading.Lock()

    def check(self, url: str, headers: Mapping[str, str], status: int) -> None:
        """Pin the answer's version, or refuse it if another is pinned.

        Args:
            url (str): The address (for the message; redacted).
            headers (Mapping[str, str]): The answer's headers.
            status (int): Its status code.

        Raises:
            RemoteIntegrityError: The answer comes from another version of the file.
        """
        seen = response_validator(headers)
        if seen is None:
            return
        with self._lock:
            if self.version is None:
                self.version = seen
            pinned = self.version
        if seen != pinned:
            raise RemoteIntegrityError(
                f"{redact_url(url)}: the file changed since it was opened (it was {pinned}, "
                f"the server now answers {seen}); open it again", url=redact_url(url),
                status=status)


def _receive(url: str, sink: ShardBuffer | ShardPart | FileSink, *,
             headers: RequestHeaders | Mapping[str, str], policy: RetryPolicy, cancel: Cancel,
             pin: VersionPin, clock: TransferClock) -> None:
    """One attempt: append the (rest of the) body at ``url`` to ``sink``.

    A sink holding some bytes asks for the rest (``Range: bytes=len-``); a server that
    ignores the range answers 200 and the sink starts over (a :class:`ShardPart` raises
    :class:`RangeIgnoredError` instead). An answer from another version of the file
    than ``pin``'s is refused before its body is read, and so is one announcing more bytes
    than the sink may hold; a body that sends more anyway is cut off at the first byte
    too many, and one that outlives ``clock``'s deadline when the next bytes arrive.
    """
    range_header = sink.range_header()
    with open_response(url, headers=headers, range_header=range_header, policy=policy,
                       cancel=cancel) as response:
        status = response.status_code
        if status in (206, 416):
            _check_file_size(url, sink, response.headers, status)
        if status == 416 and range_header:
            sink.restart(None)  # our partial copy no longer matches the file: start over
            raise TransientError("HTTP 416 on resume; restarting the transfer")
        if status == 206 and range_header:
            start = _content_range_start(response.headers.get("Content-Range"))
            if start != sink.position:
                expected = sink.position
                sink.restart(None)
                raise TransientError(f"server resumed at byte {start}, expected {expected}; "
                                     f"restarting")
        elif status != 200:
            raise permanent_error(status, response.headers, redact_url(url))
        pin.check(url, response.headers, status)
        declared = response.headers.get("Content-Length")
        declared = int(declared) if declared and declared.isdigit() else None
        room = sink.room(whole=status == 200)
        if declared is not None and room is not None and declared > room:
            raise RemoteIntegrityError(
                f"{redact_url(url)}: the server announces {declared} bytes where "
                f"{room} are listed; nothing was read", url=redact_url(url), status=status)
        if status == 200:  # the whole body (again): into a buffer of its announced size
            try:
                sink.whole_body(declared)
            except (OverflowError, MemoryError, ValueError, OSError) as error:
                raise RemoteTooLargeError(
                    f"{redact_url(url)}: {declared} bytes cannot be held in memory ({error}); "
                    f"open it with AtompackDataset, which downloads shards to disk",
                    url=redact_url(url)) from error
        expected_end = len(sink) + declared if declared is not None else None
        try:
            # iter_raw hands over whatever has arrived, so a connection dropped mid-body
            # loses no received bytes and the resume starts exactly where it broke
            for chunk in response.iter_raw():
                cancel.raise_if_cancelled()
                sink.append(chunk)
                clock.check(len(sink))
        except BodyOverrunError as error:
            raise RemoteIntegrityError(f"{redact_url(url)}: {error}; the transfer was stopped",
                                       url=redact_url(url), status=status) from None
        cancel.raise_if_cancelled()
        if expected_end is not None and len(sink) < expected_end:
            raise TransientError(f"connection closed after {len(sink)} of {expected_end} bytes")


def fill(url: str, sink: ShardBuffer | ShardPart | FileSink, *, policy: RetryPolicy,
         cancel: Cancel = NEVER, headers: RequestHeaders | Mapping[str, str] | None = None,
         validator: str | None = None, pin: VersionPin | None = None) -> None:
    """Fill ``sink`` with the body at ``url``, retrying and resuming transient failures.

    The transfer is bounded by the sink (its listed size) and by the policy's deadline
    (:meth:`RetryPolicy.deadline_for` the sink's size).

    Args:
        url (str): The address.
        sink (ShardBuffer | ShardPart | FileSink): A :class:`ShardBuffer`, :class:`ShardPart` or
            :class:`FileSink`.
        policy (RetryPolicy): Retries, timeouts and the deadline.
        cancel (Cancel, optional): Stops the transfer (and any backoff wait) when cancelled.
            (default: :obj:`NEVER`)
        headers (RequestHeaders | Mapping[str, str], optional): Request headers, credentials
            bound to their origins. (default: :obj:`None`)
        validator (str, optional): The version the bytes must come from (a
            :func:`response_validator` value); an answer naming another is a
            :class:`RemoteIntegrityError`. (default: :obj:`None`: the first answer's)
        pin (VersionPin, optional): The version shared with the other requests of one
            download (the parts of a file); takes precedence over ``validator``.
            (default: :obj:`None`: this transfer's own, so a resume never splices)

    Raises:
        RemoteUnavailableError: Transient failures outlasted every retry, or the transfer
            outlived its deadline.
        RemoteIntegrityError: The server answered from another version than
            ``validator``, or announced or sent more bytes than listed.
        TransportError: A permanent failure (e.g. :class:`RemoteNotFoundError`).
    """
    pin = pin if pin is not None else VersionPin(validator)
    headers = request_headers(headers)
    size = sink.end - sink.start if isinstance(sink, ShardPart) else sink.limit
    clock = TransferClock(url, policy.deadline_for(size))

    def attempt() -> None:
        clock.check(len(sink))
        clock.start()
        try:
            _receive(url, sink, headers=headers, policy=policy, cancel=cancel, pin=pin,
                     clock=clock)
        finally:
            clock.stop()
        if isinstance(sink, ShardPart) and not sink.complete:
            raise TransientError(f"range answered short, at byte {sink.position}")

    with_retries(attempt, url=url, policy=policy, cancel=cancel, position=lambda: sink.position)


#: The most bytes a body of unknown size may bring into memory or a file (a listing without
#: sizes, a server without ``Content-Length``); a listed size always bounds instead.
UNLISTED_LIMIT = 8 << 30
#: The most bytes of a JSON document (Hub API pages, ``manifest.json``).
DOCUMENT_LIMIT = 64 << 20


def fetch(url: str, *, policy: RetryPolicy, cancel: Cancel = NEVER,
          headers: RequestHeaders | Mapping[str, str] | None = None,
          size: int | None = None, limit: int = UNLISTED_LIMIT) -> WritableBuffer:
    """Download ``url`` completely into memory.

    Args:
        url (str): The address.
        policy (RetryPolicy): Retries, timeouts and the deadline.
        cancel (Cancel, optional): Stops the transfer when cancelled. (default: :obj:`NEVER`)
        headers (RequestHeaders | Mapping[str, str], optional): Request headers.
            (default: :obj:`None`)
        size (int, optional): The listed size: no more bytes are accepted.
            (default: unknown)
        limit (int, optional): The most bytes accepted when ``size`` is unknown.
            (default: :data:`UNLISTED_LIMIT`)

    Returns:
        The body, in an anonymous memory map of exactly its size when the server
        announced it (see :mod:`pyg_atompack.transport.buffers`), else in a bytearray.
    """
    buffer = ShardBuffer(redact_url(url), limit=size if size is not None else limit)
    fill(url, buffer, policy=policy, cancel=cancel, headers=headers)
    return buffer.take()


def fetch_range(url: str, start: int, length: int, *, policy: RetryPolicy,
                cancel: Cancel = NEVER,
                headers: RequestHeaders | Mapping[str, str] | None = None) -> bytes:
    """Read bytes ``[start, start + length)`` of ``url`` with a ``Range`` request.

    A server that ignores ranges answers with the whole body: it is read only up to the
    end of the wanted range and the connection closed.

    Args:
        url (str): The address.
        start (int): First byte.
        length (int): Number of bytes (``> 0``).
        policy (RetryPolicy): Retries and timeouts.
        cancel (Cancel, optional): Stops the transfer when cancelled. (default: :obj:`NEVER`)
        headers (Mapping[str, str], optional): Request headers. (default: :obj:`None`)

    Returns:
        Exactly ``length`` bytes.
    """
    buffer = bytearray(length)
    part = ShardPart(buffer, start, start + length, base=start)
    try:
        fill(url, part, policy=policy, cancel=cancel, headers=headers)
    except RangeIgnoredError:
        return _prefix(url, start + length, policy=policy, cancel=cancel,
                       headers=headers)[start:]
    return bytes(buffer)


def _prefix(url: str, end: int, *, policy: RetryPolicy, cancel: Cancel,
            headers: RequestHeaders | Mapping[str, str] | None) -> bytes:
    def attempt() -> bytes:
        with open_response(url, headers=headers, policy=policy, cancel=cancel) as response:
            if response.status_code != 200:
                raise permanent_error(response.status_code, response.headers, redact_url(url))
            data = bytearray()
            for chunk in response.iter_raw():
                data += chunk
                if len(data) >= end:
                    return bytes(data[:end])
        raise TransientError(f"body ended after {len(data)} of the {end} bytes wanted")

    return with_retries(attempt, url=url, policy=policy, cancel=cancel)


@dataclass(frozen=True)
class Probe:
    """What a one-byte range request tells about a file.

    Attributes:
        size: Its length, or :obj:`None` when the server does not say.
        validator: Its version (:func:`response_validator`), or :obj:`None`.
    """

    size: int | None
    validator: str | None


def probe(url: str, *, policy: RetryPolicy,
          headers: RequestHeaders | Mapping[str, str] | None = None) -> Probe:
    """The size and version of the file at ``url``, from a one-byte range request.

    Args:
        url (str): The address.
        policy (RetryPolicy): Retries and timeouts.
        headers (Mapping[str, str], optional): Request headers. (default: :obj:`None`)

    Returns:
        Probe: The total from ``Content-Range`` (or ``Content-Length`` of a server that
        ignores ranges; the body is not read) and the response's validator.
    """
    def attempt() -> Probe:
        with open_response(url, headers=headers, range_header="bytes=0-0",
                           policy=policy) as response:
            status = response.status_code
            validator = response_validator(response.headers)
            if status == 206:
                total = (response.headers.get("Content-Range") or "").rpartition("/")[2]
                return Probe(int(total) if total.isdigit() else None, validator)
            if status == 416:  # an empty file
                return Probe(0, validator)
            if status != 200:
                raise permanent_error(status, response.headers, redact_url(url))
            length = response.headers.get("Content-Length") or ""
            return Probe(int(length) if length.isdigit() else None, validator)

    return with_retries(attempt, url=url, policy=policy)


def request_json(url: str, *, method: str = "GET",
                 headers: RequestHeaders | Mapping[str, str] | None = None,
                 form: Mapping[str, Any] | None = None, policy: RetryPolicy,
                 on_error: Callable[[TransportError], BaseException] | None = None
                 ) -> tuple[Any, Mapping[str, str]]:
    """A JSON API call (Hub listings, revision lookups), retried like every transfer.

    Args:
        url (str): The address.
        method (str, optional): ``"GET"`` or ``"POST"``. (default: :obj:`"GET"`)
        headers (Mapping[str, str], optional): Request headers. (default: :obj:`None`)
        form (Mapping[str, Any], optional): Form fields for a ``POST``. (default: :obj:`None`)
        policy (RetryPolicy): Retries and timeouts.
        on_error (Callable[[TransportError], BaseException], optional): Turns a permanent
            :class:`TransportError` into the caller's error. (default: :obj:`None`)

    Returns:
        ``(document, response headers)``.
    """

    def attempt():
        with open_response(url, method=method, headers=headers, form=form,
                           policy=policy) as response:
            if response.status_code >= 400:
                raise permanent_error(response.status_code, response.headers, redact_url(url))
            body = bytearray()
            for chunk in response.iter_bytes():  # decoded, so a compressed bomb is bounded too
                body += chunk
                if len(body) > DOCUMENT_LIMIT:
                    raise TransportError(f"{redact_url(url)}: the answer exceeds "
                                         f"{DOCUMENT_LIMIT} bytes", url=redact_url(url))
            try:
                return json.loads(body.decode("utf-8")), response.headers
            except (UnicodeDecodeError, ValueError) as error:
                raise TransportError(f"{redact_url(url)}: the answer is not JSON: {error}",
                                     url=redact_url(url)) from error

    try:
        return with_retries(attempt, url=url, policy=policy)
    except TransportError as error:
        if on_error is None:
            raise
        raise on_error(error) from error
