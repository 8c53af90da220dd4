"""A loopback fake of the Hugging Face Hub for tests, driven by the real client.

:class:`FakeHub` is a real ``ThreadingHTTPServer`` on ``127.0.0.1`` (random
free port) that serves repositories held in memory, with the routes and
headers huggingface_hub 2.x uses:

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
  ``Content-Range`` (416 when unsatisfiable). With ``redirect_lfs=True`` LFS
  files answer 302 to ``/cdn/{sha256}`` on another origin (``localhost``), as the
  Hub does with its CDN;
* errors: 404 with ``X-Error-Code: RepoNotFound | RevisionNotFound |
  EntryNotFound`` (what ``hf_raise_for_status`` maps to the client's
  exceptions); 401 + ``RepoNotFound`` for a private repo without its token.

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
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from servers.hub_repos import LFS_PATTERNS, RepoStore, git_blob_id
from servers.hub_routes import RecordedRequest
from servers.hub_upload_routes import UploadingHubHandler  # write routes (push)

__all__ = ["FakeHub", "RecordedRequest", "git_blob_id", "LFS_PATTERNS", "serve_fake_hub",
           "fake_hub", "fake_hub_server"]


class FakeHub(ThreadingHTTPServer):
    """The fake Hub server. Start with :meth:`start`, or use the ``fake_hub`` fixture.

    Args:
        delay_s: Seconds to sleep before answering each request. (default: ``0``)
        page_size: Tree entries per page before a ``Link`` next page. (default: ``1000``)
        redirect_lfs: Answer LFS downloads with a 302 to ``/cdn/{sha256}``. (default: ``False``)
    """

    daemon_threads = True

    def __init__(self, *, delay_s: float = 0.0, page_size: int = 1000,
                 redirect_lfs: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), UploadingHubHandler)
        self.delay_s = delay_s
        self.page_size = page_size
        self.redirect_lfs = redirect_lfs
        self.requests: list[RecordedRequest] = []
        self.store = RepoStore()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._connections: set = set()  # open client sockets, closed by stop()

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
    def cdn_endpoint(self) -> str:
        """The same server under another origin (``localhost``), standing in for the CDN."""
        return f"http://localhost:{self.server_address[1]}"

    def start(self) -> FakeHub:
        """Serve in a daemon thread; returns ``self``."""
        # a short poll interval keeps stop() (and so each test's teardown) fast
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the listening socket and every kept-alive connection."""
        import socket

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
