"""Remote `.atp` metadata (header, schema, index) by range reads: the one remote-`.atp` reader.

Every remote `.atp` file, whatever serves it (the Hub, a plain HTTP(S) server, an object
store), is read here through its :class:`~pyg_atompack.remote.ranges.RangeReader`:

* :func:`read_header`: the header slots (one range read of the first 8192 bytes), which
  give the molecule count and where the schema and index blocks are; what opening a
  listing of shards costs;
* :func:`read_fields`: the fields, from one range read of the schema block (hundreds
  of bytes), without the index;
* :func:`load_meta`: header, schema and index (:class:`~pyg_atompack.atp.images.FileMeta`),
  fetched once per machine and cached on disk.

Parsing is the format layer's (:mod:`pyg_atompack.atp`); this module only fetches and
caches. The index of a multi-GB shard is hundreds of MB (20 bytes a record). :func:`load_meta`
fetches it by range reads of at most :data:`META_CHUNK_BYTES` each, several at once,
each resumed by the range reader when a connection drops; it is checked against the
header that announced it (:func:`pyg_atompack.atp.images.parse_meta`) and written to
``{root}/atp-meta/{key}.atpmeta``, where ``key`` hashes the file's content identity
(sha256 from the listing, else location, size and version). A file lock makes one process
fetch while the others (DataLoader workers, ranks on the same machine) wait and then read
the cached copy; a later run reads it too. The cached file ends with the sha256 of its
contents, and is parsed and checked again on every load, so a damaged copy is refetched.
Writes go through :mod:`pyg_atompack.remote.cache` (inside the root after resolving
symlinks); in a read-only cache a miss is fetched into memory and not stored.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pyg_atompack.atp.fields import FieldInfo, schema_block_fields
from pyg_atompack.atp.header import HEADER_SIZE, Header, select_header
from pyg_atompack.atp.images import FileMeta, parse_meta
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.remote.ranges import RangeReader, read_range

__all__ = ["META_CHUNK_BYTES", "fetch_meta", "load_meta", "meta_path", "read_fields",
           "read_header"]

#: Largest range request used for metadata (the index of a big shard is fetched in pieces).
META_CHUNK_BYTES = 16 << 20
_MAGIC = b"ATPMETA1"
_LENGTHS = struct.Struct("<QQQQ")  # file size, identity length, schema length, index length


def meta_path(cache_dir: str | os.PathLike, identity: str, size: int) -> Path:
    """Where the metadata of the file with this content identity is cached.

    Args:
        cache_dir (str | os.PathLike): Cache root.
        identity (str): The file's content identity (see :class:`RangeReader`).
        size (int): Its length.

    Returns:
        The path (whether or not it exists).
    """
    key = hashlib.sha256(f"{identity}|{size}".encode()).hexdigest()[:40]
    return remote_cache.kind_folder(remote_cache.META, cache_dir) / f"{key}.atpmeta"


def _read_chunked(reader: RangeReader, start: int, stop: int, workers: int) -> bytes:
    if stop <= start:
        return b""
    out = bytearray(stop - start)
    view = memoryview(out)
    cuts = list(range(start, stop, META_CHUNK_BYTES)) + [stop]
    pieces = list(zip(cuts[:-1], cuts[1:]))

    def fetch(piece: tuple[int, int]) -> None:
        a, b = piece
        reader.read_into(a, view[a - start:b - start])

    if len(pieces) == 1:
        fetch(pieces[0])
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(pieces)))) as pool:
            list(pool.map(fetch, pieces))
    view.release()
    return bytes(out)


def read_header(reader: RangeReader) -> tuple[bytes, Header]:
    """A file's header slots, from one range read of its first 8192 bytes.

    Args:
        reader (RangeReader): The file.

    Returns:
        The bytes read (fewer than 8192 for a shorter file; :func:`load_meta` takes them
        as ``head=``) and the committed :class:`~pyg_atompack.atp.header.Header`.

    Raises:
        AtpError: The bytes are not a valid ``.atp`` header (names the file).
    """
    head = bytes(read_range(reader, 0, min(HEADER_SIZE, reader.size)))
    return head, select_header(head, reader.size, reader.name)


def read_fields(reader: RangeReader, header: Header,
                schema: bytes | None = None) -> dict[str, FieldInfo] | None:
    """A file's fields from its schema block: one range read, the index is not read.

    Args:
        reader (RangeReader): The file.
        header (Header): Its committed header (:func:`read_header`).
        schema (bytes, optional): The schema block when already at hand (a loaded
            :class:`~pyg_atompack.atp.images.FileMeta`'s): nothing is read.
            (default: :obj:`None`)

    Returns:
        ``name -> FieldInfo``, or :obj:`None` when the schema block cannot tell: a file
        without one (written by atompack 0.2.x: only its records tell) or with positions
        of an unknown dtype (the format layer names the problem when the file is opened).
    """
    if not header.schema_len or header.record_format not in (2, 3):
        return None
    if schema is None:
        schema = bytes(read_range(reader, header.schema_offset,
                                  header.schema_offset + header.schema_len))
    return schema_block_fields(schema, header.record_format, reader.name)


def fetch_meta(reader: RangeReader, *, head: bytes | None = None, workers: int = 4) -> FileMeta:
    """Fetch and check a file's metadata by range reads (no cache).

    Args:
        reader (RangeReader): The file.
        head (bytes, optional): Its header slots when already read (:func:`read_header`):
            one range read fewer. (default: :obj:`None`)
        workers (int, optional): Range requests in flight for a large index. (default: :obj:`4`)

    Returns:
        The :class:`~pyg_atompack.atp.images.FileMeta`.

    Raises:
        AtpError: The metadata is not valid for a file of this size (names the file).
    """
    if head is None:
        head, header = read_header(reader)
    else:
        header = select_header(head, reader.size, reader.name)
    spans = []
    if header.schema_len:
        spans.append((header.schema_offset, header.schema_offset + header.schema_len))
    if header.index_len:
        spans.append((header.index_offset, header.index_offset + header.index_len))
    if len(spans) == 2 and spans[0][1] == spans[1][0]:
        # written by every flush: schema block directly before the index, one span
        both = _read_chunked(reader, spans[0][0], spans[1][1], workers)
        schema, index = both[:header.schema_len], both[header.schema_len:]
    else:
        schema = _read_chunked(reader, *spans[0], workers) if header.schema_len else b""
        index = _read_chunked(reader, *spans[-1], workers) if header.index_len else b""
    return parse_meta(reader.name, reader.size, head, schema, index)


def _encode(meta: FileMeta, identity: str) -> bytes:
    ident = identity.encode()
    index = meta.index.tobytes()
    body = b"".join([_MAGIC, _LENGTHS.pack(meta.size, len(ident), len(meta.schema),
                                           8 + len(index)), ident, meta.head, meta.schema,
                     struct.pack("<Q", len(meta.index)), index])
    return body + hashlib.sha256(body).digest()


def _decode(data: bytes, reader: RangeReader) -> FileMeta | None:
    """The cached metadata, or None when the file is damaged or belongs elsewhere.

    The index stays a view of ``data`` (no copy of what may be hundreds of MB).
    """
    if len(data) < len(_MAGIC) + _LENGTHS.size + 32 or not data.startswith(_MAGIC):
        return None
    view = memoryview(data)
    body, digest = view[:-32], view[-32:]
    if hashlib.sha256(body).digest() != digest:
        return None
    at = len(_MAGIC)
    size, n_ident, n_schema, n_index = _LENGTHS.unpack_from(body, at)
    at += _LENGTHS.size
    ident = bytes(body[at:at + n_ident]).decode(errors="replace")
    at += n_ident
    if size != reader.size or ident != reader.identity:
        return None
    head = body[at:at + HEADER_SIZE]
    at += HEADER_SIZE
    schema = body[at:at + n_schema]
    index = body[at + n_schema:at + n_schema + n_index]
    return parse_meta(reader.name, reader.size, head, schema, index)


#: Metadata kept in memory per process (most recently used files); forked DataLoader
#: workers inherit what the constructing process loaded.
_MEMORY: OrderedDict[tuple[str, int], FileMeta] = OrderedDict()
MEMORY_ENTRIES = 4


def load_meta(reader: RangeReader, cache_dir: str | os.PathLike | None = None, *,
              head: bytes | None = None, workers: int = 4,
              stats: dict[str, Any] | None = None) -> FileMeta:
    """A file's metadata from the disk cache, fetching (once per machine) when absent.

    Args:
        reader (RangeReader): The file.
        cache_dir (str | os.PathLike, optional): Cache root
            (default: :func:`~pyg_atompack.remote.cache.cache_root`).
        head (bytes, optional): The file's header slots when already read
            (:func:`read_header`): a fetch reads only the schema and index blocks.
            (default: :obj:`None`)
        workers (int, optional): Range requests in flight for a large index. (default: :obj:`4`)
        stats (dict[str, Any], optional): When given, ``stats["fetched"]`` is incremented when this
            call fetched the metadata over the network (for tests and traces).
            (default: :obj:`None`)

    Returns:
        The :class:`~pyg_atompack.atp.images.FileMeta` (its ``name`` is the reader's).
    """
    key = (reader.identity, reader.size)
    kept = _MEMORY.get(key)
    if kept is not None and kept.name == reader.name:
        _MEMORY.move_to_end(key)
        return kept
    meta = _load_meta(reader, cache_dir, head, workers, stats)
    _MEMORY[key] = meta
    while len(_MEMORY) > MEMORY_ENTRIES:
        _MEMORY.popitem(last=False)
    return meta


def _load_meta(reader: RangeReader, cache_dir: str | os.PathLike | None, head: bytes | None,
               workers: int, stats: dict[str, Any] | None) -> FileMeta:
    root = remote_cache.cache_root(cache_dir)
    path = remote_cache.check_inside(meta_path(root, reader.identity, reader.size), root,
                                     url=reader.name)
    found: list[FileMeta] = []

    def cached(candidate: Path) -> bool:
        try:
            meta = _decode(candidate.read_bytes(), reader)
        except FileNotFoundError:
            return False
        except Exception:  # noqa: BLE001 - a damaged cache entry is refetched
            return False
        if meta is not None:
            found[:] = [meta]
        return meta is not None

    def fetch() -> FileMeta:
        meta = fetch_meta(reader, head=head, workers=workers)
        if stats is not None:
            stats["fetched"] = stats.get("fetched", 0) + 1
        return meta

    def write(temp: Path) -> None:
        meta = fetch()
        found[:] = [meta]
        temp.write_bytes(_encode(meta, reader.identity))

    try:
        remote_cache.cached_file(path, root, complete=cached, write=write, url=reader.name)
    except remote_cache.CacheReadOnlyError:
        if not found:  # a read-only cache: this process keeps the metadata in memory only
            found[:] = [fetch()]
    return found[0]
