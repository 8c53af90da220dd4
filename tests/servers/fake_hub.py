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
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

LFS_PATTERNS = ("*.atp", "*.pt", "*.bin", "*.npy")
_TYPE_PLURAL = {"dataset": "datasets", "model": "models", "space": "spaces"}
_RESOLVE_PREFIX = {"dataset": "datasets/", "model": "", "space": "spaces/"}


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob holding ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class RecordedRequest:
    """One HTTP request as the fake Hub saw it."""

    method: str
    path: str  # decoded path, without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    status: int = 0
    body_bytes: int = 0  # bytes of body sent back


@dataclass
class _Repo:
    repo_id: str
    repo_type: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha
    token: str | None = None  # required bearer token (private repo), if any


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
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay_s = delay_s
        self.page_size = page_size
        self.redirect_lfs = redirect_lfs
        self.requests: list[RecordedRequest] = []
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._wrong_bytes: dict[tuple[str, str], bytes] = {}
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._commit_counter = 0
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
        """Create a commit on ``branch`` (creating the repo if needed).

        Args:
            repo_id: ``owner/name``.
            files: ``{path: bytes}`` or a local directory whose files are all committed.
            repo_type: ``"dataset"``, ``"model"`` or ``"space"``.
            branch: Branch moved to the new commit.
            token: Make the repo private: requests need ``Authorization: Bearer {token}``.
            replace: The commit holds exactly ``files``; with ``False`` they are
                added on top of the branch's current files.

        Returns:
            The new commit's 40-hex sha.
        """
        if not isinstance(files, dict):
            root = Path(files)
            files = {p.relative_to(root).as_posix(): p.read_bytes()
                     for p in sorted(root.rglob("*")) if p.is_file()}
        with self._lock:
            repo = self._repos.setdefault((repo_type, repo_id), _Repo(repo_id, repo_type))
            if token is not None:
                repo.token = token
            base = {} if replace or branch not in repo.refs else dict(
                repo.commits[repo.refs[branch]])
            base.update(files)
            self._commit_counter += 1
            sha = hashlib.sha1(f"{repo_id}:{self._commit_counter}".encode()).hexdigest()
            repo.commits[sha] = base
            repo.refs[branch] = sha
            for data in base.values():
                self._blobs[hashlib.sha256(data).hexdigest()] = data
        return sha

    def serve_wrong_bytes(self, repo_id: str, path: str, data: bytes, *,
                          repo_type: str = "dataset") -> None:
        """Serve ``data`` for ``path`` (every revision) while listings keep the true size/sha."""
        self._wrong_bytes[(repo_id, path)] = data

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        with self._lock:
            self.requests.clear()

    def requests_to(self, fragment: str, method: str | None = None) -> list[RecordedRequest]:
        """Recorded requests whose path contains ``fragment`` (and with ``method``)."""
        with self._lock:
            return [r for r in self.requests if fragment in r.path
                    and (method is None or r.method == method)]

    # ------------------------------------------------------------------ lookups
    def _repo(self, repo_type: str, repo_id: str) -> _Repo | None:
        return self._repos.get((repo_type, repo_id))

    def _split_repo(self, repo_type: str, rest: str) -> tuple[_Repo | None, str, str]:
        """Split ``owner/name/tail`` into (repo, repo_id, tail) using the known repos."""
        parts = rest.split("/", 2)
        repo_id = "/".join(parts[:2])
        tail = parts[2] if len(parts) > 2 else ""
        return self._repo(repo_type, repo_id), repo_id, tail

    @staticmethod
    def is_lfs(path: str) -> bool:
        """Whether the fake stores ``path`` with Git LFS (by file-name pattern)."""
        name = path.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(name, p) for p in LFS_PATTERNS)

    def file_entry(self, path: str, data: bytes) -> dict:
        """The tree / paths-info JSON entry of one file."""
        entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
        if self.is_lfs(path):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    @staticmethod
    def folder_entry(path: str) -> dict:
        """The tree JSON entry of one folder."""
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(),
                "path": path}


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``a-`` / ``-n`` -> inclusive (first, last); ``None`` if unsatisfiable."""
    spec = header.strip()
    if not spec.startswith("bytes=") or "," in spec:
        return None
    first_s, _, last_s = spec[len("bytes="):].partition("-")
    if first_s == "":
        n = int(last_s)
        if n == 0 or size == 0:
            return None
        return max(0, size - n), size - 1
    first = int(first_s)
    last = int(last_s) if last_s else size - 1
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)


class _Handler(BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # keep test output clean; requests are recorded instead

    # ------------------------------------------------------------------ plumbing
    def _record(self) -> RecordedRequest:
        split = urlsplit(self.path)
        record = RecordedRequest(
            method=self.command, path=unquote(split.path), query=parse_qs(split.query),
            headers={k.lower(): v for k, v in self.headers.items()},
        )
        with self.server._lock:
            self.server.requests.append(record)
        return record

    def _send(self, record: RecordedRequest, status: int, body: bytes = b"",
              headers: dict[str, str] | None = None, *, content_length: int | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        length = len(body) if content_length is None else content_length
        self.send_header("Content-Length", str(length))
        self.end_headers()
        record.status = status
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            record.body_bytes = len(body)

    def _json(self, record: RecordedRequest, payload, headers: dict[str, str] | None = None):
        self._send(record, 200, json.dumps(payload).encode(),
                   {"Content-Type": "application/json", **(headers or {})})

    def _error(self, record: RecordedRequest, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(record, status, body, {"Content-Type": "application/json",
                                          "X-Error-Code": code, "X-Error-Message": message})

    def _authorized(self, repo: _Repo) -> bool:
        return repo.token is None or self.headers.get("Authorization") == f"Bearer {repo.token}"

    def _resolve(self, record, repo: _Repo | None, repo_id: str, revision: str):
        """(sha, files) of a revision, or None after sending the error response."""
        if repo is None or not self._authorized(repo):
            status = 404 if repo is None else 401
            self._error(record, status, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        sha = repo.refs.get(revision, revision if revision in repo.commits else None)
        if sha is None:
            self._error(record, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return sha, repo.commits[sha]

    # ------------------------------------------------------------------ verbs
    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch()

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch()

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch()

    def _dispatch(self) -> None:
        record = self._record()
        if self.server.delay_s:
            time.sleep(self.server.delay_s)
        raw_path = urlsplit(self.path).path
        try:
            if raw_path.startswith("/api/"):
                self._api(record, raw_path[len("/api/"):])
            elif raw_path.startswith("/cdn/"):
                data = self.server._blobs.get(raw_path[len("/cdn/"):])
                if data is None:
                    self._error(record, 404, "EntryNotFound", "no such blob")
                else:
                    self._serve_bytes(record, data, {})
            else:
                self._resolve_route(record, raw_path.lstrip("/"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up (e.g. it read only a prefix of the body)

    # ------------------------------------------------------------------ API routes
    def _api(self, record: RecordedRequest, raw: str) -> None:
        plural, _, rest = raw.partition("/")
        repo_type = {v: k for k, v in _TYPE_PLURAL.items()}.get(plural)
        if repo_type is None:
            self._error(record, 404, "RepoNotFound", f"unknown API route {raw}")
            return
        repo, repo_id, tail = self.server._split_repo(repo_type, rest)
        action, _, after = tail.partition("/")
        if action in ("", "revision"):
            revision = unquote(after) if action else "main"
            resolved = self._resolve(record, repo, repo_id, revision)
            if resolved:
                self._repo_info(record, repo_id, *resolved)
        elif action in ("tree", "paths-info"):
            rev_raw, _, path_raw = after.partition("/")
            resolved = self._resolve(record, repo, repo_id, unquote(rev_raw))
            if not resolved:
                return
            if action == "tree":
                self._tree(record, resolved[1], unquote(path_raw).strip("/"))
            else:
                self._paths_info(record, resolved[1])
        else:
            self._error(record, 404, "RepoNotFound", f"unknown API route {raw}")

    def _repo_info(self, record, repo_id: str, sha: str, files: dict[str, bytes]) -> None:
        with_blobs = record.query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for path in sorted(files):
            sibling = {"rfilename": path}
            if with_blobs:
                entry = self.server.file_entry(path, files[path])
                sibling.update(size=entry["size"], blobId=entry["oid"])
                if "lfs" in entry:
                    sibling["lfs"] = {"sha256": entry["lfs"]["oid"], "size": entry["size"],
                                      "pointerSize": 134}
            siblings.append(sibling)
        self._json(record, {"id": repo_id, "_id": sha[:24], "sha": sha, "private": False,
                            "siblings": siblings, "tags": [], "downloads": 0, "likes": 0})

    def _tree(self, record, files: dict[str, bytes], root: str) -> None:
        recursive = record.query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{root}/" if root else ""
        if root and root in files or (root and not any(p.startswith(prefix) for p in files)):
            self._error(record, 404, "EntryNotFound", f"{root} does not exist or is not a folder")
            return
        entries: dict[str, dict] = {}
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rel_parts = path[len(prefix):].split("/")
            for depth in range(1, len(rel_parts)):  # intermediate folders
                folder = prefix + "/".join(rel_parts[:depth])
                entries.setdefault(folder, self.server.folder_entry(folder))
                if not recursive:
                    break
            if recursive or len(rel_parts) == 1:
                entries[path] = self.server.file_entry(path, files[path])
        ordered = [entries[k] for k in sorted(entries)]
        cursor = int(record.query.get("cursor", ["0"])[0])
        page = ordered[cursor:cursor + self.server.page_size]
        headers = {}
        if cursor + self.server.page_size < len(ordered):
            query = f"recursive={str(recursive).lower()}&cursor={cursor + self.server.page_size}"
            next_url = f"{self.server.endpoint}{quote(urlsplit(self.path).path)}?{query}"
            headers["Link"] = f'<{next_url}>; rel="next"'
        self._json(record, page, headers)

    def _paths_info(self, record, files: dict[str, bytes]) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode()) if length else {}
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in files:
                out.append(self.server.file_entry(path, files[path]))
            elif any(p.startswith(path + "/") for p in files):
                out.append(self.server.folder_entry(path))
        self._json(record, out)

    # ------------------------------------------------------------------ file routes
    def _resolve_route(self, record: RecordedRequest, raw: str) -> None:
        repo_type = "model"
        for kind, prefix in _RESOLVE_PREFIX.items():
            if prefix and raw.startswith(prefix):
                repo_type, raw = kind, raw[len(prefix):]
                break
        repo, repo_id, tail = self.server._split_repo(repo_type, raw)
        action, _, after = tail.partition("/")
        if action != "resolve":
            self._error(record, 404, "RepoNotFound", f"unknown route /{raw}")
            return
        rev_raw, _, path_raw = after.partition("/")
        resolved = self._resolve(record, repo, repo_id, unquote(rev_raw))
        if not resolved:
            return
        sha, files = resolved
        path = unquote(path_raw)
        if path not in files:
            self._error(record, 404, "EntryNotFound", f"{path} not found at {sha}")
            return
        true_data = files[path]
        entry = self.server.file_entry(path, true_data)
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if "lfs" in entry:
            sha256 = entry["lfs"]["oid"]
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"',
                            "X-Linked-Size": str(len(true_data))})
            if self.server.redirect_lfs and (repo_id, path) not in self.server._wrong_bytes:
                # another origin, like the Hub's CDN: clients stop at this 302 for metadata
                # (X-Repo-Commit, X-Linked-*) and follow it only for the bytes
                headers["Location"] = f"{self.server.cdn_endpoint}/cdn/{sha256}"
                self._send(record, 302, b"", headers)
                return
        else:
            headers["ETag"] = f'"{entry["oid"]}"'
        data = self.server._wrong_bytes.get((repo_id, path), true_data)
        self._serve_bytes(record, data, headers)

    def _serve_bytes(self, record: RecordedRequest, data: bytes, headers: dict[str, str]) -> None:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   **headers}
        range_header = self.headers.get("Range")
        if range_header is None:
            self._send(record, 200, data, headers)
            return
        span = _parse_range(range_header, len(data))
        if span is None:
            headers["Content-Range"] = f"bytes */{len(data)}"
            self._send(record, 416, b"", headers)
            return
        first, last = span
        headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        self._send(record, 206, data[first:last + 1], headers)


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
