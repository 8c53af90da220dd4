"""A reader over the listed ``.atp`` shards of a Hub directory (or of a URL listing).

:func:`open_hub_atp` does, in order:

1. resolve the revision to a commit sha (skipped when given a sha) — one API call;
2. list every ``*.atp`` below the path, recursively, with sizes and sha256 —
   one API call; shard order is the POSIX path sort of the format spec (§11);
3. read the first 8192 bytes (the two header slots) of each shard with one range
   request, in parallel, to learn its molecule count — no shard is downloaded.

Headers, then lazily atom counts and fields, come from the one remote-``.atp`` reader,
:mod:`pyg_atompack.remote.atp_meta`, over each shard's range reader (its backend's).

Steps 2-3 are stored in ``{cache_dir}/.../listings/{sha}/`` (a commit is
immutable, so this never goes stale) and reused by the next open of the same
commit. The reader returned is a :class:`~pyg_atompack.atp.ShardedReader` (one
global index and one batching for local, Hub, HTTP and bucket shards) whose shard
openers fetch on demand: a shard is downloaded (verified against its sha256) the
first time a record inside it is read, or, after :meth:`HubAtpReader.by_record`,
only the records read are fetched through the bounded page cache. Pickling keeps
the listing and the counts, never the open files, so DataLoader workers neither
re-list nor re-download what the cache already holds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack.atp.base import RecordReader
from pyg_atompack.atp.header import Header
from pyg_atompack.atp.images import FileMeta
from pyg_atompack.atp.reader import Reader
from pyg_atompack.atp.sharded import ShardedReader
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
    describe_file,
    is_commit_sha,
    list_remote_files,
    repo_of,
    resolve_revision,
)
from pyg_atompack.hub.uri import hf_uri, normalize_path_in_repo
from pyg_atompack.remote.atp_meta import load_meta, read_fields, read_header
from pyg_atompack.remote.cache import cache_root
from pyg_atompack.remote.files import RemoteFile
from pyg_atompack.remote.ranges import RangeReader

# the header facts a listing keeps (plain ints: JSON-friendly, picklable)
_FACTS = ("num_molecules", "index_offset", "index_len", "schema_offset", "schema_len",
          "record_format", "codec")


class HubAtpReader(ShardedReader):
    """Read-only view over listed remote ``.atp`` shards: a :class:`ShardedReader` whose
    shard openers fetch on demand.

    Use :func:`open_hub_atp` (or :func:`~pyg_atompack.hub.open_remote_atp`) to create one.
    The global index, ``f[i]``, ``locate``, iteration and ``read_batch`` are
    :class:`~pyg_atompack.atp.ShardedReader`'s, the same code as for local shards; this
    class adds only how a listed shard is opened and the listing's surface
    (:attr:`repo_id`, :attr:`revision`, :attr:`shards`, :meth:`downloaded_shards`,
    :meth:`download_all`). Two openers:

    * by default a shard is downloaded, verified against its listed sha256, into the
      cache the first time a record inside it is read, then opened with the format
      layer (messages name the remote file, never the cache path);
    * :meth:`by_record` reads only the records asked for, through the bounded page
      cache (:class:`~pyg_atompack.remote.record_reader.RemoteAtpReader`).

    Either way a shard's length comes from its header, so opening downloads nothing.
    Pickling keeps the listing, the counts, the range readers and the settings, never
    open files, so DataLoader workers neither re-list nor re-download what the cache
    already holds.

    Args:
        shards (list[RemoteFile]): The shard files, in global order.
        headers (list[dict[str, int]], optional): Per shard, the header facts
            (``num_molecules``, ``index_offset``, ``index_len``, ``schema_offset``,
            ``schema_len``, ``record_format``, ``codec``), e.g. from a cached listing;
            :obj:`None` reads each shard's header slots now, one range request per shard
            (:func:`~pyg_atompack.remote.atp_meta.read_header`). (default: :obj:`None`)
        path_in_repo (str, optional): The listed directory or file, for ``repr`` and messages.
            (default: :obj:`""`)
        backend (Any): The :mod:`~pyg_atompack.remote.backends` backend that listed the
            shards (picklable): their range reads and downloads go through it.
        cache_dir (str | os.PathLike, optional): Download cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        verify (bool, optional): Verify each downloaded shard's sha256. (default: :obj:`True`)
        access (str, optional): Passed to ``atp.open`` for downloaded shards.
            (default: :obj:`"mmap"`)
        name (str, optional): How messages and ``repr`` name the source
            (default: its ``hf://`` URI).
        max_workers (int, optional): Header range reads in flight when ``headers`` is
            :obj:`None`. (default: :obj:`8`)
    """

    def __init__(
        self,
        shards: list[RemoteFile],
        headers: list[dict[str, int]] | None = None,
        *,
        backend: Any,
        path_in_repo: str = "",
        cache_dir: str | os.PathLike | None = None,
        verify: bool = True,
        access: str = "mmap",
        name: str | None = None,
        max_workers: int = 8,
    ) -> None:
        if headers is not None and len(shards) != len(headers):
            raise ValueError("one header per shard is required")
        if not shards:
            raise HubNoShardsError(f"{name or path_in_repo or 'listing'}: no .atp shard")
        self._remote = list(shards)
        self.path_in_repo = path_in_repo
        self.cache_dir = cache_root(cache_dir)
        self.backend = backend
        self.verify = verify
        first = self._remote[0]
        repo_id, repo_type = repo_of(first)
        self.name = name or hf_uri(repo_id, path_in_repo, revision=first.version or "",
                                   repo_type=repo_type)
        self._ranges = [backend.range_reader(shard) for shard in self._remote]
        self._heads: dict[int, bytes] = {}  # header slots read by this process
        self.headers = ([dict(h) for h in headers] if headers is not None
                        else self._read_headers(max_workers))
        self._pages: dict[str, Any] | None = None  # set by by_record()
        self._init_runtime(access)

    def _read_headers(self, max_workers: int) -> list[dict[str, int]]:
        """Each shard's header facts from one range read of its header slots, in parallel."""
        def read(shard: int) -> dict[str, int]:
            head, header = read_header(self._ranges[shard])
            self._heads[shard] = head  # the shard's metadata fetch then skips them
            return {name: int(getattr(header, name)) for name in _FACTS}

        with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(self._ranges)))) as pool:
            return list(pool.map(read, range(len(self._ranges))))

    def _init_runtime(self, access: str) -> None:
        self._readers: dict[int, Any] = {}  # downloaded shards opened so far
        self._lock = threading.Lock()  # guards the two dicts
        self._shard_locks: dict[int, threading.Lock] = {}
        if self._pages is None:
            openers: list[Any] = [_DownloadedShard(self, i) for i in range(len(self._remote))]
        else:
            openers = [_PagedShard(self, i) for i in range(len(self._remote))]
        self._open_shards(self.name, openers, access, opened=True)

    def by_record(self, *, cache_dir: str | os.PathLike | None = None,
                  cache_bytes: int | None = None) -> HubAtpReader:
        """The same listing, read record by record instead of in whole shards.

        ``f[i]`` and ``read_batch`` then fetch only the records they need (adjacent
        pages in one range request, several requests at once) through the disk page
        cache shared by the processes of a machine; nothing is downloaded whole and
        :meth:`downloaded_shards` stays empty. A shard's sha256 cannot be checked
        without reading all of it: pages carry their own checksum, the metadata is
        checked against the header and every record is checked by decoding it.

        Args:
            cache_dir (str | os.PathLike, optional): Root of the metadata and page cache.
                (default: ``$PYG_ATOMPACK_CACHE`` or ``~/.cache/pyg_atompack``)
            cache_bytes (int, optional): Bound on the page cache (LRU eviction). (default: 8 GiB)

        Returns:
            A new :class:`HubAtpReader` over the same shards.
        """
        from pyg_atompack.remote.block_cache import DEFAULT_CACHE_BYTES

        state = self.__getstate__()
        state["_pages"] = {"cache_dir": cache_dir,
                           "cache_bytes": DEFAULT_CACHE_BYTES if cache_bytes is None
                           else int(cache_bytes)}
        reader = type(self).__new__(type(self))
        reader.__setstate__(state)
        reader._heads = self._heads  # the same files: their header slots are known
        return reader

    # ------------------------------------------------------------------ identity
    @property
    def shards(self) -> list[RemoteFile]:
        """The listed remote files in global order (:meth:`shard_reader` opens one)."""
        return list(self._remote)

    @property
    def repo_id(self) -> str:
        """The repository the shards belong to."""
        return repo_of(self._remote[0])[0]

    @property
    def revision(self) -> str:
        """The pinned commit sha."""
        return self._remote[0].version or ""

    @property
    def reads_by_record(self) -> bool:
        """Whether records are read through the page cache (see :meth:`by_record`)."""
        return self._pages is not None

    @property
    def shard_lengths(self) -> np.ndarray:
        """Molecules per shard (from the headers), int64 ``(num_shards,)``."""
        return np.diff(self._starts).astype(np.int64)

    def __repr__(self) -> str:
        mode = ("by record" if self.reads_by_record
                else f"downloaded={len(self.downloaded_shards())}")
        return (
            f"{type(self).__name__}(repo={self.repo_id!r}, revision={self.revision[:12]!r}, "
            f"path={self.path_in_repo!r}, shards={len(self._remote)}, molecules={len(self)}, "
            f"{mode})"
        )

    # ------------------------------------------------------------------ shards
    def downloaded_shards(self) -> list[int]:
        """Indices of the shards downloaded and opened by this reader so far."""
        return sorted(self._readers)

    def shard_reader(self, shard: int) -> Any:
        """The reader of one shard: downloaded (verified) and opened if needed, or, after
        :meth:`by_record`, its :class:`~pyg_atompack.remote.record_reader.RemoteAtpReader`.

        Args:
            shard (int): Shard number in global order.

        Returns:
            The opened reader.
        """
        if self._pages is not None:
            return self._shards[shard].reader()
        reader = self._readers.get(shard)
        if reader is not None:
            return reader
        with self._lock:
            shard_lock = self._shard_locks.setdefault(shard, threading.Lock())
        # one lock per shard: threads wanting different shards download in parallel,
        # threads wanting the same shard wait for one download
        with shard_lock:
            reader = self._readers.get(shard)
            if reader is not None:
                return reader
            remote = self._remote[shard]
            path = self.backend.download(remote, self.cache_dir, verify=self.verify)
            reader = Reader(path, access=self.access, name=self._ranges[shard].name)
            expected = self.headers[shard]["num_molecules"]
            if len(reader) != expected:
                reader.close()
                raise HubIntegrityError(
                    f"{describe_file(remote)}: downloaded shard holds {len(reader)} molecules, "
                    f"its remote header said {expected}"
                )
            with self._lock:
                self._readers[shard] = reader
        return reader

    def _groups_of(self, shard: int) -> Any:
        # the shard's groups frames: through its page cache after by_record(), else
        # from the downloaded (verified) shard
        return self.shard_reader(shard)

    def download_all(self, max_workers: int = 4) -> list[Path]:
        """Download (and verify) every shard now instead of on first read.

        Args:
            max_workers (int, optional): Shards downloaded in parallel. (default: :obj:`4`)

        Returns:
            The local path of each shard, in shard order.
        """
        def fetch(shard: RemoteFile) -> Path:
            return self.backend.download(shard, self.cache_dir, verify=self.verify)

        with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
            return list(pool.map(fetch, self._remote))

    # ------------------------------------------------------------------ metadata
    @property
    def n_atoms(self) -> np.ndarray:
        """Atoms per molecule, int64 ``(len(self),)``.

        Opened shards answer from their index; the others from their metadata
        (:func:`~pyg_atompack.remote.atp_meta.load_meta`: the schema and index blocks,
        ``20`` bytes per molecule, in one range read after the header read when opening,
        cached on disk once per machine), not the records.
        """
        return super().n_atoms

    @property
    def fields(self) -> dict:
        """Field name -> ``atp.FieldInfo``: the union of every shard's schema.

        Each shard's schema block is fetched with one range read (a few hundred
        bytes; nothing when its metadata is loaded already), for all shards at once;
        only shards without a schema block (files written by atompack 0.2.x) are
        downloaded and opened to learn their fields.
        """
        if self._fields is None and len(self._shards) > 1:
            # the union is ShardedReader's; fetching every shard's schema in parallel
            # (each opener keeps its own) is what a remote listing adds
            with ThreadPoolExecutor(max_workers=min(8, len(self._shards))) as pool:
                list(pool.map(lambda shard: shard.fields, self._shards))
        return super().fields

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every opened shard (the reader can still be used: shards reopen)."""
        with self._lock:
            readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k in _PICKLED}
        state["access"] = self._access
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        access = state.pop("access")
        self.__dict__.update(state)
        self._heads = {}
        self._init_runtime(access)


# what a pickled HubAtpReader carries: the listing, the range readers (a URL's keeps the
# version its first read was pinned to) and the settings, no open file
_PICKLED = ("_remote", "_ranges", "headers", "path_in_repo", "cache_dir", "backend", "verify",
            "name", "_pages")


class _DownloadedShard(RecordReader):
    """Shard opener of :class:`HubAtpReader`: a listed shard downloaded (verified) on its
    first read. Its length comes from its header; while it is not downloaded, its atom
    counts from its metadata (:func:`~pyg_atompack.remote.atp_meta.load_meta`) and its
    fields from its schema block (:func:`~pyg_atompack.remote.atp_meta.read_fields`)."""

    def __init__(self, owner: HubAtpReader, shard: int) -> None:
        self.owner = owner
        self.shard = shard
        self.range_reader: RangeReader = owner._ranges[shard]
        self.name = self.range_reader.name
        self._fields: dict | None = None
        self._n_atoms: np.ndarray | None = None
        self._meta: FileMeta | None = None

    def meta(self) -> FileMeta:
        """The shard's header, schema and index (from the disk cache, fetched once)."""
        if self._meta is None:
            self._meta = load_meta(self.range_reader, self.owner.cache_dir,
                                   head=self.owner._heads.get(self.shard))
        return self._meta

    def reader(self) -> Any:
        """The downloaded shard's format-layer reader."""
        return self.owner.shard_reader(self.shard)

    def __len__(self) -> int:
        return int(self.owner.headers[self.shard]["num_molecules"])

    def __getitem__(self, index: int) -> Any:
        return self.reader()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.reader())

    @property
    def fields(self) -> dict:
        if self._fields is None:
            meta, parsed = self._meta, None
            if self.shard not in self.owner._readers:  # metadata loaded: no read at all
                header = meta.header if meta else Header(**self.owner.headers[self.shard])
                parsed = read_fields(self.range_reader, header, meta and meta.schema)
            self._fields = parsed if parsed is not None else dict(self.reader().fields)
        return self._fields

    @property
    def n_atoms(self) -> np.ndarray:
        if self._n_atoms is None:
            opened = self.owner._readers.get(self.shard)
            self._n_atoms = (np.asarray(opened.n_atoms, dtype=np.int64) if opened is not None
                             else self.meta().n_atoms)
        return self._n_atoms

    def read_resolved(self, indices: np.ndarray, infos: dict) -> dict:
        return self.reader().read_resolved(indices, infos)


