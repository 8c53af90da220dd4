"""A loopback TCP proxy that paces and breaks connections, for object-store tests.

S3 clients speak to an endpoint URL, not through an HTTP proxy, so faults and bandwidth
limits are put in front of moto (``tests/servers/moto_s3.py``) as a plain TCP relay:
point ``endpoint_url`` at :attr:`ThrottlingProxy.endpoint_url` and every byte passes
through it.

* ``bandwidth``: bytes per second *per connection* from the server to the client (as
  stores and CDNs limit each connection), paced in 16 KiB chunks;
* :meth:`ThrottlingProxy.cut_next`: the next connection(s) are closed after a number of
  bytes from the server (a dropped transfer; the client must resume);
* :meth:`ThrottlingProxy.stall_next`: the next connection(s) stop relaying after a
  number of bytes and hold the socket open (a stalled transfer);
* :meth:`ThrottlingProxy.fail_next`: the next connection(s) answer their first request
  with an S3-style error themselves (``503 SlowDown``, as S3 throttles; optionally with
  ``Retry-After``) and close, without reaching the server;
* :attr:`ThrottlingProxy.ranges`: the ``Range`` headers of the requests relayed.

Written here because no maintained package offers a paced, fault-injecting TCP relay
for tests; it is ~100 lines of sockets and threads.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections import deque

_CHUNK = 16 * 1024
# Azure's SDK sends its range as x-ms-range
_RANGE = re.compile(rb"\r\n(?:x-ms-)?range: *(bytes=[0-9-]+)", re.IGNORECASE)


class ThrottlingProxy:
    """Relay ``127.0.0.1:{port}`` to ``upstream`` with pacing and injected faults.

    Args:
        upstream_port: Port of the server on 127.0.0.1.
        bandwidth: Server-to-client bytes per second per connection, or :obj:`None`
            for no limit. (default: :obj:`None`)
    """

    def __init__(self, upstream_port: int, *, bandwidth: float | None = None) -> None:
        self.upstream_port = upstream_port
        self.bandwidth = bandwidth
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._faults: deque[tuple] = deque()
        self._lock = threading.Lock()
        self.ranges: list[str] = []
        self.connections = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThrottlingProxy:
        """Start accepting connections."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting; open relays end when their sockets close."""
        self._stop.set()
        self._listener.close()

    def cut_next(self, after_bytes: int, times: int = 1) -> None:
        """Close the next ``times`` connections after ``after_bytes`` server bytes."""
        with self._lock:
            self._faults.extend([("cut", after_bytes)] * times)

    def stall_next(self, after_bytes: int, times: int = 1) -> None:
        """Stop relaying on the next ``times`` connections after ``after_bytes``."""
        with self._lock:
            self._faults.extend([("stall", after_bytes)] * times)

    def fail_next(self, status: int = 503, code: str = "SlowDown", times: int = 1,
                  retry_after: int | None = None) -> None:
        """Answer the next ``times`` connections' first request with an S3 error."""
        with self._lock:
            self._faults.extend([("status", status, code, retry_after)] * times)

    def _fail(self, client: socket.socket, status: int, code: str,
              retry_after: int | None) -> None:
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := client.recv(65536)):
                data += chunk
            with self._lock:
                self.ranges.extend(m.decode() for m in _RANGE.findall(data))
                self.failed += 1
            body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                    f'<Message>injected by the test proxy</Message></Error>').encode()
            extra = f"Retry-After: {retry_after}\r\n" if retry_after is not None else ""
            head = (f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n")
            client.sendall(head.encode() + body)
        except OSError:
            pass
        finally:
            _close(client)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                fault = self._faults.popleft() if self._faults else None
                self.connections += 1
            if fault is not None and fault[0] == "status":
                threading.Thread(target=self._fail, args=(client, *fault[1:]),
                                 daemon=True).start()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._requests, args=(client, upstream),
                             daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, fault),
                             daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        try:
            while data := client.recv(65536):
                with self._lock:
                    self.ranges.extend(m.decode() for m in _RANGE.findall(data))
                upstream.sendall(data)
        except OSError:
            pass
        finally:
            _close(upstream)

    def _responses(self, upstream: socket.socket, client: socket.socket,
                   fault: tuple[str, int] | None) -> None:
        sent = 0
        try:
            while data := upstream.recv(_CHUNK):
                if fault is not None and sent + len(data) >= fault[1]:
                    client.sendall(data[:fault[1] - sent])
                    if fault[0] == "stall":
                        self._stop.wait()  # hold the connection open, silent
                    return
                started = time.monotonic()
                client.sendall(data)
                sent += len(data)
                if self.bandwidth:
                    time.sleep(max(0.0, len(data) / self.bandwidth
                                   - (time.monotonic() - started)))
        except OSError:
            pass
        finally:
            _close(client)
            _close(upstream)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
