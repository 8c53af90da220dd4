"""Revision resolution and file listing through the real ``huggingface_hub`` client.

Requests made here (all through :class:`huggingface_hub.HfApi`, so tokens,
proxies, user agent and the ``HF_ENDPOINT`` setting of the client apply):

* :func:`resolve_revision`: one ``GET /api/{type}s/{repo}/revision/{rev}``.
* :func:`list_remote_files`: one ``GET /api/{type}s/{repo}/tree/{sha}/{path}?recursive=true``
  (followed through ``Link: rel="next"`` pages for trees of more than a
  thousand entries). Only when the path is a file, not a directory, a second
  call ``POST /api/{type}s/{repo}/paths-info/{sha}`` describes that file.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyg_atompack.hub.errors import (
    HubError,
    HubNoShardsError,
    HubPathNotFoundError,
    HubRepositoryNotFoundError,
    HubRevisionNotFoundError,
    HubTransferError,
    describe_remote,
)
from pyg_atompack.hub.uri import normalize_path_in_repo

_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_REPO_TYPES = ("dataset", "model", "space")


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub repository at a pinned revision.

    Instances are small, immutable and picklable; they carry everything needed
    to fetch the file again (the URL embeds endpoint, repository and commit).

    Attributes:
        path: POSIX path of the file inside the repository.
        size: Size in bytes, from the listing.
        sha256: Hex sha256 of the content for Git LFS files (what the Hub
            announces); ``None`` for plain git files.
        url: The ``.../resolve/{revision}/{path}`` download URL.
        revision: The revision the listing was made at (a commit sha when the
            listing was pinned, which :func:`list_remote_files` callers should do).
        repo_id: The repository, for error messages (``""`` when unknown).
        repo_type: ``"dataset"``, ``"model"`` or ``"space"``.
        blob_id: The git blob id (sha1 of ``"blob {size}\\0" + content``), which
            lets plain git files be verified too; ``None`` when unknown.
    """

    path: str
    size: int
    sha256: str | None
    url: str
    revision: str
    repo_id: str = ""
    repo_type: str = "dataset"
    blob_id: str | None = None

    def describe(self) -> str:
        """Human-readable ``repo @ revision, path`` string for messages."""
        return describe_remote(self.repo_id or None, self.revision, self.path or self.url)


def is_commit_sha(revision: str | None) -> bool:
    """Whether ``revision`` is a full 40-hex git commit id (already pinned).

    Args:
        revision: A branch, tag or commit id, or :obj:`None` for the default branch.

    Returns:
        :obj:`True` only for a 40-character lowercase hexadecimal string; branch names,
        tags, short ids and :obj:`None` give :obj:`False`.
    """
    return bool(revision) and _COMMIT_SHA.match(revision) is not None


def _check_repo_type(repo_type: str) -> None:
    if repo_type not in _REPO_TYPES:
        raise ValueError(f"repo_type must be one of {_REPO_TYPES}, got {repo_type!r}")


def make_api(endpoint: str | None):
    """An :class:`huggingface_hub.HfApi` for ``endpoint`` (``None``: the client's default).

    Args:
        endpoint: Base URL of the Hub, e.g. ``"http://127.0.0.1:8123"``. ``None``
            uses ``huggingface_hub.constants.ENDPOINT``, i.e. ``HF_ENDPOINT`` as
            read when huggingface_hub was first imported.

    Returns:
        The client object.
    """
    from huggingface_hub import HfApi

    from pyg_atompack import __version__

    return HfApi(
        endpoint=endpoint.rstrip("/") if endpoint else None,
        library_name="pyg_atompack",
        library_version=__version__,
    )


@contextmanager
def translate_errors(repo_id: str, revision: str | None, path: str | None) -> Iterator[None]:
    """Turn huggingface_hub / HTTP exceptions into :class:`HubError` subclasses.

    Args:
        repo_id: Repository named in messages.
        revision: Revision named in messages.
        path: Path inside the repository named in messages.
    """
    from huggingface_hub import errors as hf_errors

    where = describe_remote(repo_id, revision, path)
    try:
        yield
    except HubError:
        raise
    except hf_errors.RepositoryNotFoundError as exc:
        raise HubRepositoryNotFoundError(
            f"{where}: repository not found (or not accessible with this token)"
        ) from exc
    except hf_errors.RevisionNotFoundError as exc:
        raise HubRevisionNotFoundError(f"{where}: revision not found") from exc
    except hf_errors.EntryNotFoundError as exc:
        raise HubPathNotFoundError(f"{where}: path not found in the repository") from exc
    except hf_errors.HfHubHTTPError as exc:
        raise HubTransferError(f"{where}: Hub request failed: {exc}") from exc
    except OSError as exc:  # connection refused, timeouts, DNS, ...
        raise HubTransferError(f"{where}: cannot reach the Hub: {exc}") from exc
    except Exception as exc:  # httpx errors do not all derive from OSError
        if type(exc).__module__.split(".")[0].startswith("httpx"):
            raise HubTransferError(f"{where}: HTTP error: {exc}") from exc
        raise


