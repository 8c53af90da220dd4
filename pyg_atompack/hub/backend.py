"""The ``hf://`` backend (:mod:`pyg_atompack.remote.backends`): a repository directory or
file, listed once at a pinned commit.

Registered when :mod:`pyg_atompack.hub` is imported. Listing resolves the revision to a
commit sha (:attr:`HubBackend.revision`) and lists the repository once, at that commit
(sizes, sha256 of LFS files, git blob ids of the others; record counts from a
``manifest.json`` next to the files). Bytes are read from the pinned ``resolve`` URLs
through the one transport, the token bound to the Hub's origin (never sent to the CDN a
large file is redirected to); failures are :class:`~pyg_atompack.hub.HubError` subclasses
naming repository, revision and path.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pyg_atompack.hub.errors import HubIntegrityError, HubNoShardsError
from pyg_atompack.hub.remote import (
    describe_file,
    endpoint_url,
    hub_headers,
    is_commit_sha,
    list_remote_files,
    repo_of,
    resolve_revision,
    translate_errors,
)
from pyg_atompack.hub.uri import hf_uri, parse_hf_uri
from pyg_atompack.remote.files import SHARD_SUFFIXES, Backend, RemoteFile
from pyg_atompack.remote.http_backend import HTTPBackend
from pyg_atompack.remote.manifest import MANIFEST_NAME, read_manifest_records
from pyg_atompack.transport.errors import RemoteIntegrityError

__all__ = ["HubBackend"]


class HubBackend(HTTPBackend):
    """Files of a Hub repository.

    Args:
        url (str): ``hf://{datasets|models|spaces}/{owner}/{name}[@{revision}]/{path}``: a
            directory (listed recursively) or one file.
        token (str | bool, optional): Hub token (``None``: the saved login / ``HF_TOKEN``,
            never stored, so never pickled; ``False``: none; a string: itself, pickled so
            that DataLoader workers can read). (default: :obj:`None`)
        endpoint (str, optional): Hub base URL (``None``: huggingface_hub's ``HF_ENDPOINT``).
            (default: :obj:`None`)
        retry (RetryPolicy, optional): Retries and timeouts of every request.
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
        pattern (str, optional): ``fnmatch`` pattern for paths relative to the listed
            directory (``*`` crosses ``/``). (default: every file; for a file URL, its name)
    """

    def __init__(self, url: str, *, token: str | bool | None = None,
                 endpoint: str | None = None, retry: Any = None,
                 pattern: str | None = None) -> None:
        Backend.__init__(self, url, retry=retry)
        self.urls = None
        location = parse_hf_uri(url)
        self.repo_id, self.repo_type = location.repo_id, location.repo_type
        self.requested_revision = location.revision or "main"
        self.revision: str | None = (location.revision if is_commit_sha(location.revision)
                                     else None)
        path = location.path_in_repo.strip("/")
        if path.endswith(SHARD_SUFFIXES):  # one file: list its directory, match its name
            path, _, name = path.rpartition("/")
            pattern = pattern or name
        self.path_in_repo, self.pattern = path, pattern or "*"
        self.token = token
        # the token's origin, fixed now: the files' URLs are built from it
        self.endpoint = endpoint_url(endpoint)

    @property
    def headers(self) -> Any:
        """Request headers with the token bound to the Hub's origin, built when needed: a
        token found in ``HF_TOKEN`` or the saved login is never stored in the backend, so
        it is not in a pickled copy either."""
        return hub_headers(self.token, self.endpoint)

    def _common(self) -> dict:
        return {"repo_type": self.repo_type, "token": self.token, "endpoint": self.endpoint,
                "policy": self.retry}

    def relative(self, file: RemoteFile) -> str:
        """The path of a listed file relative to the listed directory.

        Args:
            file (RemoteFile): A file of :meth:`list` (its name is its path in the repository).

        Returns:
            The path below :attr:`path_in_repo`, as streams name the shard.
        """
        root = self.path_in_repo
        return file.name[len(root) + 1:] if root else file.name

    def list(self, suffixes: Sequence[str] | None = SHARD_SUFFIXES) -> list[RemoteFile]:
        """The files below the directory matching the pattern and suffixes, at a commit.

        Raises:
            HubNoShardsError: Nothing matches.
            HubError: Any other remote problem.
        """
        if self.revision is None:
            self.revision = resolve_revision(self.repo_id, self.requested_revision,
                                             **self._common())
        files = list_remote_files(self.repo_id, self.path_in_repo, revision=self.revision,
                                  pattern="*", **self._common())
        manifest = next((f for f in files if self.relative(f) == MANIFEST_NAME), None)
        self.manifest = self._read_manifest(manifest) if manifest is not None else {}
        kept = [f for f in files if self.relative(f) != MANIFEST_NAME
                and fnmatch.fnmatchcase(self.relative(f), self.pattern)
                and (suffixes is None or f.name.endswith(tuple(suffixes)))]
        if not kept:
            raise HubNoShardsError(
                f"{self.repo_id}@{self.revision} ({self.path_in_repo or '/'}): no "
                f"{' or '.join(suffixes or ('',))} file matches {self.pattern!r}")
        return kept

    def _read_manifest(self, file: RemoteFile) -> dict[str, dict]:
        body = bytearray(file.size or 0)
        self.read_into(file, memoryview(body), 0)
        try:
            document = json.loads(bytes(body).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return {}  # some other tool's manifest.json: the listing alone is enough
        return read_manifest_records(document, file.describe())

    def headers_for(self, file: RemoteFile) -> Any:
        """The Hub token for a repository file (bound to its origin), none for another."""
        return hub_headers(self.token if file.repo else False, file.url)

    def _pinned(self, file: RemoteFile) -> str | None:
        # a Hub file's version is its commit, which its URL pins already; the server's
        # ETag is taken from the first answer
        return None if file.repo else file.version

    @contextmanager
    def errors(self, file: RemoteFile) -> Iterator[None]:
        """Hub errors naming the repository file; bytes that do not fit the listing are a
        :class:`~pyg_atompack.hub.HubIntegrityError`."""
        repo_id, repo_type = repo_of(file)
        with translate_errors(repo_id or None, file.version, file.name,
                              repo_type=repo_type or "dataset"):
            try:
                yield
            except RemoteIntegrityError as error:
                if isinstance(error, HubIntegrityError):
                    raise
                raise HubIntegrityError(f"{describe_file(file)}: {error}", url=error.url,
                                        status=error.status) from error

    def range_reader(self, file: RemoteFile) -> Any:
        """A :class:`~pyg_atompack.remote.ranges.BackendRangeReader`: its identity is the
        listed LFS sha256 / git blob id of a commit, whose files never change."""
        return Backend.range_reader(self, file)

    def integrity_error(self, file: RemoteFile, problem: str) -> Exception:
        """A :class:`~pyg_atompack.hub.HubIntegrityError` naming the repository file."""
        from pyg_atompack.transport.redact import redact_url

        return HubIntegrityError(f"{describe_file(file)}: downloaded {problem}",
                                 url=redact_url(file.url))

    def __repr__(self) -> str:
        where = hf_uri(self.repo_id, self.path_in_repo, repo_type=self.repo_type,
                       revision=self.revision or self.requested_revision)
        return f"{type(self).__name__}({where!r})"
