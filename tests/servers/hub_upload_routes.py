"""The write side of the fake Hub: the routes huggingface_hub's upload path calls.

Checked against huggingface_hub 2.4.0, 1.33.0 and 0.36.2 (``hf_api.py``,
``_commit_api.py``, ``lfs.py``; ``make test`` pushes with each) with Xet disabled
(``HF_HUB_DISABLE_XET=1``; with ``hf_xet`` installed the client would otherwise upload
through the Xet CAS, which the fake does not model). The three lines walk the same
routes, in this order:

* ``GET /api/whoami-v2`` -> ``{"name", "type": "user", "auth": {...}}``; 401 for an
  unknown or missing token;
* ``POST /api/repos/create`` (JSON ``{"name", "organization", "type", "visibility"}``;
  0.x sends ``"private": true`` instead of ``"visibility"``) -> ``{"url"}``; 409 when
  the repository exists; the new repository holds one commit with ``.gitattributes``,
  as on the Hub;
* ``POST /api/{type}s/{repo}/preupload/{rev}`` (JSON ``{"files": [{"path", "sample",
  "size"}]}``) -> ``{"files": [{"path", "uploadMode", "shouldIgnore", "oid"}]}``: LFS
  by file name (:data:`servers.hub_repos.LFS_PATTERNS`), ``oid`` of the file already
  at that path (sha256 for LFS, git blob id otherwise) so the client can skip it;
* ``POST /{datasets/|spaces/}{repo}.git/info/lfs/objects/batch`` (git-lfs batch API)
  -> per object an ``upload`` and a ``verify`` action, or no ``actions`` at all
  when the object is already stored (this is what makes an interrupted push
  resumable: objects uploaded before the failure are not sent again);
* ``PUT /lfs-objects/{oid}`` with the bytes (single-part "basic" transfer; the
  client sends no ``Authorization`` there, as to S3), checked against oid and size;
* ``POST /lfs-verify/{oid}`` -> 200 when stored, 404 otherwise;
* ``POST /api/validate-yaml`` (JSON ``{"content", "repoType"}``) when a commit adds
  ``README.md``: 400 with ``errors`` when the front matter is not YAML;
* ``POST /api/{type}s/{repo}/commit/{rev}`` (``application/x-ndjson``: a ``header``
  line with ``summary``/``description``/``parentCommit``, then ``file`` (base64),
  ``lfsFile`` (oid of an uploaded object), ``deletedFile``/``deletedFolder`` lines)
  -> ``{"commitUrl", "commitOid", "success"}``; 412 when ``parentCommit`` is not the
  branch head, 400 for an ``lfsFile`` whose object was never uploaded.

Writes need ``Authorization: Bearer <token>`` with a token of :attr:`UploadState.users`.
:meth:`UploadState.drop_uploads_of` makes every ``PUT`` of an object reset the
connection halfway through its body (the server dropping a large upload).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from servers.hub_repos import git_blob_id, is_lfs
from servers.hub_routes import HubRequestHandler, RecordedRequest

if TYPE_CHECKING:
    from servers.fake_hub import FakeHub

WRITE_TOKEN = "hf_fake_write_token"
_PLURAL_TO_TYPE = {"datasets": "dataset", "models": "model", "spaces": "space"}
_GITATTRIBUTES = (b"*.atp filter=lfs diff=lfs merge=lfs -text\n"
                  b"*.pt filter=lfs diff=lfs merge=lfs -text\n")


@dataclass
class UploadState:
    """What the write routes keep: accepted tokens, uploaded LFS objects, injected faults."""

    users: dict[str, str] = field(default_factory=lambda: {WRITE_TOKEN: "publisher"})
    objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes (the LFS store)
    dropped_oids: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def drop_uploads_of(self, data: bytes) -> str:
        """Reset the connection halfway through every upload of ``data``; returns its oid."""
        oid = hashlib.sha256(data).hexdigest()
        with self.lock:
            self.dropped_oids.add(oid)
        return oid

    def stop_dropping(self) -> None:
        """Accept every upload again."""
        with self.lock:
            self.dropped_oids.clear()


def upload_state(server: FakeHub) -> UploadState:
    """The server's :class:`UploadState`, created on first use."""
    state = getattr(server, "uploads", None)
    if state is None:
        state = server.uploads = UploadState()
    return state


