"""A lazily-downloading reader over the ``.atp`` shards of a Hub directory.

:func:`open_hub_atp` does, in order:

1. resolve the revision to a commit sha (skipped when given a sha) — one API call;
2. list every ``*.atp`` below the path, recursively, with sizes and sha256 —
   one API call; shard order is the POSIX path sort of the format spec (§11);
3. read the first 8192 bytes (the two header slots) of each shard with an HTTP
   range request, in parallel, to learn its molecule count — no shard is
   downloaded.

Steps 2-3 are stored in ``{cache_dir}/.../listings/{sha}/`` (a commit is
immutable, so this never goes stale) and reused by the next open of the same
commit. The reader returned has the interface of ``atp.open`` readers; a shard
is downloaded (verified against its sha256) the first time a record inside it
is read, then opened with the format layer. Pickling keeps the listing and the
counts, never the open files, so DataLoader workers neither re-list nor
re-download what the cache already holds.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack.hub.errors import (
    HubIntegrityError,
    HubNoShardsError,
    HubOfflineError,
    describe_remote,
)
from pyg_atompack.hub.listing_cache import (
    listing_file,
    load_listing,
    load_ref,
    store_listing,
    store_ref,
)
from pyg_atompack.hub.remote import (
    RemoteFile,
    is_commit_sha,
    list_remote_files,
    resolve_revision,
)
from pyg_atompack.hub.remote_atp import read_shard_header, remote_fields, remote_n_atoms
from pyg_atompack.hub.transfer import default_cache_dir, download
from pyg_atompack.hub.uri import normalize_path_in_repo


class HubAtpReader:
    """Read-only view over remote ``.atp`` shards, downloading each on first use.

    Use :func:`open_hub_atp` to create one. The interface mirrors ``atp.open``
    readers: ``len``, ``f[i]`` (negative ``i`` allowed), ``read_batch``,
    ``n_atoms``, ``fields``, ``close`` and the context manager protocol.

    Args:
        shards: The shard files, in global order.
        headers: Per shard, the header facts (``num_molecules``, ``index_offset``,
            ``index_len``, ``schema_offset``, ``schema_len``).
        path_in_repo: The listed directory or file, for ``repr`` and messages.
        cache_dir: Download cache root (default: :func:`default_cache_dir`).
        token: Hub token used for downloads.
        verify: Verify each downloaded shard's sha256. (default: ``True``)
        access: Passed to ``atp.open`` for downloaded shards. (default: ``"mmap"``)
        policy: Retries and timeouts of range reads and downloads (a ``RetryPolicy``).
            (default: the Hub default)
        name: How messages and ``repr`` name the source (default: its ``hf://`` URI).
        store: The object-store handle that listed the shards (object-store URLs only;
            picklable, without secrets).
    """

    def __init__(
        self,
        shards: list[RemoteFile],
        headers: list[dict[str, int]],
        *,
        path_in_repo: str = "",
        cache_dir: str | os.PathLike | None = None,
        token: str | bool | None = None,
        verify: bool = True,
        access: str = "mmap",
        policy: Any = None,
        name: str | None = None,
        store: Any = None,
    ) -> None:
        if len(shards) != len(headers):
            raise ValueError("one header per shard is required")
        self.shards = list(shards)
        self.headers = [dict(h) for h in headers]
        self.path_in_repo = path_in_repo
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.token = token
        self.verify = verify
        self.access = access
        self.policy = policy
        self.name = name
        self.store = store
        counts = np.array([h["num_molecules"] for h in self.headers], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._readers: dict[int, Any] = {}
        self._lock = threading.Lock()  # guards the two dicts
        self._shard_locks: dict[int, threading.Lock] = {}
        self._n_atoms: np.ndarray | None = None
        self._fields: dict | None = None
        self._core: Any = None

    # ------------------------------------------------------------------ identity
    @property
    def repo_id(self) -> str:
        """The repository the shards belong to."""
        return self.shards[0].repo_id

    @property
    def revision(self) -> str:
        """The pinned commit sha."""
        return self.shards[0].revision

    @property
    def shard_lengths(self) -> np.ndarray:
        """Molecules per shard (from the headers), int64 ``(num_shards,)``."""
        return np.diff(self._offsets)

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(repo={self.repo_id!r}, revision={self.revision[:12]!r}, "
            f"path={self.path_in_repo!r}, shards={len(self.shards)}, molecules={len(self)}, "
            f"downloaded={len(self.downloaded_shards())})"
        )

    # ------------------------------------------------------------------ shards
    def downloaded_shards(self) -> list[int]:
        """Indices of the shards opened by this reader so far."""
        return sorted(self._readers)

    def shard_reader(self, shard: int) -> Any:
        """The ``atp`` reader of one shard, downloading and opening it if needed.

        Args:
            shard: Shard number in global order.

        Returns:
            The opened ``atp`` reader.
        """
        reader = self._readers.get(shard)
        if reader is not None:
            return reader
        from pyg_atompack import atp

        with self._lock:
            shard_lock = self._shard_locks.setdefault(shard, threading.Lock())
        # one lock per shard: threads wanting different shards download in parallel,
        # threads wanting the same shard wait for one download
        with shard_lock:
            reader = self._readers.get(shard)
            if reader is not None:
                return reader
            remote = self.shards[shard]
            path = download(remote, self.cache_dir, token=self.token, verify=self.verify,
                            policy=self.policy, store=self.store)
            reader = atp.open(path, access=self.access)
            expected = self.headers[shard]["num_molecules"]
            if len(reader) != expected:
                reader.close()
                raise HubIntegrityError(
                    f"{remote.describe()}: downloaded shard holds {len(reader)} molecules, "
                    f"its remote header said {expected}"
                )
            with self._lock:
                self._readers[shard] = reader
        return reader

    def download_all(self, max_workers: int = 4) -> list[Path]:
        """Download (and verify) every shard now instead of on first read.

        Args:
            max_workers: Shards downloaded in parallel. (default: ``4``)

        Returns:
            The local path of each shard, in shard order.
        """
        def fetch(shard: RemoteFile) -> Path:
            return download(shard, self.cache_dir, token=self.token, verify=self.verify,
                            policy=self.policy, store=self.store)

        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            return list(pool.map(fetch, self.shards))

    def locate(self, index: int) -> tuple[int, int]:
        """Map a global molecule index to the shard holding it, without downloading.

        Args:
            index: Index over all shards in listing order; negative values count from
                the end.

        Returns:
            ``(shard, local)``: the shard's position in :attr:`shards` and the
            molecule's index inside that shard.

        Raises:
            AtpIndexError: ``index`` is out of range (the message names the repository).
        """
        from pyg_atompack import atp

        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise atp.AtpIndexError(
                f"index {index} out of range for {n} molecules in "
                f"{describe_remote(self.repo_id, self.revision, self.path_in_repo)}"
            )
        shard = int(np.searchsorted(self._offsets, i, side="right")) - 1
        return shard, i - int(self._offsets[shard])

    def __getitem__(self, index: int) -> Any:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"molecule index must be an integer, got {type(index).__name__}")
        shard, local = self.locate(index)
        return self.shard_reader(shard)[local]

    def _global_indices(self, indices: Any) -> np.ndarray:
        from pyg_atompack import atp

        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        idx = np.where(idx < 0, idx + n, idx)
        bad = (idx < 0) | (idx >= n)
        if bad.any():
            raise atp.AtpIndexError(
                f"index {np.asarray(indices).reshape(-1)[bad][0]} out of range for {n} molecules "
                f"in {describe_remote(self.repo_id, self.revision, self.path_in_repo)}"
            )
        return idx

    def read_batch(self, indices: Any, fields: Any = None) -> dict:
        """Decode several molecules into flat arrays, as ``atp`` readers do.

        The global index and the batching are :class:`pyg_atompack.atp.ShardedReader`'s
        (one multi-shard core for local, Hub and HTTP data): molecules of one shard are
        decoded by one call into that shard whatever the order of ``indices`` (the
        shard is downloaded first if needed), fields are resolved against the union of
        all shards' schemas (a field missing from a shard is zero-filled and masked),
        and the result is put back in the requested order. It equals ``atp.open`` on a
        local copy of the same shards.

        Args:
            indices: Global molecule indices (negative allowed, repeats allowed).
            fields: Field selection, as for ``atp`` readers. (default: all)

        Returns:
            The flat dict described in ``docs/architecture.md``.
        """
        idx = self._global_indices(indices)
        return self._sharded().read_batch(idx, fields)

    def _sharded(self) -> Any:
        """The :class:`~pyg_atompack.atp.ShardedReader` over this reader's lazy shards."""
        if self._core is None:
            from pyg_atompack.atp import ShardedReader

            core = ShardedReader.from_readers(
                [_LazyShard(self, shard) for shard in range(len(self.shards))], name=self._name)
            core._fields = self.fields  # fetched in parallel, by this reader
            self._core = core
        return self._core

    @property
    def _name(self) -> str:
        if self.name:
            return self.name
        return f"hf://{self.shards[0].repo_type}s/{self.repo_id}@{self.revision}/{self.path_in_repo}"

    # ------------------------------------------------------------------ metadata
    @property
    def n_atoms(self) -> np.ndarray:
        """Atoms per molecule, int64 ``(len(self),)``.

        Opened shards answer from their index; for the others only the index
        block is fetched with an HTTP range read (``20`` bytes per molecule),
        not the records.
        """
        if self._n_atoms is None:
            pieces = []
            for shard, remote in enumerate(self.shards):
                reader = self._readers.get(shard)
                if reader is not None:
                    pieces.append(np.asarray(reader.n_atoms, dtype=np.int64))
                    continue
                pieces.append(remote_n_atoms(remote, self.headers[shard], token=self.token,
                                             policy=self.policy, store=self.store))
            self._n_atoms = (
                np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
            )
        return self._n_atoms

    @property
    def fields(self) -> dict:
        """Field name -> ``atp.FieldInfo``: the union of every shard's schema.

        Each shard's schema block is fetched with an HTTP range read (a few
        hundred bytes); only shards without a schema block (files written by
        atompack 0.2.x) are downloaded and opened to learn their fields.
        """
        if self._fields is None:
            workers = max(1, min(8, len(self.shards)))
            with ThreadPoolExecutor(max_workers=workers) as pool:
                per_shard = list(pool.map(self._shard_fields, range(len(self.shards))))
            merged: dict = {}
            for shard_fields in per_shard:  # first shard defining a name wins, as in atp
                for name, info in shard_fields.items():
                    merged.setdefault(name, info)
            self._fields = merged
        return self._fields

    def _shard_fields(self, shard: int) -> dict:
        reader = self._readers.get(shard)
        if reader is None:
            parsed = remote_fields(self.shards[shard], self.headers[shard], token=self.token,
                                   policy=self.policy, store=self.store)
            if parsed is not None:
                return parsed
            reader = self.shard_reader(shard)
        return dict(reader.fields)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every opened shard (the reader can still be used: shards reopen)."""
        with self._lock:
            readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()

    def __enter__(self) -> HubAtpReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in ("_readers", "_lock", "_shard_locks", "_n_atoms", "_fields", "_core"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()


class _LazyShard:
    """Shard opener for :class:`~pyg_atompack.atp.ShardedReader`: a Hub shard that is
    downloaded (verified) on its first read; its length comes from the remote header."""

    def __init__(self, owner: HubAtpReader, shard: int) -> None:
        self.owner = owner
        self.shard = shard
        self.name = owner.shards[shard].describe()

    def __len__(self) -> int:
        return int(self.owner.headers[self.shard]["num_molecules"])

    def __getitem__(self, index: int) -> Any:
        return self.owner.shard_reader(self.shard)[index]

    @property
    def fields(self) -> dict:
        return self.owner._shard_fields(self.shard)

    @property
    def n_atoms(self) -> np.ndarray:
        start, stop = self.owner._offsets[self.shard:self.shard + 2]
        return self.owner.n_atoms[start:stop]

    def read_resolved(self, indices: np.ndarray, infos: dict) -> dict:
        return self.owner.shard_reader(self.shard).read_resolved(indices, infos)


def open_hub_atp(
    repo_id: str,
    path_in_repo: str | None = None,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    repo_type: str = "dataset",
    verify: bool = True,
    access: str = "mmap",
    max_workers: int = 8,
    policy: Any = None,
) -> HubAtpReader:
    """Open a remote ``.atp`` file or directory of shards without downloading it.

    Args:
        repo_id: ``owner/name`` of the repository.
        path_in_repo: A ``.atp`` file or a directory searched recursively for
            ``*.atp``; ``None``/``""`` is the repository root.
        revision: Branch, tag or commit sha (default: the default branch). A
            branch is resolved once and the reader is pinned to that commit.
        cache_dir: Download cache root (default: :func:`default_cache_dir`).
        token: Hub token; ``None`` uses the locally saved token, ``False`` none.
        endpoint: Hub base URL; ``None`` uses huggingface_hub's configured endpoint.
        repo_type: ``"dataset"`` (default), ``"model"`` or ``"space"``.
        verify: Verify each shard's sha256 when it is downloaded. (default: ``True``)
        access: ``atp.open`` access mode for downloaded shards. (default: ``"mmap"``)
        max_workers: Parallel header range reads when opening. (default: ``8``)
        policy: Retries and timeouts of every request (a ``RetryPolicy``).
            (default: the Hub default)

    With ``HF_HUB_OFFLINE=1`` nothing is asked of the Hub: a commit sha, or a branch or
    tag resolved online before with this cache, is answered from the cache (listing,
    headers and the shards downloaded so far); anything else raises
    :class:`~pyg_atompack.hub.HubOfflineError`.

    Returns:
        A :class:`HubAtpReader`.

    Raises:
        HubNoShardsError: No ``.atp`` file under the path.
        HubError: Any other remote problem (see :mod:`pyg_atompack.hub`).
        pyg_atompack.atp.AtpError: A shard header is not a valid ``.atp`` header.
    """
    from huggingface_hub import constants

    path = normalize_path_in_repo(path_in_repo)
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    offline = constants.is_offline_mode()
    if is_commit_sha(revision):
        sha = revision
    elif offline:
        sha = load_ref(cache_root, repo_id, repo_type, revision, endpoint)
        if sha is None:
            raise HubOfflineError(
                f"{describe_remote(repo_id, revision or 'the default branch', path or '/')}: "
                f"HF_HUB_OFFLINE=1 is set and this revision was never resolved with the cache "
                f"{cache_root}; pass a commit sha, or open it once online"
            )
    else:
        sha = resolve_revision(repo_id, revision, repo_type=repo_type, token=token,
                               endpoint=endpoint, policy=policy)
        store_ref(cache_root, repo_id, repo_type, revision, endpoint, sha)
    cache_file = listing_file(cache_root, repo_id, repo_type, sha, path)
    cached = load_listing(cache_file, endpoint)
    if cached is not None:
        shards, headers = cached
    elif offline:
        raise HubOfflineError(
            f"{describe_remote(repo_id, sha, path or '/')}: HF_HUB_OFFLINE=1 is set and the "
            f"listing of this commit is not in the cache {cache_root}"
        )
    else:
        shards = list_remote_files(
            repo_id, path, revision=sha, pattern="*.atp", repo_type=repo_type,
            token=token, endpoint=endpoint, allow_empty=True, policy=policy,
        )
        if not shards:
            raise HubNoShardsError(
                f"{describe_remote(repo_id, sha, path or '/')}: no .atp file under this path"
            )
        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(shards)))) as pool:
            headers = list(pool.map(
                lambda s: read_shard_header(s, token=token, policy=policy), shards))
        store_listing(cache_file, shards, headers)
    return HubAtpReader(
        shards, headers, path_in_repo=path, cache_dir=cache_root, token=token,
        verify=verify, access=access, policy=policy,
    )
