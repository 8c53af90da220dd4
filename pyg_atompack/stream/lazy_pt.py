"""Lazy decoding of ``.pt`` shards that hold a list of plain ``Data`` objects.

``torch.load`` turns a shard of N small molecules into N ``Data`` objects, each with a
storage object, a tensor object and a ``TensorImpl`` per attribute: measured on 64-atom
structures, a 12.5 MiB file becomes ~38 MiB of live objects, and the unpickler's memo
holds every intermediate object until the load ends. That alone breaks a memory bound
of "(prefetch + 1) shards".

This module reads the same archive without building any of it. A small pickle machine
(:class:`_ShardPickleMachine`) runs the opcodes ``torch.save`` emits for a list of
``Data`` and, as each sample completes, writes where its tensors lie in the downloaded
buffer into compact columns (one offset and one shape per tensor); the per-sample
objects are then dropped from the memo. The decoded shard is the buffer plus those
columns (a few percent of it), and :class:`LazyPtSamples` builds each ``Data`` when the
consumer takes it, as tensors over the buffer's bytes (no copy).

The machine never calls anything: it knows the handful of globals such a pickle names
(the ``Data`` and ``GlobalStorage`` classes, torch's tensor rebuild function, storage
types, ``OrderedDict`` for empty hooks) and gives up (:class:`NotLazyLayout`) on
anything else. The caller then decodes the shard with the restricted ``torch.load``,
which applies the allow-list and its error messages. Giving up is also the answer for
shapes it does not index (``HeteroData``, non-contiguous tensors, tensors requiring
grad, a sample referenced twice, big-endian archives).
"""

from __future__ import annotations

import math
import struct
import warnings
from array import array
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data

from pyg_atompack.stream.buffers import BufferViewSamples, WritableBuffer, is_writable_buffer
from pyg_atompack.stream.torch_zip import TorchArchive, TorchZipError, read_torch_archive

__all__ = ["LazyPtSamples", "NotLazyLayout", "decode_pt_lazily"]


class NotLazyLayout(Exception):
    """The archive is not a list of plain ``Data`` this module can index in place."""


class _Global:
    """A global the machine knows by name; only its ``kind`` is ever used."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any = None) -> None:
        self.kind = kind
        self.value = value


def _known_globals() -> dict[tuple[str, str], _Global]:
    known = {
        ("torch_geometric.data.data", "Data"): _Global("data"),
        ("torch_geometric.data.storage", "GlobalStorage"): _Global("store"),
        ("torch_geometric.data.data", "DataEdgeAttr"): _Global("ignored"),
        ("torch_geometric.data.data", "DataTensorAttr"): _Global("ignored"),
        ("torch._utils", "_rebuild_tensor_v2"): _Global("tensor"),
        ("collections", "OrderedDict"): _Global("hooks"),
        ("torch", "UntypedStorage"): _Global("storage", torch.uint8),
    }
    with warnings.catch_warnings():  # reading a legacy storage class's dtype warns
        warnings.simplefilter("ignore")
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                dtype = getattr(getattr(torch, name), "dtype", None)
                if isinstance(dtype, torch.dtype):
                    known[("torch", name)] = _Global("storage", dtype)
    return known


_KNOWN_GLOBALS = _known_globals()
_EMPTY_HOOKS = _Global("empty hooks")  # what ``OrderedDict()`` rebuilds to here
_UINT32 = struct.Struct("<I")
_MISSING = _Global("missing")  # an attribute a sample does not have


class _Sample:
    """A ``Data`` under construction; becomes its row number once finished."""

    __slots__ = ("row",)

    def __init__(self) -> None:
        self.row = -1


class _Store:
    """A ``GlobalStorage`` under construction; keeps its pickled state."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = None


class _TensorRef(tuple):
    """``(byte offset in the buffer, dtype, shape)`` of one contiguous tensor."""

    __slots__ = ()


_KEEPABLE = (str, int, float, bytes, bool, type(None), _Global)


