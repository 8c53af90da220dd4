"""On-disk cache of shard listings and header facts, keyed by commit sha, and of refs.

A commit never changes, so a listing made at a commit sha is valid forever:
reopening a pinned dataset (a second training run, a restarted job) then costs
no API call and no header range read. Files live under
``{root}/hub/{repo_type}s--{owner}--{name}/listings/{sha}/{hash of path}.json``
and are written atomically, inside the cache root
(:func:`pyg_atompack.remote.cache.write_atomically`); a read-only cache is read, never
written (nothing is stored, and nothing fails).

Each time a branch or tag is resolved online, the commit it pointed at is recorded in
``{repo folder}/refs/{hash of endpoint and revision}.json``; with ``HF_HUB_OFFLINE=1`` a
revision resolved before is answered from there, so a cached dataset opened by branch
name works on a node without network (the commit recorded last is used, as
huggingface_hub's own cache does with its ``refs/`` files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from pyg_atompack.hub.remote import is_commit_sha
from pyg_atompack.hub.transfer import repo_cache_folder
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.files import RemoteFile

_VERSION = 3


def listing_file(cache_dir: Path, repo_id: str, repo_type: str, sha: str, path: str) -> Path:
    """Where the listing of ``path`` at commit ``sha`` is cached.

    Args:
        cache_dir (Path): Cache root.
        repo_id (str): ``owner/name``.
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.
        sha (str): The commit sha (never a branch name: branches move).
        path (str): The listed path inside the repository.

    Returns:
        The JSON file path.
    """
    key = hashlib.sha256(path.encode()).hexdigest()[:16]
    if not is_commit_sha(sha):
        raise remote_cache.RemoteNameError(
            f"hf://{repo_type}s/{repo_id}: refusing the revision {sha!r} as a listing key: "
            f"not a commit sha")
    return repo_cache_folder(cache_dir, repo_id, repo_type) / "listings" / sha / f"{key}.json"


def _endpoint_prefix(endpoint: str | None) -> str:
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/") + "/"


def load_listing(
    file: Path, endpoint: str | None
) -> tuple[list[RemoteFile], list[dict[str, int]]] | None:
    """Read a cached listing; ``None`` when absent, unreadable or made via another endpoint.

    Args:
        file (Path): From :func:`listing_file`.
        endpoint (str | None): The endpoint the caller would list through (``None``: the
            client's default); a listing whose URLs point elsewhere is ignored.

    Returns:
        ``(shards, headers)`` or ``None``.
    """
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if data.get("version") != _VERSION:
            return None
        shards = [RemoteFile(**entry) for entry in data["shards"]]
        headers = [dict(h) for h in data["headers"]]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # a damaged cache entry only costs a fresh listing
    if len(shards) != len(headers):
        return None
    if any(not s.url.startswith(_endpoint_prefix(endpoint)) for s in shards):
        return None
    return shards, headers


def _write_json(file: Path, payload: dict, cache_dir: Path) -> None:
    """Write ``payload`` to ``file`` atomically, inside the cache root ``cache_dir``.

    A cache that cannot be written (read-only) only costs a fresh listing next time, so
    that failure is ignored; a path leading out of the cache is not.
    """
    text = json.dumps(payload)
    with contextlib.suppress(remote_cache.CacheReadOnlyError):
        remote_cache.write_atomically(
            file, remote_cache.cache_root(cache_dir),
            lambda temp: temp.write_text(text, encoding="utf-8"))


def store_listing(file: Path, shards: list[RemoteFile], headers: list[dict[str, int]],
                  cache_dir: Path) -> None:
    """Write a listing atomically; a read-only cache is left as it is.

    Args:
        file (Path): From :func:`listing_file`.
        shards (list[RemoteFile]): The listed shards.
        headers (list[dict[str, int]]): Per shard, the header facts.
        cache_dir (Path): The cache root ``file`` must stay inside.
    """
    payload = {"version": _VERSION, "shards": [asdict(s) for s in shards], "headers": headers}
    _write_json(file, payload, cache_dir)


def _ref_file(cache_dir: Path, repo_id: str, repo_type: str, revision: str | None,
              endpoint: str | None) -> Path:
    key = hashlib.sha256(f"{_endpoint_prefix(endpoint)}\n{revision or ''}".encode()).hexdigest()
    return repo_cache_folder(cache_dir, repo_id, repo_type) / "refs" / f"{key[:16]}.json"


def store_ref(cache_dir: Path, repo_id: str, repo_type: str, revision: str | None,
              endpoint: str | None, sha: str) -> None:
    """Record that ``revision`` (``None``: the default branch) resolved to ``sha``.

    Args:
        cache_dir (Path): Cache root.
        repo_id (str): ``owner/name``.
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.
        revision (str | None): The branch or tag that was resolved.
        endpoint (str | None): The endpoint it was resolved through (``None``: the client's
            default).
        sha (str): The commit.
    """
    if load_ref(cache_dir, repo_id, repo_type, revision, endpoint) == sha:
        return  # unchanged: no write (a read-only cache opens without one)
    file = _ref_file(cache_dir, repo_id, repo_type, revision, endpoint)
    payload = {"revision": revision, "endpoint": _endpoint_prefix(endpoint), "sha": sha}
    _write_json(file, payload, cache_dir)


def load_ref(cache_dir: Path, repo_id: str, repo_type: str, revision: str | None,
             endpoint: str | None) -> str | None:
    """The commit ``revision`` resolved to when it was last resolved online, or ``None``.

    Args:
        cache_dir (Path): Cache root.
        repo_id (str): ``owner/name``.
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.
        revision (str | None): The branch or tag (``None``: the default branch).
        endpoint (str | None): The endpoint (``None``: the client's default).

    Returns:
        The commit sha, or ``None`` when never recorded.
    """
    try:
        data = json.loads(_ref_file(cache_dir, repo_id, repo_type, revision,
                                    endpoint).read_text(encoding="utf-8"))
        sha = data["sha"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return sha if isinstance(sha, str) and is_commit_sha(sha) else None
