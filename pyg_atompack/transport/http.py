"""HTTP(S) transfers: one client, one redirect rule, one retry loop, one resume logic.

Every HTTP request of the project (Hub API calls, Hub file reads, plain HTTP(S) shards)
goes through :func:`open_response`, on this module's own :class:`httpx.Client` (the
``httpx`` package is a declared dependency; huggingface_hub's client is not used, so the
transport works the same next to any huggingface_hub release). The client:

* is made once per process, on the first request, shared by its threads and closed at
  exit. A forked child (a DataLoader worker) never uses its parent's: the client and its
  connections are forgotten in the child (never closed there: the sockets are the
  parent's too) and the child makes its own on its first request. The trust store (an
  :class:`ssl.SSLContext` holding no connection) is loaded once and kept across ``fork``
  (every source sends requests to list or size its shards before workers fork), so a
  worker's client costs about a millisecond instead of the tens of milliseconds loading
  the CA bundle takes;
* reads ``HTTP(S)_PROXY`` / ``ALL_PROXY`` / ``NO_PROXY`` when it is made, and the trust
  store honours ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when it is loaded (httpx's
  ``trust_env``; certifi's bundle otherwise);
* refuses to connect in offline mode (``HF_HUB_OFFLINE=1``, read from huggingface_hub's
  public ``constants.HF_HUB_OFFLINE`` before each request, so the Hub layer, huggingface_hub
  and the transport agree): :class:`RemoteOfflineError`.

Per request this module adds:

* **timeouts**: connect and read timeouts from the :class:`RetryPolicy`;
* **credentials stay at their origin**: redirects are followed here, hop by hop, and
  ``Authorization`` / ``Cookie`` headers are sent only to the origin (scheme, host, port)
  of the URL they were given for. The Hub answers ``resolve/`` of large files with a 302
  to a signed URL on a CDN, which must not see the Hub token (and rejects a request that
  carries one);
* **retries** (the one loop, :func:`~pyg_atompack.transport.retry.with_retries`) with
  backoff and jitter for connection errors, timeouts, 408, 429 and 5xx,
  honouring ``Retry-After`` and the Hub's ``RateLimit`` header; a dropped body is resumed
  with a ``Range`` request from the byte where it broke;
* **prompt cancellation**: a :class:`CancelToken`-like object shuts the connection's socket
  down, which wakes a thread blocked in ``recv`` at once (closing the response or the
  client does not: ``close()`` leaves a concurrent ``recv`` blocked until the read
  timeout).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urljoin

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
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteOfflineError,
    RemoteTooLargeError,
    TransportError,
)
from pyg_atompack.transport.redact import redact_text, redact_url
from pyg_atompack.transport.retry import (
    RETRYABLE_STATUSES,
    RetryPolicy,
    TransferClock,
    TransientError,
    server_wait,
    with_retries,
)

logger = logging.getLogger(__name__)

__all__ = ["DOCUMENT_LIMIT", "MAX_REDIRECTS", "MIN_PART_BYTES", "UNLISTED_LIMIT", "Cancel",
           "Probe", "fetch", "fetch_range", "offline",
           "open_response", "part_count", "probe", "request_json", "response_validator",
           "VersionPin"]

_CHUNK = 1 << 16
MAX_REDIRECTS = 10
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
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class Cancel(Protocol):
    """What the transport needs from a cancellation token (see ``stream.CancelToken``)."""

    def raise_if_cancelled(self) -> None: ...

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]: ...

    def sleep(self, seconds: float) -> None: ...


class _NeverCancelled:
    """The token of transfers nobody cancels (Hub listings, cache downloads)."""

    def raise_if_cancelled(self) -> None:
        return None

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        return lambda: None

    def sleep(self, seconds: float) -> None:
        threading.Event().wait(max(0.0, seconds))


NEVER = _NeverCancelled()


_client_lock = threading.Lock()
_process_client: Any = None  # this process's httpx.Client, made on first use
_trust_store: Any = None  # its ssl.SSLContext: no connection in it, kept across fork
_trust_lock = threading.Lock()


def _load_trust_store() -> Any:
    # SSL_CERT_FILE / SSL_CERT_DIR when set, else certifi's bundle (httpx's rule). Loading
    # it is most of the cost of a client: on 2 cores busy with two other processes a forked
    # child's first client took 162 ms with its own and 1.6 ms with the inherited one.
    import httpx

    global _trust_store
    with _trust_lock:
        if _trust_store is None:
            _trust_store = httpx.create_ssl_context(trust_env=True)
        return _trust_store


def _new_client() -> Any:
    import httpx

    # trust_env: the proxy variables; redirects are followed hop by hop in open_response
    return httpx.Client(verify=_load_trust_store(), trust_env=True, follow_redirects=False)


def _client() -> Any:
    """This process's HTTP client (``httpx.Client``), made on first use (thread-safe)."""
    global _process_client
    client = _process_client
    if client is None:
        with _client_lock:
            if _process_client is None:
                _process_client = _new_client()
            client = _process_client
    return client


