"""The pickle machine: runs a ``torch.save`` pickle of PyG ``Data`` into columns.

``torch.load`` turns a shard of N small molecules into N ``Data`` objects, each with a
storage object, a tensor object and a ``TensorImpl`` per attribute: measured on 64-atom
structures, a 12.5 MiB file becomes ~38 MiB of live objects, and the unpickler's memo
holds every intermediate object until the load ends. This machine
(:class:`ShardPickleMachine`) runs the opcodes ``torch.save`` emits instead and, as each
``Data`` completes, writes where its tensors lie in the buffer into compact columns (one
offset, one shape and, for strided views, one stride per tensor); the per-sample
objects are then dropped from the memo.

It never calls anything: it knows the handful of globals such pickles name (the
``Data`` and ``GlobalStorage`` classes, torch's tensor rebuild function, storage types,
``OrderedDict`` for empty hooks) and gives up (:class:`NotLazyLayout`) on anything else,
and on shapes it does not index (``HeteroData``, tensors requiring grad, a sample
referenced twice). What its columns become is :mod:`.pt_index`'s job (samples over a
whole archive) and :mod:`.pt_arriving`'s (samples over an archive still arriving).

Why one module of ~630 lines: the opcode loop, the memo that forgets finished samples and
the columns it fills are one machine (PyTorch's own ``_weights_only_unpickler.py`` is one
file of the same size); split, each part would only be read with the others.
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

import torch

from pyg_atompack.transport.buffers import WritableBuffer

from .pt_archive import TorchArchive
from .samples import overlapping

__all__ = ["KnownGlobal", "NotLazyLayout", "Sample", "ShardPickleMachine", "TensorColumn",
           "TensorRef", "bounds_problem", "contiguous_strides", "plain_value"]


class NotLazyLayout(Exception):
    """The archive is not a layout this module can index in place."""


class KnownGlobal:
    """A global the machine knows by name; only its ``kind`` is ever used."""

    __slots__ = ("kind", "value")

    def __init__(self, kind: str, value: Any = None) -> None:
        self.kind = kind
        self.value = value


_TENSOR_REBUILD = KnownGlobal("tensor")


def _known_globals() -> dict[tuple[str, str], KnownGlobal]:
    known = {
        ("torch_geometric.data.data", "Data"): KnownGlobal("data"),
        ("torch_geometric.data.storage", "GlobalStorage"): KnownGlobal("store"),
        ("torch_geometric.data.data", "DataEdgeAttr"): KnownGlobal("ignored"),
        ("torch_geometric.data.data", "DataTensorAttr"): KnownGlobal("ignored"),
        ("torch._utils", "_rebuild_tensor_v2"): _TENSOR_REBUILD,
        ("collections", "OrderedDict"): KnownGlobal("hooks"),
        ("torch", "UntypedStorage"): KnownGlobal("storage", torch.uint8),
    }
    with warnings.catch_warnings():  # reading a legacy storage class's dtype warns
        warnings.simplefilter("ignore")
        for name in dir(torch):
            if name.endswith("Storage") and name not in ("UntypedStorage", "TypedStorage"):
                dtype = getattr(getattr(torch, name), "dtype", None)
                if isinstance(dtype, torch.dtype):
                    known[("torch", name)] = KnownGlobal("storage", dtype)
    return known


_KNOWN_GLOBALS = _known_globals()
_EMPTY_HOOKS = KnownGlobal("empty hooks")  # what ``OrderedDict()`` rebuilds to here
MISSING = KnownGlobal("missing")  # an attribute a sample does not have
_KEEPABLE = (str, int, float, bytes, bool, type(None), KnownGlobal)
_UINT32 = struct.Struct("<I").unpack_from
_INT32 = struct.Struct("<i").unpack_from
_FLOAT64 = struct.Struct(">d").unpack_from
#: opcode byte -> its name, for messages
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


class Sample:
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


class TensorRef(tuple):
    """``(byte offset in the buffer, dtype, shape, stride, bytes)`` of one tensor.

    ``stride`` is :obj:`None` for a contiguous tensor; ``bytes`` is what its elements
    hold, or ``-1`` for a view that reuses storage elements (:func:`overlapping`).
    """

    __slots__ = ()


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class TensorColumn:
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
                self.strides.extend(contiguous_strides(tuple(
                    self.shapes[row * self.ndim:(row + 1) * self.ndim])))
        self.offsets.append(offset)
        self.shapes.extend(shape)
        if self.strides is not None:
            self.strides.extend(stride if stride is not None else contiguous_strides(shape))

    def append_missing(self) -> None:
        self.offsets.append(-1)
        self.shapes.extend([0] * self.ndim)
        if self.strides is not None:
            self.strides.extend([0] * self.ndim)


class _ObjectColumn:
    """Plain Python values (numbers, strings, lists of them) of one attribute."""

    def __init__(self, rows_before: int) -> None:
        self.values: list[Any] = [MISSING] * rows_before

    def append(self, value: Any) -> None:
        self.values.append(value)

    def append_missing(self) -> None:
        self.values.append(MISSING)


def plain_value(key: Any, value: Any) -> Any:
    """``value`` if it may be an attribute kept as is: a scalar or a list of scalars."""
    if not isinstance(key, str):
        raise NotLazyLayout("attribute name is not a string")
    if type(value) is list:
        if all(isinstance(item, _KEEPABLE) and not isinstance(item, KnownGlobal)
               for item in value):
            return value
    elif isinstance(value, _KEEPABLE) and not isinstance(value, KnownGlobal):
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


class ShardPickleMachine:
    """Runs a ``torch.save`` pickle of ``Data`` objects into per-attribute columns.

    It understands the opcodes ``torch.save`` emits (protocols 2 to 5) for the layouts
    of the module docstring, resolves storages against the archive's records and never
    calls anything: a ``REDUCE`` of the tensor rebuild function becomes a
    :class:`TensorRef`, ``NEWOBJ``/``BUILD`` of ``Data`` and ``GlobalStorage`` become
    :class:`Sample` rows. Anything else raises :class:`NotLazyLayout`.

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
        self.columns: dict[str, TensorColumn | _ObjectColumn] = {}
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
            The unpickled top-level object, with :class:`Sample` for each ``Data``
            and :class:`TensorRef` for each tensor outside one.

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
    def _known(self, module: Any, name: Any) -> KnownGlobal:
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
        if type(function) is not KnownGlobal:
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
        if type(cls) is not KnownGlobal or args != ():
            raise NotLazyLayout("instance of an unknown class")
        if cls.kind == "data":
            self.stack[-1] = Sample()
        elif cls.kind == "store":
            self.stack[-1] = _Store()
        else:
            raise NotLazyLayout(f"instance of {cls.kind}")

    def _build(self) -> None:
        state = self.stack.pop()
        target = self.stack[-1]
        if type(target) is _Store and target.state is None:
            target.state = state
        elif type(target) is Sample:
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
                or type(pid[1]) is not KnownGlobal or pid[1].kind != "storage"
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
            for size, step, expected in zip(shape, stride, contiguous_strides(shape)))
        count = -1 if not contiguous and overlapping(shape, stride) else math.prod(shape)
        geometry = self.geometries[(shape, stride)] = span, contiguous, count
        return geometry

    def _tensor(self, args: Any) -> TensorRef:
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
        return TensorRef((at, dtype, shape, None if contiguous else stride,
                           count * itemsize if count >= 0 else -1))

    def _finish_sample(self, sample: Sample, state: Any) -> None:
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
            if type(value) is TensorRef:
                offset, dtype, shape, stride, size = value
                claimed += size
                if (size < 0 or claimed > self.limit) and self.problem is None:
                    self.problem = (row, key, bounds_problem(value, claimed, self.limit))
                if column is None:
                    column = columns[key] = TensorColumn(dtype, len(shape), row)
                elif (type(column) is not TensorColumn or column.dtype != dtype
                      or column.ndim != len(shape)):
                    raise NotLazyLayout(f"attribute {key!r} changes type between samples")
                column.append(offset, shape, stride)
            else:
                value = plain_value(key, value)
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


def bounds_problem(ref: TensorRef, claimed: int, limit: int) -> str:
    """What is wrong with a sample whose tensors reached ``ref`` (see ``problem``)."""
    _, _, shape, stride, size = ref
    if size < 0:
        return (f"a tensor of shape {shape} with strides {stride} reuses elements of its "
                f"storage, which torch.save of PyG data never writes")
    return f"its tensors claim {claimed} bytes so far, more than the {limit} bytes of the file"
