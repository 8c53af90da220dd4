"""The exception family of the Hub layer.

Every error raised by :mod:`pyg_atompack.hub` for a remote problem derives from
:class:`HubError`. Messages name the repository, the revision and the path in
the repository so that a failing training job says *which* remote object was
wrong, not only that something was.
"""

from __future__ import annotations

from pyg_atompack.transport.errors import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteOfflineError,
    TransportError,
)


class HubError(Exception):
    """Base class of every error raised by :mod:`pyg_atompack.hub`.

    Errors about remote objects are also :class:`~pyg_atompack.transport.TransportError`
    subclasses (not-found, auth, integrity, unavailable), the project's one error family
    for remote reads.
    """


class HubRepositoryNotFoundError(HubError, RemoteNotFoundError):
    """The repository does not exist, or is private and the token does not grant access."""


class HubGatedRepoError(HubError, RemoteAuthError):
    """The repository is gated: its terms must be accepted on the Hub by the token's user."""


class HubAuthError(HubError, RemoteAuthError):
    """The Hub refused the credentials (HTTP 401 / 403) for another reason than a gate."""


class HubOfflineError(HubError, RemoteOfflineError):
    """``HF_HUB_OFFLINE=1`` is set and the cache cannot answer without the Hub."""


class HubRevisionNotFoundError(HubError, RemoteNotFoundError):
    """The repository exists but the branch, tag or commit does not."""


class HubPathNotFoundError(HubError, RemoteNotFoundError):
    """The revision exists but the path inside the repository does not."""


class HubNoShardsError(HubError, FileNotFoundError):
    """The path exists but holds no file matching the requested pattern (e.g. no ``.atp``)."""


class HubIntegrityError(HubError, RemoteIntegrityError):
    """Downloaded bytes do not match the size or checksum announced by the listing."""


class HubTransferError(HubError, TransportError):
    """An HTTP transfer failed or the server answered in a way the client cannot use."""


class HubURIError(HubError, ValueError):
    """An ``hf://`` URI is malformed or refers outside its repository."""


def describe_remote(repo_id: str | None, revision: str | None, path: str | None) -> str:
    """One-line description of a remote object for error messages.

    Args:
        repo_id (str | None): The repository id (``owner/name``), if known.
        revision (str | None): The revision (branch, tag or commit sha), if known.
        path (str | None): The path inside the repository, if any.

    Returns:
        A string such as ``"repo 'org/data' @ 'main', path 'train/part_0.atp'"``.
    """
    text = f"repo {repo_id!r}" if repo_id else "remote file"
    if revision:
        text += f" @ {revision!r}"
    if path:
        text += f", path {path!r}"
    return text
