"""Safe decoding of shard payloads (``.pt`` pickles and ``.atp`` images) into PyG samples.

``.pt`` shards are read with ``torch.load(weights_only=True)``: only tensors, containers
and an explicit allow-list of PyG data classes can be reconstructed, so a shard cannot
run code when it is opened. Anything else is refused with :class:`UnsafePayloadError`
unless the user passes ``trusted=True``.

Accepted ``.pt`` layouts:

* a ``list`` / ``tuple`` of :class:`~torch_geometric.data.Data` (or ``HeteroData``);
* a collated :class:`~torch_geometric.data.Batch` (only with ``trusted=True``: a pickled
  ``Batch`` is rebuilt by calling a dynamic class factory, which ``weights_only`` forbids;
  save ``batch.to_data_list()`` instead);
* an ``InMemoryDataset``-style ``(data, slices)`` tuple, or the newer
  ``(data.to_dict(), slices, data_class)`` triple written by ``InMemoryDataset.save``.

``.atp`` shards are decoded by the format layer (no pickle involved) into ``Data`` with
the attribute names of :mod:`pyg_atompack.pyg`.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.data.data import BaseData, DataEdgeAttr, DataTensorAttr
from torch_geometric.data.separate import separate
from torch_geometric.data.storage import EdgeStorage, GlobalStorage, NodeStorage

from pyg_atompack.stream.errors import ShardDecodeError, UnsafePayloadError

#: Classes a ``.pt`` shard may contain besides tensors and builtin containers.
PYG_SAFE_GLOBALS = [
    Data,
    HeteroData,
    Batch,
    DataEdgeAttr,
    DataTensorAttr,
    GlobalStorage,
    NodeStorage,
    EdgeStorage,
]

ATP_MAGIC = b"ATPK"

# the allow-list is installed by a context manager that edits process-wide state, so
# concurrent loads from prefetch threads take turns (unpickling holds the GIL anyway)
_LOAD_LOCK = threading.Lock()


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


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a buffer, without copying it.

    ``io.BytesIO`` copies a ``bytearray`` (it shares only immutable ``bytes``), which
    would hold every downloaded shard twice while it is decoded.
    """

    def __init__(self, buffer: bytearray | memoryview) -> None:
        super().__init__()
        self._view = memoryview(buffer).cast("B")
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        count = min(len(target), len(self._view) - self._position)
        target[:count] = self._view[self._position:self._position + count]
        self._position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}
        self._position = max(base[whence] + offset, 0)
        return self._position

    def tell(self) -> int:
        return self._position


def _load_pt(buffer: bytes | bytearray | memoryview, name: str, trusted: bool) -> Any:
    stream = io.BytesIO(buffer) if isinstance(buffer, bytes) else _MemoryFile(buffer)
    try:
        if trusted:
            return torch.load(stream, map_location="cpu", weights_only=False)
        with _LOAD_LOCK, torch.serialization.safe_globals(PYG_SAFE_GLOBALS):
            return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if trusted:
            raise ShardDecodeError(f"shard {name}: not a readable .pt file: {error}") from error
        # torch's message lists the offending global; keep its first line, it names it
        reason = str(error).strip().splitlines()
        markers = ("GLOBAL", "Unsupported", "Trying to")
        detail = next((line for line in reason if any(m in line for m in markers)),
                      reason[0] if reason else "")
        raise UnsafePayloadError(
            f"shard {name}: refusing to unpickle it with weights_only=True, because it "
            f"holds objects outside the PyG allow-list ({detail.strip()}). Pickles can run "
            f"arbitrary code; pass trusted=True only if you trust where this shard comes from."
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
        return list(obj)
    raise ShardDecodeError(
        f"shard {name}: expected a list of Data, a Batch or a (data, slices) tuple, "
        f"got {type(obj).__name__}"
    )


def _decode_atp(buffer: bytes | bytearray, name: str) -> list[Data]:
    from pyg_atompack import atp
    from pyg_atompack.pyg import flat_to_data_list

    try:
        reader = atp.Reader.from_bytes(buffer, name=name)
    except atp.AtpError as error:
        raise ShardDecodeError(f"shard {name}: {error}") from error
    try:
        flat = reader.read_batch(range(len(reader)))
        # owned copies: the decoded samples must not pin the downloaded bytes
        return [_owned(data) for data in flat_to_data_list(flat)]
    except atp.AtpError as error:
        raise ShardDecodeError(f"shard {name}: {error}") from error
    finally:
        reader.close()


def _owned(data: Data) -> Data:
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            data[key] = value.clone()
    return data


def decode_shard(buffer: bytes | bytearray, name: str, *, trusted: bool = False
                 ) -> Sequence[BaseData]:
    """Turn the bytes of one shard into an indexable sequence of PyG samples.

    The format is chosen by the name's suffix (``.atp`` or anything else as ``.pt``);
    an ``.atp`` payload is also recognised by its magic bytes.

    Args:
        buffer: The complete shard bytes. They are not referenced by the result.
        name: Shard name, used in error messages.
        trusted: Allow arbitrary pickles in ``.pt`` shards (``weights_only=False``).
            (default: :obj:`False`)

    Returns:
        A sequence of ``Data`` (``len`` and integer indexing).

    Raises:
        UnsafePayloadError: A ``.pt`` shard needs globals outside the allow-list.
        ShardDecodeError: The bytes are not a readable shard.
    """
    if name.endswith(".atp") or bytes(buffer[:4]) == ATP_MAGIC:
        return _decode_atp(buffer, name)
    return _as_samples(_load_pt(buffer, name, trusted), name)
