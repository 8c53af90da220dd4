"""Lazy decoding of ``.pt`` files: index a whole ``torch.save`` archive in place.

``torch.load`` of a shard builds every sample's objects at once and keeps them until the
load ends, which breaks a memory bound of "(prefetch + 1) shards". :func:`index_pt` runs
the archive's pickle through the pickle machine (:mod:`.pt_pickle`) instead and serves
samples that view the buffer's bytes, built when taken. Three layouts are indexed:

* a list (or tuple) of ``Data`` whose tensors own their storages
  (:class:`LazyPtSamples`);
* a list of ``Data`` whose tensors are views of storages shared between samples, which
  is what ``torch.save([dataset[i] for i in ...])`` writes for an ``InMemoryDataset``
  (FoldPipe's shards): each sample's views are indexed, the shared storage is neither
  copied nor split (also :class:`LazyPtSamples`);
* a collated ``(data, slices)`` tuple, or the ``(data.to_dict(), slices, Data)`` triple
  of ``InMemoryDataset.save``: the collated tensors are viewed in place and each sample
  is cut out when taken, as ``InMemoryDataset`` does
  (:class:`~pyg_atompack.pyg.samples.CollatedSamples`).

Anything else (and big-endian archives) raises :class:`~.pt_pickle.NotLazyLayout`; the
caller then decodes the file with ``torch.load(weights_only=True)``
(:func:`pyg_atompack.pyg.pt.decode_pt`).
"""

from __future__ import annotations

import math
import struct
from array import array
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data

from pyg_atompack.transport.buffers import WritableBuffer, is_writable_buffer

from .data import data_from_mapping
from .errors import PtPayloadError
from .pt_archive import TorchZipError, read_torch_archive
from .pt_pickle import (
    MISSING,
    KnownGlobal,
    NotLazyLayout,
    Sample,
    ShardPickleMachine,
    TensorColumn,
    TensorRef,
    bounds_problem,
    contiguous_strides,
    plain_value,
)
from .samples import BufferViewSamples, CollatedSamples

__all__ = ["LazyPtSamples", "index_pt", "list_columns", "refuse_problem"]


def refuse_problem(machine: ShardPickleMachine, layout: str) -> None:
    """Raise the problem the machine found in a sample, if it found one."""
    if machine.problem is not None:
        row, key, what = machine.problem
        where = f"sample {row}" if layout == "list" else "the collated data"
        raise PtPayloadError(f"{where}, attribute {key!r}: {what}")


def list_columns(machine: ShardPickleMachine, result: Any) -> tuple[dict, dict]:
    """The columns of a list of ``Data``, or :class:`NotLazyLayout` for anything else."""
    if not isinstance(result, (list, tuple)) or any(
            type(sample) is not Sample or sample.row != row
            for row, sample in enumerate(result)):
        raise NotLazyLayout("not a list of Data")
    tensor_columns = {}
    object_columns = {}
    for key, column in machine.columns.items():
        if isinstance(column, TensorColumn):
            tensor_columns[key] = (column.dtype, column.offsets, column.shapes,
                                   column.strides, column.ndim)
        else:
            object_columns[key] = column.values
    return tensor_columns, object_columns


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other types numpy lacks
        return None


