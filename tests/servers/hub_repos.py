"""The repository model behind the fake Hub: commits, branches, blobs and listing entries.

Nothing here speaks HTTP: :class:`RepoStore` holds repositories in memory and answers
the questions the routes of :mod:`servers.hub_routes` ask (which commit a revision names,
what a file's tree entry looks like, which bytes to serve).
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

# files stored with Git LFS (the Hub decides by .gitattributes; the fake by name)
LFS_PATTERNS = ("*.atp", "*.pt", "*.bin", "*.npy")


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob holding ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    """Whether the fake stores ``path`` with Git LFS (by file-name pattern)."""
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) for p in LFS_PATTERNS)


def file_entry(path: str, data: bytes) -> dict:
    """The tree / paths-info JSON entry of one file."""
    entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
    if is_lfs(path):
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                        "pointerSize": 134}
    return entry


def folder_entry(path: str) -> dict:
    """The tree JSON entry of one folder."""
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "path": path}


@dataclass
class HubRepo:
    """One repository: its commits and the branches / tags pointing at them."""

    repo_id: str
    repo_type: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> files
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha
    token: str | None = None  # required bearer token (private repo), if any
    gated: bool = False  # files need a token of a user granted access (see `granted`)
    granted: set[str] = field(default_factory=set)  # tokens whose users accepted the terms

    def authorizes(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header may see the repo."""
        return self.token is None or authorization == f"Bearer {self.token}"

    def gate(self, authorization: str | None) -> tuple[int, str] | None:
        """``(status, X-Error-Message)`` refusing a file download of a gated repo, or None.

        As on the Hub: 401 without a token, 403 with a token whose user was not granted
        access; listings and repository info stay visible to everybody.
        """
        if not self.gated:
            return None
        kind = f"{self.repo_type} {self.repo_id}"
        if not authorization:
            return 401, (f"Access to {kind} is restricted. You must have access to it and be "
                         f"authenticated to access it. Please log in.")
        if authorization.removeprefix("Bearer ") in self.granted:
            return None
        plural = {"dataset": "datasets/", "space": "spaces/"}.get(self.repo_type, "")
        return 403, (f"Access to {kind} is restricted and you are not in the authorized "
                     f"list. Visit https://huggingface.co/{plural}{self.repo_id} to ask for "
                     f"access.")

    def commit_of(self, revision: str) -> str | None:
        """The commit a branch, tag or full commit id names, or None."""
        return self.refs.get(revision, revision if revision in self.commits else None)


class RepoStore:
    """Every repository of the fake Hub, safe to use from the server's request threads."""

    def __init__(self) -> None:
        self._repos: dict[tuple[str, str], HubRepo] = {}
        self._wrong_bytes: dict[tuple[str, str], bytes] = {}
        self._blobs: dict[str, bytes] = {}  # sha256 -> content (the CDN's view)
        self._commit_counter = 0
        self._lock = threading.Lock()

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
            repo = self._repos.setdefault((repo_type, repo_id), HubRepo(repo_id, repo_type))
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

    def make_gated(self, repo_id: str, *, repo_type: str = "dataset",
                   granted: tuple[str, ...] = ()) -> None:
        """Gate an existing repository; ``granted`` tokens belong to users with access."""
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            repo.gated = True
            repo.granted = set(granted)

    def serve_wrong_bytes(self, repo_id: str, path: str, data: bytes) -> None:
        """Serve ``data`` for ``path`` (every revision) while listings keep the true size/sha."""
        with self._lock:
            self._wrong_bytes[(repo_id, path)] = data

    def has_wrong_bytes(self, repo_id: str, path: str) -> bool:
        """Whether :meth:`serve_wrong_bytes` replaced this file's content."""
        return (repo_id, path) in self._wrong_bytes

    def served_bytes(self, repo_id: str, path: str, true_data: bytes) -> bytes:
        """The bytes a download of ``path`` gets: its content, unless replaced."""
        return self._wrong_bytes.get((repo_id, path), true_data)

    def blob(self, sha256: str) -> bytes | None:
        """Content by sha256, as the CDN serves it, or None."""
        return self._blobs.get(sha256)

    def register_download(self, repo_id: str, path: str, true_data: bytes) -> str:
        """The CDN key of what a download of ``path`` gets (its sha256, or a key of the
        replacement bytes set by :meth:`serve_wrong_bytes`)."""
        data = self.served_bytes(repo_id, path, true_data)
        key = hashlib.sha256(data).hexdigest()
        with self._lock:
            self._blobs.setdefault(key, data)
        return key

    def download_bytes(self, key: str) -> bytes | None:
        """What the CDN serves for ``key``, or None."""
        return self._blobs.get(key)

    def split_repo(self, repo_type: str, rest: str) -> tuple[HubRepo | None, str, str]:
        """Split ``owner/name/tail`` into (repo or None, repo_id, tail)."""
        parts = rest.split("/", 2)
        repo_id = "/".join(parts[:2])
        tail = parts[2] if len(parts) > 2 else ""
        return self._repos.get((repo_type, repo_id)), repo_id, tail
