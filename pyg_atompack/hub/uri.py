"""``hf://`` URIs: parsed into a :class:`HubLocation`, and written (how messages name Hub files)."""

from __future__ import annotations

from dataclasses import dataclass

from pyg_atompack.hub.errors import HubURIError

_SCHEME = "hf://"
# URI prefix -> repo_type, as in huggingface_hub's HfFileSystem paths
_TYPE_PREFIXES = {"datasets/": "dataset", "spaces/": "space", "models/": "model"}


@dataclass(frozen=True)
class HubLocation:
    """Where something lives on the Hub.

    Attributes:
        repo_id: ``owner/name`` of the repository.
        revision: Branch, tag or commit sha; ``None`` means the default branch.
        path_in_repo: POSIX path inside the repository, ``""`` for the root.
        repo_type: ``"dataset"``, ``"model"`` or ``"space"``.
    """

    repo_id: str
    revision: str | None
    path_in_repo: str
    repo_type: str = "dataset"


def normalize_path_in_repo(path: str | None, *, what: str = "path_in_repo") -> str:
    """Strip leading/trailing ``/`` and refuse ``..`` or empty inner components.

    Args:
        path (str | None): A POSIX path inside a repository, or ``None`` for the root.
        what (str, optional): How to call the value in error messages.
            (default: :obj:`"path_in_repo"`)

    Returns:
        The normalized path (``""`` for the repository root).
    """
    if path is None:
        return ""
    if not isinstance(path, str):
        raise HubURIError(f"{what} must be a string, got {type(path).__name__}")
    stripped = path.strip("/")
    if not stripped:
        return ""
    parts = stripped.split("/")
    for part in parts:
        if part == "..":
            raise HubURIError(f"{what} {path!r} contains a '..' component, which is refused")
        if part in ("", "."):
            raise HubURIError(f"{what} {path!r} contains an empty or '.' component")
    return stripped


def parse_hf_uri(uri: str) -> HubLocation:
    """Parse ``hf://[datasets/|models/|spaces/]{owner}/{repo}[@{revision}][/{path}]``.

    Without a type prefix the repository is a dataset (this project's default,
    unlike huggingface_hub where it is a model). The revision may contain ``/``
    only when written URL-encoded (``refs%2Fpr%2F1``), as in huggingface_hub.

    Args:
        uri (str): The URI, e.g. ``"hf://datasets/org/data@main/omat/train"``.

    Returns:
        The parsed :class:`HubLocation`.

    Raises:
        HubURIError: For a wrong scheme, a missing owner or name, an empty
            revision, or a path with ``..`` components.
    """
    from urllib.parse import unquote

    if not isinstance(uri, str) or not uri.startswith(_SCHEME):
        raise HubURIError(f"not an hf:// URI: {uri!r}")
    rest = uri[len(_SCHEME) :].strip("/")
    repo_type = "dataset"
    for prefix, kind in _TYPE_PREFIXES.items():
        if rest.startswith(prefix):
            repo_type, rest = kind, rest[len(prefix) :]
            break
    parts = rest.split("/", 2)
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise HubURIError(f"hf:// URI {uri!r} must name a repository as owner/name")
    owner, name_rev = parts[0], parts[1]
    path = parts[2] if len(parts) == 3 else ""
    revision: str | None = None
    if "@" in owner:
        raise HubURIError(f"hf:// URI {uri!r}: '@revision' must follow the repository name")
    if "@" in name_rev:
        name, revision = name_rev.split("@", 1)
        revision = unquote(revision)
        if not name or not revision:
            raise HubURIError(f"hf:// URI {uri!r} has an empty repository name or revision")
    else:
        name = name_rev
    return HubLocation(
        repo_id=f"{owner}/{name}",
        revision=revision,
        path_in_repo=normalize_path_in_repo(path, what=f"path of {uri!r}"),
        repo_type=repo_type,
    )


def hf_uri(repo_id: str, path_in_repo: str = "", *, revision: str,
           repo_type: str = "dataset") -> str:
    """``hf://{repo_type}s/{repo_id}@{revision}/{path}``: the URI :func:`parse_hf_uri` reads.

    How messages, readers and ``repr`` name a file or directory of a repository.

    Args:
        repo_id (str): ``owner/name`` of the repository.
        path_in_repo (str, optional): A path inside it (``""``: the repository root).
            (default: :obj:`""`)
        revision (str): The revision (a commit sha for a pinned listing; written
            URL-encoded, as :func:`parse_hf_uri` reads a ``/`` in it).
        repo_type (str, optional): ``"dataset"``, ``"model"`` or ``"space"``.
            (default: :obj:`"dataset"`)

    Returns:
        The URI, without a trailing ``/`` for the root.
    """
    from urllib.parse import quote

    path = f"/{path_in_repo}" if path_in_repo else ""
    return f"{_SCHEME}{repo_type}s/{repo_id}@{quote(revision, safe='')}{path}"
