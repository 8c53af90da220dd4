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
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch_geometric.data import Batch, Data, HeteroData

__all__ = ["INLINE_BYTES", "install", "install_in_worker", "reduce_packed"]

#: Largest packed buffer sent inside the pickle; bigger ones go as one shared-memory tensor.
INLINE_BYTES = 4 << 20
_ALIGN = 64  # every tensor starts on a 64-byte boundary of the buffer
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
    specs, offset = [], 0
    for tensor in tensors:
        offset = -(-offset // _ALIGN) * _ALIGN
        size = tensor.numel() * tensor.element_size()
        specs.append((offset, size, tensor.dtype, tuple(tensor.shape)))
        offset += size
    return specs, offset


def _fill(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], specs: Sequence[tuple]) -> None:
    for tensor, (offset, size, _, _) in zip(tensors, specs):
        if size:
            flat = tensor.resolve_conj().resolve_neg().reshape(-1)
            buffer[offset:offset + size].copy_(flat.view(torch.uint8))


class _Rebuilder(pickle.Unpickler):
    def __init__(self, meta: bytes, buffer: torch.Tensor, specs: Sequence[tuple]) -> None:
        super().__init__(io.BytesIO(meta))
        self.buffer = buffer
        self.specs = specs

    def persistent_load(self, number: int) -> torch.Tensor:
        offset, size, dtype, shape = self.specs[number]
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        return self.buffer[offset:offset + size].view(dtype).view(shape)


def _rebuild_packed(buffer: torch.Tensor, meta: bytes, specs: Sequence[tuple]) -> Any:
    return _Rebuilder(meta, buffer, specs).load()


def _rebuild_inline(raw: bytes, meta: bytes, specs: Sequence[tuple]) -> Any:
    # a bytearray: the rebuilt tensors must be writable like any other
    buffer = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
              else torch.empty(0, dtype=torch.uint8))
    return _rebuild_packed(buffer, meta, specs)


def reduce_packed(obj: Any) -> tuple:
    """``ForkingPickler`` reducer sending ``obj`` with all its tensors in one buffer.

    Args:
        obj (Any): A ``Data``, ``HeteroData`` or ``Batch`` (any picklable object works).

    Returns:
        A reduce tuple: the rebuild function and its arguments (the buffer inline up to
        :data:`INLINE_BYTES`, else as one shared-memory tensor), or the object's default
        reduction when it cannot be packed (see the module docstring).
    """
    file = io.BytesIO()
    collector = _Collector(file)
    try:
        collector.dump(obj)
        _check_no_overlap(collector.tensors)
    except (_Unpackable, pickle.PicklingError, TypeError, AttributeError):
        return obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    tensors = collector.tensors
    specs, total = _layout(tensors)
    if total <= INLINE_BYTES:
        raw = bytearray(total)
        if total:
            _fill(torch.frombuffer(raw, dtype=torch.uint8), tensors, specs)
        return _rebuild_inline, (raw, file.getvalue(), specs)
    buffer = torch.empty(total, dtype=torch.uint8)
    _fill(buffer, tensors, specs)
    return _rebuild_packed, (buffer.share_memory_(), file.getvalue(), specs)


def _batch_class(data_class: type) -> type:
    return type(Batch(_base_cls=data_class))


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


def install_in_worker() -> None:
    """:func:`install` if this process is a DataLoader worker (cheap to call per sample).

    A dataset cannot tell when the DataLoader forks it into a worker, so it calls this
    on every item it builds: the first call in each process asks
    :func:`torch.utils.data.get_worker_info`, later ones return at once (a fork resets
    that, so a worker forked after the main process looked checks again).
    """
    global _worker_checked
    if _worker_checked:
        return
    _worker_checked = True
    if get_worker_info() is not None:
        install()