def _forget_client_in_child() -> None:
    # The parent's connections must not be used (two processes on one socket) nor closed
    # (they are the parent's too): drop the client. A thread of the parent may have held a
    # lock when it forked: new ones.
    global _process_client, _client_lock, _trust_lock
    _process_client = None
    _client_lock, _trust_lock = threading.Lock(), threading.Lock()


def _close_client_at_exit() -> None:
    # this process's own client (a forked child's is its own, the parent's was forgotten)
    client = _process_client
    if client is not None:
        client.close()


os.register_at_fork(after_in_child=_forget_client_in_child)
atexit.register(_close_client_at_exit)


def offline() -> bool:
    """Whether offline mode is on (``HF_HUB_OFFLINE=1``): no request may be sent.

    Read from huggingface_hub's public ``constants.HF_HUB_OFFLINE`` (set from the
    environment when huggingface_hub is imported), the switch huggingface_hub's own
    downloads and the Hub layer obey.

    Returns:
        bool: :obj:`True` when no request may be sent.
    """
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _timeout(policy: RetryPolicy):
    import httpx

    return httpx.Timeout(policy.timeout, connect=policy.connect_timeout)


def _shutdown(sock: socket.socket) -> None:
    # shutdown() wakes a thread blocked in recv() on this socket at once; close() does not
    sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _Interrupt:
    """Shuts down the socket of the request in flight when its token is cancelled."""

    cancel: Cancel
    unregister: Callable[[], None] = lambda: None

    def watch(self, sock: Any) -> None:
        if isinstance(sock, socket.socket):
            self.unregister()
            self.unregister = self.cancel.on_cancel(lambda: _shutdown(sock))

    def trace(self, event: str, info: dict) -> None:
        # httpcore reports each new connection's stream; a reused one is watched once the
        # response headers arrive (see open_response)
        if event.endswith((".connect_tcp.complete", ".start_tls.complete")):
            stream = info.get("return_value")
            if stream is not None:
                self.watch(stream.get_extra_info("socket"))


def _transport_failure(error: BaseException) -> bool:
    import httpx

    return isinstance(error, (httpx.TransportError, OSError))


