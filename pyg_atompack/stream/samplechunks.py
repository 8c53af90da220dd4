"""Items leave the retrieval process in chunks; samples packed as columns.

The retrieval process (:mod:`pyg_atompack.stream.offproc`) hands unbatched samples to
the consumer's process a chunk per message. Packed one object at a time
(:func:`pyg_atompack.pyg.handoff.pack`), every tensor of every sample is pickled,
checked and copied on its own: ~50 µs a sample of four small tensors in the child and
~25 µs to rebuild it in the consumer (2-core VM, loaded), as much as decoding it.
Samples of one flat ``Data`` class that carry the same attributes are instead packed
as *columns*: each tensor attribute of the chunk is concatenated (along its first
dimension, or stacked when it has none) straight into the message's buffer (a run of
the shared arena's chunks when large, else the pipe), so a chunk is a handful of
tensors whatever its length, copied once. The consumer splits each column into views,
one per sample, and makes every sample from its class and attribute mapping as
unpickling does (``__setstate__``; ``Data(**values)`` or ``Data.__setattr__`` cost
~15 µs a sample).

What does not fit the columns (an attribute that is not a plain CPU tensor, tensors of
a column that differ in dtype, rank or trailing shape, an attribute aliasing another)
travels per sample in its column; a chunk whose samples differ in class or attributes,
or that is not ``Data``, is packed whole by :func:`~pyg_atompack.pyg.handoff.pack`.
Values are the same as the samples sent (dtype, shape, contents); the tensors are
contiguous views of the column, not of the shard they were sliced from.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch_geometric.data import Data

from pyg_atompack.pyg.arena import Arena, find_arena
from pyg_atompack.pyg.handoff import ARENA_MIN_BYTES, pack

__all__ = ["CHUNK_BYTES", "CHUNK_SAMPLES", "FLUSH_IDLE_S", "Chunker", "pack_columns",
           "pack_items", "unpack_columns", "unpack_items"]

#: Samples handed over in one message at most (batches go one a message).
CHUNK_SAMPLES = 32
#: Tensor bytes after which a chunk of samples is sent without waiting for more.
CHUNK_BYTES = 1 << 20
#: Seconds the loop building samples may add none before the samples it holds are sent.
FLUSH_IDLE_S = 0.0005

_STORE_STATE = frozenset({"_mapping", "_parent", "_cached_attr"})  # the cache is dropped
_ALIGN = 64  # every column starts on a 64-byte boundary: viewable as any dtype


def _spec(values: tuple) -> tuple | None:
    # (dtype, shape of the column, first-dimension lengths or None when stacked), or
    # None when the values do not make one column
    head = values[0]
    if type(head) is not torch.Tensor or head.layout != torch.strided or head.is_cuda:
        return None
    dtype, rank = head.dtype, head.dim()
    for value in values:
        # cat would promote dtypes, and it passes 1-D empty tensors of any rank
        if (type(value) is not torch.Tensor or value.dtype is not dtype
                or value.dim() != rank or value.requires_grad):
            return None
    if rank == 0:
        return dtype, (len(values),), None
    tail = head.shape[1:]
    lengths = []
    for value in values:
        shape = value.shape
        if shape[1:] != tail:
            return None
        lengths.append(shape[0])
    return dtype, (sum(lengths), *tail), lengths


def _layout(specs: list) -> tuple[list[int], int]:
    offsets, total = [], 0
    for spec in specs:
        if spec is None:
            offsets.append(0)
            continue
        dtype, shape, _ = spec
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        count = 1
        for extent in shape:
            count *= extent
        total += count * dtype.itemsize
    return offsets, total


def _view(buffer: torch.Tensor, offset: int, spec: tuple) -> torch.Tensor:
    dtype, shape, _ = spec
    count = 1
    for extent in shape:
        count *= extent
    return buffer[offset:offset + count * dtype.itemsize].view(dtype).view(shape)


def pack_columns(items: list, arena: Arena | None = None) -> tuple | None:
    """A chunk of samples as columns in one buffer, or :obj:`None` where they do not fit.

    Args:
        items (list): Samples, in order.
        arena (Arena, optional): Where a buffer of at least
            :data:`~pyg_atompack.pyg.handoff.ARENA_MIN_BYTES` goes (a run of its chunks;
            the pipe otherwise). (default: :obj:`None`)

    Returns:
        A picklable description of the chunk for :func:`unpack_columns`, or
        :obj:`None` when the samples are not all ``Data`` of one class with the same
        attributes (see the module docstring).
    """
    first = items[0]
    kind = type(first)
    # PyG's pickled state of a Data: its ``__dict__`` with a ``_store`` whose own state
    # is the attribute mapping and the parent; anything else goes the general way
    state = getattr(first, "__dict__", {})
    store = state.get("_store")
    if (not isinstance(first, Data) or not isinstance(getattr(store, "_mapping", None), dict)
            or not set(store.__dict__) <= _STORE_STATE):
        return None
    shell = state.keys()
    keys = tuple(store._mapping)
    if not keys:
        return None  # samples without attributes: columns would not count them
    rows = []
    for item in items:
        if type(item) is not kind or item.__dict__.keys() != shell:
            return None
        mapping = item._store._mapping
        if tuple(mapping) != keys:
            return None
        values = tuple(mapping.values())
        if len({id(value) for value in values}) != len(values):
            return None  # one tensor under two names: separate copies would break that
        rows.append(values)
    columns = list(zip(*rows))
    specs = [_spec(values) for values in columns]
    # what is not a column travels per sample, pickled (tensors by value); a failure
    # here is the general path's to report
    try:
        others = pickle.dumps([None if spec else list(values)
                               for spec, values in zip(specs, columns)],
                              pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        return None
    offsets, total = _layout(specs)
    start = None
    if arena is not None and total >= ARENA_MIN_BYTES:
        start = arena.allocate(total)
    raw = None
    if start is None:
        raw = bytearray(total)
        buffer = (torch.frombuffer(raw, dtype=torch.uint8) if total
                  else torch.empty(0, dtype=torch.uint8))
    else:
        buffer = arena.writable(start, total)
    try:
        for spec, offset, values in zip(specs, offsets, columns):
            if spec is None:
                continue
            target = _view(buffer, offset, spec)
            if spec[2] is None:
                torch.stack(values, out=target)
            else:
                torch.cat(values, out=target)  # straight into the buffer: one copy
    except BaseException:
        if start is not None:
            arena.give_back(start, total)
        raise
    empty = (kind, {key: value for key, value in state.items() if key != "_store"},
             type(store))
    where = (raw,) if start is None else (arena.token, start, total)
    return empty, keys, specs, offsets, others, where


def unpack_columns(empty: tuple, keys: tuple, specs: list, offsets: list, others: bytes,
                   where: tuple) -> list:
    """The samples :func:`pack_columns` packed, each tensor a view of its column.

    Args:
        empty (tuple): The samples' class, their state but the store, the store's class.
        keys (tuple): The attribute names, in the samples' order.
        specs (list): Each column's dtype, shape and lengths (:obj:`None`: per sample).
        offsets (list): Each column's place in the buffer.
        others (bytes): The values that are not in columns, pickled.
        where (tuple): The buffer: ``(bytes,)``, or an arena run
            ``(token, start, total)``.

    Returns:
        The samples, in order.
    """
    if len(where) == 1:
        # a bytearray: the samples' tensors must be writable like any other
        buffer = (torch.frombuffer(bytearray(where[0]), dtype=torch.uint8) if where[0]
                  else torch.empty(0, dtype=torch.uint8))
    else:
        token, start, total = where
        arena = find_arena(token)
        if arena is None:  # only the process that made the arena before forking reads it
            raise RuntimeError(f"a chunk of samples names shared memory {token} this "
                               "process does not hold")
        buffer = arena.claim(start, total)
    parts: list[Any] = pickle.loads(others)
    for index, (spec, offset) in enumerate(zip(specs, offsets)):
        if spec is None:
            continue
        column = _view(buffer, offset, spec)
        parts[index] = column.unbind(0) if spec[2] is None else torch.split(column, spec[2])
    kind, shell, store_kind = empty
    samples = []
    for values in zip(*parts):
        # as unpickling makes a sample (its class's __setstate__), without the pickle
        sample = kind.__new__(kind)
        store = store_kind.__new__(store_kind)
        store.__setstate__({"_mapping": dict(zip(keys, values)), "_parent": sample})
        sample.__setstate__({**shell, "_store": store})
        samples.append(sample)
    return samples


def pack_items(marks: list[list], items: list, arena: Arena | None) -> bytes:
    """One message: items and the progress marks of each.

    Samples of one kind go as columns (:func:`pack_columns`); other items with every
    tensor in one buffer (:func:`~pyg_atompack.pyg.handoff.pack`, in ``arena`` when
    large), or pickled whole, their tensors by value, when they cannot be packed:
    nothing may need the sending process alive.

    Args:
        marks (list[list]): Each item's progress marks.
        items (list): The items.
        arena (Arena | None): The sender's arena.

    Returns:
        The message's bytes, for :func:`unpack_items` after unpickling.
    """
    if len(items) > 1:
        columns = pack_columns(items, arena)
        if columns is not None:
            return pickle.dumps((marks, True, columns), pickle.HIGHEST_PROTOCOL)
    packed = pack(items, share=False)
    if packed is None:
        return pickle.dumps((marks, False, (None, pickle.dumps(items, pickle.HIGHEST_PROTOCOL))),
                            pickle.HIGHEST_PROTOCOL)
    return pickle.dumps((marks, False, (packed, None)), pickle.HIGHEST_PROTOCOL)


def unpack_items(columnar: bool, body: tuple) -> list:
    """The items of a message of :func:`pack_items` (``marks, columnar, body``).

    Args:
        columnar (bool): Whether the items went as columns.
        body (tuple): The packed items.

    Returns:
        The items, in order.
    """
    if columnar:
        return unpack_columns(*body)
    packed, whole = body
    if packed is None:
        return pickle.loads(whole)
    rebuild, arguments = packed
    return rebuild(*arguments)


def _nbytes(item: Any) -> int:
    # the tensor bytes of a sample (0 for what is not a PyG data object): what a chunk
    # of samples weighs
    stores = getattr(item, "stores", None)
    if stores is None:
        return 0
    return sum(value.nbytes for store in stores for value in store.values()
               if isinstance(value, torch.Tensor))


class Chunker:
    """Items built in the retrieval process, sent a chunk per message.

    The loop that builds items (the child's main thread) adds each one with its
    progress marks and sends the chunk itself once it holds ``limit`` items or
    :data:`CHUNK_BYTES`. Items it holds while the loop waits (for the next shard, for
    room ahead of the consumer) are sent by a flusher thread as soon as the loop has
    added nothing for :data:`FLUSH_IDLE_S`, so that the consumer never waits on items
    that are ready. Chunks are taken and sent under one lock: messages keep the items'
    order whichever thread sends. A failure of the flusher (an item that cannot be
    pickled) is raised by the loop's next :meth:`add` or :meth:`close`; nothing is sent
    after it.

    Args:
        send (Callable[[bytes], None]): Sends one message.
        limit (int): Items a message at most (1: no flusher, each item at once).
        arena (Arena | None): Where large buffers go.
    """

    def __init__(self, send: Callable[[bytes], None], limit: int,
                 arena: Arena | None) -> None:
        self.send, self.limit, self.arena = send, limit, arena
        self.marks: list[list] = []
        self.items: list = []
        self.bytes = 0
        self.added = 0  # items added so far: the flusher's sign that the loop is busy
        self.done = False
        self.failure: BaseException | None = None  # what stopped the flusher
        self.ready = threading.Condition(threading.Lock())  # guards the fields above
        self.sending = threading.Lock()  # one chunk taken and sent at a time
        if limit > 1:
            threading.Thread(target=self._flusher, daemon=True,
                             name="pyg_atompack-stream-flush").start()

    def add(self, marks: list, item: Any) -> None:
        """One item and the progress marks it carries."""
        self._check()
        weight = _nbytes(item) if self.limit > 1 else 0
        with self.ready:
            self.marks.append(marks)
            self.items.append(item)
            self.bytes += weight
            self.added += 1
            full = len(self.items) >= self.limit or self.bytes >= CHUNK_BYTES
            if len(self.items) == 1 and not full:
                self.ready.notify()  # the flusher watches the loop from now on
        if full:
            self.flush()

    def flush(self) -> None:
        """Send the items held, if any."""
        with self.sending:
            self._check()  # nothing goes after items the flusher failed to send
            with self.ready:
                marks, items = self.marks, self.items
                if not items:
                    return
                self.marks, self.items, self.bytes = [], [], 0
            self.send(pack_items(marks, items, self.arena))

    def close(self) -> None:
        """Send what is held and stop the flusher."""
        with self.ready:
            self.done = True
            self.ready.notify()
        self.flush()

    def _flusher(self) -> None:
        try:
            while True:
                with self.ready:
                    while not self.items and not self.done:
                        self.ready.wait()
                    if self.done:
                        return
                    seen = self.added
                time.sleep(FLUSH_IDLE_S)
                with self.ready:
                    idle = self.added == seen
                if idle:  # the loop waits: what it holds is all there is for now
                    self.flush()
        except BaseException as error:  # noqa: BLE001 - the loop raises it (add, close)
            self.failure = error

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