class _BufferTensors:
    """Builds tensors that view a buffer's bytes (no copy)."""

    def __init__(self, buffer: WritableBuffer) -> None:
        self.buffer = buffer
        self.bytes = np.frombuffer(buffer, dtype=np.uint8) if len(buffer) else None
        self._typed: dict[np.dtype, np.ndarray] = {}

    def typed(self, numpy_dtype: np.dtype) -> np.ndarray | None:
        """The whole buffer as an array of ``numpy_dtype`` (:obj:`None` if empty).

        Slicing it by element skips the per-tensor ``view`` of a byte slice (~2 us a
        tensor instead of ~3 us); the caller keeps to aligned offsets.
        """
        view = self._typed.get(numpy_dtype)
        if view is None and self.bytes is not None:
            count = len(self.bytes) // numpy_dtype.itemsize
            view = self._typed[numpy_dtype] = np.frombuffer(self.buffer, numpy_dtype,
                                                            count=count)
        return view

    def tensor(self, dtype: torch.dtype, numpy_dtype: np.dtype | None, offset: int,
               shape: tuple[int, ...], stride: tuple[int, ...] | None) -> torch.Tensor:
        if stride is None:
            count = math.prod(shape)
            if not count:
                return torch.empty(shape, dtype=dtype)
            if numpy_dtype is not None:  # the faster route (~3 us against ~3.5 us)
                view = self.bytes[offset:offset + count * dtype.itemsize].view(numpy_dtype)
                return torch.from_numpy(view.reshape(shape))
            return torch.frombuffer(self.buffer, dtype=dtype, count=count,
                                    offset=offset).view(shape)
        span = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
        flat = torch.frombuffer(self.buffer, dtype=dtype, count=span, offset=offset)
        return flat.as_strided(shape, stride)

    def of(self, ref: TensorRef) -> torch.Tensor:
        offset, dtype, shape, stride, _ = ref
        return self.tensor(dtype, _numpy_dtype(dtype), offset, shape, stride)


def _uniform_shape(shapes: array, ndim: int) -> tuple[int, ...] | None:
    """The shape every row of a column has, or :obj:`None` if rows differ (or none)."""
    rows = len(shapes) // ndim if ndim else 0
    if not rows:
        return None if ndim else ()
    first = shapes[:ndim]
    if 0 in first or first * rows != shapes:  # 0 also stands in for a missing row
        return None
    return tuple(first)


class LazyPtSamples(BufferViewSamples):
    """The samples of a ``.pt`` list of ``Data``, built from its buffer when taken.

    Each tensor of a sample views its bytes of the buffer; a contiguous one has a
    storage of exactly its size (sending a sample to another process shares just that
    sample), a strided view one spanning its elements. No bytes are copied. The
    ``Data`` gets the attribute mapping the pickle holds, as ``torch.load`` restores it.

    Args:
        buffer (bytearray | mmap.mmap): The file's writable bytes.
        tensor_columns (dict[str, tuple]): ``{key: (dtype, offsets, shapes, strides,
            ndim)}``; ``strides`` is :obj:`None` when every row is contiguous.
        object_columns (dict[str, list]): ``{key: values}`` for plain Python attributes.
        length (int): Number of samples.
    """

    def __init__(self, buffer: WritableBuffer, tensor_columns: dict[str, tuple],
                 object_columns: dict[str, list], length: int) -> None:
        super().__init__(length)
        self._views = _BufferTensors(buffer)
        self._tensors = []
        for key, (dtype, offsets, shapes, strides, ndim) in tensor_columns.items():
            numpy_dtype = _numpy_dtype(dtype)
            # a column of contiguous rows numpy can type is sliced from one typed view
            # of the buffer; the same shape in every row (per-molecule labels always,
            # fixed-size molecules often) is kept once, not read back for every row
            typed = (self._views.typed(numpy_dtype)
                     if numpy_dtype is not None and strides is None else None)
            self._tensors.append((key, dtype, numpy_dtype, offsets, shapes, strides, ndim,
                                  typed, dtype.itemsize, _uniform_shape(shapes, ndim)))
        self._objects = object_columns

    def _build(self, index: int) -> Data:
        mapping = {}
        from_numpy = torch.from_numpy
        for (key, dtype, numpy_dtype, offsets, shapes, strides, ndim, typed, itemsize,
             shape) in self._tensors:
            offset = offsets[index]
            if offset < 0:
                continue
            if shape is None:
                shape = tuple(shapes[index * ndim:(index + 1) * ndim])
            if typed is not None:
                start, misaligned = divmod(offset, itemsize)
                if not misaligned:
                    if ndim == 1:
                        if shape[0]:
                            mapping[key] = from_numpy(typed[start:start + shape[0]])
                            continue
                    else:
                        count = math.prod(shape)
                        if count:
                            mapping[key] = from_numpy(typed[start:start + count]
                                                      .reshape(shape))
                            continue
            stride = None
            if strides is not None:
                stride = tuple(strides[index * ndim:(index + 1) * ndim])
                if stride == contiguous_strides(shape):
                    stride = None
            mapping[key] = self._views.tensor(dtype, numpy_dtype, offset, shape, stride)
        for key, column in self._objects.items():
            value = column[index]
            if value is not MISSING:
                mapping[key] = list(value) if type(value) is list else value
        # the pickled mapping as it was, like torch.load's __setstate__ (attribute
        # assignment would be four times slower and would drop None values)
        return data_from_mapping(mapping)


