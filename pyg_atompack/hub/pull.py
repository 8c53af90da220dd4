"""A full local copy of a published dataset: ``snapshot_download`` plus verification.

:func:`pull` pins the revision, lists the files under the path (sizes, sha256,
git blob ids: one listing request), lets huggingface_hub's ``snapshot_download``
fetch exactly those files into ``dest`` (its resume, retries and parallel
downloads apply), then hashes every file and compares it with the listing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pyg_atompack.hub.errors import HubIntegrityError
from pyg_atompack.hub.remote import (
    describe_file,
    list_remote_files,
    resolve_revision,
    translate_errors,
)
from pyg_atompack.hub.uri import normalize_path_in_repo


@dataclass(frozen=True)
class PullResult:
    """What :func:`pull` fetched.

    Attributes:
        repo_id: The repository.
        commit: The commit the files were fetched at.
        root: ``dest / path_in_repo``: the local copy of the pulled path.
        files: Local paths of the verified files, sorted by repository path.
    """

    repo_id: str
    commit: str
    root: Path
    files: tuple[Path, ...]


def parse_pull_spec(spec: str) -> tuple[str, str, str | None]:
    """Split ``REPO_ID[/PATH][@REV]`` (or an ``hf://`` URI) into its parts.

    Args:
        spec (str): E.g. ``"org/data/omat/train@main"`` or ``"hf://datasets/org/data@v1/x"``.

    Returns:
        ``(repo_id, path_in_repo, revision or None)``.
    """
    from pyg_atompack.hub.errors import HubURIError
    from pyg_atompack.hub.uri import parse_hf_uri

    if spec.startswith("hf://"):
        loc = parse_hf_uri(spec)
        return loc.repo_id, loc.path_in_repo, loc.revision
    body, at, revision = spec.partition("@")
    parts = body.strip("/").split("/", 2)
    if len(parts) < 2 or not all(parts[:2]) or (at and not revision):
        raise HubURIError(f"expected REPO_ID[/PATH][@REV] (owner/name/...), got {spec!r}")
    path = normalize_path_in_repo(parts[2] if len(parts) == 3 else "")
    return f"{parts[0]}/{parts[1]}", path, revision or None


def _matches(local: Path, remote) -> bool:
    """Whether a local file has the size and hash the listing announces."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    if not local.is_file() or local.stat().st_size != remote.size:
        return False
    if remote.sha256:  # LFS file: sha256 of the content, hashed in chunks
        with open(local, "rb") as handle:
            return sha_fileobj(handle).hex() == remote.sha256.lower()
    # plain git files are small (the Hub stores large ones with LFS)
    return not remote.blob_id or git_hash(local.read_bytes()) == remote.blob_id.lower()


def pull(
    repo_id: str,
    dest: str | os.PathLike,
    path_in_repo: str = "",
    *,
    revision: str | None = None,
    pattern: str = "*",
    token: str | bool | None = None,
    endpoint: str | None = None,
    max_workers: int = 8,
) -> PullResult:
    """Download every file under ``path_in_repo`` into ``dest`` and verify it.

    Args:
        repo_id (str): The dataset repository.
        dest (str | os.PathLike): Local directory; files land at ``dest/<path in the repository>``.
        path_in_repo (str, optional): A directory or file in the repository (``""``: everything).
            (default: :obj:`""`)
        revision (str, optional): Branch, tag or commit (``None``: the default branch); pinned
            first. (default: :obj:`None`)
        pattern (str, optional): ``fnmatch`` pattern relative to ``path_in_repo``, as for
            :func:`~pyg_atompack.hub.list_remote_files`. (default: :obj:`"*"`)
        token (str | bool, optional): Hub token (``None``: the saved login / ``HF_TOKEN``).
            (default: :obj:`None`)
        endpoint (str, optional): Hub base URL (``None``: huggingface_hub's configured endpoint).
            (default: :obj:`None`)
        max_workers (int, optional): Parallel downloads. (default: :obj:`8`)

    Returns:
        A :class:`PullResult`.

    Raises:
        HubIntegrityError: A downloaded file differs from the listing.
        HubError: The repository, revision or path does not exist, or a transfer failed.
    """
    from huggingface_hub import snapshot_download

    path_in_repo = normalize_path_in_repo(path_in_repo)
    commit = resolve_revision(repo_id, revision, token=token, endpoint=endpoint)
    listed = list_remote_files(repo_id, path_in_repo, revision=commit, pattern=pattern,
                               token=token, endpoint=endpoint)
    dest = Path(dest).expanduser()
    with translate_errors(repo_id, commit, path_in_repo or None):
        snapshot_download(repo_id, repo_type="dataset", revision=commit,
                          allow_patterns=[f.name for f in listed], local_dir=dest,
                          token=token, endpoint=endpoint, max_workers=max_workers)
    files = []
    for remote in listed:
        local = dest / remote.name
        if not _matches(local, remote):
            raise HubIntegrityError(f"{describe_file(remote)}: the local copy {local} differs from "
                                    "the listing (size or checksum)")
        files.append(local)
    root = dest / path_in_repo if path_in_repo else dest
    return PullResult(repo_id, commit, root, tuple(files))
