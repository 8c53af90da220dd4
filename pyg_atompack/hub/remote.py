"""Revision resolution and file listing: the Hub API, called through the one transport.

Requests made here (all through :mod:`pyg_atompack.transport.transfers`, so timeouts, retries
with backoff on 429 / 5xx / connection errors, proxies, the trust store, offline mode and
the token headers of huggingface_hub's ``build_hf_headers`` apply):

* :func:`resolve_revision`: one ``GET /api/{type}s/{repo}/revision/{rev}``.
* :func:`list_remote_files`: one ``GET /api/{type}s/{repo}/tree/{sha}/{path}?recursive=true``
  (followed through ``Link: rel="next"`` pages for trees of more than a
  thousand entries). Only when the path is a file, not a directory, a second
  call ``POST /api/{type}s/{repo}/paths-info/{sha}`` describes that file.

The answers are read the way huggingface_hub reads them (``X-Error-Code`` tells a gated
repository, a missing repository, revision or file apart), but the requests are made
here so that every remote read of the project shares one retry policy and one error
family.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote, urljoin

from pyg_atompack.hub.errors import (
    HubAuthError,
    HubError,
    HubGatedRepoError,
    HubNoShardsError,
    HubOfflineError,
    HubPathNotFoundError,
    HubRepositoryNotFoundError,
    HubRevisionNotFoundError,
    HubTransferError,
    describe_remote,
)
from pyg_atompack.hub.uri import normalize_path_in_repo
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.files import RemoteFile
from pyg_atompack.transport import transfers
from pyg_atompack.transport.credentials import RequestHeaders, bind_headers, origin
from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteNotFoundError,
    RemoteOfflineError,
    TransportError,
)
from pyg_atompack.transport.http import permanent_error
from pyg_atompack.transport.redact import redact_url
from pyg_atompack.transport.retry import RetryPolicy

_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
_REPO_TYPES = ("dataset", "model", "space")


def repo_of(remote_file: RemoteFile) -> tuple[str, str]:
    """``(repo_id, repo_type)`` of a Hub file (``RemoteFile.repo``).

    Args:
        remote_file (RemoteFile): A file of a Hub listing.

    Returns:
        ``("owner/name", "dataset")`` and the like; ``("", "")`` for other backends' files.
    """
    kind, _, repo_id = remote_file.repo.partition("s/")
    return repo_id, kind


def describe_file(remote_file: RemoteFile) -> str:
    """``repo 'owner/name' @ 'sha', path 'p'`` for a Hub file, else its redacted URL."""
    if not remote_file.repo:
        return remote_file.describe()
    return describe_remote(repo_of(remote_file)[0], remote_file.version, remote_file.name)


def is_commit_sha(revision: str | None) -> bool:
    """Whether ``revision`` is a full 40-hex git commit id (already pinned).

    Args:
        revision (str | None): A branch, tag or commit id, or :obj:`None` for the default branch.

    Returns:
        :obj:`True` only for a 40-character lowercase hexadecimal string; branch names,
        tags, short ids and :obj:`None` give :obj:`False`.
    """
    return bool(revision) and _COMMIT_SHA.match(revision) is not None


def _check_repo_type(repo_type: str) -> None:
    if repo_type not in _REPO_TYPES:
        raise ValueError(f"repo_type must be one of {_REPO_TYPES}, got {repo_type!r}")


#: Retry and timeout policy of Hub requests when none is given.
HUB_POLICY = RetryPolicy()


def endpoint_url(endpoint: str | None) -> str:
    """The Hub base URL: ``endpoint``, else huggingface_hub's ``HF_ENDPOINT`` setting.

    Args:
        endpoint (str | None): Base URL, e.g. ``"http://127.0.0.1:8123"``, or ``None``.

    Returns:
        The base URL without a trailing ``/``.
    """
    from huggingface_hub import constants

    return (endpoint or constants.ENDPOINT).rstrip("/")


def hub_headers(token: str | bool | None, endpoint: str | None = None) -> RequestHeaders:
    """Request headers for the Hub: user agent and, unless ``token=False``, the token.

    Args:
        token (str | bool | None): ``None``: the saved login / ``HF_TOKEN``; ``False``: none; a
            string: itself.
        endpoint (str, optional): The Hub (or the URL of a file on it) the token is for.
            (default: :func:`endpoint_url` ``(None)``)

    Returns:
        The headers, the token bound to the Hub's origin: no redirect, CDN or pagination
        link elsewhere receives it.
    """
    from huggingface_hub.utils import build_hf_headers

    from pyg_atompack import __version__

    headers = build_hf_headers(token=token, library_name="pyg_atompack",
                               library_version=__version__)
    return bind_headers(dict(headers), endpoint or endpoint_url(None))


def repo_page(repo_id: str, repo_type: str, endpoint: str | None = None) -> str:
    """The web page of a repository (where a gated repository's terms are accepted)."""
    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo_type, "")
    return f"{endpoint_url(endpoint)}/{prefix}{repo_id}"