def _collated(buffer: WritableBuffer, mapping: Any, slices: Any) -> CollatedSamples:
    """The samples of a collated ``(data, slices)`` archive, over its buffer."""
    if not isinstance(mapping, dict) or not isinstance(slices, dict) or not slices:
        raise NotLazyLayout("not a (data, slices) tuple")
    for what, values in (("slices", slices), ("the collated data", mapping)):
        claimed = 0
        for key, value in values.items():
            if type(value) is TensorRef:
                claimed += value[4]
                if value[4] < 0 or claimed > len(buffer):
                    raise PtPayloadError(f"{what}, attribute {key!r}: "
                                         f"{bounds_problem(value, claimed, len(buffer))}")
    views = _BufferTensors(buffer)
    data = data_from_mapping({key: views.of(value) if type(value) is TensorRef
                              else plain_value(key, value) for key, value in mapping.items()})
    cuts = {}
    for key, value in slices.items():
        if type(value) is not TensorRef:
            raise NotLazyLayout(f"slices of {key!r} are not a tensor")
        cuts[key] = views.of(value)
    if not CollatedSamples.indexes(data, cuts):
        raise NotLazyLayout("collated attributes this module does not cut")
    try:
        return CollatedSamples(data, cuts)
    except PtPayloadError:
        raise
    except Exception as error:  # noqa: BLE001 - damaged slices: torch.load judges them
        raise NotLazyLayout(f"{type(error).__name__}: {error}") from None


def index_pt(buffer: WritableBuffer) -> BufferViewSamples:
    """Index a ``torch.save`` archive of PyG samples without unpickling it.

    Args:
        buffer (bytearray | mmap.mmap): The archive's bytes. Kept (not copied) as the
            samples' storage; it must not be modified afterwards.

    Returns:
        The file's samples, built when taken.

    Raises:
        NotLazyLayout: The archive holds another layout (or is damaged); decode it with
            ``torch.load`` instead, which gives the precise error where there is one.
        PtPayloadError: A collated archive whose slices do not fit its data.
    """
    if not is_writable_buffer(buffer):
        raise NotLazyLayout("needs a writable bytearray or memory map")
    try:
        archive = read_torch_archive(buffer)
    except TorchZipError as error:
        raise NotLazyLayout(str(error)) from None
    if archive.byteorder is not None:
        offset, size = archive.byteorder
        if bytes(buffer[offset:offset + size]) != b"little":
            raise NotLazyLayout("big-endian archive")
    machine = ShardPickleMachine(buffer, archive)
    try:
        result = machine.run()
    except (IndexError, KeyError, struct.error, UnicodeDecodeError, TypeError, ValueError,
            OverflowError) as error:  # truncated or odd pickles: let torch.load judge them
        raise NotLazyLayout(f"{type(error).__name__}: {error}") from None
    if type(result) is tuple and len(result) == 2 and type(result[0]) is Sample \
            and machine.rows == 1:  # (data, slices)
        refuse_problem(machine, "collated")
        return _collated(buffer, machine.first_mapping, result[1])
    if type(result) is tuple and len(result) == 3 and type(result[2]) is KnownGlobal \
            and result[2].kind == "data" and machine.rows == 0:  # InMemoryDataset.save
        return _collated(buffer, result[0], result[1])
    tensor_columns, object_columns = list_columns(machine, result)
    refuse_problem(machine, "list")
    return LazyPtSamples(buffer, tensor_columns, object_columns, len(result))