class _TensorColumn:
    """Offsets and shapes of one attribute's tensors, one row per sample."""

    def __init__(self, dtype: torch.dtype, ndim: int, rows_before: int) -> None:
        self.dtype = dtype
        self.ndim = ndim
        self.offsets = array("q", [-1]) * rows_before  # -1: the sample lacks the key
        self.shapes = array("q", [0]) * (rows_before * ndim)

    def append(self, offset: int, shape: tuple[int, ...]) -> None:
        self.offsets.append(offset)
        self.shapes.extend(shape)

    def append_missing(self) -> None:
        self.offsets.append(-1)
        self.shapes.extend([0] * self.ndim)


class _ObjectColumn:
    """Plain Python values (numbers, strings) of one attribute, one row per sample."""

    def __init__(self, rows_before: int) -> None:
        self.values: list[Any] = [_MISSING] * rows_before

    def append(self, value: Any) -> None:
        self.values.append(value)

    def append_missing(self) -> None:
        self.values.append(_MISSING)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _ShardPickleMachine:
    """Runs a ``torch.save`` pickle of a ``Data`` list into per-attribute columns.

    Args:
        pickle_bytes: The archive's ``data.pkl`` record.
        storages: ``{storage key: (offset, size)}`` of the archive's storage records.
    """

    def __init__(self, buffer: WritableBuffer, archive: TorchArchive):
        self.buffer = buffer
        self.start = archive.pickle[0]
        self.end = archive.pickle[0] + archive.pickle[1]
        self.storages = archive.storages
        self.columns: dict[str, _TensorColumn | _ObjectColumn] = {}
        self.rows = 0
        self.fresh_memo: list[int] = []
        self.element_counts: dict[tuple, int] = {}  # (shape, stride) -> elements

    # ------------------------------------------------------------------ semantics
    def _storage(self, pid: Any) -> tuple[int, torch.dtype, int]:
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage"
                or type(pid[1]) is not _Global or pid[1].kind != "storage"
                or type(pid[2]) is not str or type(pid[4]) is not int):
            raise NotLazyLayout("persistent id is not a tensor storage")
        _, storage_type, key, _, numel = pid
        record = self.storages.get(key)
        if record is None or numel < 0 or numel * storage_type.value.itemsize > record[1]:
            raise NotLazyLayout(f"storage {key!r} is missing or short")
        return record[0], storage_type.value, numel

    def _element_count(self, shape: Any, stride: Any) -> int:
        if (type(shape) is not tuple or type(stride) is not tuple
                or len(shape) != len(stride)
                or not all(type(size) is int and size >= 0 for size in shape)):
            raise NotLazyLayout("malformed tensor geometry")
        count = math.prod(shape)
        if count and any(size != 1 and step != expected for size, step, expected
                         in zip(shape, stride, _contiguous_strides(shape))):
            raise NotLazyLayout("non-contiguous tensor")
        self.element_counts[(shape, stride)] = count
        return count

    def _tensor(self, args: Any) -> _TensorRef:
        if type(args) is not tuple or len(args) not in (6, 7):
            raise NotLazyLayout("unexpected tensor rebuild arguments")
        storage, start, shape, stride, requires_grad, hooks = args[:6]
        if requires_grad is not False or hooks is not _EMPTY_HOOKS or (
                len(args) == 7 and args[6] is not None):
            raise NotLazyLayout("tensor with gradient state, hooks or metadata")
        count = self.element_counts.get((shape, stride))
        if count is None:
            count = self._element_count(shape, stride)
        offset, dtype, numel = storage
        if type(start) is not int or start < 0 or start + count > numel:
            raise NotLazyLayout("tensor extends past its storage")
        at = offset + start * dtype.itemsize
        if at % dtype.itemsize:
            raise NotLazyLayout("misaligned storage")
        return _TensorRef((at, dtype, shape))

    def _finish_sample(self, sample: _Sample, state: Any) -> None:
        if sample.row >= 0 or not isinstance(state, dict):
            raise NotLazyLayout("Data state is not a dict")
        store = state.get("_store")
        if not isinstance(store, _Store) or not isinstance(store.state, dict):
            raise NotLazyLayout("Data without a GlobalStorage")
        if set(state) - {"_store", "_edge_attr_cls", "_tensor_attr_cls"} or set(
                store.state) - {"_mapping", "_parent"}:
            raise NotLazyLayout("Data with extra state")
        mapping = store.state.get("_mapping")
        if not isinstance(mapping, dict):
            raise NotLazyLayout("GlobalStorage without a mapping")
        row = self.rows
        columns = self.columns
        for key, value in mapping.items():
            column = columns.get(key)
            if type(value) is _TensorRef:
                offset, dtype, shape = value
                if column is None:
                    column = columns[key] = _TensorColumn(dtype, len(shape), row)
                elif (type(column) is not _TensorColumn or column.dtype != dtype
                      or column.ndim != len(shape)):
                    raise NotLazyLayout(f"attribute {key!r} changes type between samples")
                column.append(offset, shape)
            else:
                if not isinstance(key, str) or not isinstance(value, _KEEPABLE) or isinstance(
                        value, _Global):
                    raise NotLazyLayout(f"attribute {key!r} is not a tensor or a scalar")
                if column is None:
                    column = columns[key] = _ObjectColumn(row)
                elif type(column) is not _ObjectColumn:
                    raise NotLazyLayout(f"attribute {key!r} changes type between samples")
                column.append(value)
        if len(mapping) != len(columns):
            for key, column in columns.items():
                if key not in mapping:
                    column.append_missing()
        sample.row = row
        self.rows = row + 1

    def _forget_sample_objects(self, memo: dict[int, Any]) -> None:
        # A finished sample's containers and storage keys (torch names storages with
        # numbers) are not referenced again by a torch.save pickle: samples share only
        # attribute names and globals. If one is (a storage shared between samples),
        # the missing memo entry makes the machine give up, and the shard is decoded
        # the ordinary way.
        for index in self.fresh_memo:
            value = memo[index]
            if (not isinstance(value, _KEEPABLE) or value is _EMPTY_HOOKS
                    or (type(value) is str and value.isdigit())):
                del memo[index]
        self.fresh_memo.clear()

    # ------------------------------------------------------------------ the machine
    def run(self) -> list[_Sample]:  # noqa: C901 - one dispatch loop, kept flat for speed
        """Execute the pickle.

        Returns:
            The unpickled top-level object (a list or tuple of finished samples).

        Raises:
            NotLazyLayout: An opcode, global or structure outside the indexed layout.
        """
        data = self.buffer  # read in place: the pickle is a record of the buffer
        memo: dict[int, Any] = {}
        memoised = 0
        stack: list[Any] = []
        push = stack.append
        marks: list[int] = []
        remember = self.fresh_memo.append
        unpack_from = struct.unpack_from
        uint32 = _UINT32.unpack_from
        at = self.start
        end = self.end
        # branches in the order of how often torch.save emits them for a Data list
        while at < end:
            op = data[at]
            at += 1
            if op == 0x68:  # BINGET
                push(memo[data[at]])  # KeyError for a finished sample's object
                at += 1
            elif op == 0x72:  # LONG_BINPUT
                if memoised:
                    raise NotLazyLayout("explicit PUT after MEMOIZE")
                index = uint32(data, at)[0]
                memo[index] = stack[-1]
                remember(index)
                at += 4
            elif op == 0x4B:  # BININT1
                push(data[at])
                at += 1
            elif op == 0x28:  # MARK
                marks.append(len(stack))
            elif op == 0x74:  # TUPLE
                start = marks.pop()
                items = tuple(stack[start:])
                del stack[start:]
                push(items)
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                function = stack[-1]
                if type(function) is not _Global:
                    raise NotLazyLayout("call of an unknown object")
                if function.kind == "tensor":
                    stack[-1] = self._tensor(args)
                elif function.kind == "hooks" and args == ():
                    stack[-1] = _EMPTY_HOOKS
                else:
                    raise NotLazyLayout(f"call of {function.kind}")
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
            elif op == 0x58:  # BINUNICODE
                length = uint32(data, at)[0]
                at += 4
                push(data[at:at + length].decode("utf-8", "surrogatepass"))
                at += length
            elif op == 0x51:  # BINPERSID
                stack[-1] = self._storage(stack[-1])
            elif op == 0x86:  # TUPLE2
                second = stack.pop()
                stack[-1] = (stack[-1], second)
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x7D:  # EMPTY_DICT
                push({})
            elif op == 0x75:  # SETITEMS
                start = marks.pop()
                target = stack[start - 1]
                if type(target) is not dict:
                    raise NotLazyLayout("SETITEMS on a non-dict")
                for position in range(start, len(stack), 2):
                    target[stack[position]] = stack[position + 1]
                del stack[start:]
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack[-1]
                if type(cls) is not _Global or args != ():
                    raise NotLazyLayout("instance of an unknown class")
                if cls.kind == "data":
                    stack[-1] = _Sample()
                elif cls.kind == "store":
                    stack[-1] = _Store()
                else:
                    raise NotLazyLayout(f"instance of {cls.kind}")
            elif op == 0x62:  # BUILD
                state = stack.pop()
                target = stack[-1]
                if type(target) is _Store and target.state is None:
                    target.state = state
                elif type(target) is _Sample:
                    self._finish_sample(target, state)
                    self._forget_sample_objects(memo)
                else:
                    raise NotLazyLayout("state for an unknown object")
            elif op == 0x6A:  # LONG_BINGET
                push(memo[uint32(data, at)[0]])
                at += 4
            elif op == 0x71:  # BINPUT
                if memoised:
                    raise NotLazyLayout("explicit PUT after MEMOIZE")
                memo[data[at]] = stack[-1]
                remember(data[at])
                at += 1
            elif op == 0x4D:  # BININT2
                push(data[at] | data[at + 1] << 8)
                at += 2
            elif op == 0x4A:  # BININT
                push(unpack_from("<i", data, at)[0])
                at += 4
            elif op == 0x8C:  # SHORT_BINUNICODE
                length = data[at]
                at += 1
                push(data[at:at + length].decode("utf-8", "surrogatepass"))
                at += length
            elif op == 0x87:  # TUPLE3
                third = stack.pop()
                second = stack.pop()
                stack[-1] = (stack[-1], second, third)
            elif op == 0x5D:  # EMPTY_LIST
                push([])
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                if type(stack[-1]) is not dict:
                    raise NotLazyLayout("SETITEM on a non-dict")
                stack[-1][key] = value
            elif op == 0x65:  # APPENDS
                start = marks.pop()
                target = stack[start - 1]
                if type(target) is not list:
                    raise NotLazyLayout("APPENDS on a non-list")
                target.extend(stack[start:])
                del stack[start:]
            elif op == 0x61:  # APPEND
                value = stack.pop()
                if type(stack[-1]) is not list:
                    raise NotLazyLayout("APPEND on a non-list")
                stack[-1].append(value)
            elif op == 0x63:  # GLOBAL
                newline = data.find(b"\n", at, end)
                second = data.find(b"\n", newline + 1, end)
                if newline < 0 or second < 0:
                    raise NotLazyLayout("truncated GLOBAL")
                module = data[at:newline].decode("ascii")
                name = data[newline + 1:second].decode("ascii")
                at = second + 1
                known = _KNOWN_GLOBALS.get((module, name))
                if known is None:
                    raise NotLazyLayout(f"global {module}.{name}")
                push(known)
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                known = _KNOWN_GLOBALS.get((module, name))
                if known is None:
                    raise NotLazyLayout(f"global {module}.{name}")
                push(known)
            elif op == 0x94:  # MEMOIZE
                # the index is the count of entries memoised so far: len(memo) would
                # undercount once finished samples' entries are deleted. Picklers
                # use either MEMOIZE or explicit PUTs, never both in one pickle.
                if memoised == 0 and memo:
                    raise NotLazyLayout("MEMOIZE after explicit PUTs")
                index = memoised
                memoised += 1
                memo[index] = stack[-1]
                remember(index)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x47:  # BINFLOAT
                push(unpack_from(">d", data, at)[0])
                at += 8
            elif op == 0x8A:  # LONG1
                length = data[at]
                push(int.from_bytes(data[at + 1:at + 1 + length], "little",
                                            signed=True))
                at += 1 + length
            elif op == 0x80:  # PROTO
                at += 1
            elif op == 0x95:  # FRAME
                at += 8
            elif op == 0x2E:  # STOP
                if len(stack) != 1 or marks:
                    raise NotLazyLayout("unbalanced pickle")
                return stack[0]
            else:
                raise NotLazyLayout(f"opcode {op:#04x}")
        raise NotLazyLayout("pickle ends without STOP")


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other types numpy lacks
        return None


