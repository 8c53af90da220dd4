"""HTTP(S) requests: one client, one redirect rule, one cancellation protocol.

Every HTTP request of the project (Hub API calls, Hub file reads, plain HTTP(S) shards)
goes through :func:`open_response` (reading the bodies, retrying and resuming them is
:mod:`pyg_atompack.transport.transfers`' job), on this module's own :class:`httpx.Client` (the
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
* **one error family**: an answer that will not improve on retry becomes the error that
  names it (:func:`permanent_error`: 404/410, 401/403, other 4xx); the retry loop around each
  attempt is the caller's (:mod:`~pyg_atompack.transport.transfers`, with
  :func:`~pyg_atompack.transport.retry.with_retries`);
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

from pyg_atompack.transport.credentials import RequestHeaders, request_headers
from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteNotFoundError,
    RemoteOfflineError,
    TransportError,
)
from pyg_atompack.transport.redact import redact_text, redact_url
from pyg_atompack.transport.retry import (
    RETRYABLE_STATUSES,
    RetryPolicy,
    TransientError,
    server_wait,
)

logger = logging.getLogger(__name__)

__all__ = ["MAX_REDIRECTS", "NEVER", "Cancel", "offline", "open_response", "permanent_error"]

_CHUNK = 1 << 16
MAX_REDIRECTS = 10
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