def hub_error(error: TransportError, where: str, *, page: str | None = None) -> HubError:
    """The Hub-layer error for a failed transport request about ``where``.

    Args:
        error (TransportError): What the transport raised (``error_code`` is the Hub's
            ``X-Error-Code``).
        where (str): ``repo @ revision, path`` for the message.
        page (str, optional): The repository's web page, named in the message of a gated repository.
            (default: :obj:`None`)

    Returns:
        A :class:`HubError` subclass, also a transport error of the matching kind.
    """
    code = getattr(error, "error_code", None)
    status = error.status
    if isinstance(error, HubError):
        return error
    if isinstance(error, RemoteOfflineError):
        kind, text = HubOfflineError, f"{where}: {error}"
    elif code == "GatedRepo":
        login = ("the request carried no token" if status == 401
                 else "the token's user has not been granted access")
        kind, text = HubGatedRepoError, (
            f"{where}: the repository is gated (HTTP {status}: {login}). Accept its terms or "
            f"request access at {page or 'its page on the Hub'}, then log in with "
            f"`hf auth login` or set HF_TOKEN to a token of that account")
    elif code == "RevisionNotFound":
        kind, text = HubRevisionNotFoundError, f"{where}: revision not found"
    elif code == "EntryNotFound":
        kind, text = HubPathNotFoundError, f"{where}: path not found in the repository"
    elif code == "RepoNotFound" or status == 401:
        why = ("HTTP 401: it may be private, and the request carried no valid token"
               if status == 401 else f"HTTP {status}, or not visible with this token")
        kind, text = HubRepositoryNotFoundError, f"{where}: repository not found ({why})"
    elif isinstance(error, RemoteAuthError):
        kind, text = HubAuthError, (f"{where}: access refused (HTTP {status}); the token "
                                    f"lacks the permission to read this repository")
    elif isinstance(error, RemoteNotFoundError):
        kind, text = HubPathNotFoundError, f"{where}: not found (HTTP {status})"
    else:
        kind, text = HubTransferError, f"{where}: Hub request failed: {error}"
    result = kind(text, url=error.url, status=status)
    result.error_code = code
    return result


def make_api(endpoint: str | None):
    """An :class:`huggingface_hub.HfApi` for ``endpoint`` (``None``: the client's default).

    Used for what the transport does not do itself: uploads (``hub.push``) and whoami.

    Args:
        endpoint (str | None): Base URL of the Hub, e.g. ``"http://127.0.0.1:8123"``.

    Returns:
        The client object.
    """
    from huggingface_hub import HfApi

    from pyg_atompack import __version__

    return HfApi(endpoint=endpoint.rstrip("/") if endpoint else None,
                 library_name="pyg_atompack", library_version=__version__)


def _from_huggingface_hub(exc: BaseException, where: str, page: str | None) -> HubError | None:
    """The Hub-layer error for an exception of huggingface_hub's client (``HfApi`` calls)."""
    from huggingface_hub import errors as hf_errors

    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    url = str(getattr(getattr(response, "request", None), "url", "")) or None
    if isinstance(exc, hf_errors.HfHubHTTPError) and response is not None:
        error = permanent_error(status, response.headers, redact_url(url or ""))
        return hub_error(error, where, page=page)
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return HubOfflineError(f"{where}: {exc}")
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0].startswith("httpx"):
        return HubTransferError(f"{where}: cannot reach the Hub: {exc}")
    return None


