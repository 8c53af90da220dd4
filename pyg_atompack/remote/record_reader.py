"""Random access to remote `.atp` files: only the records asked for cross the network.

:class:`RemoteAtpReader` is a :class:`pyg_atompack.atp.RecordReader` (``len``, ``f[i]``,
``read_batch``, ``n_atoms``, ``fields``) over one :class:`RangeReader`. Its
metadata comes from :func:`~pyg_atompack.remote.atp_meta.load_meta` (fetched once per
machine), its records from a :class:`~pyg_atompack.remote.block_cache.BlockCache`
(pages on local disk, bounded by ``cache_bytes``, shared by the processes of a machine).
A ``read_batch`` fetches the pages its records lie in (adjacent ones in one request,
several requests at once; ``ShardedReader`` hands each shard all its records of a
batch), wraps the records into an in-memory image
(:func:`pyg_atompack.atp.images.gathered_image`) and decodes it with the format layer.

Several files become one dataset through
:meth:`pyg_atompack.atp.ShardedReader.from_readers`, which owns the global index and the
batching for local and remote shards alike (:func:`open_remote_atp`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from pyg_atompack.atp import batch as _batch
from pyg_atompack.atp.base import RecordReader
from pyg_atompack.atp.errors import AtpError
from pyg_atompack.atp.extensions import read_directory, read_payload
from pyg_atompack.atp.groups import read_groups
from pyg_atompack.atp.images import FileMeta, gathered_image, record_ranges
from pyg_atompack.atp.index import molecule_index
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.atp_meta import load_meta
from pyg_atompack.remote.block_cache import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_PAGE_BYTES,
    BlockCache,
)
from pyg_atompack.remote.ranges import RangeReader

__all__ = ["RemoteAtpReader", "open_remote_atp", "range_readers"]


class RemoteAtpReader(RecordReader):
    """Read-only view of one remote `.atp` file, reading records through a disk cache.

    Args:
        reader (RangeReader): The file's range reads.
        cache_dir (str | os.PathLike, optional): Cache root: metadata under ``atp-meta/``, pages
            under ``pages/``. (default: ``$PYG_ATOMPACK_CACHE`` or ``~/.cache/pyg_atompack``)
        cache_bytes (int, optional): Bound on the page cache (metadata not included); ``0`` caches
            no page. (default: 8 GiB)
        page_bytes (int, optional): Cache page size. (default: 256 KiB)
        head (bytes, optional): The file's header slots when already read
            (:func:`~pyg_atompack.remote.atp_meta.read_header`): fetching the metadata
            then reads only the schema and index blocks. (default: :obj:`None`)
    """

    def __init__(self, reader: RangeReader, *, cache_dir: str | os.PathLike | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES,
                 page_bytes: int = DEFAULT_PAGE_BYTES, head: bytes | None = None) -> None:
        self.range_reader = reader
        self.cache_dir = remote_cache.cache_root(cache_dir)
        self.cache_bytes = int(cache_bytes)
        self.page_bytes = int(page_bytes)
        self._init_runtime()
        self._head = head

    def _init_runtime(self) -> None:
        self._head: bytes | None = None
        self._meta: FileMeta | None = None
        self._fields: dict | None = None
        self._directory: list | None = None
        self._groups: Any = None
        self.cache = BlockCache(remote_cache.kind_folder(remote_cache.PAGES, self.cache_dir),
                                self.cache_bytes, page_bytes=self.page_bytes,
                                root=self.cache_dir)

    def __getstate__(self) -> dict[str, Any]:
        # location and settings only: each process reloads the metadata from the disk cache
        return {"range_reader": self.range_reader, "cache_dir": self.cache_dir,
                "cache_bytes": self.cache_bytes, "page_bytes": self.page_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # ----------------------------------------------------------------- metadata
    @property
    def meta(self) -> FileMeta:
        """Header, schema and index (loaded from the disk cache, fetched once)."""
        if self._meta is None:
            self._meta = load_meta(self.range_reader, self.cache_dir, head=self._head)
        return self._meta

    @property
    def name(self) -> str:
        """How messages name the file."""
        return self.range_reader.name

    @property
    def header(self) -> Any:
        """The committed header slot."""
        return self.meta.header

    @property
    def index(self) -> np.ndarray:
        """The index entries."""
        return self.meta.index

    def __len__(self) -> int:
        return len(self.meta)

    @property
    def n_atoms(self) -> np.ndarray:
        """Atom count of every molecule (int64), from the index."""
        return self.meta.n_atoms

    @property
    def fields(self) -> dict:
        """Every field of the file, from its schema block."""
        if self._fields is None:
            if not self.meta.schema:
                raise AtpError(f"{self.name}: no schema block (a file written by atompack "
                               f"0.2.x); its fields are only known by reading every record: "
                               f"download it whole (prefetch_shards=True) instead")
            self._fields = self._image(np.zeros(0, np.int64)).fields
        return self._fields

    @property
    def metadata_frames(self) -> list:
        """The metadata frames the extensions directory lists (fetched once), as
        :attr:`pyg_atompack.atp.Reader.metadata_frames`."""
        if self._directory is None:
            h = self.header
            block = b"" if not h.ext_len else self._bytes(h.ext_offset, h.ext_len)
            self._directory = read_directory(block, h, self.name) if block else []
        return list(self._directory)

    def read_metadata(self, frame: Any) -> bytes:
        """The payload of one of :attr:`metadata_frames`, its CRC-32 checked.

        Args:
            frame (MetaFrame): One entry of :attr:`metadata_frames`.

        Returns:
            bytes: The frame's payload.
        """
        return read_payload(self._bytes, frame, self.name)

    @property
    def groups(self) -> Any:
        """The file's groupings (:class:`pyg_atompack.atp.groups.Groups`); only the
        groups frames are fetched, and a group's members when it is read."""
        if self._groups is None:
            self._groups = read_groups(self)
        return self._groups

    def _bytes(self, offset: int, length: int) -> bytes:
        return bytes(self.cache.read(self.range_reader, [(offset, offset + length)])[0])

    # ----------------------------------------------------------------- records
    def _image(self, records: np.ndarray) -> Any:
        return gathered_image(self.meta, records, self.cache.read(
            self.range_reader, record_ranges(self.meta, records)))

    def __getitem__(self, i: int) -> Any:
        i = molecule_index(i, len(self), self.name)
        records = np.asarray([i], np.int64)
        with _file_record_numbers(self.name, records):
            return self._image(records)[0]

    def read_resolved(self, indices: Sequence[int] | np.ndarray, infos: dict) -> dict[str, Any]:
        """Decode several molecules, fetching only their records (``read_batch`` with
        fields already resolved: what ``ShardedReader`` calls).

        Args:
            indices (Sequence[int] | np.ndarray): Molecule indices.
            infos (dict): ``name -> FieldInfo`` to decode.

        Returns:
            The flat dict of :meth:`pyg_atompack.atp.Reader.read_batch`.
        """
        idx = _batch._normalize_indices(indices, len(self), self.name)
        records = np.unique(idx)
        with _file_record_numbers(self.name, records):
            image = self._image(records)
            return image.read_resolved(np.searchsorted(records, idx), infos)

    def __repr__(self) -> str:
        return f"RemoteAtpReader({self.name!r}, cache_bytes={self.cache_bytes})"


