"""A small HTTP file server on 127.0.0.1 that behaves like a slow remote store.

The SchNet example uses it to make the embedded aspirin shards *really* stream: every
request waits ``latency_s`` before the first byte (a round trip to a distant object
store) and the body is then sent at ``bandwidth_bps`` bytes per second. The limit applies
per connection, as it does for most object stores, so concurrent downloads add up.

``GET`` (with a single ``Range: bytes=a-b``), ``HEAD`` and ``ETag`` headers are supported,
which is everything the streaming sources and ``huggingface_hub`` need from a file server.
This module is self-contained on purpose: examples must not depend on the test helpers.

Example:
    >>> with LoopbackServer("shards/", latency_s=0.05, bandwidth_bps=2e6) as server:
    ...     url = server.url("manifest.json")
"""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
# small chunks keep the simulated bandwidth smooth even for sub-megabyte shards
_CHUNK_BYTES = 16 * 1024


class _ThrottledHandler(http.server.BaseHTTPRequestHandler):
    """Serves files below ``server.root`` with simulated latency and bandwidth."""

    protocol_version = "HTTP/1.1"
    server: _ThrottledHTTPServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        # the example prints its own progress; request logs would drown it
        return

    def do_HEAD(self) -> None:  # noqa: N802 (name fixed by http.server)
        self._serve(send_body=False)

    def do_GET(self) -> None:  # noqa: N802
        self._serve(send_body=True)

    def _resolve(self) -> Path | None:
        relative = unquote(urlsplit(self.path).path).lstrip("/")
        candidate = (self.server.root / relative).resolve()
        if candidate != self.server.root and self.server.root not in candidate.parents:
            return None  # path traversal outside the served directory
        return candidate if candidate.is_file() else None

    def _serve(self, *, send_body: bool) -> None:
        time.sleep(self.server.latency_s)
        path = self._resolve()
        if path is None:
            self._send_error(404, f"not found: {self.path}")
            return
        size = path.stat().st_size
        start, end, status = 0, size - 1, 200
        header = self.headers.get("Range")
        if header:
            match = _RANGE.match(header.strip())
            if match is None or (not match.group(1) and not match.group(2)):
                self._send_error(416, f"unsupported range {header!r}")
                return
            if match.group(1):
                start = int(match.group(1))
                end = min(int(match.group(2)), size - 1) if match.group(2) else size - 1
            else:  # suffix range: the last N bytes
                start = max(0, size - int(match.group(2)))
            if start > end or start >= size:
                self._send_error(416, f"range {header!r} outside a {size}-byte file")
                return
            status = 206
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{self.server.etag(path)}"')
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        if send_body:
            self._send_throttled(path, start, length)

    def _send_throttled(self, path: Path, start: int, length: int) -> None:
        bandwidth = self.server.bandwidth_bps
        began = time.perf_counter()
        sent = 0
        with open(path, "rb") as handle:
            handle.seek(start)
            while sent < length:
                chunk = handle.read(min(_CHUNK_BYTES, length - sent))
                if not chunk:
                    break
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up; nothing left to do
                sent += len(chunk)
                if bandwidth:
                    # sleep until the bytes sent so far are "due" at the configured rate
                    lag = sent / bandwidth - (time.perf_counter() - began)
                    if lag > 0:
                        time.sleep(lag)

    def _send_error(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class _ThrottledHTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, latency_s: float, bandwidth_bps: float | None) -> None:
        super().__init__(("127.0.0.1", 0), _ThrottledHandler)
        self.root = root
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self._etags: dict[tuple[Path, int, int], str] = {}
        self._etag_lock = threading.Lock()

    def etag(self, path: Path) -> str:
        stat = path.stat()
        key = (path, stat.st_size, stat.st_mtime_ns)
        with self._etag_lock:
            if key not in self._etags:
                self._etags[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            return self._etags[key]


class LoopbackServer:
    """Threaded HTTP server for a directory, bound to 127.0.0.1 on a free port.

    Args:
        directory: Folder whose files are served (sub-folders included).
        latency_s: Delay before every response, in seconds. (default: :obj:`0.0`)
        bandwidth_bps: Per-connection body rate in bytes per second; :obj:`None` for
            unlimited. (default: :obj:`None`)

    Use it as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        latency_s: float = 0.0,
        bandwidth_bps: float | None = None,
    ) -> None:
        root = Path(directory).resolve()
        if not root.is_dir():
            raise NotADirectoryError(f"LoopbackServer: {root} is not a directory")
        if latency_s < 0:
            raise ValueError(f"LoopbackServer: latency_s must be >= 0, got {latency_s}")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError(f"LoopbackServer: bandwidth_bps must be > 0, got {bandwidth_bps}")
        self.directory = root
        self.latency_s = float(latency_s)
        self.bandwidth_bps = None if bandwidth_bps is None else float(bandwidth_bps)
        self._server: _ThrottledHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` of the running server."""
        if self._server is None:
            raise RuntimeError("LoopbackServer is not running; call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, relative_path: str = "") -> str:
        """Absolute URL of a file below the served directory.

        Args:
            relative_path: Path relative to ``directory`` (``/``-separated).

        Returns:
            The URL, with the path percent-encoded.
        """
        return f"{self.base_url}/{quote(relative_path.lstrip('/'))}"

    def start(self) -> LoopbackServer:
        """Bind the socket and serve from a daemon thread.

        Returns:
            ``self``, so that ``server = LoopbackServer(...).start()`` reads naturally.
        """
        if self._server is not None:
            return self
        self._server = _ThrottledHTTPServer(self.directory, self.latency_s, self.bandwidth_bps)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="loopback-http", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._server = None
        self._thread = None

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = self.base_url if self._server is not None else "stopped"
        return (
            f"{self.__class__.__name__}({str(self.directory)!r}, latency_s={self.latency_s}, "
            f"bandwidth_bps={self.bandwidth_bps}, {state})"
        )