@contextmanager
def translate_errors(repo_id: str, revision: str | None, path: str | None, *,
                     repo_type: str = "dataset",
                     endpoint: str | None = None) -> Iterator[None]:
    """Turn transport errors into :class:`HubError` subclasses naming the remote object.

    Args:
        repo_id (str): Repository named in messages.
        revision (str | None): Revision named in messages.
        path (str | None): Path inside the repository named in messages.
        repo_type (str, optional): For the repository page named when it is gated.
            (default: :obj:`"dataset"`)
        endpoint (str, optional): For the repository page named when it is gated.
            (default: :obj:`None`)
    """
    where = describe_remote(repo_id, revision, path)
    page = repo_page(repo_id, repo_type, endpoint) if repo_id else None
    try:
        yield
    except HubError:
        raise
    except TransportError as exc:
        raise hub_error(exc, where, page=page) from exc
    except Exception as exc:  # HfApi calls (uploads) raise huggingface_hub's errors
        translated = _from_huggingface_hub(exc, where, page)
        if translated is None:
            raise
        raise translated from exc


def _api_url(endpoint: str | None, repo_type: str, repo_id: str, *tail: str) -> str:
    return "/".join((endpoint_url(endpoint), "api", f"{repo_type}s", repo_id, *tail))


def resolve_revision(
    repo_id: str,
    revision: str | None = "main",
    *,
    repo_type: str = "dataset",
    token: str | bool | None = None,
    endpoint: str | None = None,
    policy: RetryPolicy | None = None,
) -> str:
    """Resolve a branch, tag or commit to the 40-hex commit sha it points at now.

    Pin this sha for everything that follows (listing, ranges, downloads), so that
    a push to the branch during training cannot mix two versions of a dataset.

    Args:
        repo_id (str): ``owner/name`` of the repository.
        revision (str | None, optional): Branch, tag or commit (default: ``"main"``; ``None`` means
            the default branch).
        repo_type (str, optional): ``"dataset"``, ``"model"`` or ``"space"``.
            (default: :obj:`"dataset"`)
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        endpoint (str, optional): Hub base URL; ``None`` uses huggingface_hub's configured endpoint.
            (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts. (default: :data:`HUB_POLICY`)

    Returns:
        The commit sha.

    Raises:
        HubRepositoryNotFoundError: Unknown or inaccessible repository.
        HubRevisionNotFoundError: Unknown revision.
        HubTransferError: Network or server failure.
    """
    _check_repo_type(repo_type)
    tail = ("revision", quote(revision, safe="")) if revision else ()
    with translate_errors(repo_id, revision, None, repo_type=repo_type, endpoint=endpoint):
        info, _ = transfers.request_json(
            _api_url(endpoint, repo_type, repo_id, *tail) + "?expand=sha",
            headers=hub_headers(token, endpoint_url(endpoint)), policy=policy or HUB_POLICY)
    sha = info.get("sha") if isinstance(info, dict) else None
    if not is_commit_sha(sha):
        raise HubTransferError(
            f"{describe_remote(repo_id, revision, None)}: the Hub answered without a commit "
            f"sha (got {sha!r})"
        )
    return sha


def file_url(repo_id: str, path: str, *, revision: str, repo_type: str,
             endpoint: str | None) -> str:
    """The ``resolve`` URL of a file at a revision (what ``hf_hub_url`` builds).

    Args:
        repo_id (str): ``owner/name``.
        path (str): Path in the repository.
        revision (str): Branch, tag or commit.
        repo_type (str): ``"dataset"``, ``"model"`` or ``"space"``.
        endpoint (str | None): Hub base URL, or ``None``.

    Returns:
        ``{endpoint}/[datasets/|spaces/]{repo}/resolve/{revision}/{path}``.
    """
    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(repo_type, "")
    return (f"{endpoint_url(endpoint)}/{prefix}{repo_id}/resolve/{quote(revision, safe='')}/"
            f"{quote(path)}")


def _remote_file(entry: dict, *, repo_id, revision, repo_type, endpoint) -> RemoteFile:
    lfs = entry.get("lfs") or None
    sha256 = lfs.get("oid") or lfs.get("sha256") if isinstance(lfs, dict) else None
    url = file_url(repo_id, entry["path"], revision=revision, repo_type=repo_type,
                   endpoint=endpoint)
    # the listing is untrusted: names and digests become cache paths (remote/cache.py)
    return RemoteFile(
        name=remote_cache.local_name(entry["path"], url=url),
        size=int(entry["size"]),
        sha256=remote_cache.check_sha256(sha256, url=url, field="lfs sha256"),
        version=revision,
        url=url,
        blob_id=remote_cache.check_digest(entry.get("oid"), url=url, field="oid",
                                          lengths=(40, 64)),
        repo=f"{repo_type}s/{repo_id}",
    )