class _PagedShard(_DownloadedShard):
    """Shard opener of :meth:`HubAtpReader.by_record`: only the records read are fetched,
    through the page cache; nothing is downloaded whole."""

    def __init__(self, owner: HubAtpReader, shard: int) -> None:
        super().__init__(owner, shard)
        self._remote_reader: Any = None

    def reader(self) -> Any:
        """The shard's :class:`~pyg_atompack.remote.record_reader.RemoteAtpReader`."""
        if self._remote_reader is None:
            from pyg_atompack.remote.record_reader import RemoteAtpReader

            self._remote_reader = RemoteAtpReader(
                self.range_reader, head=self.owner._heads.get(self.shard),
                **{k: v for k, v in self.owner._pages.items() if v is not None})
        return self._remote_reader

    @property
    def fields(self) -> dict:
        return self.reader().fields

    @property
    def n_atoms(self) -> np.ndarray:
        return self.reader().n_atoms


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
        repo_id (str): ``owner/name`` of the repository.
        path_in_repo (str, optional): A ``.atp`` file or a directory searched recursively for
            ``*.atp``; ``None``/``""`` is the repository root. (default: :obj:`None`)
        revision (str, optional): Branch, tag or commit sha (default: the default branch). A
            branch is resolved once and the reader is pinned to that commit.
        cache_dir (str | os.PathLike, optional): Download cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        token (str | bool, optional): Hub token; ``None`` uses the locally saved token, ``False``
            none. (default: :obj:`None`)
        endpoint (str, optional): Hub base URL; ``None`` uses huggingface_hub's configured endpoint.
            (default: :obj:`None`)
        repo_type (str, optional): ``"dataset"``, ``"model"`` or ``"space"``.
            (default: :obj:`"dataset"`)
        verify (bool, optional): Verify each shard's sha256 when it is downloaded.
            (default: :obj:`True`)
        access (str, optional): ``atp.open`` access mode for downloaded shards.
            (default: :obj:`"mmap"`)
        max_workers (int, optional): Parallel header range reads when opening. (default: :obj:`8`)
        policy (Any, optional): Retries and timeouts of every request (a ``RetryPolicy``).
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
    from pyg_atompack.transport.http import offline as offline_mode

    path = normalize_path_in_repo(path_in_repo)
    cache_root_dir = cache_root(cache_dir)
    offline = offline_mode()  # huggingface_hub 0.x has no is_offline_mode()
    if is_commit_sha(revision):
        sha = revision
    elif offline:
        sha = load_ref(cache_root_dir, repo_id, repo_type, revision, endpoint)
        if sha is None:
            raise HubOfflineError(
                f"{describe_remote(repo_id, revision or 'the default branch', path or '/')}: "
                f"HF_HUB_OFFLINE=1 is set and this revision was never resolved with the cache "
                f"{cache_root_dir}; pass a commit sha, or open it once online"
            )
    else:
        sha = resolve_revision(repo_id, revision, repo_type=repo_type, token=token,
                               endpoint=endpoint, policy=policy)
        store_ref(cache_root_dir, repo_id, repo_type, revision, endpoint, sha)
    cache_file = listing_file(cache_root_dir, repo_id, repo_type, sha, path)
    cached = load_listing(cache_file, endpoint)
    if cached is not None:
        shards, headers = cached
    elif offline:
        raise HubOfflineError(
            f"{describe_remote(repo_id, sha, path or '/')}: HF_HUB_OFFLINE=1 is set and the "
            f"listing of this commit is not in the cache {cache_root_dir}"
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
        headers = None  # read now, one range request per shard
    from pyg_atompack.hub.backend import HubBackend

    backend = HubBackend(hf_uri(repo_id, path, revision=sha, repo_type=repo_type), token=token,
                         endpoint=endpoint, retry=policy)
    reader = HubAtpReader(shards, headers, backend=backend, path_in_repo=path,
                          cache_dir=cache_root_dir, verify=verify, access=access,
                          max_workers=max_workers)
    if cached is None:
        store_listing(cache_file, shards, reader.headers, cache_root_dir)
    return reader


def open_remote_atp(url: str, *, cache_dir: str | os.PathLike | None = None,
                    verify: bool = True, access: str = "mmap", policy: Any = None,
                    max_workers: int = 8, **options: Any) -> HubAtpReader:
    """Open the remote ``.atp`` data any supported URL names, lazily (the one URL rule).

    ``hf://`` goes to :func:`open_hub_atp` (revision pinning, the listing cache, offline
    use); every other scheme to its backend (:func:`~pyg_atompack.remote.backends.open_backend`:
    ``http(s)://`` files, manifests and directories, object-store prefixes, schemes other
    packages add), which lists the ``.atp`` files once (one manifest read, or one size
    probe of a single file, or one bucket listing); then one 8192-byte header range read
    per shard. Shards are downloaded, verified, into the cache on first use.

    Args:
        url (str): The URL.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        verify (bool, optional): Verify each download against the listed sha256.
            (default: :obj:`True`)
        access (str, optional): ``atp.open`` access mode of downloaded shards.
            (default: :obj:`"mmap"`)
        policy (Any, optional): Retries and timeouts (a ``RetryPolicy``).
            (default: :class:`~pyg_atompack.transport.RetryPolicy` ``()``)
        max_workers (int, optional): Parallel header reads. (default: :obj:`8`)
        **options (optional): The backend's options (``token`` / ``endpoint`` for ``hf://``,
            ``headers`` for http(s), the store's options).

    Returns:
        A :class:`HubAtpReader` named by the (redacted) URL.

    Raises:
        UnsupportedURLError: No backend serves the scheme, or it is not installed.
        HubNoShardsError: The URL names no ``.atp`` file.
    """
    from pyg_atompack.remote.backends import open_backend, url_scheme
    from pyg_atompack.transport.errors import TransportError
    from pyg_atompack.transport.redact import redact_url

    if url_scheme(url) == "hf":
        from pyg_atompack.hub.uri import parse_hf_uri

        location = parse_hf_uri(url)
        return open_hub_atp(location.repo_id, location.path_in_repo,
                            revision=location.revision, repo_type=location.repo_type,
                            cache_dir=cache_dir, verify=verify, access=access, policy=policy,
                            max_workers=max_workers, **options)
    where = redact_url(url)
    backend = open_backend(url, retry=policy, **options)
    try:
        shards = backend.list((".atp",))
    except FileNotFoundError as error:
        raise HubNoShardsError(f"{where}: no .atp file: {error}") from error
    unsized = [shard.describe() for shard in shards if shard.size is None]
    if unsized:
        raise TransportError(f"{unsized[0]}: the server does not tell the file's size",
                             url=unsized[0])
    return HubAtpReader(shards, backend=backend, cache_dir=cache_dir, verify=verify,
                        access=access, name=where, max_workers=max_workers)
