"""How samples and batches leave a DataLoader worker: as one block of bytes.

A DataLoader worker hands every batch to the main process through a multiprocessing
queue, pickled by torch's ``ForkingPickler``. That pickler moves each tensor storage
into a shared-memory segment of its own and sends the segment's file descriptor on the
side: to unpickle the batch, the main process connects once *per tensor* to the
worker's resource-sharer thread, which must win the worker's GIL to answer. A PyG
``Batch`` of molecules holds about 14 tensors (four attributes, ``batch``, ``ptr``, and a
slice and an increment tensor per attribute), so each batch costs 14 such round trips,
and every one waits while the worker's prefetch threads decode shards. Measured with a
worker process sending batches of 32 molecules of 64 atoms through a queue (two runs on
a loaded 2-core machine): 30 ms a batch (74 ms with one busy thread in the worker),
against 5–12 ms (25–34 ms) for the four tensors of a default-collated dict of the same
data, and 3 ms (11 ms) for the same ``Batch`` packed as below. At 20 ms of training per
batch that hand-off alone made the workers slower than loading in the main process.

Inside a DataLoader worker, :class:`~pyg_atompack.stream.ShardStreamDataset`,
:class:`~pyg_atompack.data.AtompackDataset` and the batches of
:class:`~pyg_atompack.data.AtompackLoader` therefore register :func:`reduce_packed`
with ``ForkingPickler`` for ``Data``, ``HeteroData`` and their ``Batch`` classes
(:func:`install`, :func:`install_in_worker`; this changes only how that worker
process pickles, never the main process). The object is pickled with its CPU tensors replaced
by references into one contiguous buffer holding all their bytes; the buffer travels
in the pickle itself up to :data:`INLINE_BYTES` (no shared memory, no descriptor, no
round trip), as one shared-memory tensor above. The main process rebuilds the same
object (same class, attributes, dtypes, shapes and values) with its tensors as views
of that one buffer. Objects whose tensors overlap in memory (real aliasing, which a
copy would break) or need autograd, and anything that cannot be pickled this way, are
sent the default way.

Where the producer was forked after its parent made an
:class:`~pyg_atompack.pyg.arena.Arena` for it (:func:`use_arena`; ``AtompackLoader``
makes one per worker, the stream's retrieval process has one), buffers of at least
:data:`ARENA_MIN_BYTES` go into the arena's shared chunks instead and the pickle carries
only their position: no copy through the pipe, and the parent's tensors are views of the
chunks, given back when they die. Measured with ``benchmarks/loader_handoff.py`` (2
workers, batches of 64 molecules of 64 atoms, 170 KB): the main process's cost per batch
halves against the pipe. Rebuilding is cheap too: a ``Batch`` is made without PyG's
constructor (which inspects ``__init__``'s signature each time) and each tensor is one
``as_strided`` of a typed view of the buffer.

``AtompackLoader``'s workers send several consecutive batches as one item
(:mod:`pyg_atompack.pyg.bundle`, ``pack(..., bundle=True)`` or :func:`pack_tensors`): one
buffer, one message and one arena run for all of them; what each item costs whatever
its size (DataLoader's and torchdata's bookkeeping, the queues) is then paid once per
bundle.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info
from torch_geometric.data import Batch, Data, HeteroData

from pyg_atompack.pyg.arena import Arena, find_arena
from pyg_atompack.pyg.bundle import BatchBundle

__all__ = ["ARENA_MIN_BYTES", "INLINE_BYTES", "install", "install_in_worker", "pack", "pack_shared",
           "pack_tensors", "rebuild_packed", "reduce_packed", "use_arena"]

#: Largest packed buffer sent inside the pickle; bigger ones go as one shared-memory tensor.
INLINE_BYTES = 4 << 20
#: Smallest packed buffer sent through an :class:`~pyg_atompack.pyg.arena.Arena` when the
#: process has one (below it, the pipe costs less than allocating chunks).
ARENA_MIN_BYTES = 16 << 10
_ALIGN = 64  # every tensor starts on a 64-byte boundary of the buffer
_arena: Arena | None = None  # where this producer process puts packed buffers (use_arena)
_installed_in: int | None = None  # pid of the process whose ForkingPickler is set up
_worker_checked = False  # install_in_worker has looked at this process (reset on fork)


def _forget_worker_check() -> None:
    global _worker_checked
    _worker_checked = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_check)


class _Unpackable(Exception):
    """The object cannot be packed; it is sent the default way."""


def _packable(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and not tensor.requires_grad
            and not tensor.is_quantized)


class _Collector(pickle.Pickler):
    """Pickles an object with each packable tensor replaced by its number."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._numbers: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if not _packable(obj):
            raise _Unpackable(f"a {obj.dtype} tensor on {obj.device} (layout {obj.layout})")
        number = self._numbers.get(id(obj))
        if number is None:  # the same tensor object twice stays one tensor
            number = self._numbers[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return number

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Batch):
            bases = type(obj).__bases__
            if len(bases) == 2 and bases[0] is Batch and type(obj) is _batch_class(bases[1]):
                return _new_batch, (bases[1],), obj.__dict__.copy()
        return NotImplemented