class LazyPtSamples(BufferViewSamples):
    """The samples of a ``.pt`` shard, built from its buffer one at a time when taken.

    Each tensor of a sample views its own bytes of the shard buffer and has a storage of
    exactly its size (sending a sample to another process shares just that sample); no
    bytes are copied. The ``Data`` gets the attribute mapping the pickle holds, as
    ``torch.load`` restores it.

    Args:
        buffer: The shard's writable bytes.
        tensor_columns: ``{key: (dtype, offsets, shapes, ndim)}``.
        object_columns: ``{key: values}`` for plain Python attributes.
        length: Number of samples.
    """

    def __init__(self, buffer: WritableBuffer, tensor_columns: dict[str, tuple],
                 object_columns: dict[str, list], length: int) -> None:
        super().__init__(length)
        self._buffer = buffer
        self._bytes = np.frombuffer(buffer, dtype=np.uint8) if len(buffer) else None
        self._tensors = [(key, dtype, _numpy_dtype(dtype), dtype.itemsize, offsets, shapes,
                          ndim) for key, (dtype, offsets, shapes, ndim)
                         in tensor_columns.items()]
        self._objects = object_columns

    def _tensor(self, dtype: torch.dtype, numpy_dtype: np.dtype | None, offset: int,
                shape: tuple[int, ...], itemsize: int) -> torch.Tensor:
        count = math.prod(shape)
        if not count:
            return torch.empty(shape, dtype=dtype)
        if numpy_dtype is not None:  # the faster route (~1 us against ~2 us)
            view = self._bytes[offset:offset + count * itemsize].view(numpy_dtype)
            return torch.from_numpy(view.reshape(shape))
        return torch.frombuffer(self._buffer, dtype=dtype, count=count,
                                offset=offset).view(shape)

    def _build(self, index: int) -> Data:
        mapping = {}
        for key, dtype, numpy_dtype, itemsize, offsets, shapes, ndim in self._tensors:
            offset = offsets[index]
            if offset >= 0:
                shape = tuple(shapes[index * ndim:(index + 1) * ndim])
                mapping[key] = self._tensor(dtype, numpy_dtype, offset, shape, itemsize)
        for key, column in self._objects.items():
            value = column[index]
            if value is not _MISSING:
                mapping[key] = value
        data = Data()
        # the pickled mapping as it was, like torch.load's __setstate__ (attribute
        # assignment would be four times slower and would drop None values)
        data._store._mapping.update(mapping)
        return data


