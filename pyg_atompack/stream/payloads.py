"""Decoding shard payloads into PyG samples: one table of shard formats.

A :class:`ShardFormat` says what its shards look like (name suffixes, leading bytes)
and how their bytes become samples; :func:`shard_format` walks the table
(:data:`SHARD_FORMATS`, in registration order) by suffix first, then by magic bytes, as
the converters' format table (:mod:`pyg_atompack.convert.registry`) does for files.
A shard no format recognises is refused with a :class:`ShardDecodeError` naming it.

``.pt`` shards go through :func:`pyg_atompack.pyg.pt.decode_pt`, the project's one
``.pt`` path: a list of ``Data`` (tensors of their own, or views of one storage the
samples share, as list slices of an ``InMemoryDataset`` are) and a collated
``(data, slices)`` tuple are indexed in place without unpickling when the shard is a
writable buffer, and their samples built when taken; anything else is read by
``torch.load(weights_only=True)`` with the PyG allow-list
(:data:`~pyg_atompack.pyg.pt.PYG_SAFE_GLOBALS`), so a shard cannot run code when it is
opened. Objects outside the allow-list are refused with :class:`UnsafePayloadError`
unless the user passes ``trusted=True``. The accepted layouts are listed by
:func:`pyg_atompack.pyg.pt.as_samples`; a pickled ``Batch`` needs ``trusted=True`` (it
is rebuilt by calling a dynamic class factory, which the allow-list forbids).

``.atp`` shards are decoded by the format layer (no pickle involved) into ``Data`` with
the attribute names of :mod:`pyg_atompack.pyg`, one sample at a time as the consumer
takes it (:class:`AtpShardSamples`); every record is validated when the shard is decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch_geometric.data import Data
from torch_geometric.data.data import BaseData

from pyg_atompack import atp
from pyg_atompack.pyg import record_to_data
from pyg_atompack.pyg.errors import PtPayloadError, UnsafePtPayloadError
from pyg_atompack.pyg.pt import PYG_SAFE_GLOBALS, decode_pt
from pyg_atompack.pyg.samples import BufferViewSamples
from pyg_atompack.stream.errors import ShardDecodeError, UnsafePayloadError

__all__ = ["PYG_SAFE_GLOBALS", "SHARD_FORMATS", "AtpShardSamples", "ShardFormat", "decode_shard",
           "register_shard_format", "shard_format"]


class AtpShardSamples(BufferViewSamples):
    """The samples of an ``.atp`` shard, built from its bytes one at a time when taken.

    An ``.atp`` image is already a compact, indexed layout, so the decoded shard is the
    downloaded buffer itself plus the reader's index: no per-sample Python objects exist
    until the consumer asks for a sample. This keeps a decoded shard at its file size,
    where a list of ``Data`` costs about three times its ``.pt`` file.

    Args:
        reader (Any): An in-memory reader over the shard's bytes.
    """

    def __init__(self, reader: Any) -> None:
        super().__init__(len(reader))
        self._reader = reader

    def _build(self, index: int) -> Data:
        return record_to_data(self._reader[index])


# records decoded per validation step: enough to amortise the call, small next to a shard
_VALIDATION_CHUNK = 64


def _decode_atp(buffer: bytes | bytearray, name: str, trusted: bool = False,
                lazy: bool = True) -> AtpShardSamples:
    # records are decoded by the format layer: no pickle to trust, nothing to index
    try:
        # the reader takes the downloaded buffer over instead of copying it
        reader = atp.Reader.from_bytes(buffer, name=name, copy=False)
        # every record is decoded once here, on the prefetch thread, and thrown away in
        # small chunks: a damaged record fails now as a named ShardDecodeError (which
        # on_error="skip" can handle) rather than halfway through the consumer's loop
        for start in range(0, len(reader), _VALIDATION_CHUNK):
            reader.read_batch(range(start, min(start + _VALIDATION_CHUNK, len(reader))))
    except atp.AtpError as error:
        raise ShardDecodeError(f"shard {name}: {error}") from error
    return AtpShardSamples(reader)


def _decode_pt(buffer: bytes | bytearray, name: str, trusted: bool,
               lazy: bool) -> Sequence[BaseData]:
    try:
        return decode_pt(buffer, trusted=trusted, lazy=lazy)
    except UnsafePtPayloadError as error:
        raise UnsafePayloadError(
            f"shard {name}: {error}, or pass trusted=True only if you trust where this "
            f"shard comes from."
        ) from None
    except PtPayloadError as error:
        raise ShardDecodeError(f"shard {name}: {error}") from error


def _prepare_pt(buffer: bytes | bytearray, lazy: bool) -> bytes | bytearray:
    if lazy and isinstance(buffer, bytes):
        return bytearray(buffer)  # lazily built samples need writable bytes
    if not lazy and not isinstance(buffer, bytes):
        # one memcpy so torch reads the archive through io.BytesIO's C code instead
        # of a Python file object; the caller's rebinding frees the download buffer
        # before unpickling builds anything
        return bytes(buffer)
    return buffer


def _as_downloaded(buffer: bytes | bytearray, lazy: bool) -> bytes | bytearray:
    return buffer  # the .atp reader takes any buffer over as it is


@dataclass(frozen=True)
class ShardFormat:
    """A shard format the stream decodes, with the facts that recognise its shards.

    Args:
        name (str): The format's name (``"pt"``, ``"atp"``).
        suffixes (tuple[str, ...]): Endings of its shards' names (``(".atp",)``); a
            suffix decides before any magic bytes do, the longest one first.
        magic (tuple[bytes, ...]): Prefixes of its shards' first bytes, tried when no
            format claims the name's suffix.
        decode (Callable): ``(buffer, name, trusted, lazy) -> samples``, raising
            :class:`ShardDecodeError` or :class:`UnsafePayloadError` naming the shard.
        prepare (Callable): ``(buffer, lazy) -> buffer``: the downloaded bytes as
            ``decode`` reads them (the download is dropped before decoding starts).
    """

    name: str
    suffixes: tuple[str, ...]
    magic: tuple[bytes, ...]
    decode: Callable[[bytes | bytearray, str, bool, bool], Sequence[BaseData]]
    prepare: Callable[[bytes | bytearray, bool], bytes | bytearray]


#: The shard formats by name, in registration order (the order detection tries them).
SHARD_FORMATS: dict[str, ShardFormat] = {}


def register_shard_format(fmt: ShardFormat) -> None:
    """Add a shard format to :data:`SHARD_FORMATS` (a name registered again is replaced).

    Args:
        fmt (ShardFormat): The format.
    """
    SHARD_FORMATS[fmt.name] = fmt


register_shard_format(ShardFormat("pt", (".pt",), (b"PK\x03\x04", b"\x80"), _decode_pt,
                                  _prepare_pt))  # a zip archive, or a legacy pickle
register_shard_format(ShardFormat("atp", (".atp",), (b"ATPK",), _decode_atp, _as_downloaded))


def shard_format(name: str, buffer: bytes | bytearray) -> ShardFormat:
    """The format of a shard: by its name's longest known suffix, else by its first bytes.

    Args:
        name (str): The shard's name (its URL or file name).
        buffer (bytes | bytearray): Its bytes (only the first few are read).

    Returns:
        The :class:`ShardFormat` that reads it.

    Raises:
        ShardDecodeError: No format recognises the shard (names the shard).
    """
    claimed = [(len(suffix), fmt) for fmt in SHARD_FORMATS.values() for suffix in fmt.suffixes
               if name.endswith(suffix)]
    if claimed:  # the longest suffix is the most specific (``.x.pt`` before ``.pt``)
        return max(claimed, key=lambda pair: pair[0])[1]
    head = bytes(buffer[:8])
    for fmt in SHARD_FORMATS.values():
        if head.startswith(fmt.magic):
            return fmt
    known = "; ".join(f"{fmt.name}: names ending in {', '.join(fmt.suffixes)} or bytes "
                      f"starting with {', '.join(repr(m) for m in fmt.magic)}"
                      for fmt in SHARD_FORMATS.values())
    raise ShardDecodeError(f"shard {name}: not a shard format the stream reads (its first "
                           f"bytes are {head!r}); known formats: {known}")


def decode_shard(buffer: bytes | bytearray, name: str, *, trusted: bool = False,
                 lazy: bool = True) -> Sequence[BaseData]:
    """Turn the bytes of one shard into an indexable sequence of PyG samples.

    The format is chosen by :func:`shard_format`: the name's suffix (``.pt``,
    ``.atp``), else the leading bytes.

    Args:
        buffer (bytes | bytearray): The complete shard bytes. An ``.atp`` shard, and an indexed
            ``.pt`` layout passed as a :class:`bytearray` or :class:`mmap.mmap`, decode to a
            lazy view over them (see :class:`AtpShardSamples` and
            :func:`pyg_atompack.pyg.pt.decode_pt`): do not modify the buffer
            afterwards. Other ``.pt`` layouts are unpickled and do not reference it.
        name (str): Shard name (its URL or file name), used in error messages.
        trusted (bool, optional): Allow arbitrary pickles in ``.pt`` shards (plain
            ``weights_only=False``). (default: :obj:`False`)
        lazy (bool, optional): Index a ``.pt`` shard in place when ``buffer`` is writable, instead
            of unpickling it. (default: :obj:`True`)

    Returns:
        A sequence of ``Data`` (``len`` and integer indexing).

    Raises:
        UnsafePayloadError: A ``.pt`` shard needs globals outside the allow-list.
        ShardDecodeError: The bytes are not a readable shard, or no format recognises it.
    """
    return shard_format(name, buffer).decode(buffer, name, trusted, lazy)
