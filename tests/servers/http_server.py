"""A fault-injecting loopback HTTP file server for streaming tests and benchmarks.

:class:`ShardServer` is a real ``ThreadingHTTPServer`` on ``127.0.0.1`` (random free
port) serving the files of one directory, with:

* ``ttfb_s``: delay before the status line of every response (time to first byte);
* ``bandwidth``: bytes per second *per connection* (bodies are paced in small chunks),
  so parallel downloads add up like they do against a CDN;
* ``Range: bytes=a-`` / ``bytes=a-b`` -> 206 with ``Content-Range`` (416 when outside);
* injected faults, consumed in order per file (:meth:`ShardServer.add_fault`):
  ``"500"``, ``"503"``, ``"429"`` (with ``Retry-After``), ``"reset"`` (a TCP reset in
  the middle of the body), ``"truncate"`` (full ``Content-Length``, half the body, then
  a clean close), ``"wrong_bytes"`` (right length, corrupted content) and ``"stall"``
  (headers, then silence until the client gives up or is cancelled);
* held bytes (:meth:`ShardServer.hold`): nothing of a file from a given byte on is sent
  until the test releases it;
* ``ETag`` and ``Last-Modified`` from the file's modification time and size (as nginx
  sends them), so a file rewritten in place answers with new validators;
* a request log (:attr:`ShardServer.requests`) of what was asked and answered.

Use the ``shard_server`` fixture (serving a fresh ``tmp_path`` directory), or
:func:`serve_directory` in your own fixtures. :func:`write_pt_shards` fills a directory
with small PyG ``.pt`` shards and the converter's ``manifest.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import struct
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

FAULT_KINDS = ("500", "503", "429", "reset", "truncate", "wrong_bytes", "stall")
_CHUNK = 16 * 1024


@dataclass
class LoggedRequest:
    """One request as the server saw it.

    Attributes:
        path: Decoded request path.
        range: The ``Range`` header, or ``None``.
        status: Status code answered.
        fault: Fault injected into this response, or ``None``.
        body_bytes: Body bytes actually sent.
        started: ``time.monotonic()`` when the request arrived.
        finished: ``time.monotonic()`` when the response was complete (or cut).
    """

    path: str
    range: str | None
    status: int = 0
    fault: str | None = None
    body_bytes: int = 0
    started: float = 0.0
    finished: float = 0.0


@dataclass
class Fault:
    """An injected failure (see :meth:`ShardServer.add_fault`)."""

    kind: str
    retry_after: float | None = None
    at_fraction: float = 0.5


class ShardServer(ThreadingHTTPServer):
    """Serve ``root`` over HTTP on loopback with latency, bandwidth limits and faults.

    Args:
        root: Directory whose files are served (``/name`` -> ``root/name``).
        ttfb_s: Seconds before every response starts. (default: ``0``)
        bandwidth: Body bytes per second per connection; ``None`` is unlimited.
            (default: ``None``)
        ignore_ranges: Answer every request with the whole file (``200``), as servers
            without range support do. (default: ``False``)
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, root: str | Path, *, ttfb_s: float = 0.0,
                 bandwidth: float | None = None, ignore_ranges: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root = Path(root)
        self.ignore_ranges = ignore_ranges
        self.ttfb_s = ttfb_s
        self.bandwidth = bandwidth
        self.requests: list[LoggedRequest] = []
        self.gates: dict[str, tuple[int, threading.Event]] = {}
        self._faults: dict[str, deque[Fault]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.stop_event = threading.Event()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:{port}``."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    def url(self, name: str) -> str:
        """URL of the file ``name`` under the served root."""
        return f"{self.base_url}/{name}"

    def start(self) -> ShardServer:
        """Serve on a daemon thread; returns ``self``."""
        self._thread = threading.Thread(target=self.serve_forever, name="shard-server",
                                        daemon=True, kwargs={"poll_interval": 0.05})
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, release stalled responses and close the socket."""
        self.stop_event.set()
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def add_fault(self, name: str, kind: str, *, times: int = 1,
                  retry_after: float | None = None, at_fraction: float = 0.5) -> None:
        """Make the next ``times`` requests for ``name`` fail with ``kind``.

        Args:
            name: File name (path under the root, no leading ``/``).
            kind: One of :data:`FAULT_KINDS`.
            times: How many consecutive requests get this fault.
            retry_after: ``Retry-After`` sent with ``"429"`` / ``"503"``, in whole seconds
                (the header's delay-seconds form, RFC 9110): fractions are truncated.
            at_fraction: Where in the body ``"reset"`` / ``"truncate"`` cut it, and which
                byte ``"wrong_bytes"`` corrupts.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; expected one of {FAULT_KINDS}")
        with self._lock:
            self._faults[name].extend(Fault(kind, retry_after, at_fraction) for _ in range(times))

    def hold(self, name: str, offset: int) -> threading.Event:
        """Send no byte of ``name`` from ``offset`` on until the returned event is set.

        Every response body reaching that byte sends what comes before it, then waits
        (a download that has to wait for the rest of a file stays blocked, so a test can
        tell what a client does with the first part of a file alone).

        Args:
            name: File name (path under the root, no leading ``/``).
            offset: The first byte held back.

        Returns:
            The event that releases the bytes.
        """
        gate = threading.Event()
        self.gates[name] = (offset, gate)
        return gate

    def next_fault(self, name: str) -> Fault | None:
        """Pop the next fault queued for ``name``."""
        with self._lock:
            queue = self._faults.get(name)
            return queue.popleft() if queue else None

    def requests_for(self, name: str, settle_s: float = 5.0) -> list[LoggedRequest]:
        """Logged requests whose path is ``/name``, once their handlers have returned.

        A handler finishes its bookkeeping (body bytes, status, end time) a moment after
        the client has read the last byte, so a test that looks right after a transfer
        waits for that, up to ``settle_s``; a request still in flight by then (held by a
        test) is returned as it stands.
        """
        deadline = time.monotonic() + settle_s
        while True:
            with self._lock:
                log = [r for r in self.requests if r.path == f"/{name}"]
            if all(entry.finished for entry in log) or time.monotonic() >= deadline:
                return log
            time.sleep(0.01)

    def log(self, entry: LoggedRequest) -> None:
        """Append to the request log (thread-safe)."""
        with self._lock:
            self.requests.append(entry)


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``(first, last)`` inclusive, ``None`` without a header, ``"bad"`` if unsatisfiable."""
    if not header:
        return None
    if not header.startswith("bytes=") or "," in header:
        return "bad"
    first, _, last = header[len("bytes="):].partition("-")
    if not first.isdigit():
        return "bad"
    start = int(first)
    end = int(last) if last.isdigit() else size - 1
    if start >= size or end < start:
        return "bad"
    return start, min(end, size - 1)


class _ConnectionWasReset(Exception):
    """Unwinds the handler after an injected reset closed the socket."""


class _Handler(BaseHTTPRequestHandler):
    server: ShardServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass

    def _pace(self, body: _FileSpan, length: int, entry: LoggedRequest) -> None:
        bandwidth = self.server.bandwidth
        gate = self.server.gates.get(entry.path.lstrip("/"))
        started = time.monotonic()
        for offset in range(0, length, _CHUNK):
            chunk = body.read(offset, min(_CHUNK, length - offset))
            held = None if gate is None else gate[0] - (body.first + offset)
            if held is not None and 0 <= held < len(chunk) and not gate[1].is_set():
                self.wfile.write(chunk[:held])  # everything before the gate, then wait
                self.wfile.flush()
                while not gate[1].wait(0.05) and not self.server.stop_event.is_set():
                    pass
                chunk = chunk[held:]
                entry.body_bytes += held
            self.wfile.write(chunk)
            entry.body_bytes += len(chunk)
            if bandwidth:
                ahead = (offset + len(chunk)) / bandwidth - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    def _reset_connection(self) -> None:
        # SO_LINGER with a zero timeout turns close() into a TCP RST
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.wfile.close()
        self.rfile.close()
        self.connection.close()
        raise _ConnectionWasReset

    def handle(self) -> None:
        with contextlib.suppress(_ConnectionWasReset):
            super().handle()

    def finish(self) -> None:
        if self.connection.fileno() == -1:  # reset: nothing left to flush
            return
        super().finish()

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        entry = LoggedRequest(unquote(urlsplit(self.path).path), self.headers.get("Range"),
                              started=time.monotonic())
        self.server.log(entry)
        try:
            self._answer(entry)
        finally:
            entry.finished = time.monotonic()

    def _answer(self, entry: LoggedRequest) -> None:
        if self.server.ttfb_s:
            time.sleep(self.server.ttfb_s)
        name = entry.path.lstrip("/")
        target = (self.server.root / name).resolve()
        if self.server.root.resolve() not in target.parents or not target.is_file():
            entry.status = 404
            self.send_error(404)
            return
        fault = self.server.next_fault(name)
        entry.fault = fault.kind if fault else None
        if fault is not None and fault.kind in ("500", "503", "429"):
            entry.status = int(fault.kind)
            self.send_response(entry.status)
            if fault.retry_after is not None:
                self.send_header("Retry-After", str(int(fault.retry_after)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        stat = target.stat()
        size = stat.st_size
        span = None if self.server.ignore_ranges else _parse_range(self.headers.get("Range"),
                                                                   size)
        if span == "bad":
            entry.status = 416
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        first, last = span if span else (0, size - 1)
        length = last + 1 - first
        entry.status = 206 if span else 200
        self.send_response(entry.status)
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        # validators as nginx derives them: a file rewritten in place gets new ones
        self.send_header("ETag", f'"{stat.st_mtime_ns:x}-{size:x}"')
        self.send_header("Last-Modified", formatdate(stat.st_mtime, usegmt=True))
        if span:
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        self.end_headers()
        # only the asked-for bytes are read, chunk by chunk as they are sent: files may
        # be several GB, and the first byte must not wait for the last to be read
        flip = int(length * fault.at_fraction) % length if (
            fault is not None and fault.kind == "wrong_bytes" and length) else None
        with _FileSpan(target, first, flip) as body:
            try:
                if fault is not None and fault.kind in ("reset", "truncate"):
                    self._pace(body, int(length * fault.at_fraction), entry)
                    if fault.kind == "reset":
                        self._reset_connection()
                    else:
                        self.close_connection = True
                    return
                if fault is not None and fault.kind == "stall":
                    self.wfile.flush()
                    self.server.stop_event.wait(30)
                    return
                self._pace(body, length, entry)
            except (BrokenPipeError, ConnectionResetError):  # the client went away
                self.close_connection = True


class _FileSpan:
    """The bytes of a file from ``first`` on, read on demand; the byte at ``flip``
    (relative to ``first``) is inverted (the ``wrong_bytes`` fault)."""

    def __init__(self, path: Path, first: int, flip: int | None) -> None:
        self.handle = open(path, "rb")  # noqa: SIM115 - closed by __exit__
        self.first = first
        self.flip = flip

    def read(self, offset: int, length: int) -> bytes:
        self.handle.seek(self.first + offset)
        data = self.handle.read(length)
        if self.flip is not None and offset <= self.flip < offset + len(data):
            changed = bytearray(data)
            changed[self.flip - offset] ^= 0xFF
            data = bytes(changed)
        return data

    def __enter__(self) -> _FileSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()


def serve_directory(root: str | Path, **options) -> Iterator[ShardServer]:
    """Generator for fixtures: yield a started :class:`ShardServer`, stop it afterwards.

    Args:
        root: Directory to serve.
        **options: ``ttfb_s`` and ``bandwidth``.
    """
    server = ShardServer(root, **options).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shard_server(tmp_path: Path) -> Iterator[ShardServer]:
    """A started :class:`ShardServer` serving (the initially empty) ``tmp_path / "www"``."""
    root = tmp_path / "www"
    root.mkdir()
    yield from serve_directory(root)


def make_samples(shard: int, count: int, *, atoms: int = 3):
    """``count`` small molecules whose ``sample_id`` is ``shard * 1000 + i``."""
    import torch
    from torch_geometric.data import Data

    generator = torch.Generator().manual_seed(shard)
    samples = []
    for i in range(count):
        samples.append(Data(
            z=torch.randint(1, 10, (atoms,), generator=generator),
            pos=torch.randn(atoms, 3, generator=generator),
            energy=torch.randn(1, generator=generator),
            sample_id=torch.tensor([shard * 1000 + i]),
        ))
    return samples


def write_manifest(root: str | Path, names: list[str], records: list[int | None]) -> Path:
    """Write the converter's ``manifest.json`` (names, records, bytes, sha256) for ``names``."""
    root = Path(root)
    shards = []
    for name, count in zip(names, records):
        data = (root / name).read_bytes()
        shards.append({"name": name, "records": count, "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})
    path = root / "manifest.json"
    path.write_text(json.dumps({"shards": shards}, indent=1), encoding="utf-8")
    return path


def write_pt_shards(root: str | Path, sizes: list[int], *, collated: tuple[int, ...] = (),
                    atoms: int = 3, manifest: bool = True) -> list[str]:
    """Write ``len(sizes)`` ``.pt`` shards (lists of ``Data``) and a manifest.

    Args:
        root: Target directory.
        sizes: Samples per shard.
        collated: Shard numbers written as ``InMemoryDataset``-style ``(data, slices)``.
        atoms: Atoms per molecule.
        manifest: Also write ``manifest.json``.

    Returns:
        The shard file names.
    """
    import torch
    from torch_geometric.data import InMemoryDataset

    root = Path(root)
    names = []
    for shard, count in enumerate(sizes):
        samples = make_samples(shard, count, atoms=atoms)
        name = f"shard-{shard:04d}.pt"
        payload = InMemoryDataset.collate(samples) if shard in collated else samples
        torch.save(payload, root / name)
        names.append(name)
    if manifest:
        write_manifest(root, names, list(sizes))
    return names