def _check_no_overlap(tensors: Sequence[torch.Tensor]) -> None:
    # views of one storage (samples over a shard buffer) are fine as long as their bytes
    # do not overlap; overlapping ones alias each other, which separate copies would break
    spans: dict[int, list[tuple[int, int]]] = {}
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        start = tensor.data_ptr()
        extent = sum((size - 1) * abs(stride) for size, stride in
                     zip(tensor.shape, tensor.stride())) + 1
        spans.setdefault(tensor.untyped_storage().data_ptr(), []).append(
            (start, start + extent * tensor.element_size()))
    for ranges in spans.values():
        ranges.sort()
        for (_, end), (start, _) in zip(ranges, ranges[1:]):
            if start < end:
                raise _Unpackable("tensors overlap in memory")


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple], int]:
    # (offset in elements of its dtype, size in bytes, dtype, shape, contiguous strides)
    specs, offset = [], 0
    for tensor in tensors:
        offset = -(-offset // _ALIGN) * _ALIGN
        size = tensor.numel() * tensor.element_size()
        shape = tuple(tensor.shape)
        strides, step = [], 1
        for extent in reversed(shape):
            strides.append(step)
            step *= extent
        specs.append((offset // tensor.element_size(), size, tensor.dtype, shape,
                      tuple(reversed(strides))))
        offset += size
    # whole alignment units, so that the buffer can be viewed as any dtype
    return specs, -(-offset // _ALIGN) * _ALIGN


def _fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], specs: Sequence[tuple]) -> None:
    # numpy copies a plain contiguous tensor in ~3 us against ~8 us for the torch calls
    # (17 tensors a Batch); conjugated, negated or strided ones, and dtypes numpy lacks
    # (bfloat16), take the torch path
    target = buffer.numpy()
    for tensor, (offset, size, _, _, _) in zip(tensors, specs):
        if not size:
            continue
        start = offset * tensor.element_size()
        if (tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
                and tensor.dtype in _NUMPY_DTYPES):
            target[start:start + size] = tensor.numpy().reshape(-1).view(np.uint8)
            continue
        flat = tensor.resolve_conj().resolve_neg().reshape(-1)
        buffer[start:start + size].copy_(flat.view(torch.uint8))


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64,
                           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                           torch.complex64, torch.complex128})


class _Rebuilder(pickle.Unpickler):
    def __init__(self, meta: bytes, buffer: torch.Tensor, specs: Sequence[tuple]) -> None:
        super().__init__(io.BytesIO(meta))
        self.buffer = buffer
        self.specs = specs
        self.typed: dict[torch.dtype, torch.Tensor] = {}

    def persistent_load(self, number: int) -> torch.Tensor:
        # one typed view of the whole buffer per dtype, then one as_strided per tensor
        # (~3 us; slicing bytes, then viewing dtype and shape, cost three times that)
        offset, size, dtype, shape, strides = self.specs[number]
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        typed = self.typed.get(dtype)
        if typed is None:
            typed = self.typed[dtype] = self.buffer.view(dtype)
        return typed.as_strided(shape, strides, offset)


def rebuild_packed(buffer: torch.Tensor, meta: bytes, specs: Sequence[tuple]) -> Any:
    """The object :func:`pack` packed, its tensors views of ``buffer``.

    Args:
        buffer (torch.Tensor): The packed bytes (``uint8``).
        meta (bytes): The object pickled with tensor numbers.
        specs (Sequence[tuple]): The tensors' layout in ``buffer``.

    Returns:
        The rebuilt object.
    """
    return _Rebuilder(meta, buffer, specs).load()


