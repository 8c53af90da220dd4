"""A PyG ``Dataset`` that serves graphs straight from memory-mapped `.atp` records."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data, Dataset

from pyg_atompack import atp
from pyg_atompack.pyg import flat_to_data_list, record_to_data, resolve_fields, resolve_names
from pyg_atompack.pyg.handoff import install_in_worker
from pyg_atompack.remote.backends import url_scheme

__all__ = ["AtompackDataset"]

# Records decoded per read_batch call while building the pre_filter index.
_FILTER_CHUNK = 1024
# Show a progress bar for the pre_filter scan from this many records on.
_FILTER_PROGRESS_FROM = 50_000

# Readers hold memory maps and file handles; a child created by fork must not
# use its parent's. Every dataset remembers the pid that opened its reader and
# compares it with this value, which an at-fork hook keeps current (cheaper
# than calling os.getpid() on every __getitem__).
_current_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _current_pid
    _current_pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _describe(source: Any) -> str:
    if isinstance(source, (list, tuple)):
        return f"[{len(source)} files]" if len(source) > 3 else repr([str(s) for s in source])
    if isinstance(source, (str, os.PathLike)):
        return repr(str(source))
    return type(source).__name__


def _is_url(source: Any) -> bool:
    return isinstance(source, str) and source.startswith(("http://", "https://"))


def _open_source(source: Any, access: str, remote: dict[str, Any] | None = None) -> Any:
    """Opens whatever ``source`` names as one reader with the `.atp` reader interface.

    ``remote`` holds ``cache_dir``, ``cache_bytes`` and ``prefetch_shards``.
    """
    remote = remote or {}
    cache = {k: remote[k] for k in ("cache_dir", "cache_bytes") if remote.get(k) is not None}
    if isinstance(source, atp.RecordReader):
        return source
    if isinstance(source, (list, tuple)) and source and all(_is_url(s) for s in source):
        from pyg_atompack.remote.record_reader import open_remote_atp, range_readers

        return open_remote_atp(range_readers(list(source)), name=str(source), **cache)
    scheme = url_scheme(source)
    if scheme is not None:  # never a local path: the one URL rule
        from pyg_atompack import hub

        # one rule for every scheme: records are read by range through the bounded page
        # cache unless prefetch_shards=True (hf:// keeps its pinned, cached listing)
        by_record = not remote.get("prefetch_shards")
        if by_record and scheme != "hf":
            from pyg_atompack.remote.record_reader import open_remote_atp, range_readers

            return open_remote_atp(range_readers(source), name=source, **cache)
        reader = hub.open_remote_atp(source, access=access)
        return reader.by_record(**cache) if by_record else reader
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("AtompackDataset needs at least one .atp file, got an empty list")
        return atp.ShardedReader.from_paths(source, access=access)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"AtompackDataset source {str(path)!r} does not exist")
        return atp.open(path, access=access)
    raise TypeError(
        "AtompackDataset source must be a .atp path, a directory of shards, a list of "
        "paths, a URL (hf://, http(s)://, an object store) or an open atp.RecordReader, got "
        f"{type(source).__name__}"
    )


class AtompackDataset(Dataset):
    r"""A :class:`~torch_geometric.data.Dataset` over Atompack (`.atp`) records.

    Each item is a :class:`~torch_geometric.data.Data` without edges built from
    one record, read on demand from a memory map: there is no processing step,
    nothing is written under a ``root`` directory, and opening a file of
    millions of structures costs only its index. Attribute names follow one
    table (see :mod:`pyg_atompack.pyg`): ``z`` (int64), ``pos``, ``natoms`` and,
    when stored, ``energy`` (``[1]``), ``forces``, ``charges``, ``velocities``,
    ``cell`` (``[1, 3, 3]``), ``stress`` (``[1, 3, 3]``), ``pbc`` (``[1, 3]``),
    ``name`` and custom properties (per-atom ones node-level, per-molecule ones
    graph-level with a leading dimension of 1). A record that lacks a field
    gives a ``Data`` without that attribute.

    The dataset works with everything PyG does to a dataset (slicing, index
    lists, :meth:`shuffle`, :meth:`index_select`, ``transform``) and with
    :class:`torch_geometric.loader.DataLoader` in any number of workers: the
    reader is reopened lazily in each worker process, so no file handle or
    memory map crosses a ``fork``. For batches, :class:`AtompackLoader` is
    several times faster because it never builds one ``Data`` per molecule.

    ``pre_filter`` has no processing step to run in, so it is applied once at
    construction: every record is decoded (in chunks, with a progress bar for
    large sources) and the indices of the kept records are stored; ``len()``
    and indexing then refer to the kept records only. The filter sees the same
    ``Data`` that :meth:`get` returns (selected ``fields``, cast ``dtype``,
    before ``transform``). The scan costs one pass over the data per
    construction; it is not cached on disk.

    Args:
        source (str or os.PathLike or list): A `.atp` file, a directory of `.atp`
            shards (ordered by POSIX path), a list of `.atp` files (in the given
            order), a URL: ``"hf://datasets/{repo_id}@{revision}/{path}"`` (see
            :meth:`from_hub`), ``"http(s)://.../manifest.json"`` (or a ``.atp`` file, or a
            directory URL ending in ``/``), an object-store URL (``"s3://..."``) where its
            backend is installed, or a list of ``http(s)`` `.atp` URLs. ``hf://``,
            ``http(s)`` and object-store sources are read record by record through a
            bounded disk page cache (``cache_dir``, ``cache_bytes``) unless
            ``prefetch_shards=True`` (shards downloaded lazily and verified into the
            cache, see :func:`pyg_atompack.hub.open_remote_atp`). Or an already open
            reader.
        fields (list[str], optional): The fields to materialise, e.g.
            ``["pos", "z", "energy", "forces"]``. Builtins may be named by field
            (``"positions"``) or attribute (``"pos"``); custom properties by key
            or as ``"properties/<key>"`` / ``"atom_properties/<key>"``. Positions,
            atomic numbers and ``natoms`` are always included. Other fields are
            never turned into tensors; :class:`AtompackLoader` does not even decode
            them (``dataset[i]`` decodes one whole record into zero-copy views, as a
            compressed record has to be inflated whole anyway). :obj:`None` reads
            every field. (default: :obj:`None`)
        transform (callable, optional): A function applied to each ``Data``
            on access. (default: :obj:`None`)
        pre_filter (callable, optional): ``Data -> bool``; records for which it
            returns :obj:`False` are left out (see above). (default: :obj:`None`)
        dtype (torch.dtype, optional): Cast floating-point fields to this dtype;
            :obj:`None` keeps the stored dtypes. (default: :obj:`None`)
        access (str, optional): How records are read, passed to
            :func:`pyg_atompack.atp.open`: ``"auto"`` (zero-copy views of a
            memory map advised for random access; batches not in the page cache
            are read with concurrent positional reads), ``"mmap"`` (plain memory
            map, kernel read-ahead) or ``"pread"`` (owned copies via positional
            reads). :class:`AtompackLoader` reads through the dataset's reader, so
            it uses the same mode. (default: :obj:`"auto"`)
        log (bool, optional): Show a progress bar while ``pre_filter`` scans a
            large source. (default: :obj:`True`)
        rename (Mapping[str, str], optional): Give attributes other names in every
            ``Data``, e.g. ``{"forces": "force"}``; ``fields=`` may use the new
            names. (default: :obj:`None`)
        names (str, optional): A naming preset: ``"pyg-md17"`` gives ``force``
            and a float32 ``energy``, as :class:`torch_geometric.datasets.MD17`
            does, so a script written for it runs unchanged. ``rename`` entries
            apply on top. (default: :obj:`None`)
        cache_dir (str, optional): For remote sources read by record (``hf://``,
            ``http(s)://`` and object-store URLs unless ``prefetch_shards=True``): where
            the metadata (header, schema, index) and the page cache live, shared by
            DataLoader workers, ranks and later runs of one machine. (default:
            ``$PYG_ATOMPACK_CACHE`` or ``~/.cache/pyg_atompack``)
        cache_bytes (int, optional): Bound on that page cache; least recently used
            pages are evicted. (default: 8 GiB)
        prefetch_shards (bool, optional): For remote sources: :obj:`True` downloads
            a whole shard (verified against its sha256) the first time a record in it
            is read, for users with the disk to spare; :obj:`False` fetches only the
            records read, through the page cache (see "Big remote datasets" in the
            training-at-scale guide). :obj:`None` is :obj:`False`: one rule for ``hf://``, ``http(s)://``
            and object stores. (default: :obj:`None`)

    Raises:
        pyg_atompack.pyg.FieldSelectionError: If a requested field exists in no
            record; the message lists the fields that do.
    """

    def __init__(
        self,
        source: Any,
        *,
        fields: Sequence[str] | None = None,
        transform: Callable[[Data], Data] | None = None,
        pre_filter: Callable[[Data], bool] | None = None,
        dtype: torch.dtype | None = None,
        access: str = "auto",
        log: bool = True,
        rename: Mapping[str, str] | None = None,
        names: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | None = None,
        prefetch_shards: bool | None = None,
    ) -> None:
        self.names = resolve_names(rename, names)
        if fields is not None and self.names is not None:
            fields = [fields] if isinstance(fields, str) else fields
            fields = [self.names.stored_name(name) for name in fields]
        self._source_repr = _describe(source)
        self._reader = _open_source(source, access, {
            "cache_dir": cache_dir, "cache_bytes": cache_bytes,
            "prefetch_shards": prefetch_shards})
        self._reader_pid = _current_pid
        self.access = access
        self.dtype = dtype
        # Only look at the reader's fields when a selection needs checking: for
        # a Hub source they come from remote schema reads.
        self.fields = None if fields is None else resolve_fields(
            fields, self._reader.fields, source=f"AtompackDataset({self._source_repr})"
        )
        self._kept: np.ndarray | None = None
        self._index_cache: tuple[Any, np.ndarray] | None = None
        super().__init__(root=None, transform=transform, log=log)
        self.pre_filter = pre_filter
        if pre_filter is not None:
            self._kept = self._scan_pre_filter(pre_filter)

    @classmethod
    def from_hub(
        cls,
        repo_id: str,
        path_in_repo: str,
        *,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
        **kwargs: Any,
    ) -> AtompackDataset:
        r"""Opens `.atp` shards in a Hugging Face dataset repository lazily.

        The shards under ``path_in_repo`` are listed once (with their sizes and
        checksums) at a pinned revision, without downloading any; records are then
        read by range through the page cache in ``cache_dir`` (bounded by
        ``cache_bytes``), or, with ``prefetch_shards=True``, a shard is downloaded
        into the Hub cache when an index inside it is first read and verified
        against the listing (see :mod:`pyg_atompack.hub`).

        Args:
            repo_id (str): The dataset repository, e.g. ``"LeMaterial/Atompack"``.
            path_in_repo (str): A `.atp` file or a directory of shards in it.
            revision (str, optional): Branch, tag or commit; resolved once to a
                commit so every worker reads the same files. (default: :obj:`None`)
            cache_dir (str, optional): The cache directory of the listing, the
                pages and (``prefetch_shards=True``) the shard downloads.
                (default: :obj:`None`)
            token (str or bool, optional): A Hub token; :obj:`None` uses the saved
                login. (default: :obj:`None`)
            endpoint (str, optional): The Hub URL; :obj:`None` uses
                huggingface_hub's configured endpoint (``HF_ENDPOINT``).
                (default: :obj:`None`)
            **kwargs (optional): Forwarded to :class:`AtompackDataset` (``fields``,
                ``transform``, ``dtype``, ``access``, ``cache_bytes``, ...).
                ``prefetch_shards=True`` downloads whole verified shards instead of
                reading records through the page cache.

        Returns:
            AtompackDataset: The dataset.
        """
        from pyg_atompack import hub

        reader = hub.open_hub_atp(
            repo_id, path_in_repo, revision=revision, cache_dir=cache_dir, token=token,
            endpoint=endpoint, access=kwargs.get("access", "auto"),
        )
        pinned = getattr(reader, "revision", None) or revision
        prefetch_shards = kwargs.pop("prefetch_shards", None)
        cache_bytes = kwargs.pop("cache_bytes", None)
        if not prefetch_shards:  # by record, through the page cache in cache_dir
            reader = reader.by_record(cache_dir=cache_dir, cache_bytes=cache_bytes)
        dataset = cls(reader, **kwargs)
        revision_part = f"@{pinned}" if pinned else ""
        dataset._source_repr = repr(f"hf://datasets/{repo_id}{revision_part}/{path_in_repo}")
        return dataset

    # ------------------------------------------------------------------ reader

    @property
    def reader(self) -> Any:
        """The open `.atp` reader of this process (reopened after a fork)."""
        if self._reader_pid != _current_pid:
            # Forked child (e.g. a DataLoader worker): readers pickle to their
            # location only and reopen lazily, so a round trip gives this
            # process its own handles without touching the parent's.
            self._reader = pickle.loads(pickle.dumps(self._reader))
            self._reader_pid = _current_pid
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_index_cache"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # Unpickled readers reopen lazily on first use in this process.
        self._reader_pid = _current_pid

    # ------------------------------------------------------------------ PyG Dataset API

    @property
    def raw_file_names(self) -> list[str]:
        return []

    @property
    def processed_file_names(self) -> list[str]:
        return []

    @property
    def raw_paths(self) -> list[str]:
        return []

    @property
    def processed_paths(self) -> list[str]:
        return []

    def len(self) -> int:
        """Returns the number of (kept) records."""
        if self._kept is not None:
            return len(self._kept)
        return len(self.reader)

    def get(self, idx: int) -> Data:
        """Reads record ``idx`` (after ``pre_filter``) as a ``Data``.

        Args:
            idx (int): The record position.

        Returns:
            Data: The molecule as a graph without edges.
        """
        install_in_worker()  # in a DataLoader worker, batches leave packed (pyg.handoff)
        if self._kept is not None:
            idx = int(self._kept[idx])
        # get(): reader[idx] after a check that the file did not shrink under a mapped
        # reader (a SIGBUS would kill the DataLoader worker)
        data = record_to_data(self.reader.get(idx), self.fields, self.dtype)
        return data if self.names is None else self.names.apply(data)

    def record_indices(self, positions: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Maps dataset positions to record indices in the underlying reader.

        Follows this dataset's view (``index_select``, slicing, ``shuffle``) and
        its ``pre_filter``, so that batch readers can address records directly.

        Args:
            positions (Sequence[int], optional): Positions in ``range(len(self))``;
                :obj:`None` maps them all. (default: :obj:`None`)

        Returns:
            np.ndarray: int64 record indices.
        """
        table = self._record_table()
        if positions is None:
            return table.copy()
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.max() >= len(table) or positions.min() < -len(table)):
            bad = positions[(positions >= len(table)) | (positions < -len(table))][0]
            raise IndexError(
                f"position {int(bad)} is out of range for AtompackDataset of length {len(table)}"
            )
        return table[positions]

    def _record_table(self) -> np.ndarray:
        cached = self._index_cache
        if cached is not None and cached[0] is self._indices:
            return cached[1]
        if self._indices is None:
            view = np.arange(self.len(), dtype=np.int64)
        elif isinstance(self._indices, range):
            view = np.arange(self._indices.start, self._indices.stop, self._indices.step,
                             dtype=np.int64)
        else:
            view = np.asarray([int(i) for i in self._indices], dtype=np.int64)
        table = view if self._kept is None else self._kept[view]
        self._index_cache = (self._indices, table)
        return table

    def _scan_pre_filter(self, pre_filter: Callable[[Data], bool]) -> np.ndarray:
        reader = self.reader
        total = len(reader)
        starts = range(0, total, _FILTER_CHUNK)
        if self.log and total >= _FILTER_PROGRESS_FROM:
            from tqdm.auto import tqdm

            starts = tqdm(starts, total=len(starts), unit="chunk", desc="pre_filter")
        kept: list[int] = []
        for start in starts:
            indices = np.arange(start, min(start + _FILTER_CHUNK, total))
            flat = reader.read_batch(indices, fields=self.fields)
            for index, data in zip(indices, flat_to_data_list(flat, self.dtype)):
                if self.names is not None:
                    data = self.names.apply(data)
                if pre_filter(data):
                    kept.append(int(index))
        return np.asarray(kept, dtype=np.int64)

    def __repr__(self) -> str:
        parts = [str(len(self)), f"source={self._source_repr}"]
        if self.fields is not None:
            parts.append(f"fields={list(self.fields)}")
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.names is not None:
            parts.append(f"rename={dict(self.names.rename)}")
        if self.pre_filter is not None:
            parts.append(f"kept={len(self._kept)}/{len(self.reader)}")
        return f"{self.__class__.__name__}({', '.join(parts)})"