def decode_pt_lazily(buffer: WritableBuffer) -> LazyPtSamples:
    """Index a ``torch.save`` archive of a list of ``Data`` without unpickling it.

    Args:
        buffer: The archive's bytes. Kept (not copied) as the samples' storage; it must
            not be modified afterwards.

    Returns:
        The shard's samples.

    Raises:
        NotLazyLayout: The archive holds anything else (or is damaged); decode it with
            ``torch.load`` instead, which gives the precise error where there is one.
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
    machine = _ShardPickleMachine(buffer, archive)
    try:
        result = machine.run()
    except (IndexError, KeyError, struct.error, UnicodeDecodeError, TypeError, ValueError,
            OverflowError) as error:  # truncated or odd pickles: let torch.load judge them
        raise NotLazyLayout(f"{type(error).__name__}: {error}") from None
    if not isinstance(result, (list, tuple)) or any(
            type(sample) is not _Sample or sample.row != row
            for row, sample in enumerate(result)):
        raise NotLazyLayout("not a list of Data")
    tensor_columns = {}
    object_columns = {}
    for key, column in machine.columns.items():
        if isinstance(column, _TensorColumn):
            tensor_columns[key] = (column.dtype, column.offsets, column.shapes, column.ndim)
        else:
            object_columns[key] = column.values
    return LazyPtSamples(buffer, tensor_columns, object_columns, len(result))