def _rebuild_packed(buffer: torch.Tensor, meta: bytes, specs: Sequence[tuple],
                    bundle: bool = False) -> Any:
    if bundle:  # the batches are rebuilt when the loader hands them out (pyg.bundle)
        return BatchBundle(packed=(buffer, meta, specs))
    return rebuild_packed(buffer, meta, specs)


def _rebuild_inline(raw: bytes, meta: bytes, specs: Sequence[tuple],
                    bundle: bool = False) -> Any:
    # a bytearray: the rebuilt tensors must be writable like any other
    buffer = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
              else torch.empty(0, dtype=torch.uint8))
    return _rebuild_packed(buffer, meta, specs, bundle)


def _rebuild_shared(token: str, start: int, total: int, meta: bytes,
                    specs: Sequence[tuple], bundle: bool = False) -> Any:
    arena = find_arena(token)
    if arena is None:  # the arena's owner made it; only its forked producers send these
        raise RuntimeError(f"a packed batch names shared memory {token} this process does "
                           "not hold")
    return _rebuild_packed(arena.claim(start, total), meta, specs, bundle)


def _new_batch(base_class: type) -> Any:
    # a Batch instance without Batch's constructor (which inspects __init__'s signature,
    # ~50 us): unpickling then sets its state, as for any Data
    return object.__new__(_batch_class(base_class))


def pack(obj: Any, share: bool = True, bundle: bool = False) -> tuple | None:
    """``obj`` with all its tensors in one buffer, as a rebuild function and its arguments.

    Args:
        obj (Any): Any picklable object (a ``Data``, ``Batch``, a dict of tensors, ...).
        share (bool, optional): Send a buffer above :data:`INLINE_BYTES` (without an
            arena) as a torch shared-memory tensor, which the receiver maps while this
            process lives; :obj:`False` keeps it in the arguments as bytes.
            (default: :obj:`True`)
        bundle (bool, optional): ``obj`` is a list of batches, rebuilt as a
            :class:`~pyg_atompack.pyg.bundle.BatchBundle` holding the buffer (its batches
            made when asked for, after ``pin_memory`` has pinned the buffer once).
            (default: :obj:`False`)

    Returns:
        ``(rebuild, args)``: the buffer in this process's arena (:func:`use_arena`), in
        the arguments, or shared; :obj:`None` when ``obj`` cannot be packed (see the
        module docstring).
    """
    file = io.BytesIO()
    collector = _Collector(file)
    try:
        collector.dump(obj)
        _check_no_overlap(collector.tensors)
    except (_Unpackable, pickle.PicklingError, TypeError, AttributeError):
        return None
    return pack_tensors(collector.tensors, file.getvalue(), share, bundle)


def pack_tensors(tensors: Sequence[torch.Tensor], meta: Any, share: bool = True,
                 bundle: bool = False, layout: tuple[list[tuple], int] | None = None,
                 fill: Callable[..., None] | None = None) -> tuple:
    """Copy ``tensors`` into one buffer and return the reduce tuple that rebuilds them.

    The transport half of :func:`pack`: the buffer goes into this process's arena, into
    the arguments, or into a torch shared-memory tensor (see :func:`pack`).

    Args:
        tensors (Sequence[torch.Tensor]): Contiguous-or-not CPU tensors, not overlapping.
        meta (Any): What the receiver rebuilds the object from: the pickle of
            :func:`pack`, or a bundle layout (:mod:`pyg_atompack.pyg.bundle`).
        share (bool, optional): As in :func:`pack`. (default: :obj:`True`)
        bundle (bool, optional): As in :func:`pack`. (default: :obj:`False`)
        layout (tuple, optional): ``(specs, total)``: where each tensor goes in the
            buffer and its size, if the caller laid them out. (default: :obj:`None`,
            each tensor on a 64-byte boundary, in order)
        fill (Callable, optional): ``fill(buffer, tensors, specs)`` copies the tensors
            into the buffer. (default: :obj:`None`, one copy per tensor)

    Returns:
        ``(rebuild, args)``.
    """
    specs, total = _layout(tensors) if layout is None else layout
    fill = _fill if fill is None else fill
    packed = pack_shared(tensors, specs, total, meta, fill)
    if packed is None and (total <= INLINE_BYTES or not share):
        raw = bytearray(total)
        if total:
            fill(torch.frombuffer(raw, dtype=torch.uint8), tensors, specs)
        packed = _rebuild_inline, (raw, meta, specs)
    elif packed is None:
        buffer = torch.empty(total, dtype=torch.uint8)
        fill(buffer, tensors, specs)
        packed = _rebuild_packed, (buffer.share_memory_(), meta, specs)
    return (packed[0], (*packed[1], True)) if bundle else packed