class UploadingHubHandler(HubRequestHandler):
    """The read routes of :class:`HubRequestHandler` plus the write routes above."""

    def do_PUT(self) -> None:  # noqa: N802 - stdlib naming
        record = self._record()
        path = urlsplit(self.path).path
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            if path.startswith("/lfs-objects/"):
                self._put_object(record, path[len("/lfs-objects/"):])
            else:
                self._error(record, 404, "EntryNotFound", f"unknown route {path}")

    def do_POST(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        if not self._is_write_route(path):
            super().do_POST()
            return
        record = self._record()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._write_route(record, path)

    def do_GET(self) -> None:  # noqa: N802
        if urlsplit(self.path).path == "/api/whoami-v2":
            record = self._record()
            user = self._user()
            if user is None:
                self._error(record, 401, "Unauthorized", "Invalid credentials")
            else:
                self._json(record, {"type": "user", "name": user,
                                    "auth": {"type": "access_token",
                                             "accessToken": {"role": "write"}}})
            return
        super().do_GET()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _is_write_route(path: str) -> bool:
        return (path in ("/api/repos/create", "/api/validate-yaml")
                or "/preupload/" in path or "/commit/" in path
                or path.endswith(".git/info/lfs/objects/batch") or path.startswith("/lfs-verify/"))

    def _user(self) -> str | None:
        header = self.headers.get("Authorization") or ""
        token = header[len("Bearer "):] if header.startswith("Bearer ") else None
        return upload_state(self.server).users.get(token) if token else None

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _writable_repo(self, record: RecordedRequest, repo_type: str, rest: str):
        """(repo, repo_id, tail) when the caller may write to it, else None (error sent)."""
        repo, repo_id, tail = self.server.store.split_repo(repo_type, rest)
        user = self._user()
        if user is None:
            self._error(record, 401, "RepoNotFound", "Invalid credentials in Authorization header")
            return None
        if repo is None or not repo.authorizes(self.headers.get("Authorization")):
            self._error(record, 404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        return repo, repo_id, tail

    def _write_route(self, record: RecordedRequest, path: str) -> None:
        body = self._body()
        if path == "/api/repos/create":
            self._create_repo(record, json.loads(body))
        elif path == "/api/validate-yaml":
            self._validate_yaml(record, json.loads(body))
        elif path.startswith("/lfs-verify/"):
            stored = path[len("/lfs-verify/"):] in upload_state(self.server).objects
            if stored:
                self._json(record, {"success": True})
            else:
                self._error(record, 404, "EntryNotFound", "object not uploaded")
        elif path.endswith(".git/info/lfs/objects/batch"):
            self._lfs_batch(record, path, json.loads(body))
        else:
            plural, _, rest = path[len("/api/"):].partition("/")
            repo_type = _PLURAL_TO_TYPE.get(plural)
            writable = self._writable_repo(record, repo_type, rest) if repo_type else None
            if writable is None:
                if repo_type is None:
                    self._error(record, 404, "RepoNotFound", f"unknown route {path}")
                return
            repo, repo_id, tail = writable
            action, _, revision = tail.partition("/")
            revision = unquote(revision)
            sha = repo.commit_of(revision)
            if sha is None or revision not in repo.refs:
                self._error(record, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            elif action == "preupload":
                self._preupload(record, repo.commits[sha], json.loads(body))
            elif action == "commit":
                self._commit(record, repo, repo_id, revision, sha, body)
            else:
                self._error(record, 404, "EntryNotFound", f"unknown route {path}")

    # ------------------------------------------------------------------ routes
    def _create_repo(self, record: RecordedRequest, payload: dict) -> None:
        if self._user() is None:
            self._error(record, 401, "Unauthorized", "Invalid credentials in Authorization header")
            return
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload.get('organization') or self._user()}/{payload['name']}"
        store = self.server.store
        if store.split_repo(repo_type, repo_id)[0] is not None:
            self._error(record, 409, "Conflict", "You already created this repo")
            return
        token = None
        # 1.x and later send "visibility"; 0.x sends "private": true
        if payload.get("visibility") == "private" or payload.get("private") is True:
            token = self.headers["Authorization"][len("Bearer "):]
        store.commit(repo_id, {".gitattributes": _GITATTRIBUTES}, repo_type=repo_type,
                     token=token)
        prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo_type, "")
        self._json(record, {"url": f"{self.server.endpoint}/{prefix}{repo_id}", "name": repo_id})

    def _validate_yaml(self, record: RecordedRequest, payload: dict) -> None:
        import yaml

        content = payload.get("content", "")
        errors = []
        if content.startswith("---"):
            front = content.split("---", 2)[1] if content.count("---") >= 2 else ""
            try:
                yaml.safe_load(front)
            except yaml.YAMLError as exc:
                errors.append({"message": f"invalid YAML: {exc}"})
        if errors:
            self._send(record, 400, json.dumps({"errors": errors, "warnings": []}).encode(),
                       {"Content-Type": "application/json"})
        else:
            self._json(record, {"errors": [], "warnings": []})

    def _preupload(self, record: RecordedRequest, files: dict[str, bytes], payload: dict) -> None:
        answer = []
        for entry in payload.get("files", []):
            path = entry["path"]
            lfs = is_lfs(path)
            oid = None
            if path in files:
                oid = hashlib.sha256(files[path]).hexdigest() if lfs else git_blob_id(files[path])
            answer.append({"path": path, "uploadMode": "lfs" if lfs else "regular",
                           "shouldIgnore": False, "oid": oid})
        self._json(record, {"files": answer, "commitOid": None})

    def _lfs_batch(self, record: RecordedRequest, path: str, payload: dict) -> None:
        raw = path[1:-len(".git/info/lfs/objects/batch")]
        plural, _, rest = raw.partition("/")
        repo_type = _PLURAL_TO_TYPE.get(plural)
        if repo_type is None:
            repo_type, rest = "model", raw
        if self._writable_repo(record, repo_type, rest) is None:
            return
        state = upload_state(self.server)
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            answer = {"oid": oid, "size": size, "authenticated": True}
            with state.lock:
                present = oid in state.objects
            if not present:
                answer["actions"] = {
                    "upload": {"href": f"{self.server.endpoint}/lfs-objects/{oid}?size={size}"},
                    "verify": {"href": f"{self.server.endpoint}/lfs-verify/{oid}"},
                }
            objects.append(answer)
        self._send(record, 200, json.dumps({"transfer": "basic", "objects": objects}).encode(),
                   {"Content-Type": "application/vnd.git-lfs+json"})

    def _put_object(self, record: RecordedRequest, oid: str) -> None:
        state = upload_state(self.server)
        with state.lock:
            drop = oid in state.dropped_oids
        if drop:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length // 2)
            record.status = -1  # marks a dropped upload in the request log
            # SO_LINGER 0 turns close() into a TCP reset: the upload dies mid-body
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)
            return
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            self._error(record, 400, "BadRequest", "uploaded bytes do not match the oid")
            return
        with state.lock:
            state.objects[oid] = data
        self._send(record, 200)

    def _commit(self, record: RecordedRequest, repo, repo_id: str, branch: str, head: str,
                body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line["key"] == "header"), {})
        parent = header.get("parentCommit")
        if parent is not None and parent != head:
            self._error(record, 412, "PreconditionFailed",
                        f"parentCommit {parent} is not the head of {branch} ({head})")
            return
        files = dict(repo.commits[head])
        state = upload_state(self.server)
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                with state.lock:
                    data = state.objects.get(value["oid"])
                if data is None:
                    self._error(record, 400, "BadRequest",
                                f"LFS object {value['oid']} of {value['path']} was not uploaded")
                    return
                files[value["path"]] = data
            elif key == "deletedFile":
                files.pop(value["path"], None)
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: d for p, d in files.items() if not p.startswith(prefix)}
        sha = self.server.store.commit(repo_id, files, repo_type=repo.repo_type, branch=branch)
        prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo.repo_type, "")
        self._json(record, {"success": True, "commitOid": sha,
                            "commitUrl": f"{self.server.endpoint}/{prefix}{repo_id}/commit/{sha}"})
