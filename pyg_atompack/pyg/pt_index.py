"""Lazy decoding of ``.pt`` files: index a ``torch.save`` archive without unpickling it.

``torch.load`` turns a shard of N small molecules into N ``Data`` objects, each with a
storage object, a tensor object and a ``TensorImpl`` per attribute: measured on 64-atom
structures, a 12.5 MiB file becomes ~38 MiB of live objects, and the unpickler's memo
holds every intermediate object until the load ends. That alone breaks a memory bound
of "(prefetch + 1) shards".

This module reads the same archive without building any of it. A small pickle machine
(:class:`_ShardPickleMachine`) runs the opcodes ``torch.save`` emits and, as each
``Data`` completes, writes where its tensors lie in the buffer into compact columns (one
offset, one shape and, for strided views, one stride per tensor); the per-sample
objects are then dropped from the memo. Three layouts are indexed:

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

The machine never calls anything: it knows the handful of globals such pickles name
(the ``Data`` and ``GlobalStorage`` classes, torch's tensor rebuild function, storage
types, ``OrderedDict`` for empty hooks) and gives up (:class:`NotLazyLayout`) on
anything else, and on shapes it does not index (``HeteroData``, tensors requiring grad,
a sample referenced twice, big-endian archives). The caller then decodes the file with
``torch.load(weights_only=True)`` (:func:`pyg_atompack.pyg.pt.decode_pt`).
"""

from __future__ import annotations

import math
import pickle
import pickletools
import struct
import threading
import time
import warnings
from array import array
from bisect import bisect_left
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data

from pyg_atompack.transport.buffers import WritableBuffer, is_writable_buffer

from .data import data_from_mapping
from .errors import PtPayloadError
from .pt_archive import (
    LocalRecord,
    TorchArchive,
    TorchZipError,
    crc_problem,
    data_crc,
    find_record_end,
    read_local_record,
    read_torch_archive,
    record_end,
)
from .samples import BufferViewSamples, CollatedSamples, overlapping

__all__ = ["ArrivingPt", "ArrivingPtSamples", "LazyPtSamples", "NotLazyLayout", "index_pt"]


class NotLazyLayout(Exception):
    """The archive is not a layout this module can index in place."""


