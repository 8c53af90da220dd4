"""Safe decoding of shard payloads (``.pt`` pickles and ``.atp`` images) into PyG samples.

``.pt`` shards are read by ``torch.load`` through the restricted C unpickler of
:mod:`pyg_atompack.stream.safe_pickle`: only tensors, containers and an explicit
allow-list of PyG data classes can be reconstructed, so a shard cannot run code when it
is opened. Anything else is refused with :class:`UnsafePayloadError` unless the user
passes ``trusted=True``.

Accepted ``.pt`` layouts:

* a ``list`` / ``tuple`` of :class:`~torch_geometric.data.Data` (or ``HeteroData``);
* a collated :class:`~torch_geometric.data.Batch` (only with ``trusted=True``: a pickled
  ``Batch`` is rebuilt by calling a dynamic class factory, which the allow-list forbids;
  save ``batch.to_data_list()`` instead);
* an ``InMemoryDataset``-style ``(data, slices)`` tuple, or the newer
  ``(data.to_dict(), slices, data_class)`` triple written by ``InMemoryDataset.save``.

A ``.pt`` list of plain ``Data`` handed over as a :class:`bytearray` is not unpickled at
all: :mod:`pyg_atompack.stream.lazy_pt` indexes it in place and builds each sample when
it is taken, which keeps a decoded shard at about its file size (a list of ``Data`` costs
about three times that) and decodes three times faster. The same allow-list applies:
the indexer knows only the few globals such a pickle names, and hands anything else to
the restricted ``torch.load``.

``.atp`` shards are decoded by the format layer (no pickle involved) into ``Data`` with
the attribute names of :mod:`pyg_atompack.pyg`, one sample at a time as the consumer
takes it (:class:`AtpShardSamples`); every record is validated when the shard is decoded.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch_geometric.data import Batch, Data
from torch_geometric.data.data import BaseData
from torch_geometric.data.separate import separate

from pyg_atompack import atp
from pyg_atompack.pyg import record_to_data
from pyg_atompack.stream.buffers import BufferViewSamples, is_writable_buffer
from pyg_atompack.stream.errors import ShardDecodeError, UnsafePayloadError
from pyg_atompack.stream.lazy_pt import NotLazyLayout, decode_pt_lazily
from pyg_atompack.stream.pickle_scan import check_pickle_bounds
from pyg_atompack.stream.safe_pickle import (
    PYG_SAFE_GLOBALS,
    ForbiddenGlobalError,
    restricted_torch_load,
)
from pyg_atompack.stream.torch_zip import TorchZipError, read_torch_archive

__all__ = ["PYG_SAFE_GLOBALS", "AtpShardSamples", "decode_shard", "is_atp_shard"]

ATP_MAGIC = b"ATPK"

def _separate_collated(data: BaseData, slices: dict, name: str) -> list[BaseData]:
    """Cuts a collated ``(data, slices)`` shard into its samples, all at decode time.

    Doing it here, on the prefetch thread, rather than lazily in the consumer means a
    damaged shard (slices that do not fit the data, a ``Data`` whose storage did not
    survive unpickling; torch does not check the zip CRC) fails as a named
    :class:`ShardDecodeError` that ``on_error="skip"`` can handle, and the consumer only
    ever receives ready samples.
    """
    try:
        lengths = {int(value.numel()) for value in slices.values()
                   if isinstance(value, torch.Tensor)}
        if len(lengths) != 1 or len(slices) != sum(
                isinstance(value, torch.Tensor) for value in slices.values()):
            raise ValueError("slice tensors differ in length or are not tensors")
        count = lengths.pop() - 1
        for key, value in slices.items():
            if value.dim() != 1 or (count >= 0 and int(value[0]) != 0) or bool(
                    (value[1:] < value[:-1]).any()):
                raise ValueError(f"slices of {key!r} do not start at 0 and increase")
        data_class = type(data)
        return [separate(data_class, batch=data, idx=index, slice_dict=slices,
                         decrement=False) for index in range(max(count, 0))]
    except Exception as error:  # torch/PyG raise RuntimeError, KeyError, ... on bad input
        raise ShardDecodeError(
            f"shard {name}: malformed (data, slices) payload: {type(error).__name__}: {error}"
        ) from error


def _check_pickle(buffer: bytes | bytearray | memoryview, name: str) -> None:
    """Refuse damaged sizes that the C unpickler would act on before failing."""
    try:
        archive = read_torch_archive(buffer)
    except TorchZipError:
        return  # not an archive this module can read in place; torch.load judges it
    offset, size = archive.pickle
    try:
        check_pickle_bounds(buffer, offset, offset + size)
    except pickle.UnpicklingError as error:
        raise ShardDecodeError(f"shard {name}: not a readable .pt file: {error}") from None


def _load_pt(buffer: bytes | bytearray | memoryview, name: str, trusted: bool) -> Any:
    # BytesIO shares ``bytes`` (what the streaming loader passes) and copies anything else
    _check_pickle(buffer, name)
    stream = io.BytesIO(buffer)
    try:
        if trusted:
            return torch.load(stream, map_location="cpu", weights_only=False)
        return restricted_torch_load(stream)
    except ForbiddenGlobalError as error:
        raise UnsafePayloadError(
            f"shard {name}: refusing to unpickle it, because it references "
            f"{error.module}.{error.name}, which is outside the allow-list of tensors and "
            f"PyG data classes. Pickles can run arbitrary code; pass trusted=True only if "
            f"you trust where this shard comes from (or register the class with "
            f"torch.serialization.add_safe_globals)."
        ) from None
    except pickle.UnpicklingError as error:
        if trusted:
            raise ShardDecodeError(f"shard {name}: not a readable .pt file: {error}") from error
        # torch's own weights_only checker (TORCH_FORCE_WEIGHTS_ONLY_LOAD) names the global
        reason = str(error).strip().splitlines()
        markers = ("GLOBAL", "Unsupported", "Trying to")
        detail = next((line for line in reason if any(m in line for m in markers)),
                      reason[0] if reason else "")
        raise UnsafePayloadError(
            f"shard {name}: refusing to unpickle it, because it holds objects outside the "
            f"PyG allow-list ({detail.strip()}). Pickles can run arbitrary code; pass "
            f"trusted=True only if you trust where this shard comes from."
        ) from None
    except Exception as error:  # corrupt zip archives raise RuntimeError, etc.
        raise ShardDecodeError(f"shard {name}: not a readable .pt file: {error}") from error


def _as_samples(obj: Any, name: str) -> Sequence[BaseData]:
    if isinstance(obj, Batch):
        return obj.to_data_list()
    if isinstance(obj, tuple) and len(obj) in (2, 3) and isinstance(obj[1], dict):
        data, slices = obj[0], obj[1]
        if isinstance(data, dict):
            data_class = obj[2] if len(obj) == 3 else Data
            if not (isinstance(data_class, type) and issubclass(data_class, BaseData)):
                raise ShardDecodeError(f"shard {name}: third element is not a PyG data class")
            data = data_class.from_dict(data)
        if not isinstance(data, BaseData) or not slices:
            raise ShardDecodeError(f"shard {name}: malformed (data, slices) tuple")
        return _separate_collated(data, slices, name)
    if isinstance(obj, (list, tuple)):
        for position, item in enumerate(obj):
            if not isinstance(item, BaseData):
                raise ShardDecodeError(
                    f"shard {name}: element {position} is a {type(item).__name__}, "
                    f"expected torch_geometric Data"
                )
            try:
                item.stores  # noqa: B018 - a Data whose storage did not survive raises here
            except Exception as error:  # PyG raises RuntimeError / AttributeError
                raise ShardDecodeError(
                    f"shard {name}: element {position} is a damaged {type(item).__name__}: "
                    f"{error}"
                ) from None
        return list(obj)
    raise ShardDecodeError(
        f"shard {name}: expected a list of Data, a Batch or a (data, slices) tuple, "
        f"got {type(obj).__name__}"
    )


class AtpShardSamples(BufferViewSamples):
    """The samples of an ``.atp`` shard, built from its bytes one at a time when taken.

    An ``.atp`` image is already a compact, indexed layout, so the decoded shard is the
    downloaded buffer itself plus the reader's index: no per-sample Python objects exist
    until the consumer asks for a sample. This keeps a decoded shard at its file size,
    where a list of ``Data`` costs about three times its ``.pt`` file.

    Args:
        reader: An in-memory reader over the shard's bytes.
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
        name: The shard's name.
        buffer: Its bytes.

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
        buffer: The complete shard bytes. An ``.atp`` shard, and a ``.pt`` list of plain
            ``Data`` passed as a :class:`bytearray` or :class:`mmap.mmap`, decode to a
            lazy view over them (see
            :class:`AtpShardSamples` and :class:`~pyg_atompack.stream.lazy_pt.LazyPtSamples`):
            do not modify the buffer afterwards. Other ``.pt`` layouts are unpickled and
            do not reference it.
        name: Shard name, used in error messages.
        trusted: Allow arbitrary pickles in ``.pt`` shards (plain ``weights_only=False``).
            (default: :obj:`False`)
        lazy: Index a ``.pt`` list of plain ``Data`` in place when ``buffer`` is
            writable, instead of unpickling it. (default: :obj:`True`)

    Returns:
        A sequence of ``Data`` (``len`` and integer indexing).

    Raises:
        UnsafePayloadError: A ``.pt`` shard needs globals outside the allow-list.
        ShardDecodeError: The bytes are not a readable shard.
    """
    if is_atp_shard(name, buffer):
        return _decode_atp(buffer, name)
    if lazy and is_writable_buffer(buffer):
        try:
            return decode_pt_lazily(buffer)
        except NotLazyLayout:
            pass  # another layout (or a damaged file): torch.load decides
    return _as_samples(_load_pt(buffer, name, trusted), name)
