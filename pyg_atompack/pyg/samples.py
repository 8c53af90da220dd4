"""Sequences of samples built when taken: lazily decoded files and collated datasets.

A decoded ``.pt`` or ``.atp`` file is kept as its bytes plus an index, not as one
``Data`` per sample (which costs about three times the file). The sequences here build
each sample when it is taken, its tensors viewing the decoded file's memory.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch_geometric.data import Data
from torch_geometric.data.data import BaseData
from torch_geometric.data.storage import recursive_apply

from .data import data_from_mapping
from .errors import PtPayloadError

__all__ = ["BufferViewSamples", "CollatedSamples", "bounds_problem", "overlapping"]

_PLAIN_ITEMS = (str, int, float, bool, bytes, type(None))
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def overlapping(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a strided view may reach one storage element through two indices.

    The dimensions longer than one are taken by increasing stride, and each stride must
    step past every element the smaller ones reach. Every narrow, step slice, select and
    permutation of a contiguous tensor passes (all that PyG's ``collate``, ``separate``
    and ``InMemoryDataset`` slicing produce); a zero stride on a dimension longer than one
    (what ``expand`` gives) or two dimensions with one stride do not. A view that passes
    holds at most as many elements as the storage span it covers, so its size is
    bounded by its storage's bytes.

    Args:
        shape (Sequence[int]): The view's sizes.
        stride (Sequence[int]): Its strides, in elements.

    Returns:
        :obj:`True` when the view may overlap itself (an empty view never does).
    """
    if 0 in shape:
        return False
    reach = 0  # the largest offset the smaller dimensions reach
    for step, size in sorted((step, size) for size, step in zip(shape, stride) if size > 1):
        if step <= reach:
            return True
        reach += (size - 1) * step
    return False


def _tensors(name: str, value: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors inside an attribute value (nested lists, tuples and dicts too)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from _tensors(f"{name}[{position}]", item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(f"{name}[{key!r}]", item)


def bounds_problem(sample: BaseData | dict[str, Any], limit: int) -> str | None:
    """Why a decoded sample cannot be what a file of ``limit`` bytes holds, if it cannot.

    A sample of a ``.pt`` file views that file's storages: no tensor of it may reuse
    storage elements (:func:`overlapping`; ``torch.ones(1).expand(2**40)`` claims 2**40
    elements in an 8-byte storage) and its tensors together cannot hold more bytes than
    the file. Checked before anything allocates what the sample claims (a collate, a
    copy to a device).

    Args:
        sample (BaseData | dict[str, Any]): A ``Data``, ``HeteroData``, the collated
            data of a ``(data, slices)`` file or its slices.
        limit (int): The file's size in bytes.

    Returns:
        :obj:`None`, or what is wrong, naming the attribute (``"attribute 'pos': ..."``).
    """
    total = 0
    for store in ([sample] if isinstance(sample, dict) else sample.stores):
        store_key = getattr(store, "__dict__", {}).get("_key")  # a HeteroData's type
        prefix = "" if store_key is None else f"{store_key}."
        for key, value in store.items():
            for name, tensor in _tensors(f"{prefix}{key}", value):
                if tensor.layout != torch.strided:
                    continue  # sparse tensors are made of strided ones torch checked
                if overlapping(tensor.shape, tensor.stride()):
                    return (f"attribute {name!r}: a tensor of shape {tuple(tensor.shape)} "
                            f"with strides {tensor.stride()} reuses elements of its "
                            f"storage, which torch.save of PyG data never writes")
                total += math.prod(tensor.shape) * tensor.element_size()
                if total > limit:
                    return (f"attribute {name!r}: its tensors claim {total} bytes so far, "
                            f"more than the {limit} bytes of the file")
    return None


class BufferViewSamples(Sequence):
    """The samples of a file decoded in place, each built from its memory when taken.

    Subclasses implement :meth:`_build`. A built sample's tensors view the file's
    memory, so keeping one alive keeps all of it alive; :meth:`detached` gives a sample
    with its own copies, for samples that may outlive their file.

    Args:
        length (int): Number of samples.
    """

    #: Samples are views of the file's memory: one kept alive keeps all of it.
    views_into_buffer = True

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int | slice) -> BaseData | list[BaseData]:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"sample {index} out of range for {self._length} samples")
        return self._build(index)

    def _build(self, index: int) -> BaseData:
        raise NotImplementedError

    def detached(self, index: int) -> BaseData:
        """Sample ``index`` with tensors of its own, not views of the file's memory.

        Args:
            index (int): Position of the sample.

        Returns:
            The sample, holding no reference to the file's memory.
        """
        sample = self[index]
        if type(sample) is not Data:
            return sample.apply(torch.clone)
        # what Data.apply(torch.clone) gives, without its per-store walk (~4x the time)
        return data_from_mapping({key: recursive_apply(value, torch.clone)
                                  for key, value in sample._store._mapping.items()})


