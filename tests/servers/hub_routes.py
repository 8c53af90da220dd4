"""The HTTP side of the fake Hub: request records and the route handlers.

The routes (``/api/...``, ``/.../resolve/...``, ``/cdn/...``) and headers are those
huggingface_hub 0.x, 1.x and 2.x use; see :mod:`servers.fake_hub` for the list. The handler reads
repositories from the server's :class:`~servers.hub_repos.RepoStore` and records every
request on the server.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, quote, unquote, urlsplit

from servers.hub_repos import HubRepo, file_entry, folder_entry

if TYPE_CHECKING:
    from servers.fake_hub import FakeHub

_TYPE_PLURAL = {"dataset": "datasets", "model": "models", "space": "spaces"}
_RESOLVE_PREFIX = {"dataset": "datasets/", "model": "", "space": "spaces/"}


@dataclass
class RecordedRequest:
    """One HTTP request as the fake Hub saw it."""

    method: str
    path: str  # decoded path, without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    status: int = 0
    body_bytes: int = 0  # bytes of body sent back
    fault: str | None = None  # the injected fault, if any
    origin: str = "hub"  # "hub" or "cdn": which server answered
    started: float = 0.0  # time.monotonic() when the request arrived
    client_port: int = 0  # the client's port: requests on one connection share it


def parse_range(header: str, size: int) -> tuple[int, int] | None:
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


class HubRequestHandler(BaseHTTPRequestHandler):
    """Answers the fake Hub's routes from the server's :class:`RepoStore`."""

    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        pass  # keep test output clean; requests are recorded instead

    # ------------------------------------------------------------------ plumbing
    def _record(self) -> RecordedRequest:
        split = urlsplit(self.path)
        record = RecordedRequest(
            method=self.command, path=unquote(split.path), query=parse_qs(split.query),
            headers={k.lower(): v for k, v in self.headers.items()}, started=time.monotonic(),
            client_port=self.client_address[1],
        )
        self.server.record_request(record)
        return record

    def _send(self, record: RecordedRequest, status: int, body: bytes = b"",
              headers: dict[str, str] | None = None, *, content_length: int | None = None) -> None:
        # recorded before the answer leaves: a client that follows a redirect at once
        # must not find the log still saying 0 for it
        record.status = status
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        length = len(body) if content_length is None else content_length
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD" and body:
            record.body_bytes = len(body)  # as the status: before the client can read it
            try:
                self.wfile.write(body)
            except OSError:
                record.body_bytes = 0  # the client hung up: nothing of it is known to arrive
                raise

    def _json(self, record: RecordedRequest, payload, headers: dict[str, str] | None = None):
        self._send(record, 200, json.dumps(payload).encode(),
                   {"Content-Type": "application/json", **(headers or {})})

    def _error(self, record: RecordedRequest, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(record, status, body, {"Content-Type": "application/json",
                                          "X-Error-Code": code, "X-Error-Message": message})

    def _resolve(self, record, repo: HubRepo | None, repo_id: str, revision: str):
        """(sha, files) of a revision, or None after sending the error response."""
        authorization = self.headers.get("Authorization")
        if repo is None or not repo.authorizes(authorization):
            # the Hub says 401 to anonymous requests and 404 to authenticated ones, and
            # "RepoNotFound" to both: a private repository is not told from a missing one
            status = 401 if repo is not None and not authorization else 404
            self._error(record, status, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        sha = repo.commit_of(revision)
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
            if raw_path.startswith("/api/resolve-cache/"):
                if not self._inject_fault(record, "resolve"):
                    self._resolve_cache(record, raw_path[len("/api/resolve-cache/"):])
            elif raw_path.startswith("/api/"):
                if not self._inject_fault(record, "api"):
                    self._api(record, raw_path[len("/api/"):])
            else:
                if not self._inject_fault(record, "resolve"):
                    self._resolve_route(record, raw_path.lstrip("/"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up (e.g. it read only a prefix of the body)

    def _inject_fault(self, record: RecordedRequest, route: str) -> bool:
        """Answer with the next fault queued for ``route``; whether one was injected."""
        fault = self.server.hub.next_fault(route)
        if fault is None:
            return False
        record.fault = fault
        if fault == "stall":  # accept the request, then say nothing until the client gives up
            self.server.hub.stop_event.wait(self.server.hub.stall_s)
            self.close_connection = True
            return True
        status = int(fault)
        headers = {"Content-Type": "text/plain"}
        if status == 429:
            # what the Hub sends: the RateLimit fields (IETF draft), no Retry-After
            resource = {"api": "api", "resolve": "resolvers", "cdn": "resolvers"}[route]
            headers["RateLimit"] = f'"{resource}";r=0;t={self.server.hub.ratelimit_reset_s}'
            headers["RateLimit-Policy"] = f'"fixed window";"{resource}";q=3000;w=300'
        self._send(record, status, f"{status} injected by the fake Hub\n".encode(), headers)
        return True

    # ------------------------------------------------------------------ API routes
    def _api(self, record: RecordedRequest, raw: str) -> None:
        plural, _, rest = raw.partition("/")
        repo_type = {v: k for k, v in _TYPE_PLURAL.items()}.get(plural)
        if repo_type is None:
            self._error(record, 404, "RepoNotFound", f"unknown API route {raw}")
            return
        repo, repo_id, tail = self.server.store.split_repo(repo_type, rest)
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
                entry = file_entry(path, files[path])
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
                entries.setdefault(folder, folder_entry(folder))
                if not recursive:
                    break
            if recursive or len(rel_parts) == 1:
                entries[path] = file_entry(path, files[path])
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
                out.append(file_entry(path, files[path]))
            elif any(p.startswith(path + "/") for p in files):
                out.append(folder_entry(path))
        self._json(record, out)

    # ------------------------------------------------------------------ file routes
    def _resolve_route(self, record: RecordedRequest, raw: str) -> None:
        repo_type = "model"
        for kind, prefix in _RESOLVE_PREFIX.items():
            if prefix and raw.startswith(prefix):
                repo_type, raw = kind, raw[len(prefix):]
                break
        repo, repo_id, tail = self.server.store.split_repo(repo_type, raw)
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
        if not self._gate_allows(record, repo):
            return
        if path not in files:
            self._error(record, 404, "EntryNotFound", f"{path} not found at {sha}")
            return
        true_data = files[path]
        entry = file_entry(path, true_data)
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if "lfs" in entry:
            sha256 = entry["lfs"]["oid"]
            headers.update({"ETag": f'"{sha256}"', "X-Linked-Etag": f'"{sha256}"',
                            "X-Linked-Size": str(len(true_data))})
            if self.server.redirect_lfs:
                # a signed URL on another origin, like the Hub's CDN: clients stop at this
                # 302 for metadata (X-Repo-Commit, X-Linked-*) and follow it for the bytes
                blob = self.server.store.register_download(repo_id, path, true_data)
                headers["Location"] = (f"{self.server.cdn_endpoint}/cdn/{blob}"
                                       f"?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                                       f"&X-Amz-Signature=5ec12e7&X-Amz-Expires=3600")
                self._send(record, 302, b"", headers)
                return
        else:
            headers["ETag"] = f'"{entry["oid"]}"'
            if self.server.redirect_lfs:
                # small files: a relative 307 to the same origin, as the Hub answers them
                location = f"/api/resolve-cache/{_TYPE_PLURAL[repo_type]}/{repo_id}/{sha}/"
                self._send(record, 307, b"", {**headers, "Location": location + quote(path)})
                return
        data = self.server.store.served_bytes(repo_id, path, true_data)
        self._serve_bytes(record, data, headers)

    def _gate_allows(self, record: RecordedRequest, repo: HubRepo) -> bool:
        refusal = repo.gate(self.headers.get("Authorization"))
        if refusal is None:
            return True
        self._error(record, refusal[0], "GatedRepo", refusal[1])
        return False

    def _resolve_cache(self, record: RecordedRequest, raw: str) -> None:
        """``/api/resolve-cache/{type}s/{owner}/{name}/{sha}/{path}``: small files' bytes."""
        plural, _, rest = raw.partition("/")
        repo_type = {v: k for k, v in _TYPE_PLURAL.items()}.get(plural, "model")
        repo, repo_id, tail = self.server.store.split_repo(repo_type, rest)
        sha, _, path_raw = tail.partition("/")
        resolved = self._resolve(record, repo, repo_id, sha)
        if not resolved or not self._gate_allows(record, repo):
            return
        path = unquote(path_raw)
        if path not in resolved[1]:
            self._error(record, 404, "EntryNotFound", f"{path} not found at {sha}")
            return
        true_data = resolved[1][path]
        headers = {"X-Repo-Commit": resolved[0], "ETag": f'"{file_entry(path, true_data)["oid"]}"'}
        self._serve_bytes(record, self.server.store.served_bytes(repo_id, path, true_data),
                          headers)

    def _serve_bytes(self, record: RecordedRequest, data: bytes, headers: dict[str, str]) -> None:
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes",
                   **headers}
        range_header = self.headers.get("Range")
        if range_header is None:
            self._send(record, 200, data, headers)
            return
        span = parse_range(range_header, len(data))
        if span is None:
            headers["Content-Range"] = f"bytes */{len(data)}"
            self._send(record, 416, b"", headers)
            return
        first, last = span
        headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        self._send(record, 206, data[first:last + 1], headers)


class CDNRequestHandler(HubRequestHandler):
    """The second origin: serves ``/cdn/{blob}`` like a signed-URL storage host.

    As pre-signed S3 URLs do, it answers 400 to any request that also carries an
    ``Authorization`` header: a client that forwards the Hub token across the redirect
    fails here.
    """

    def _record(self) -> RecordedRequest:
        record = super()._record()
        record.origin = "cdn"
        return record

    def _dispatch(self) -> None:
        record = self._record()
        raw_path = urlsplit(self.path).path
        try:
            if self._inject_fault(record, "cdn"):
                return
            if "Authorization" in self.headers:
                body = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>InvalidArgument"
                        b"</Code><Message>Only one auth mechanism allowed</Message></Error>")
                self._send(record, 400, body, {"Content-Type": "application/xml"})
                return
            data = self.server.hub.store.download_bytes(raw_path[len("/cdn/"):])
            if data is None:
                self._send(record, 404, b"NoSuchKey", {"Content-Type": "text/plain"})
            else:
                self._serve_bytes(record, data, {"ETag": '"cdn"'})
        except (BrokenPipeError, ConnectionResetError):
            pass
