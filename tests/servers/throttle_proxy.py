"""A throttling HTTP reverse proxy on loopback, for servers that cannot pace themselves.

:class:`ThrottleProxy` forwards every request (method, path, headers, body) to one
upstream ``http://127.0.0.1:port`` server and sends the answer back with its body paced
to ``bandwidth`` bytes per second *per connection*, as :class:`~servers.http_server.ShardServer`
paces its own files. The benchmarks put it in front of a ``moto`` S3 server so that the
tools reading S3 (LitData, MosaicML streaming) see the same per-connection limit as the
tools reading the throttled HTTP server.

Why not an existing proxy: mitmproxy and nginx are not installable from the package
registries into the project's environment, and none of the pure-Python proxies paces
bodies per connection. The proxy is ~80 lines over :mod:`http.server` and
:mod:`http.client`.

The upstream answer is read whole before it is paced out (objects here are shards of a
few hundred KiB); the ``Host`` header is forwarded unchanged because S3 clients sign it.
Request bodies must come with a ``Content-Length`` (boto3's do); chunked uploads are not
supported.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_CHUNK = 16 * 1024
#: Hop-by-hop headers (RFC 9110 section 7.6.1) and framing the proxy redoes itself.
_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer",
         "transfer-encoding", "upgrade", "content-length"}


class ThrottleProxy(ThreadingHTTPServer):
    """Forward to ``upstream`` with response bodies paced per connection.

    Args:
        upstream: Base URL of the upstream server (``http://host:port``).
        bandwidth: Body bytes per second per connection; ``None`` is unlimited.
            (default: ``None``)
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: str, *, bandwidth: float | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.bandwidth = bandwidth
        self.body_bytes = 0  # bytes paced out so far (all connections)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> ThrottleProxy:
        """Serve on a daemon thread; returns ``self``."""
        self._thread = threading.Thread(target=self.serve_forever, name="throttle-proxy",
                                        daemon=True, kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def count(self, sent: int) -> None:
        """Add to :attr:`body_bytes` (thread-safe)."""
        with self._lock:
            self.body_bytes += sent


class _ProxyHandler(BaseHTTPRequestHandler):
    server: ThrottleProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _DROP}
        upstream = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            payload = answer.read()
            status, reason, reply_headers = answer.status, answer.reason, answer.getheaders()
        finally:
            upstream.close()
        self.send_response(status, reason)
        for key, value in reply_headers:
            if key.lower() not in _DROP:
                self.send_header(key, value)
        # a HEAD answer announces the length of the body a GET would have
        length = answer.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self._pace(memoryview(payload))

    def _pace(self, body: memoryview) -> None:
        bandwidth = self.server.bandwidth
        started = time.monotonic()
        for offset in range(0, len(body), _CHUNK):
            chunk = body[offset:offset + _CHUNK]
            self.wfile.write(chunk)
            self.server.count(len(chunk))
            if bandwidth:
                ahead = (offset + len(chunk)) / bandwidth - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    def _handle(self) -> None:
        try:
            self._forward()
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            self.close_connection = True

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle  # noqa: N815 - stdlib naming