class _Global:
    """A global the machine knows by name; only its ``kind`` is ever used."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any = None) -> None:
        self.kind = kind
        self.value = value


_TENSOR_REBUILD = _Global("tensor")


def _known_globals() -> dict[tuple[str, str], _Global]:
    known = {
        ("torch_geometric.data.data", "Data"): _Global("data"),
        ("torch_geometric.data.storage", "GlobalStorage"): _Global("store"),
        ("torch_geometric.data.data", "DataEdgeAttr"): _Global("ignored"),
        ("torch_geometric.data.data", "DataTensorAttr"): _Global("ignored"),
        ("torch._utils", "_rebuild_tensor_v2"): _TENSOR_REBUILD,
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
_MISSING = _Global("missing")  # an attribute a sample does not have
_KEEPABLE = (str, int, float, bytes, bool, type(None), _Global)
_UINT32 = struct.Struct("<I").unpack_from
_INT32 = struct.Struct("<i").unpack_from
_FLOAT64 = struct.Struct(">d").unpack_from
#: opcode byte -> its name, for messages
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


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


class _Memo(dict):
    """The pickle's memo, which forgets a finished sample's objects.

    A finished sample's containers and tensor references are not referenced again by a
    ``torch.save`` pickle: samples share attribute names, globals and, in list slices
    of a collated dataset, storages. :meth:`forget_sample` drops them; storage keys
    (torch numbers its storages ``"0"``, ``"1"``, ...) are remembered compactly (16
    bytes) so that a shared storage can be recalled when it is referenced again
    (``__missing__``); any other forgotten object referenced again makes the machine
    give up.
    """

    __slots__ = ("fresh", "forgotten_at", "forgotten_key")

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[int] = []  # indices memoised since the last finished sample
        # (memo index, storage number) of forgotten storage keys, in memo order
        self.forgotten_at = array("q")
        self.forgotten_key = array("q")

    def __missing__(self, index: int) -> str:
        # a storage key forgotten after an earlier sample goes back into the memo for
        # good: samples that view one shared storage name it by the key memoised with
        # the first of them
        position = bisect_left(self.forgotten_at, index)
        if position == len(self.forgotten_at) or self.forgotten_at[position] != index:
            raise NotLazyLayout("a finished sample's object is referenced again")
        key = self[index] = str(self.forgotten_key[position])
        return key

    def forget_sample(self) -> None:
        """Drop the entries memoised for the sample just finished (storage keys kept)."""
        for index in self.fresh:
            value = self[index]
            if type(value) is str and value.isdigit() and (value[0] != "0" or value == "0"):
                self.forgotten_at.append(index)
                self.forgotten_key.append(int(value))
                del self[index]
            elif not isinstance(value, _KEEPABLE) or value is _EMPTY_HOOKS:
                del self[index]
        self.fresh.clear()


class _TensorRef(tuple):
    """``(byte offset in the buffer, dtype, shape, stride, bytes)`` of one tensor.

    ``stride`` is :obj:`None` for a contiguous tensor; ``bytes`` is what its elements
    hold, or ``-1`` for a view that reuses storage elements (:func:`overlapping`).
    """

    __slots__ = ()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _TensorColumn:
    """Offsets, shapes and strides of one attribute's tensors, one row per sample.

    Strides are kept only once a strided view (e.g. ``edge_index[:, a:b]`` of a
    collated dataset) appears; until then every row is contiguous.
    """

    def __init__(self, dtype: torch.dtype, ndim: int, rows_before: int) -> None:
        self.dtype = dtype
        self.ndim = ndim
        self.offsets = array("q", [-1]) * rows_before  # -1: the sample lacks the key
        self.shapes = array("q", [0]) * (rows_before * ndim)
        self.strides: array | None = None

    def append(self, offset: int, shape: tuple[int, ...], stride: tuple[int, ...] | None,
               ) -> None:
        if stride is not None and self.strides is None:
            self.strides = array("q")
            for row in range(len(self.offsets)):
                self.strides.extend(_contiguous_strides(tuple(
                    self.shapes[row * self.ndim:(row + 1) * self.ndim])))
        self.offsets.append(offset)
        self.shapes.extend(shape)
        if self.strides is not None:
            self.strides.extend(stride if stride is not None else _contiguous_strides(shape))

    def append_missing(self) -> None:
        self.offsets.append(-1)
        self.shapes.extend([0] * self.ndim)
        if self.strides is not None:
            self.strides.extend([0] * self.ndim)


class _ObjectColumn:
    """Plain Python values (numbers, strings, lists of them) of one attribute."""

    def __init__(self, rows_before: int) -> None:
        self.values: list[Any] = [_MISSING] * rows_before

    def append(self, value: Any) -> None:
        self.values.append(value)

    def append_missing(self) -> None:
        self.values.append(_MISSING)


def _plain_value(key: Any, value: Any) -> Any:
    """``value`` if it may be an attribute kept as is: a scalar or a list of scalars."""
    if not isinstance(key, str):
        raise NotLazyLayout("attribute name is not a string")
    if type(value) is list:
        if all(isinstance(item, _KEEPABLE) and not isinstance(item, _Global)
               for item in value):
            return value
    elif isinstance(value, _KEEPABLE) and not isinstance(value, _Global):
        return value
    raise NotLazyLayout(f"attribute {key!r} is not a tensor, a scalar or a list of scalars")


# ---------------------------------------------------------------------- the machine
# Opcode bytes by name (``pickle.BINGET == b"h"``).
APPEND, APPENDS, BINFLOAT, BINGET, BININT, BININT1, BININT2, BINPERSID = (
    pickle.APPEND[0], pickle.APPENDS[0], pickle.BINFLOAT[0], pickle.BINGET[0],
    pickle.BININT[0], pickle.BININT1[0], pickle.BININT2[0], pickle.BINPERSID[0])
BINPUT, BINUNICODE, BUILD, EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, FRAME, GLOBAL = (
    pickle.BINPUT[0], pickle.BINUNICODE[0], pickle.BUILD[0], pickle.EMPTY_DICT[0],
    pickle.EMPTY_LIST[0], pickle.EMPTY_TUPLE[0], pickle.FRAME[0], pickle.GLOBAL[0])
LONG1, LONG_BINGET, LONG_BINPUT, MARK, MEMOIZE, NEWFALSE, NEWOBJ, NEWTRUE = (
    pickle.LONG1[0], pickle.LONG_BINGET[0], pickle.LONG_BINPUT[0], pickle.MARK[0],
    pickle.MEMOIZE[0], pickle.NEWFALSE[0], pickle.NEWOBJ[0], pickle.NEWTRUE[0])
NONE, PROTO, REDUCE, SETITEM, SETITEMS, SHORT_BINUNICODE, STACK_GLOBAL, STOP = (
    pickle.NONE[0], pickle.PROTO[0], pickle.REDUCE[0], pickle.SETITEM[0],
    pickle.SETITEMS[0], pickle.SHORT_BINUNICODE[0], pickle.STACK_GLOBAL[0], pickle.STOP[0])
TUPLE, TUPLE1, TUPLE2, TUPLE3 = (
    pickle.TUPLE[0], pickle.TUPLE1[0], pickle.TUPLE2[0], pickle.TUPLE3[0])


#: Longest stretch, in seconds, the machine runs before it lets other threads have the
#: GIL. A thread that waits for the GIL only asks the holder to let go after
#: ``sys.getswitchinterval()`` (5 ms): a consumer waking from a GPU step or a sleep would
#: otherwise wait up to that long for every shard indexed behind it, measured as 4% of
#: the wall time of a stream of FoldPipe-style shards at D/C = 0.5
#: (``benchmarks/stream_overlap.py``). Only a machine off the main thread yields:
#: ``time.sleep(0)`` sleeps for the timer slack (~58 us here), which a converter or a
#: consumer indexing on its own thread would pay for nothing.
YIELD_AFTER_S = 200e-6


class _ShardPickleMachine:
    """Runs a ``torch.save`` pickle of ``Data`` objects into per-attribute columns.

    It understands the opcodes ``torch.save`` emits (protocols 2 to 5) for the layouts
    of the module docstring, resolves storages against the archive's records and never
    calls anything: a ``REDUCE`` of the tensor rebuild function becomes a
    :class:`_TensorRef`, ``NEWOBJ``/``BUILD`` of ``Data`` and ``GlobalStorage`` become
    :class:`_Sample` rows. Anything else raises :class:`NotLazyLayout`.

    :meth:`run` executes the opcodes that only move values (the memo, constants,
    tuples: most of a pickle) itself; each opcode that fills a container or stands for
    an object is one method (``_reduce``, ``_build``, ...), which works on the stack.

    Args:
        buffer (bytearray | mmap.mmap): The archive's bytes; the pickle is read in place.
        archive (TorchArchive): Where the archive's pickle and storage records lie in
            ``buffer``.
    """

    def __init__(self, buffer: WritableBuffer, archive: TorchArchive) -> None:
        self.data = buffer
        self.start = archive.pickle[0]
        self.end = archive.pickle[0] + archive.pickle[1]
        self.storages = archive.storages
        self.columns: dict[str, _TensorColumn | _ObjectColumn] = {}
        self.rows = 0
        self.first_mapping: dict | None = None  # the first Data's attributes
        self.stack: list[Any] = []
        self.marks: list[int] = []
        self.memo = _Memo()
        self.geometries: dict[tuple, tuple[int, bool, int]] = {}  # see _geometry
        #: Most bytes one sample's tensors may claim: the file's size.
        self.limit = len(buffer)
        #: The first sample found claiming more than it may: ``(row, key, what)``.
        self.problem: tuple[int, str, str] | None = None
        self.yielded_at = time.perf_counter()
        self.yields = threading.current_thread() is not threading.main_thread()

    def run(self) -> Any:  # noqa: C901 - one flat dispatch loop, kept flat for speed
        """Execute the pickle.

        Returns:
            The unpickled top-level object, with :class:`_Sample` for each ``Data``
            and :class:`_TensorRef` for each tensor outside one.

        Raises:
            NotLazyLayout: An opcode, global or structure outside the indexed layouts.
        """
        data = self.data  # read in place: the pickle is a record of the buffer
        memo, stack, marks = self.memo, self.stack, self.marks
        push = stack.append
        remember = memo.fresh.append
        # the rarer opcodes that fill a container or name a global: one method each
        methods = {SETITEM: self._setitem, APPENDS: self._appends, APPEND: self._append,
                   STACK_GLOBAL: self._stack_global}
        memoised = 0  # entries numbered by MEMOIZE so far
        at, end = self.start, self.end
        # branches in the order of how often torch.save emits them for a Data list
        while at < end:
            op = data[at]
            at += 1
            if op == BINGET:
                push(memo[data[at]])
                at += 1
            elif op == LONG_BINPUT or op == BINPUT:  # noqa: SIM109 - `in` builds a tuple
                if memoised:
                    raise NotLazyLayout("explicit PUT after MEMOIZE")
                if op == BINPUT:  # a 1-byte or a 4-byte index
                    index = data[at]
                    at += 1
                else:
                    index = _UINT32(data, at)[0]
                    at += 4
                memo[index] = stack[-1]
                remember(index)
            elif op == BININT1:
                push(data[at])
                at += 1
            elif op == MARK:
                marks.append(len(stack))
            elif op == TUPLE:
                start = marks.pop()
                items = tuple(stack[start:])
                del stack[start:]
                push(items)
            elif op == REDUCE:
                args = stack.pop()
                if stack[-1] is _TENSOR_REBUILD:  # the common call, kept inline
                    stack[-1] = self._tensor(args)
                else:
                    self._reduce(args)
            elif op == EMPTY_TUPLE:
                push(())
            elif op == BINUNICODE:
                at = self._text(at + 4, _UINT32(data, at)[0])
            elif op == BINPERSID:
                stack[-1] = self._storage(stack[-1])
            elif op == TUPLE2:
                second = stack.pop()
                stack[-1] = (stack[-1], second)
            elif op == NEWFALSE:
                push(False)
            elif op == TUPLE1:
                stack[-1] = (stack[-1],)
            elif op == EMPTY_DICT:
                push({})
            elif op == SETITEMS:
                self._setitems()
            elif op == NEWOBJ:
                self._newobj()
            elif op == BUILD:
                self._build()
            elif op == LONG_BINGET:
                push(memo[_UINT32(data, at)[0]])
                at += 4
            elif op == BININT2:
                push(data[at] | data[at + 1] << 8)
                at += 2
            elif op == BININT:
                push(_INT32(data, at)[0])
                at += 4
            elif op == TUPLE3:
                third = stack.pop()
                second = stack.pop()
                stack[-1] = (stack[-1], second, third)
            elif op == SHORT_BINUNICODE:
                at = self._text(at + 1, data[at])
            elif op == EMPTY_LIST:
                push([])
            elif op == MEMOIZE:
                # the index is the count of entries memoised so far: len(memo) would
                # undercount once finished samples' entries are deleted. Picklers
                # use either MEMOIZE or explicit PUTs, never both in one pickle.
                if memoised == 0 and memo:
                    raise NotLazyLayout("MEMOIZE after explicit PUTs")
                memo[memoised] = stack[-1]
                remember(memoised)
                memoised += 1
            elif op == GLOBAL:
                at = self._global(at)
            elif op == NEWTRUE:
                push(True)
            elif op == NONE:
                push(None)
            elif op == BINFLOAT:
                push(_FLOAT64(data, at)[0])
                at += 8
            elif op == LONG1:
                length = data[at]
                push(int.from_bytes(data[at + 1:at + 1 + length], "little", signed=True))
                at += 1 + length
            elif op == PROTO:
                at += 1
            elif op == FRAME:
                at += 8
            elif op == STOP:
                if len(stack) != 1 or marks:
                    raise NotLazyLayout("unbalanced pickle")
                return stack[0]
            elif op in methods:
                methods[op]()
            else:
                raise NotLazyLayout(f"opcode {_OPCODE_NAMES.get(op, op)}")
        raise NotLazyLayout("pickle ends without STOP")

    # ------------------------------------------------------------------ strings
    def _text(self, at: int, length: int) -> int:
        """Push the UTF-8 string of ``length`` bytes at ``at``; returns the offset after it."""
        if at + length > self.end:
            raise NotLazyLayout("string runs past the end of the pickle")
        self.stack.append(self.data[at:at + length].decode("utf-8", "surrogatepass"))
        return at + length

    # ------------------------------------------------------------------ containers
    def _pop_mark(self) -> list[Any]:
        start = self.marks.pop()
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def _target(self, kind: type, opcode: str) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise NotLazyLayout(f"{opcode} on a {type(target).__name__}")
        return target

    def _append(self) -> None:
        value = self.stack.pop()
        self._target(list, "APPEND").append(value)

    def _appends(self) -> None:
        items = self._pop_mark()
        self._target(list, "APPENDS").extend(items)

    def _setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict, "SETITEM")[key] = value

    def _setitems(self) -> None:
        items = self._pop_mark()
        target = self._target(dict, "SETITEMS")
        if len(items) % 2:
            raise NotLazyLayout("SETITEMS with a key and no value")
        for position in range(0, len(items), 2):
            target[items[position]] = items[position + 1]

    # ------------------------------------------------------------------ objects
    def _known(self, module: Any, name: Any) -> _Global:
        known = _KNOWN_GLOBALS.get((module, name))
        if known is None:
            raise NotLazyLayout(f"global {module}.{name}")
        return known

    def _global(self, at: int) -> int:
        """Push the global named at ``at``; returns the offset after its name."""
        data, end = self.data, self.end
        newline = data.find(b"\n", at, end)
        second = data.find(b"\n", newline + 1, end) if newline >= 0 else -1
        if second < 0:
            raise NotLazyLayout("truncated GLOBAL")
        module = data[at:newline].decode("ascii")
        name = data[newline + 1:second].decode("ascii")
        self.stack.append(self._known(module, name))
        return second + 1

    def _stack_global(self) -> None:
        name = self.stack.pop()
        module = self.stack.pop()
        self.stack.append(self._known(module, name))

    def _reduce(self, args: Any) -> None:
        function = self.stack[-1]
        if type(function) is not _Global:
            raise NotLazyLayout("call of an unknown object")
        if function.kind == "tensor":
            self.stack[-1] = self._tensor(args)
        elif function.kind == "hooks" and args == ():
            self.stack[-1] = _EMPTY_HOOKS
        else:
            raise NotLazyLayout(f"call of {function.kind}")

    def _newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack[-1]
        if type(cls) is not _Global or args != ():
            raise NotLazyLayout("instance of an unknown class")
        if cls.kind == "data":
            self.stack[-1] = _Sample()
        elif cls.kind == "store":
            self.stack[-1] = _Store()
        else:
            raise NotLazyLayout(f"instance of {cls.kind}")

    def _build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) is _Store and target.state is None:
            target.state = state
        elif type(target) is _Sample:
            self._finish_sample(target, state)
            self.memo.forget_sample()
            if self.yields and time.perf_counter() - self.yielded_at > YIELD_AFTER_S:
                time.sleep(0)  # gives the GIL to a thread waiting for it (YIELD_AFTER_S)
                self.yielded_at = time.perf_counter()
        else:
            raise NotLazyLayout("state for an unknown object")

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

    def _geometry(self, shape: Any, stride: Any) -> tuple[int, bool, int]:
        """``(elements spanned in the storage, contiguous?, elements or -1)`` of a
        ``(shape, stride)``; -1 for a view that reuses storage elements."""
        if (type(shape) is not tuple or type(stride) is not tuple
                or len(shape) != len(stride)
                or not all(type(size) is int and size >= 0 for size in shape)
                or not all(type(step) is int and step >= 0 for step in stride)):
            raise NotLazyLayout("malformed tensor geometry")
        span = 0 if 0 in shape else 1 + sum((size - 1) * step
                                            for size, step in zip(shape, stride))
        contiguous = not span or all(
            size == 1 or step == expected
            for size, step, expected in zip(shape, stride, _contiguous_strides(shape)))
        count = -1 if not contiguous and overlapping(shape, stride) else math.prod(shape)
        geometry = self.geometries[(shape, stride)] = span, contiguous, count
        return geometry

    def _tensor(self, args: Any) -> _TensorRef:
        if type(args) is not tuple or len(args) not in (6, 7):
            raise NotLazyLayout("unexpected tensor rebuild arguments")
        storage, start, shape, stride, requires_grad, hooks = args[:6]
        if requires_grad is not False or hooks is not _EMPTY_HOOKS or (
                len(args) == 7 and args[6] is not None):
            raise NotLazyLayout("tensor with gradient state, hooks or metadata")
        geometry = self.geometries.get((shape, stride))
        span, contiguous, count = geometry if geometry is not None else self._geometry(
            shape, stride)
        offset, dtype, numel = storage
        if type(start) is not int or start < 0 or start + span > numel:
            raise NotLazyLayout("tensor extends past its storage")
        itemsize = dtype.itemsize
        at = offset + start * itemsize
        if at % itemsize:
            raise NotLazyLayout("misaligned storage")
        return _TensorRef((at, dtype, shape, None if contiguous else stride,
                           count * itemsize if count >= 0 else -1))

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
        claimed = 0  # bytes the sample's tensors hold
        for key, value in mapping.items():
            column = columns.get(key)
            if type(value) is _TensorRef:
                offset, dtype, shape, stride, size = value
                claimed += size
                if (size < 0 or claimed > self.limit) and self.problem is None:
                    self.problem = (row, key, _bounds_problem(value, claimed, self.limit))
                if column is None:
                    column = columns[key] = _TensorColumn(dtype, len(shape), row)
                elif (type(column) is not _TensorColumn or column.dtype != dtype
                      or column.ndim != len(shape)):
                    raise NotLazyLayout(f"attribute {key!r} changes type between samples")
                column.append(offset, shape, stride)
            else:
                value = _plain_value(key, value)
                if column is None:
                    column = columns[key] = _ObjectColumn(row)
                elif type(column) is not _ObjectColumn:
                    raise NotLazyLayout(f"attribute {key!r} changes type between samples")
                column.append(value)
        if len(mapping) != len(columns):
            for key, column in columns.items():
                if key not in mapping:
                    column.append_missing()
        if row == 0:
            self.first_mapping = mapping
        sample.row = row
        self.rows = row + 1


def _bounds_problem(ref: _TensorRef, claimed: int, limit: int) -> str:
    """What is wrong with a sample whose tensors reached ``ref`` (see ``problem``)."""
    _, _, shape, stride, size = ref
    if size < 0:
        return (f"a tensor of shape {shape} with strides {stride} reuses elements of its "
                f"storage, which torch.save of PyG data never writes")
    return f"its tensors claim {claimed} bytes so far, more than the {limit} bytes of the file"


def _refuse(machine: _ShardPickleMachine, layout: str) -> None:
    """Raise the problem the machine found in a sample, if it found one."""
    if machine.problem is not None:
        row, key, what = machine.problem
        where = f"sample {row}" if layout == "list" else "the collated data"
        raise PtPayloadError(f"{where}, attribute {key!r}: {what}")


# ---------------------------------------------------------------------- samples
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

    def of(self, ref: _TensorRef) -> torch.Tensor:
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
                if stride == _contiguous_strides(shape):
                    stride = None
            mapping[key] = self._views.tensor(dtype, numpy_dtype, offset, shape, stride)
        for key, column in self._objects.items():
            value = column[index]
            if value is not _MISSING:
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
            if type(value) is _TensorRef:
                claimed += value[4]
                if value[4] < 0 or claimed > len(buffer):
                    raise PtPayloadError(f"{what}, attribute {key!r}: "
                                         f"{_bounds_problem(value, claimed, len(buffer))}")
    views = _BufferTensors(buffer)
    data = data_from_mapping({key: views.of(value) if type(value) is _TensorRef
                              else _plain_value(key, value) for key, value in mapping.items()})
    cuts = {}
    for key, value in slices.items():
        if type(value) is not _TensorRef:
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
    machine = _ShardPickleMachine(buffer, archive)
    try:
        result = machine.run()
    except (IndexError, KeyError, struct.error, UnicodeDecodeError, TypeError, ValueError,
            OverflowError) as error:  # truncated or odd pickles: let torch.load judge them
        raise NotLazyLayout(f"{type(error).__name__}: {error}") from None
    if type(result) is tuple and len(result) == 2 and type(result[0]) is _Sample \
            and machine.rows == 1:  # (data, slices)
        _refuse(machine, "collated")
        return _collated(buffer, machine.first_mapping, result[1])
    if type(result) is tuple and len(result) == 3 and type(result[2]) is _Global \
            and result[2].kind == "data" and machine.rows == 0:  # InMemoryDataset.save
        return _collated(buffer, result[0], result[1])
    tensor_columns, object_columns = _list_columns(machine, result)
    _refuse(machine, "list")
    return LazyPtSamples(buffer, tensor_columns, object_columns, len(result))


def _list_columns(machine: _ShardPickleMachine, result: Any) -> tuple[dict, dict]:
    """The columns of a list of ``Data``, or :class:`NotLazyLayout` for anything else."""
    if not isinstance(result, (list, tuple)) or any(
            type(sample) is not _Sample or sample.row != row
            for row, sample in enumerate(result)):
        raise NotLazyLayout("not a list of Data")
    tensor_columns = {}
    object_columns = {}
    for key, column in machine.columns.items():
        if isinstance(column, _TensorColumn):
            tensor_columns[key] = (column.dtype, column.offsets, column.shapes,
                                   column.strides, column.ndim)
        else:
            object_columns[key] = column.values
    return tensor_columns, object_columns


# ---------------------------------------------------------------------- as the bytes arrive
# ``torch.save`` writes its archive front to back: the pickle ``data.pkl`` first, then a
# few small metadata records, then the storages ``data/0``, ``data/1``, ... in the order
# the pickle first names them, then the central directory. Each record is a local header,
# the data and, because torch streams every record, a data descriptor stating the size.
# So a list of ``Data`` can be indexed once its pickle has arrived, and each sample built
# once the records of its storages have: :class:`ArrivingPt` does that over a buffer
# that is being filled from its first byte on.

#: Until its record has arrived, a storage's tensors are indexed at a virtual offset:
#: the storage number in the top bits, the byte offset inside the storage below.
_KEY_SHIFT = 40
_INSIDE = (1 << _KEY_SHIFT) - 1
_UNBOUNDED = 1 << 62
#: The records ``torch.save`` writes besides the pickle and the storages.
_METADATA_RECORDS = frozenset({".format_version", ".storage_alignment", "byteorder",
                               "version", ".data/version", ".data/serialization_id"})
#: Largest metadata record looked for (they hold a few bytes).
_METADATA_LIMIT = 4096


class _PendingStorages:
    """The storage table of an archive whose storage records have not arrived yet."""

    def get(self, key: Any) -> tuple[int, int] | None:
        if type(key) is str and key.isdigit() and key == str(int(key)):
            return int(key) << _KEY_SHIFT, _UNBOUNDED
        return None  # the machine then gives up: only torch's numbered keys stream


class _ArrivingPickleMachine(_ShardPickleMachine):
    """The pickle machine over storages not yet arrived; notes each storage's size.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, its pickle arrived.
        pickle (tuple[int, int]): ``(offset, size)`` of the pickle.
    """

    def __init__(self, buffer: WritableBuffer, pickle: tuple[int, int]) -> None:
        super().__init__(buffer, TorchArchive("", pickle, None, _PendingStorages()))
        self.sizes: dict[int, int] = {}  # storage number -> bytes its record must hold
        self.alignment: dict[int, int] = {}  # storage number -> largest item size

    def _storage(self, pid: Any) -> tuple[int, torch.dtype, int]:
        offset, dtype, numel = super()._storage(pid)
        key = offset >> _KEY_SHIFT
        if self.sizes.setdefault(key, numel * dtype.itemsize) != numel * dtype.itemsize:
            raise NotLazyLayout(f"storage {key} is named with two sizes")
        if dtype.itemsize > self.alignment.get(key, 1):
            self.alignment[key] = dtype.itemsize
        return offset, dtype, numel


class ArrivingPtSamples(LazyPtSamples):
    """The samples of a ``.pt`` list of ``Data`` whose bytes are still arriving.

    A :class:`LazyPtSamples` whose first :attr:`ready` samples may be built: their
    storages have arrived (and were checked against the archive's records). The rest
    become ready as :meth:`ArrivingPt.feed` takes in more bytes.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, being filled.
        tensor_columns (dict[str, tuple]): As for :class:`LazyPtSamples`, with virtual
            offsets for the storages that have not arrived.
        object_columns (dict[str, list]): As for :class:`LazyPtSamples`.
        length (int): Number of samples.
    """

    def __init__(self, buffer: WritableBuffer, tensor_columns: dict[str, tuple],
                 object_columns: dict[str, list], length: int) -> None:
        super().__init__(buffer, tensor_columns, object_columns, length)
        #: Samples whose bytes have all arrived (a prefix of the samples).
        self.ready = 0

    def _build(self, index: int) -> Data:
        if index >= self.ready:  # the caller waits for arrival first
            raise RuntimeError(f"sample {index} has not arrived yet ({self.ready} have)")
        return super()._build(index)


class ArrivingPt:
    """Indexes a ``torch.save`` list of ``Data`` while its bytes arrive, front to back.

    Feed it the length of the buffer's filled prefix as it grows: once the pickle and
    the metadata records before the first storage are in, :meth:`feed` returns the
    samples (:class:`ArrivingPtSamples`), whose :attr:`~ArrivingPtSamples.ready` prefix
    grows as the storage records arrive. Each storage record is checked as it arrives
    (its name, its size from the pickle, its data descriptor, its alignment); once the
    whole archive is in, :meth:`complete` checks every record against the central
    directory and makes all samples ready.

    Only lists of ``Data`` whose samples own their storages stream this way (what
    ``torch.save([data, ...])`` writes); other layouts (collated ``(data, slices)``,
    views of storages shared between samples, anything the in-place indexer declines)
    raise :class:`NotLazyLayout` before any sample is published, and are decoded whole.

    With ``check_crc``, no sample is made ready before every record it is built from
    (the pickle, the metadata records before it, its storages) matched the CRC-32 the
    archive stores for it: a record that does not raises :class:`NotLazyLayout` before
    the samples are published and :class:`~pyg_atompack.pyg.errors.PtPayloadError`
    after; an archive written without CRC-32s
    (``torch.utils.serialization.config.save.compute_crc32 = False``) is declined.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, of its final size, filled
            from its first byte on. Kept (not copied) as the samples' storage.
        check_crc (bool, optional): Check every record against its CRC-32 before any
            sample built from it is made ready. (default: :obj:`False`)

    Raises:
        NotLazyLayout: The buffer cannot hold samples built in place.
    """

    def __init__(self, buffer: WritableBuffer, check_crc: bool = False) -> None:
        if not is_writable_buffer(buffer):
            raise NotLazyLayout("needs a writable bytearray or memory map")
        self.buffer = buffer
        self.check_crc = check_crc
        self.samples: ArrivingPtSamples | None = None  # once published
        self._arrived = 0
        self._pickle_record: LocalRecord | None = None
        self._scan_from: int | None = None
        self._pickle: tuple[int, int] | None = None
        self._prefix = ""
        self._candidate: ArrivingPtSamples | None = None  # indexed, not yet published
        self._sizes: dict[int, int] = {}
        self._alignment: dict[int, int] = {}
        self._base = np.zeros(0, dtype=np.int64)  # data offset per storage, -1: not in
        self._needs = np.zeros(0, dtype=np.int64)  # per sample: storages 0..n-1 needed
        self._resolved = 0  # storages 0 .. _resolved - 1 have all arrived
        self._at = 0  # the next local header to read
        self._walking = True
        self._columns: list[array] = []  # the offsets of each tensor column

    @property
    def published(self) -> bool:
        """Whether :meth:`feed` has returned the samples."""
        return self.samples is not None

    def feed(self, arrived: int) -> ArrivingPtSamples | None:
        """Take in the buffer's first ``arrived`` bytes.

        Args:
            arrived (int): Length of the filled prefix (never smaller than before).

        Returns:
            The samples once they are published, else :obj:`None`.

        Raises:
            NotLazyLayout: Before the samples are published: the archive is not a
                layout that streams (decode it whole once it has arrived).
            PtPayloadError: After they are published: the archive is damaged.
        """
        self._arrived = max(self._arrived, min(arrived, len(self.buffer)))
        try:
            if self._candidate is None and not self._index_pickle():
                return None
            self._walk()
        except TorchZipError as error:
            if self.samples is None:
                raise NotLazyLayout(str(error)) from None
            # what is left waits for the central directory (complete())
            self._walking = False
        if self.samples is not None:
            self._advance()
        return self.samples

    def complete(self) -> ArrivingPtSamples:
        """Check the whole archive against what was read, and make every sample ready.

        Returns:
            The samples, all ready.

        Raises:
            NotLazyLayout: The samples were never published (decode the archive whole).
            PtPayloadError: The archive's directory disagrees with the records read as
                they arrived, or a storage record is missing, short or misaligned.
        """
        self.feed(len(self.buffer))
        if self.samples is None:
            raise NotLazyLayout("the archive ended before its samples were indexed")
        try:
            archive = read_torch_archive(self.buffer, with_crcs=self.check_crc)
        except TorchZipError as error:
            raise PtPayloadError(f"damaged .pt archive: {error}") from None
        if archive.prefix != self._prefix or archive.pickle != self._pickle:
            raise PtPayloadError("damaged .pt archive: its directory places the pickle "
                                 "elsewhere than its records")
        if archive.byteorder is not None:
            offset, size = archive.byteorder
            if bytes(self.buffer[offset:offset + size]) != b"little":
                raise PtPayloadError("damaged .pt archive: a big-endian byte order record "
                                     "after its storages")
        base = self._base
        for key, size in self._sizes.items():
            record = archive.storages.get(str(key))
            if record is None or record[1] != size:
                raise PtPayloadError(f"damaged .pt archive: storage {key} is missing or "
                                     f"not {size} bytes")
            if base[key] >= 0 and base[key] != record[0]:
                raise PtPayloadError(f"damaged .pt archive: storage {key} lies elsewhere "
                                     f"than its directory says")
            if record[0] % self._alignment.get(key, 1):
                raise PtPayloadError(f"damaged .pt archive: storage {key} is misaligned")
            if self.check_crc and base[key] < 0 and \
                    data_crc(self.buffer, record[0], size) != archive.crcs[str(key)]:
                # a record the walk did not reach, checked against the directory
                raise PtPayloadError(f"damaged .pt archive: storage {key} does not match "
                                     f"its CRC-32")
            base[key] = record[0]
        self._resolved = len(base)
        self._advance()
        return self.samples

    # ------------------------------------------------------------------ steps
    def _index_pickle(self) -> bool:
        """Index the pickle once it has arrived; whether it has."""
        buffer, arrived = self.buffer, self._arrived
        record = self._pickle_record
        if record is None:
            record = read_local_record(buffer, 0, arrived)
            if record is None:
                return False
            if not record.name.endswith("/data.pkl"):
                raise TorchZipError("the archive does not start with its pickle")
            self._pickle_record = record
            self._prefix = record.name[:-len("/data.pkl")]
        if record.size is not None:
            after = record_end(buffer, record, record.size, arrived)
            found = None if after is None else (record.size, after)
        else:
            found = find_record_end(buffer, record, arrived, search_from=self._scan_from,
                                    ends_with=pickle.STOP)
        if found is None:
            self._scan_from = max(record.data_at, arrived - 32)
            return False
        size, self._at = found
        self._check_crc(record, size, "the pickle: ")
        self._pickle = (record.data_at, size)
        machine = _ArrivingPickleMachine(buffer, self._pickle)
        try:
            result = machine.run()
        except (IndexError, KeyError, struct.error, UnicodeDecodeError, TypeError,
                ValueError, OverflowError) as error:
            raise NotLazyLayout(f"{type(error).__name__}: {error}") from None
        tensor_columns, object_columns = _list_columns(machine, result)
        _refuse(machine, "list")
        self._sizes, self._alignment = machine.sizes, machine.alignment
        count = len(result)
        row_needs = np.full(count, -1, dtype=np.int64)
        keys = []
        for _, offsets, *_ in tensor_columns.values():
            column = np.frombuffer(offsets, dtype=np.int64) if len(offsets) else \
                np.zeros(0, dtype=np.int64)
            column_keys = np.where(column >= 0, column >> _KEY_SHIFT, -1)
            np.maximum(row_needs, column_keys, out=row_needs)
            keys.append(column_keys[column_keys >= 0])
            self._columns.append(offsets)
        named = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
        if np.unique(named).size != named.size:
            raise NotLazyLayout("samples share storages")
        highest = int(named.max()) + 1 if named.size else 0
        if highest > 4 * named.size + 16:
            raise NotLazyLayout("storage numbers far beyond the storages named")
        self._base = np.zeros(highest, dtype=np.int64)
        self._base[named] = -1  # unnamed numbers count as arrived
        self._needs = np.maximum.accumulate(row_needs) + 1 if count else row_needs
        self._candidate = ArrivingPtSamples(buffer, tensor_columns, object_columns, count)
        return True

    def _walk(self) -> None:
        """Read the records after the pickle as far as they have arrived."""
        buffer, arrived = self.buffer, self._arrived
        while self._walking:
            at = self._at
            if at + 4 > arrived:
                return
            if bytes(buffer[at:at + 4]) == b"PK\x01\x02":  # the central directory
                self._walking = False
                self._publish()
                return
            record = read_local_record(buffer, at, arrived)
            if record is None:
                return
            if not record.name.startswith(self._prefix + "/"):
                raise TorchZipError(f"record {record.name} of another archive")
            name = record.name[len(self._prefix) + 1:]
            if name.startswith("data/"):
                self._publish()
                number = name[len("data/"):]
                if not (number.isdigit() and number == str(int(number))) or int(
                        number) not in self._sizes:
                    raise TorchZipError(f"storage record {record.name} the pickle does "
                                        f"not name")
                key = int(number)
                after = record_end(buffer, record, self._sizes[key], arrived)
                if after is None:
                    return
                if record.data_at % self._alignment.get(key, 1) or self._base[key] >= 0:
                    raise TorchZipError(f"storage record {record.name} misaligned or "
                                        f"repeated")
                self._check_crc(record, self._sizes[key])
                self._base[key] = record.data_at
                while self._resolved < len(self._base) and self._base[self._resolved] >= 0:
                    self._resolved += 1
            elif name in _METADATA_RECORDS:
                if record.size is not None:
                    after = record_end(buffer, record, record.size, arrived)
                    found = None if after is None else (record.size, after)
                else:
                    found = find_record_end(buffer, record, arrived, limit=_METADATA_LIMIT)
                if found is None:
                    if arrived - record.data_at > _METADATA_LIMIT + 64:
                        raise TorchZipError(f"record {record.name} has no end")
                    return
                size, after = found
                self._check_crc(record, size)
                if name == "byteorder" and bytes(
                        buffer[record.data_at:record.data_at + size]) != b"little":
                    if self.samples is not None:
                        raise PtPayloadError("damaged .pt archive: a big-endian byte "
                                             "order record after its storages")
                    raise TorchZipError("big-endian archive")
            else:
                raise TorchZipError(f"unexpected record {record.name}")
            self._at = after

    def _publish(self) -> None:
        self.samples = self._candidate

    def _check_crc(self, record: LocalRecord, size: int, what: str = "") -> None:
        """With ``check_crc``, refuse a record whose data does not match its CRC-32: as a
        layout that does not stream before the samples are published (:meth:`feed`
        turns the :class:`TorchZipError` into :class:`NotLazyLayout`), as a damaged
        archive after."""
        problem = crc_problem(self.buffer, record, size) if self.check_crc else None
        if problem is None:
            return
        if self.samples is not None:
            raise PtPayloadError(f"damaged .pt archive: {what}{problem}")
        raise TorchZipError(f"{what}{problem}")

    def _advance(self) -> None:
        """Give the samples whose storages have all arrived their real offsets."""
        samples = self.samples
        ready = int(np.searchsorted(self._needs, self._resolved, side="right"))
        if ready <= samples.ready:
            return
        start, base = samples.ready, self._base
        for offsets in self._columns:
            rows = np.frombuffer(offsets, dtype=np.int64)[start:ready]
            present = rows >= 0
            virtual = rows[present]
            rows[present] = base[virtual >> _KEY_SHIFT] + (virtual & _INSIDE)
            del rows  # no view may stay exported on the column
        samples.ready = ready