def resolve_revision(
    repo_id: str,
    revision: str | None = "main",
    *,
    repo_type: str = "dataset",
    token: str | bool | None = None,
    endpoint: str | None = None,
) -> str:
    """Resolve a branch, tag or commit to the 40-hex commit sha it points at now.

    Pin this sha for everything that follows (listing, ranges, downloads), so that
    a push to the branch during training cannot mix two versions of a dataset.

    Args:
        repo_id: ``owner/name`` of the repository.
        revision: Branch, tag or commit (default: ``"main"``; ``None`` means the
            default branch).
        repo_type: ``"dataset"`` (default), ``"model"`` or ``"space"``.
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.
        endpoint: Hub base URL; ``None`` uses huggingface_hub's configured endpoint.

    Returns:
        The commit sha.

    Raises:
        HubRepositoryNotFoundError: Unknown or inaccessible repository.
        HubRevisionNotFoundError: Unknown revision.
        HubTransferError: Network or server failure.
    """
    _check_repo_type(repo_type)
    with translate_errors(repo_id, revision, None):
        info = make_api(endpoint).repo_info(
            repo_id, revision=revision, repo_type=repo_type, token=token, expand=["sha"]
        )
    sha = getattr(info, "sha", None)
    if not is_commit_sha(sha):
        raise HubTransferError(
            f"{describe_remote(repo_id, revision, None)}: the Hub answered without a commit "
            f"sha (got {sha!r})"
        )
    return sha


def _remote_file(entry, *, repo_id, revision, repo_type, endpoint) -> RemoteFile:
    from huggingface_hub import hf_hub_url

    lfs = getattr(entry, "lfs", None)
    sha256 = None
    if lfs is not None:
        sha256 = lfs["sha256"] if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
    return RemoteFile(
        path=entry.path,
        size=int(entry.size),
        sha256=sha256,
        url=hf_hub_url(
            repo_id,
            entry.path,
            repo_type=repo_type,
            revision=revision,
            endpoint=endpoint.rstrip("/") if endpoint else None,
        ),
        revision=revision,
        repo_id=repo_id,
        repo_type=repo_type,
        blob_id=getattr(entry, "blob_id", None),
    )


def _relative(path: str, root: str) -> str:
    return path[len(root) + 1 :] if root else path


def list_remote_files(
    repo_id: str,
    path_in_repo: str = "",
    *,
    revision: str,
    pattern: str = "*",
    repo_type: str = "dataset",
    token: str | bool | None = None,
    endpoint: str | None = None,
    allow_empty: bool = False,
) -> list[RemoteFile]:
    """List the files under ``path_in_repo`` with sizes and checksums, in one listing call.

    Args:
        repo_id: ``owner/name`` of the repository.
        path_in_repo: A directory (listed recursively) or a single file;
            ``""`` is the repository root. Leading/trailing ``/`` are ignored,
            ``..`` is refused.
        revision: The revision to list. Pass a commit sha from
            :func:`resolve_revision`; the returned files carry it in their URLs.
        pattern: ``fnmatch`` pattern matched against each file's path relative
            to ``path_in_repo`` (``*`` also crosses ``/``, so ``"*.atp"`` finds
            nested shards). (default: ``"*"``)
        repo_type: ``"dataset"`` (default), ``"model"`` or ``"space"``.
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.
        endpoint: Hub base URL; ``None`` uses huggingface_hub's configured endpoint.
        allow_empty: Return ``[]`` instead of raising when nothing matches.

    Returns:
        The matching files sorted by POSIX path string (the shard order of
        the ``.atp`` spec, §11).

    Raises:
        HubPathNotFoundError: ``path_in_repo`` does not exist at that revision.
        HubNoShardsError: Nothing matches ``pattern`` (unless ``allow_empty``).
        HubRepositoryNotFoundError, HubRevisionNotFoundError, HubTransferError:
            As for :func:`resolve_revision`.
    """
    from huggingface_hub import errors as hf_errors

    _check_repo_type(repo_type)
    root = normalize_path_in_repo(path_in_repo)
    api = make_api(endpoint)
    common = {"repo_id": repo_id, "revision": revision, "repo_type": repo_type}
    with translate_errors(repo_id, revision, root):
        try:
            entries = list(
                api.list_repo_tree(
                    repo_id, root or None, recursive=True, revision=revision,
                    repo_type=repo_type, token=token,
                )
            )
            files = [e for e in entries if hasattr(e, "size")]
        except (hf_errors.EntryNotFoundError, hf_errors.BadRequestError):
            # The tree route only lists directories: the path may name one file.
            if not root:
                raise
            infos = api.get_paths_info(
                repo_id, [root], revision=revision, repo_type=repo_type, token=token
            )
            files = [e for e in infos if hasattr(e, "size") and e.path == root]
            if not files:
                raise HubPathNotFoundError(
                    f"{describe_remote(repo_id, revision, root)}: path not found in the repository"
                ) from None
            root = root.rpartition("/")[0]  # match the pattern against the file name
    result = [
        _remote_file(e, endpoint=endpoint, **common)
        for e in files
        if fnmatch.fnmatchcase(_relative(e.path, root), pattern)
    ]
    result.sort(key=lambda f: f.path)
    if not result and not allow_empty:
        raise HubNoShardsError(
            f"{describe_remote(repo_id, revision, path_in_repo.strip('/') or '/')}: "
            f"no file matches {pattern!r}"
        )
    return result
