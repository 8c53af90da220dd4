"""A loopback HTTP server that lies: about sizes, lengths and pace, as an attacker's would.

Each path is a behaviour (:data:`BEHAVIOURS`); every request is logged with its headers, so
a test can tell which credentials reached this origin. Every body it sends is bounded in
bytes and time, so nothing it does outlives a test even when a client keeps reading.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: The most bytes any answer sends, whatever it claims.
MAX_SENT = 256 << 20
#: The longest any answer lasts, in seconds.
MAX_SECONDS = 30.0

BEHAVIOURS = {
    "honest": "the file, as listed (byte ranges too)",
    "oversize": "an honest Content-Length, far larger than listed",
    "lying-length": "a Content-Length far larger than listed, then a short body",
    "endless": "no Content-Length, bytes until the client hangs up",
    "drip": "an honest Content-Length, one byte every drip_s seconds",
}


class HostileServer(ThreadingHTTPServer):
    """Serve ``files`` (name -> bytes) on 127.0.0.1 under ``/{behaviour}/{name}``.

    ``/manifest/{name}`` serves JSON documents set with :meth:`set_document`, and every
    ``/api/...`` path (a Hub API call) the document named ``"api"``.

    Args:
        files (dict[str, bytes]): The honest content of each file.
        drip_s (float, optional): Seconds between the bytes of ``drip``. (default: 0.25)
    """

    daemon_threads = True

    def __init__(self, files: dict[str, bytes], *, drip_s: float = 0.25) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = dict(files)
        self.documents: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.drip_s = drip_s
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.sent: dict[str, int] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        """The absolute URL of ``path`` on this server."""
        return f"http://127.0.0.1:{self.server_address[1]}/{path.lstrip('/')}"

    def set_document(self, name: str, document: object,
                     headers: dict[str, str] | None = None) -> None:
        """Serve ``document`` as JSON at ``/manifest/{name}`` with extra ``headers``."""
        self.documents[name] = (json.dumps(document).encode(), dict(headers or {}))

    def start(self) -> HostileServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)

    def log(self, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((path, headers))

    def count_sent(self, path: str, sent: int) -> None:
        with self._lock:
            self.sent[path] = self.sent.get(path, 0) + sent

    def headers_seen(self, name: str) -> list[str]:
        """Every header name (lower-case) any request to this server carried, sorted."""
        with self._lock:
            return sorted({key.lower() for _, headers in self.requests for key in headers})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HostileServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self.server.log(self.path, dict(self.headers.items()))
        _, kind, name = (self.path.split("?")[0].split("/", 2) + ["", ""])[:3]
        if kind == "api":
            kind, name = "manifest", "api"
        if kind == "manifest" and name in self.server.documents:
            body, extra = self.server.documents[name]
            self.send_response(200)
            for key, value in extra.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        data = self.server.files.get(name)
        if kind not in BEHAVIOURS or data is None:
            self.send_error(404)
            return
        try:
            getattr(self, "_" + kind.replace("-", "_"))(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up: the point of most behaviours
        finally:
            self.close_connection = True

    def _send(self, chunk: bytes) -> None:
        self.wfile.write(chunk)
        self.server.count_sent(self.path, len(chunk))

    def _honest(self, data: bytes) -> None:
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if wanted:  # ranges, as a static file server answers them
            first = int(wanted.group(1))
            last = min(int(wanted.group(2) or len(data) - 1), len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
            data = data[first:last + 1]
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._send(data)

    def _oversize(self, data: bytes) -> None:
        self._stream(data, claimed=MAX_SENT)

    def _lying_length(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(MAX_SENT * 4))
        self.end_headers()
        self._send(data)

    def _endless(self, data: bytes) -> None:
        self._stream(data, claimed=None)

    def _stream(self, data: bytes, claimed: int | None) -> None:
        self.send_response(200)
        if claimed is not None:
            self.send_header("Content-Length", str(claimed))
        else:
            self.send_header("Connection", "close")  # the body ends when the server hangs up
        self.end_headers()
        block = (data * (1 + (1 << 16) // max(1, len(data))))[: 1 << 16]
        sent, began = 0, time.monotonic()
        while sent < MAX_SENT and time.monotonic() - began < MAX_SECONDS:
            self._send(block)
            sent += len(block)

    def _drip(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        began = time.monotonic()
        for index in range(len(data)):
            if time.monotonic() - began > MAX_SECONDS:
                return
            self._send(data[index:index + 1])
            self.wfile.flush()
            time.sleep(self.server.drip_s)
