"""A loopback fake of the Hugging Face Hub for tests, driven by the real client.

:class:`FakeHub` is a real ``ThreadingHTTPServer`` on ``127.0.0.1`` (random
free port) that serves repositories held in memory, with the routes and
headers huggingface_hub uses (0.x, 1.x and 2.x; ``make test`` runs it against one
release of each line):

* ``GET /api/{type}s/{repo}[/revision/{rev}]`` -> ``{"id", "sha", "siblings"}``
  (sizes and LFS info included with ``?blobs=true``);
* ``GET /api/{type}s/{repo}/tree/{rev}[/{path}]?recursive=&expand=`` ->
  entries ``{type, path, oid, size, lfs: {oid (sha256), size, pointerSize}}``,
  paginated with a ``Link: <...>; rel="next"`` header after ``page_size`` entries;
* ``POST /api/{type}s/{repo}/paths-info/{rev}`` (form ``paths=...``);
* ``HEAD``/``GET /[datasets/|spaces/]{repo}/resolve/{rev}/{path}`` with
  ``X-Repo-Commit``, ``ETag`` (quoted sha256 for LFS files, git blob id
  otherwise), ``X-Linked-Etag``/``X-Linked-Size`` for LFS files,
  ``Content-Length``, ``Accept-Ranges: bytes``; ``Range`` -> 206 with
  ``Content-Range`` (416 when unsatisfiable). As on the Hub (``redirect_lfs=True``,
  the default), LFS files answer 302 to a signed URL ``/cdn/{key}?X-Amz-Signature=...``
  on a **second origin** (another server, on another port, named ``localhost``) that,
  like pre-signed S3 URLs, answers 400 to any request carrying ``Authorization``; small
  (plain git) files answer a relative 307 to ``/api/resolve-cache/...`` on the same origin;
* errors: 404 with ``X-Error-Code: RepoNotFound | RevisionNotFound |
  EntryNotFound`` (what ``hf_raise_for_status`` maps to the client's
  exceptions); ``RepoNotFound`` for a private repo without its token (401 when the
  request is anonymous, 404 with a wrong token); gated repositories
  (:meth:`FakeHub.make_gated`) list normally but refuse file downloads with
  ``X-Error-Code: GatedRepo`` and the Hub's ``X-Error-Message`` (401 anonymous, 403
  for a token whose user was not granted access);
* injected faults per route (:meth:`FakeHub.fail`: ``"api"``, ``"resolve"``, ``"cdn"``):
  ``"429"`` with ``RateLimit: "api";r=0;t=N`` and no ``Retry-After`` (what the Hub
  sends), ``"502"``, ``"503"``, ``"500"`` and ``"stall"`` (the request is read, then
  nothing is answered until the client gives up).

Every request is recorded (:attr:`FakeHub.requests`) with method, path, query,
headers, status and body bytes sent, so tests can assert what crossed the wire.
``delay_s`` adds latency to every request; :meth:`FakeHub.serve_wrong_bytes`
makes a file's content differ from what the listings announce.

Pointing the real client at it: huggingface_hub reads ``HF_ENDPOINT`` only when
first imported, so in-process tests pass ``endpoint=hub.endpoint`` (to
``HfApi(endpoint=...)``, ``hf_hub_url``/``hf_hub_download`` or the
``pyg_atompack.hub`` functions); subprocesses get ``HF_ENDPOINT`` in their
environment (:meth:`FakeHub.subprocess_env`).

The repositories live in :mod:`servers.hub_repos` (no HTTP), the routes in
:mod:`servers.hub_routes`; this module is the server, its controls and the fixtures.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from servers.hub_repos import LFS_PATTERNS, RepoStore, git_blob_id
from servers.hub_routes import CDNRequestHandler, RecordedRequest
from servers.hub_upload_routes import UploadingHubHandler  # write routes (push)

FAULT_ROUTES = ("api", "resolve", "cdn")
FAULT_KINDS = ("429", "500", "502", "503", "stall")

__all__ = ["FakeHub", "RecordedRequest", "git_blob_id", "LFS_PATTERNS", "serve_fake_hub",
           "fake_hub", "fake_hub_server"]


def _quiet_handle_error(server, request, client_address) -> None:
    """A client that hung up mid-answer (the real Hub just drops the connection) is
    not an error worth a traceback on stderr, where the CLI tests read the output."""
    error = sys.exc_info()[1]
    if isinstance(error, (ConnectionError, TimeoutError)):
        return
    ThreadingHTTPServer.handle_error(server, request, client_address)


class FakeHub(ThreadingHTTPServer):
    """The fake Hub server. Start with :meth:`start`, or use the ``fake_hub`` fixture.

    Args:
        delay_s: Seconds to sleep before answering each request. (default: ``0``)
        page_size: Tree entries per page before a ``Link`` next page. (default: ``1000``)
        redirect_lfs: Answer LFS downloads with a 302 to the CDN origin and small files
            with a relative 307, as the Hub does; ``False`` serves every file from
            ``resolve/`` itself. (default: ``True``)
    """

    daemon_threads = True
    handle_error = _quiet_handle_error

    def __init__(self, *, delay_s: float = 0.0, page_size: int = 1000,
                 redirect_lfs: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), UploadingHubHandler)
        self.delay_s = delay_s
        self.page_size = page_size
        self.redirect_lfs = redirect_lfs
        self.requests: list[RecordedRequest] = []
        self.store = RepoStore()
        self.stall_s = 30.0  # how long a "stall" fault keeps a request unanswered
        self.ratelimit_reset_s = 1  # the t= of injected 429s
        self.stop_event = threading.Event()
        self._faults: dict[str, list[str]] = {route: [] for route in FAULT_ROUTES}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._connections: set = set()  # open client sockets, closed by stop()
        self.cdn = _CDNServer(self)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    # ------------------------------------------------------------------ control
    @property
    def endpoint(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:38211`` (use as ``endpoint=`` / ``HF_ENDPOINT``)."""
        return f"http://127.0.0.1:{self.server_address[1]}"

    @property
    def hub(self) -> FakeHub:
        """The server holding repositories and faults (itself; the CDN points here too)."""
        return self

    @property
    def cdn_endpoint(self) -> str:
        """The second origin, standing in for the Hub's CDN.

        Another port *and another host name* (``localhost``, still the loopback server):
        the Hub's CDN is another host, and huggingface_hub 1.x follows a ``HEAD``
        redirect to the same host name on any port (2.x compares the whole origin), so a
        CDN on ``127.0.0.1`` would be taken for the Hub and asked for Hub headers.
        """
        return f"http://localhost:{self.cdn.server_address[1]}"

    def start(self) -> FakeHub:
        """Serve (the Hub and its CDN) in daemon threads; returns ``self``."""
        # a short poll interval keeps stop() (and so each test's teardown) fast
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        self.cdn.start()
        return self

    def fail(self, route: str, kind: str, *, times: int = 1) -> None:
        """Make the next ``times`` requests to ``route`` fail with ``kind``.

        Args:
            route: ``"api"`` (``/api/...``), ``"resolve"`` (``resolve/`` and the small
                files' ``resolve-cache/``) or ``"cdn"`` (the second origin).
            kind: One of :data:`FAULT_KINDS`.
            times: How many consecutive requests get it.
        """
        if route not in FAULT_ROUTES or kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {route!r}/{kind!r}")
        with self._lock:
            self._faults[route].extend([kind] * times)

    def next_fault(self, route: str) -> str | None:
        """Pop the next fault queued for ``route`` (called by the handlers)."""
        with self._lock:
            return self._faults[route].pop(0) if self._faults[route] else None

    def make_gated(self, repo_id: str, *, repo_type: str = "dataset",
                   granted: tuple[str, ...] = ()) -> None:
        """Gate a repository; see :meth:`hub_repos.RepoStore.make_gated`."""
        self.store.make_gated(repo_id, repo_type=repo_type, granted=granted)

    def stop(self) -> None:
        """Stop serving, close the listening socket and every kept-alive connection."""
        import socket

        self.stop_event.set()  # releases stalled requests
        self.cdn.stop()
        if self._thread is not None and self._thread.is_alive():
            self.shutdown()
        self.server_close()
        with self._lock:
            live, self._connections = list(self._connections), set()
        for conn in live:  # otherwise keep-alive clients would still be served
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def server_close(self) -> None:
        """Close the listening sockets of the Hub and of its CDN."""
        super().server_close()
        self.cdn.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def subprocess_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a child process whose huggingface_hub talks to this server."""
        import os

        env = dict(os.environ if base is None else base)
        env.update({"HF_ENDPOINT": self.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
        env.pop("HF_HUB_OFFLINE", None)
        return env

    def commit(self, repo_id: str, files: dict[str, bytes] | str | Path, *,
               repo_type: str = "dataset", branch: str = "main", token: str | None = None,
               replace: bool = True) -> str:
        """Create a commit on ``branch``; see :meth:`hub_repos.RepoStore.commit`."""
        return self.store.commit(repo_id, files, repo_type=repo_type, branch=branch,
                                 token=token, replace=replace)

    def serve_wrong_bytes(self, repo_id: str, path: str, data: bytes, *,
                          repo_type: str = "dataset") -> None:
        """Serve ``data`` for ``path`` (every revision) while listings keep the true size/sha."""
        self.store.serve_wrong_bytes(repo_id, path, data)

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        with self._lock:
            self.requests.clear()

    def record_request(self, record: RecordedRequest) -> None:
        """Append one request to :attr:`requests` (called by the handler threads)."""
        with self._lock:
            self.requests.append(record)

    def requests_to(self, fragment: str, method: str | None = None) -> list[RecordedRequest]:
        """Recorded requests whose path contains ``fragment`` (and with ``method``)."""
        with self._lock:
            return [r for r in self.requests if fragment in r.path
                    and (method is None or r.method == method)]


class _CDNServer(ThreadingHTTPServer):
    """The fake Hub's second origin (its own port); requests are recorded on the hub."""

    handle_error = _quiet_handle_error

    daemon_threads = True
    delay_s = 0.0

    def __init__(self, hub: FakeHub) -> None:
        super().__init__(("127.0.0.1", 0), CDNRequestHandler)
        self.hub = hub
        self._thread: threading.Thread | None = None

    def record_request(self, record: RecordedRequest) -> None:
        self.hub.record_request(record)

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub-cdn", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)


