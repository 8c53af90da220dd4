"""Decoding shard payloads (``.pt`` pickles and ``.atp`` images) into PyG samples.

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

from collections.abc import Sequence
from typing import Any

from torch_geometric.data import Data
from torch_geometric.data.data import BaseData

from pyg_atompack import atp
from pyg_atompack.pyg import record_to_data
from pyg_atompack.pyg.errors import PtPayloadError, UnsafePtPayloadError
from pyg_atompack.pyg.pt import PYG_SAFE_GLOBALS, decode_pt
from pyg_atompack.pyg.samples import BufferViewSamples
from pyg_atompack.stream.errors import ShardDecodeError, UnsafePayloadError

__all__ = ["PYG_SAFE_GLOBALS", "AtpShardSamples", "decode_shard", "is_atp_shard"]

ATP_MAGIC = b"ATPK"


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


def _decode_atp(buffer: bytes | bytearray, name: str) -> AtpShardSamples:
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


def is_atp_shard(name: str, buffer: bytes | bytearray) -> bool:
    """Whether a shard is an ``.atp`` image (by its name's suffix or its magic bytes).

    Args:
        name (str): The shard's name.
        buffer (bytes | bytearray): Its bytes.

    Returns:
        :obj:`True` for ``.atp`` shards, :obj:`False` for everything read as ``.pt``.
    """
    return name.endswith(".atp") or bytes(buffer[:4]) == ATP_MAGIC


def decode_shard(buffer: bytes | bytearray, name: str, *, trusted: bool = False,
                 lazy: bool = True) -> Sequence[BaseData]:
    """Turn the bytes of one shard into an indexable sequence of PyG samples.

    The format is chosen by the name's suffix (``.atp`` or anything else as ``.pt``);
    an ``.atp`` payload is also recognised by its magic bytes.

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
        ShardDecodeError: The bytes are not a readable shard.
    """
    if is_atp_shard(name, buffer):
        return _decode_atp(buffer, name)
    try:
        return decode_pt(buffer, trusted=trusted, lazy=lazy)
    except UnsafePtPayloadError as error:
        raise UnsafePayloadError(
            f"shard {name}: {error}, or pass trusted=True only if you trust where this "
            f"shard comes from."
        ) from None
    except PtPayloadError as error:
        raise ShardDecodeError(f"shard {name}: {error}") from error