@contextlib.contextmanager
def _file_record_numbers(name: str, records: np.ndarray) -> Iterator[None]:
    """Name records as the file numbers them in errors of a gathered image.

    The in-memory image holds the records read at positions ``0 .. len(records) - 1``;
    the format layer names a damaged record by that position, the user knows it as
    ``records[position]`` of ``name``.
    """
    def in_file(number: str) -> str:
        position = int(number)
        return str(int(records[position])) if position < len(records) else number

    try:
        yield
    except AtpError as error:
        message = str(error)
        fixed = re.sub(rf"(?<={re.escape(name)}: record )\d+", lambda m: in_file(m[0]),
                       message)
        fixed = re.sub(r"(?<=records \[)[\d, .]+(?=\])", lambda m: re.sub(
            r"\d+", lambda n: in_file(n[0]), m[0]), fixed)
        if fixed == message:
            raise
        raise type(error)(fixed) from error


def open_remote_atp(readers: Sequence[RangeReader] | RangeReader, *,
                    cache_dir: str | os.PathLike | None = None,
                    cache_bytes: int = DEFAULT_CACHE_BYTES,
                    page_bytes: int = DEFAULT_PAGE_BYTES, name: str | None = None) -> Any:
    """One reader over remote `.atp` files (a :class:`RemoteAtpReader` for one file).

    Args:
        readers (Sequence[RangeReader] | RangeReader): The files' range readers, in global order.
        cache_dir (str | os.PathLike, optional): Cache root shared by the files.
            (default: see :class:`RemoteAtpReader`)
        cache_bytes (int, optional): Bound on the page cache, shared by the files. (default: 8 GiB)
        page_bytes (int, optional): Cache page size. (default: 256 KiB)
        name (str, optional): How messages name the dataset. (default: the file names)

    Returns:
        A :class:`RemoteAtpReader`, or a :class:`pyg_atompack.atp.ShardedReader` over them.
    """
    from pyg_atompack.atp.sharded import ShardedReader

    if not isinstance(readers, (list, tuple)):
        readers = [readers]
    shards = [RemoteAtpReader(r, cache_dir=cache_dir, cache_bytes=cache_bytes,
                              page_bytes=page_bytes) for r in readers]
    if len(shards) == 1:
        return shards[0]
    return ShardedReader.from_readers(shards, name=name)


def range_readers(url: str | Sequence[str], *, suffixes: Sequence[str] = (".atp",),
                  **options: Any) -> list[RangeReader]:
    """Range readers for the files a URL names, listed once by its backend.

    Args:
        url (str | Sequence[str]): Any URL :func:`~pyg_atompack.remote.backends.open_backend`
            serves (an http(s) ``manifest.json``, directory or file, a list of http(s) file
            URLs, an object-store prefix, a local directory).
        suffixes (Sequence[str], optional): Names to keep. (default: :obj:`(".atp",)`)
        **options (optional): The backend's options (``headers``: credentials go only to
            the origin of ``url``, never to a host a manifest names; ``retry``; the store's).

    Returns:
        One :class:`~pyg_atompack.remote.ranges.RangeReader` per file, in listing order.

    Raises:
        OSError: The listing failed or a file's size is unknown (names the URL).
    """
    from pyg_atompack.remote.backends import backend_class, open_backend

    if isinstance(url, (list, tuple)):
        backend = backend_class(url[0])(list(url), **options)
    else:
        backend = open_backend(url, **options)
    files = backend.list(suffixes)
    for file in files:
        if file.size is None:
            raise OSError(f"{file.describe()}: the server announces no size (no "
                          f"Content-Range on a range request, no Content-Length)")
    return [backend.range_reader(file) for file in files]
