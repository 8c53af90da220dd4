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


class CollatedShard(Sequence):
    """Lazy view of a collated ``(data, slices)`` shard: sample ``i`` is cut on access.

    Args:
        data: The collated data object.
        slices: The slice dictionary of ``InMemoryDataset.collate``.
    """

    def __init__(self, data: BaseData, slices: dict):
        self.data = data
        self.slices = slices
        first = next(iter(slices.values()))
        self._length = int(len(first) - 1)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> BaseData:
        if not -self._length <= index < self._length:
            raise IndexError(f"sample {index} out of range for a shard of {self._length}")
        return separate(type(self.data), batch=self.data, idx=index % self._length,
                        slice_dict=self.slices, decrement=False)


def _load_pt(buffer: bytes | bytearray | memoryview, name: str, trusted: bool) -> Any:
    stream = io.BytesIO(buffer)
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
        return CollatedShard(data, slices)
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