def reduce_packed(obj: Any) -> tuple:
    """``ForkingPickler`` reducer sending ``obj`` with all its tensors in one buffer.

    Args:
        obj (Any): A ``Data``, ``HeteroData`` or ``Batch`` (any picklable object works).

    Returns:
        A reduce tuple: :func:`pack`'s, or the object's default reduction when it
        cannot be packed (see the module docstring).
    """
    packed = pack(obj)
    return packed if packed is not None else obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


_BATCH_CLASSES: dict[type, type] = {}  # Data / HeteroData -> PyG's Batch class of it


def pack_shared(tensors: Sequence[torch.Tensor], specs: Sequence[tuple], total: int,
                meta: Any, fill: Callable[..., None] | None = None) -> tuple | None:
    """The reduce tuple of a packed object whose buffer went into this process's arena.

    Args:
        tensors (Sequence[torch.Tensor]): The object's tensors, in persistent-id order.
        specs (Sequence[tuple]): Their layout in the buffer.
        total (int): The buffer's size.
        meta (Any): The object pickled with tensor numbers (or a bundle layout).
        fill (Callable, optional): As in :func:`pack_tensors`. (default: :obj:`None`)

    Returns:
        ``(rebuild, args)``, or :obj:`None` when there is no arena, the buffer is
        small (the pipe is cheaper) or no run of chunks is free.
    """
    arena = _arena
    if arena is None or total < ARENA_MIN_BYTES:
        return None
    start = arena.allocate(total)
    if start is None:
        return None
    try:
        (_fill if fill is None else fill)(arena.writable(start, total), tensors, specs)
    except BaseException:
        arena.give_back(start, total)
        raise
    return _rebuild_shared, (arena.token, start, total, meta, specs)


def _batch_class(data_class: type) -> type:
    batch_class = _BATCH_CLASSES.get(data_class)
    if batch_class is None:
        batch_class = _BATCH_CLASSES[data_class] = type(Batch(_base_cls=data_class))
    return batch_class


def use_arena(arena: Arena | None) -> None:
    """Send packed buffers of at least :data:`ARENA_MIN_BYTES` through ``arena``.

    Called in a producer process (a DataLoader worker, the stream's retrieval process)
    forked after its parent made ``arena`` (:class:`~pyg_atompack.pyg.arena.Arena`).

    Args:
        arena (Arena | None): The arena, or :obj:`None` to stop using one.
    """
    global _arena
    _arena = arena


def install() -> None:
    """Let this process's ``ForkingPickler`` send PyG data objects packed (idempotent).

    Called by :class:`~pyg_atompack.stream.ShardStreamDataset` when it starts iterating
    inside a DataLoader worker, i.e. in the process whose queue carries the batches to
    the main process. A forked worker inherits nothing from a parent that never called
    it; a process that did (a worker forking its own children) passes it on, which is
    harmless: the rebuild runs wherever the pickle is read.
    """
    global _installed_in
    if _installed_in == os.getpid():
        return
    for data_class in (Data, HeteroData):
        ForkingPickler.register(data_class, reduce_packed)
        ForkingPickler.register(_batch_class(data_class), reduce_packed)
    _installed_in = os.getpid()


def install_in_worker(arenas: Sequence[Arena] | None = None) -> None:
    """:func:`install` if this process is a DataLoader worker (cheap to call per sample).

    A dataset cannot tell when the DataLoader forks it into a worker, so it calls this
    on every item it builds: the first call in each process asks
    :func:`torch.utils.data.get_worker_info`, later ones return at once (a fork resets
    that, so a worker forked after the main process looked checks again).

    Args:
        arenas (Sequence[Arena], optional): One arena per worker, made by the main
            process before it forked the workers; worker ``i`` sends its large
            buffers through ``arenas[i]`` (:func:`use_arena`). (default: :obj:`None`)
    """
    global _worker_checked
    if _worker_checked:
        return
    _worker_checked = True
    info = get_worker_info()
    if info is not None:
        install()
        if arenas is not None and info.id < len(arenas):
            use_arena(arenas[info.id])