class CollatedSamples(BufferViewSamples):
    """The samples of a collated ``(data, slices)`` dataset, cut out when taken.

    Gives what ``InMemoryDataset.__getitem__`` gives (``separate`` with
    ``decrement=False``): each tensor attribute narrowed along its ``__cat_dim__`` to
    the sample's slice (a view of the collated tensor), each list attribute's element
    at the sample's index. The slices are checked against the data when the sequence
    is made, so a damaged file fails there and never halfway through a loop.

    Only plain ``Data`` with tensor and list attributes is cut here
    (:meth:`indexes`); other collated data is separated by PyG's ``separate``.

    Args:
        data (torch_geometric.data.Data): The collated data.
        slices (dict[str, torch.Tensor]): Sample boundaries of each attribute.
    """

    def __init__(self, data: Data, slices: dict[str, torch.Tensor]) -> None:
        lengths = {int(cut.numel()) for cut in slices.values()}
        if len(lengths) != 1:
            raise PtPayloadError("malformed (data, slices) payload: slice tensors differ "
                                 "in length")
        count = max(lengths.pop() - 1, 0)
        super().__init__(count)
        store = data._store
        self._columns: list[tuple[str, Any, int | None, array]] = []
        for key, cut in slices.items():
            if cut.dim() != 1 or cut.dtype not in _INTEGER_DTYPES:
                raise PtPayloadError(f"malformed (data, slices) payload: slices of {key!r} "
                                     f"are not a vector of integers")
            bounds = array("q", cut.tolist())
            if count and (bounds[0] != 0 or any(
                    later < earlier for earlier, later in zip(bounds, bounds[1:]))):
                raise PtPayloadError(f"malformed (data, slices) payload: slices of {key!r} "
                                     f"do not start at 0 and increase")
            if key not in store:  # separate skips slices of absent attributes
                continue
            values = store[key]
            if isinstance(values, torch.Tensor):
                dim = data.__cat_dim__(key, values, store)
                if values.dim() == 0 or not -values.dim() <= dim < values.dim():
                    raise PtPayloadError(f"malformed (data, slices) payload: {key!r} has "
                                         f"no dimension {dim} to cut")
                dim %= values.dim()
                size = values.size(dim)
            else:
                dim, size = None, len(values) if count else 0
            if count and (bounds[-1] > size if dim is not None else size < count):
                raise PtPayloadError(f"malformed (data, slices) payload: slices of {key!r} "
                                     f"run past its {size} entries")
            self._columns.append((key, values, dim, bounds))

    @staticmethod
    def indexes(data: Any, slices: Any) -> bool:
        """Whether a collated ``(data, slices)`` pair is cut by this class.

        Args:
            data (Any): The collated data.
            slices (Any): Its slices.

        Returns:
            :obj:`True` for plain ``Data`` (no explicit node counts) whose attributes
            are dense tensors or lists of plain values, with tensor slices.
        """
        if type(data) is not Data or not isinstance(slices, dict) or not slices:
            return False
        store = data._store
        if hasattr(store, "_num_nodes") or not all(
                isinstance(cut, torch.Tensor) for cut in slices.values()):
            return False
        for key in slices:
            if key not in store:
                continue
            value = store[key]
            if type(value) is torch.Tensor:
                if value.layout != torch.strided:
                    return False
            elif not (type(value) is list and all(isinstance(item, _PLAIN_ITEMS)
                                                  for item in value)):
                return False
        return True

    def _build(self, index: int) -> Data:
        mapping = {}
        for key, values, dim, bounds in self._columns:
            if dim is None:
                mapping[key] = values[index]
            else:
                start = bounds[index]
                mapping[key] = values.narrow(dim, start, bounds[index + 1] - start)
        return data_from_mapping(mapping)