def _next_link(headers, page_url: str) -> str | None:
    """The next page of a listing, from ``Link: <...>; rel="next"``.

    The Hub paginates on its own origin; a link to any other is refused rather than
    followed (the token would not go there, but neither should the listing).
    """
    for part in (headers.get("Link") or "").split(","):
        target, _, params = part.partition(";")
        if 'rel="next"' in params.replace(" ", ""):
            link = urljoin(page_url, target.strip().strip("<>"))
            if origin(link) != origin(page_url):
                raise HubTransferError(
                    f"{redact_url(page_url)}: the listing's next page is on another origin "
                    f"({redact_url(link)}); refused", url=redact_url(page_url))
            return link
    return None


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
    policy: RetryPolicy | None = None,
) -> list[RemoteFile]:
    """List the files under ``path_in_repo`` with sizes and checksums, in one listing call.

    Args:
        repo_id (str): ``owner/name`` of the repository.
        path_in_repo (str, optional): A directory (listed recursively) or a single file;
            ``""`` is the repository root. Leading/trailing ``/`` are ignored,
            ``..`` is refused. (default: :obj:`""`)
        revision (str): The revision to list. Pass a commit sha from
            :func:`resolve_revision`; the returned files carry it in their URLs.
        pattern (str, optional): ``fnmatch`` pattern matched against each file's path relative
            to ``path_in_repo`` (``*`` also crosses ``/``, so ``"*.atp"`` finds
            nested shards). (default: :obj:`"*"`)
        repo_type (str, optional): ``"dataset"``, ``"model"`` or ``"space"``.
            (default: :obj:`"dataset"`)
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        endpoint (str, optional): Hub base URL; ``None`` uses huggingface_hub's configured endpoint.
            (default: :obj:`None`)
        allow_empty (bool, optional): Return ``[]`` instead of raising when nothing matches.
            (default: :obj:`False`)
        policy (RetryPolicy, optional): Retries and timeouts. (default: :data:`HUB_POLICY`)

    Returns:
        The matching files sorted by POSIX path string (the shard order of
        the ``.atp`` spec, §11).

    Raises:
        HubPathNotFoundError: ``path_in_repo`` does not exist at that revision.
        HubNoShardsError: Nothing matches ``pattern`` (unless ``allow_empty``).
        HubRepositoryNotFoundError, HubRevisionNotFoundError, HubTransferError:
            As for :func:`resolve_revision`.
    """
    _check_repo_type(repo_type)
    root = normalize_path_in_repo(path_in_repo)
    common = {"repo_id": repo_id, "revision": revision, "repo_type": repo_type}
    headers = hub_headers(token, endpoint_url(endpoint))
    policy = policy or HUB_POLICY
    rev = quote(revision, safe="")
    with translate_errors(repo_id, revision, root, repo_type=repo_type, endpoint=endpoint):
        url = _api_url(endpoint, repo_type, repo_id, "tree", rev, *([quote(root)] if root else []))
        url += "?recursive=true&expand=false"
        try:
            files = []
            while url:
                page, page_headers = transfers.request_json(url, headers=headers, policy=policy)
                files += [e for e in page if isinstance(e, dict) and e.get("type") == "file"]
                url = _next_link(page_headers, url)
        except TransportError as error:
            # The tree route only lists directories: the path may name one file.
            if not root or getattr(error, "error_code", None) != "EntryNotFound" and \
                    error.status != 400:
                raise
            infos, _ = transfers.request_json(
                _api_url(endpoint, repo_type, repo_id, "paths-info", rev), method="POST",
                form={"paths": [root], "expand": "false"}, headers=headers, policy=policy)
            files = [e for e in infos if isinstance(e, dict) and e.get("type") == "file"
                     and e.get("path") == root]
            if not files:
                raise HubPathNotFoundError(
                    f"{describe_remote(repo_id, revision, root)}: path not found in the repository"
                ) from None
            root = root.rpartition("/")[0]  # match the pattern against the file name
    result = [
        _remote_file(e, endpoint=endpoint, **common)
        for e in files
        if fnmatch.fnmatchcase(_relative(e["path"], root), pattern)
    ]
    result.sort(key=lambda f: f.name)
    if not result and not allow_empty:
        raise HubNoShardsError(
            f"{describe_remote(repo_id, revision, path_in_repo.strip('/') or '/')}: "
            f"no file matches {pattern!r}"
        )
    return result
