"""Shards in a Hugging Face Hub repository, listed once at a pinned commit."""

from __future__ import annotations

import fnmatch
import json

from pyg_atompack.stream.errors import ShardFetchError
from pyg_atompack.stream.http import URLShardSource, fetch_url
from pyg_atompack.stream.sources import (
    MANIFEST_NAME,
    CancelToken,
    ShardInfo,
    read_manifest_records,
)
from pyg_atompack.transport.credentials import RequestHeaders
from pyg_atompack.transport.retry import RetryPolicy


class HubSource(URLShardSource):
    """Shards stored in a Hub repository (dataset, model or space).

    At construction the revision is resolved to a commit sha (:attr:`revision`) and the
    repository is listed once, at that commit, with :mod:`pyg_atompack.hub`; sizes and
    sha256 checksums come from that single listing, and so do record counts when a
    ``manifest.json`` is stored next to the shards. The listing is pickled into
    DataLoader workers and DDP ranks built from the same object, so the Hub API is not
    asked again per worker. Shard bytes are streamed into memory from the pinned
    ``resolve`` URLs (no disk cache), with the same retry, resume and cancellation
    behaviour as :class:`~pyg_atompack.stream.HTTPSource`.

    Args:
        repo_id (str): ``owner/name``.
        path_in_repo (str, optional): Directory of the shards (``""``: repository root).
            (default: :obj:`""`)
        revision (str, optional): Branch, tag or commit sha. (default: :obj:`"main"`)
        pattern (str, optional): ``fnmatch`` pattern for shard paths relative to ``path_in_repo``.
            (default: :obj:`"*.pt"`)
        repo_type (str, optional): ``"dataset"``, ``"model"`` or ``"space"``.
            (default: :obj:`"dataset"`)
        token (str | bool, optional): Hub token (``None``: the saved token, ``False``: none).
            (default: :obj:`None`)
        endpoint (str, optional): Hub base URL (``None``: huggingface_hub's configured endpoint,
            i.e. ``HF_ENDPOINT``). (default: :obj:`None`)
        retry (RetryPolicy, optional): Retry and timeout policy for downloads, and for the listing
            and the revision lookup. (default: :class:`RetryPolicy()`)
        suffixes (tuple[str, ...], optional): Keep only shard paths ending in one of these
            (``None``: every match of ``pattern``). (default: :obj:`None`)
    """

    def __init__(self, repo_id: str, path_in_repo: str = "", *, revision: str = "main",
                 pattern: str = "*.pt", repo_type: str = "dataset",
                 token: str | bool | None = None, endpoint: str | None = None,
                 retry: RetryPolicy | None = None, suffixes: tuple[str, ...] | None = None):
        from pyg_atompack import hub
        from pyg_atompack.hub.remote import endpoint_url

        self.repo_id = repo_id
        self.path_in_repo = path_in_repo.strip("/")
        self.requested_revision = revision
        self.pattern = pattern
        self.retry = retry or RetryPolicy()
        self.token = token
        # the token's origin, fixed now: the shard URLs below are built from it
        self.endpoint = endpoint_url(endpoint)
        common = {"repo_type": repo_type, "token": token, "endpoint": endpoint}
        self.revision = hub.resolve_revision(repo_id, revision, policy=self.retry, **common)
        files = hub.list_remote_files(repo_id, self.path_in_repo, revision=self.revision,
                                      pattern="*", policy=self.retry, **common)
        root = self.path_in_repo

        def relative(path: str) -> str:
            return path[len(root) + 1:] if root else path

        manifest_file = next((f for f in files if relative(f.path) == MANIFEST_NAME), None)
        manifest = self._read_manifest(manifest_file) if manifest_file is not None else {}
        shards = []
        for remote in files:
            name = relative(remote.path)
            if name == MANIFEST_NAME or not fnmatch.fnmatchcase(name, pattern):
                continue
            if suffixes is not None and not name.endswith(tuple(suffixes)):
                continue
            entry = manifest.get(name, {})
            shards.append(ShardInfo(name=name, size=remote.size,
                                    sha256=remote.sha256 or entry.get("sha256"),
                                    records=entry.get("records"), location=remote.url,
                                    extra={"path_in_repo": remote.path}))
        if not shards:
            raise ShardFetchError(
                f"{repo_id}@{self.revision} ({self.path_in_repo or '/'}): no file matches "
                f"{pattern!r}"
            )
        self._shards = tuple(shards)

    @property
    def headers(self) -> RequestHeaders:
        """Request headers, built when needed: a token found in ``HF_TOKEN`` or the saved
        login is never stored in the source, so it is not in a pickled copy either (an
        explicit ``token=`` is, so that DataLoader workers can download). The token is bound
        to the Hub's origin."""
        from pyg_atompack.hub.remote import hub_headers

        return hub_headers(self.token, self.endpoint)

    def _read_manifest(self, remote) -> dict[str, dict]:
        body = fetch_url(remote.url, name=remote.path, policy=self.retry, cancel=CancelToken(),
                         headers=self.headers)
        try:
            document = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}  # some other tool's manifest.json: the listing alone is enough
        return read_manifest_records(document, remote.describe())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.repo_id!r}, {self.path_in_repo!r}, "
                f"revision={self.revision[:12]}, shards={len(self._shards)})")