def _describe_failure(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return f"{type(error).__name__}: {text}" if str(error) else text


def permanent_error(status: int, headers: Mapping[str, str], url: str) -> TransportError:
    """The project error for a permanent HTTP answer (4xx other than 408/429).

    The Hub's ``X-Error-Code`` / ``X-Error-Message`` headers tell a gated repository
    (``GatedRepo``) and a missing repository, revision or file apart.

    Args:
        status (int): The HTTP status.
        headers (Mapping[str, str]): The response headers.
        url (str): The redacted URL.

    Returns:
        A :class:`RemoteNotFoundError` (404, 410), :class:`RemoteAuthError` (401, 403) or
        :class:`TransportError`, carrying ``status``, ``error_code`` and ``error_message``.
    """
    code = headers.get("X-Error-Code")
    message = headers.get("X-Error-Message")
    detail = f"HTTP {status}" + (f" ({message})" if message else "")
    if code == "GatedRepo":
        kind = RemoteAuthError
        detail += (": the repository is gated; open its page on the Hub, accept its terms "
                   "(or request access), then log in (`hf auth login`) or set HF_TOKEN to "
                   "a token of the account that was granted access")
    elif status in (404, 410):
        kind = RemoteNotFoundError
    elif status in (401, 403):
        kind = RemoteAuthError
        detail += (": credentials are missing or do not grant access" if status == 401
                   else ": access forbidden with these credentials")
    else:
        kind = TransportError
    error = kind(f"{url}: {detail}", url=url, status=status)
    error.error_code = code
    error.error_message = message
    return error


@contextlib.contextmanager
def open_response(url: str, *, method: str = "GET",
                  headers: RequestHeaders | Mapping[str, str] | None = None,
                  range_header: str | None = None, form: Mapping[str, Any] | None = None,
                  policy: RetryPolicy, cancel: Cancel = NEVER) -> Iterator[Any]:
    """One attempt: send a request, follow redirects hop by hop, yield the final response.

    Credentials go to a hop only when its origin is one they were bound to
    (:class:`~pyg_atompack.transport.credentials.RequestHeaders`); other headers go to every
    hop. The response is streamed: the body has not been read when it is yielded.

    Args:
        url (str): The address.
        method (str, optional): ``"GET"``, ``"HEAD"`` or ``"POST"``. (default: :obj:`"GET"`)
        headers (RequestHeaders | Mapping[str, str], optional): Request headers; credentials
            only bound to their origins (:func:`~pyg_atompack.transport.bind_headers`).
            (default: none)
        range_header (str, optional): A ``Range`` header value, sent to every hop. (default: none)
        form (Mapping[str, Any], optional): Form fields for a ``POST`` (kept on 307/308, dropped on
            301-303). (default: :obj:`None`)
        policy (RetryPolicy): Timeouts.
        cancel (Cancel, optional): Shuts the connection down when cancelled. (default: :obj:`NEVER`)

    Yields:
        The final :class:`httpx.Response` (any status but a redirect).

    Raises:
        TransientError: A connection error, timeout, 408, 429 or 5xx (retry it).
        TransportError: Too many redirects, offline mode, or a permanent status.
    """
    if offline():
        where = redact_url(url)
        raise RemoteOfflineError(
            f"{where}: HF_HUB_OFFLINE=1 is set, so nothing remote can be read; unset it "
            f"or use data already in the cache", url=where)
    bound = request_headers(headers)
    client = _client()
    for _ in range(MAX_REDIRECTS + 1):
        cancel.raise_if_cancelled()
        hop_headers = {"Accept-Encoding": "identity", **bound.for_url(url)}
        if range_header:
            hop_headers["Range"] = range_header
        interrupt = _Interrupt(cancel)
        where = redact_url(url)
        try:
            request = client.build_request(method, url, headers=hop_headers, data=form,
                                           timeout=_timeout(policy),
                                           extensions={"trace": interrupt.trace})
        except Exception as error:  # noqa: BLE001 - only a malformed URL or header fails here
            raise TransportError(f"{where}: not a valid URL ({type(error).__name__}: "
                                 f"{redact_text(str(error))})", url=where) from None
        try:
            response = client.send(request, stream=True, follow_redirects=False)
        except BaseException as error:
            interrupt.unregister()
            cancel.raise_if_cancelled()  # a shut-down socket looks like a reset
            if _transport_failure(error):
                raise TransientError(_describe_failure(error)) from error
            raise
        try:
            stream = response.extensions.get("network_stream")
            if stream is not None:
                interrupt.watch(stream.get_extra_info("socket"))
            status = response.status_code
            location = response.headers.get("Location")
            if status in _REDIRECTS and location:
                url = urljoin(url, location)
                if status == 303 or (status in (301, 302) and method == "POST"):
                    method, form = "GET", None
                continue
            if status in RETRYABLE_STATUSES:
                raise TransientError(f"HTTP {status} {response.reason_phrase}",
                                     retry_after=server_wait(response.headers))
            yield response
            return
        except (TransientError, TransportError):
            cancel.raise_if_cancelled()
            raise
        except BaseException as error:
            cancel.raise_if_cancelled()
            if _transport_failure(error):
                raise TransientError(_describe_failure(error)) from error
            raise
        finally:
            interrupt.unregister()
            response.close()
    raise TransportError(f"{redact_url(url)}: more than {MAX_REDIRECTS} redirects",
                         url=redact_url(url))


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
    import json

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