def serve_fake_hub(**options) -> Iterator[FakeHub]:
    """Generator for fixtures: yield a started :class:`FakeHub`, stop it afterwards.

    Define a fixture in a test module without tripping ruff's F811 (an imported
    fixture redefined by test arguments)::

        @pytest.fixture
        def fake_hub():
            yield from serve_fake_hub()

    Args:
        **options: Passed to :class:`FakeHub` (``delay_s``, ``page_size``, ``redirect_lfs``).
    """
    server = FakeHub(**options).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    """A started :class:`FakeHub` with no repositories, stopped after the test."""
    yield from serve_fake_hub()


@pytest.fixture
def fake_hub_server() -> Iterator[FakeHub]:
    """Same as ``fake_hub`` (the name other test modules were told about)."""
    yield from serve_fake_hub()


def write_reference_shard(path: Path, n_molecules: int, n_atoms: int, seed: int) -> None:
    """A zstd `.atp` shard written by the reference implementation (atompack-db).

    Energies are ``seed * 100 + molecule index``, so a test can tell which shard and
    molecule a value came from.
    """
    import atompack  # the test oracle; imported here so the server alone needs no extra
    import numpy as np

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = atompack.Database(str(path), compression="zstd", overwrite=True)
    db.add_arrays_batch(
        rng.normal(size=(n_molecules, n_atoms, 3)).astype(np.float32),
        rng.integers(1, 30, size=(n_molecules, n_atoms)).astype(np.uint8),
        energy=seed * 100.0 + np.arange(n_molecules, dtype=np.float64),
        forces=rng.normal(size=(n_molecules, n_atoms, 3)).astype(np.float32),
    )
    db.flush()
