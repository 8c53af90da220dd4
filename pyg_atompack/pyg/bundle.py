"""Several consecutive batches that leave a DataLoader worker as one item.

Each item a DataLoader worker hands to the main process costs the main process a fixed
amount whatever its size: an index message to the worker (a queue put, woken feeder
thread), the result message (a pipe read, an unpickle), torchdata's snapshot of the
sampler and of the worker (two state dicts a step), the iterator's bookkeeping and,
with ``pin_memory``, one trip through the pinning thread. For a batch of 64 molecules of
64 atoms that fixed cost was about twice what reading the batch costs in-process
(``benchmarks/loader_handoff.py``), so two workers delivered a fraction of one
in-process loader.

:class:`BundleSampler` groups ``size`` consecutive batches of the loader's batch sampler
into one item (a tuple of position lists); the worker reads every batch of it and returns
a :class:`BatchBundle`, which is pickled as *one* packed buffer
(:func:`pyg_atompack.pyg.handoff.pack`: one arena slab, one message of ~1 KB per bundle)
and rebuilt in the main process as zero-copy views of that buffer, one ``Batch`` at a time.
With ``pin_memory=True`` the pinning thread pins the buffer once per bundle
(:meth:`BatchBundle.pin_memory`) instead of every tensor of every batch.

Batches of the loader's usual shape (a PyG ``Batch`` of ``Data`` whose attributes,
slices and increments are all tensors, as :func:`~pyg_atompack.pyg.flat_to_batch`
builds them) skip pickling altogether: the worker lists each batch's tensors and the
names they go under (:class:`_PlainLayout`), and the main process fills a new ``Batch``
the way unpickling would (its instance and store dictionaries set directly). Pickling a
``Batch`` with a hook for its tensors calls that hook for each of its ~60 objects and
cost the worker as much as reading the batch; any other batch (strings among its
attributes, another ``Data`` class, tensors sharing memory) takes that general path.

The batches, their order and the sampler's states are those of the unbundled loader: the
bundle iterator's state *is* its batch sampler iterator's state, taken at bundle
boundaries, and a state taken between two batches of one bundle is that boundary plus the
number of the bundle's batches already handed out (the loader skips them on resume; see
:class:`pyg_atompack.data.AtompackLoader`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler
from torch_geometric.data import Batch, Data
from torch_geometric.data.storage import GlobalStorage

__all__ = ["BUNDLE_BYTES", "BatchBundle", "BundleSampler", "bundle_size"]

#: Bytes of batches a bundle aims at: large enough that the per-item cost is a few
#: percent of the main process's time, small enough that the first batch of a pass
#: waits only a few milliseconds and the arena (128 MiB a worker) holds many bundles.
BUNDLE_BYTES = 4 << 20
#: Most batches in one bundle (and so most a resumed pass may read and skip).
MAX_BUNDLE = 32
# What an atom of a batch weighs, roughly: an int64 atomic number and batch index, float32
# positions and forces (the usual fields of a force-field dataset).
_ATOM_BYTES = 48


def bundle_size(batch_atoms: float, batches: int, workers: int) -> int:
    """Batches per bundle for batches of about ``batch_atoms`` atoms.

    Args:
        batch_atoms (float): Atoms of an average batch.
        batches (int): Batches of a pass (of this rank).
        workers (int): DataLoader workers.

    Returns:
        int: ``1`` (no bundling) up to :data:`MAX_BUNDLE`: enough batches for about
        :data:`BUNDLE_BYTES`, but at least two bundles a worker in a pass so that no
        worker idles while another reads the whole pass.
    """
    if workers <= 0:
        return 1
    size = int(BUNDLE_BYTES // max(1.0, batch_atoms * _ATOM_BYTES))
    size = min(size, MAX_BUNDLE, batches // (2 * workers))
    return max(1, size)


class BatchBundle:
    """Consecutive batches of one loader, handed over as one item.

    Made in the worker from the built batches; pickled (``ForkingPickler``, in the worker)
    as one packed buffer; rebuilt in the main process holding that buffer, its batches
    made from it when first asked for.

    Args:
        batches (Sequence[Any], optional): The batches. (default: :obj:`None`)
        packed (tuple, optional): ``(buffer, meta, specs)`` of
            :mod:`pyg_atompack.pyg.handoff`, for a bundle rebuilt from its buffer.
            (default: :obj:`None`)
    """

    __slots__ = ("_batches", "_packed")

    def __init__(self, batches: Sequence[Any] | None = None,
                 packed: tuple[torch.Tensor, bytes, Sequence[tuple]] | None = None) -> None:
        self._batches = None if batches is None else list(batches)
        self._packed = packed

    def batches(self) -> list[Any]:
        """The batches, in order (views of the bundle's buffer when it came packed)."""
        if self._batches is None:
            buffer, meta, specs = self._packed
            if isinstance(meta, _PlainLayout):
                self._batches = meta.rebuild(buffer, specs)
            else:
                from pyg_atompack.pyg.handoff import rebuild_packed

                self._batches = rebuild_packed(buffer, meta, specs)
        return self._batches

    def __len__(self) -> int:
        return len(self.batches())

    def pin_memory(self) -> BatchBundle:
        """The bundle in page-locked memory: one pinned copy of its buffer.

        Called by DataLoader's pinning thread (``pin_memory=True`` on an accelerator
        machine). A bundle that came packed pins its one buffer and rebuilds its batches
        over the pinned copy; one that did not (it could not be packed) pins each batch.

        Returns:
            BatchBundle: The pinned bundle.
        """
        if self._packed is not None and self._batches is None:
            buffer, meta, specs = self._packed
            return BatchBundle(packed=(buffer.pin_memory(), meta, specs))
        return BatchBundle([batch.pin_memory() for batch in self.batches()])

    def __reduce__(self) -> tuple:
        from pyg_atompack.pyg.handoff import pack, pack_tensors

        batches = self.batches()
        plain = _PlainLayout.of(batches)
        if plain is not None:
            layout, tensors = plain
            return pack_tensors(tensors, layout, bundle=True, layout=_by_dtype(tensors),
                                fill=_fill_by_dtype)
        packed = pack(batches, bundle=True)
        if packed is not None:
            return packed
        return BatchBundle, (self.batches(),)

    def __repr__(self) -> str:
        state = "packed" if self._batches is None else f"{len(self._batches)} batches"
        return f"{type(self).__name__}({state})"


class BundleSampler(Sampler[tuple[list[int], ...]]):
    """Groups ``size`` consecutive batches of ``batch_sampler`` into one item.

    Its iterator's state is the batch sampler iterator's (torchdata's or an
    :class:`~pyg_atompack.pyg.budget.AtomBudgetBatchSampler` pass's), so a saved loader
    state does not depend on ``size``.

    Args:
        batch_sampler (Sampler[list[int]]): Yields each batch's dataset positions; its
            iterator must have ``state_dict`` / ``load_state_dict``.
        size (int): Batches per bundle (the last one of a pass may hold fewer).
    """

    def __init__(self, batch_sampler: Sampler[list[int]], size: int) -> None:
        if size < 1:
            raise ValueError(f"a bundle holds at least one batch, got size={size}")
        self.batch_sampler = batch_sampler
        self.size = int(size)

    def __len__(self) -> int:
        return -(-len(self.batch_sampler) // self.size)

    def __iter__(self) -> _BundleIterator:
        return _BundleIterator(iter(self.batch_sampler), self.size)


class _BundleIterator(Iterator[tuple[list[int], ...]]):
    """One pass of a :class:`BundleSampler`; its state is the batch iterator's."""

    def __init__(self, batches: Any, size: int) -> None:
        self.batches = batches
        self.size = size

    def __next__(self) -> tuple[list[int], ...]:
        bundle = []
        for positions in self.batches:
            bundle.append(positions)
            if len(bundle) == self.size:
                break
        if not bundle:
            raise StopIteration
        return tuple(bundle)

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)


# real dtypes: no conjugate or negative bit, nothing quantized
_PLAIN_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16,
                           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                           torch.bool})
_STORE_KEYS = frozenset({"_mapping", "_parent", "_num_graphs", "_slice_dict", "_inc_dict"})
_BATCH_STATE: dict[str, Any] | None = None  # an empty Batch's instance dict, but its store


def _batch_state() -> dict[str, Any]:
    global _BATCH_STATE
    if _BATCH_STATE is None:
        from pyg_atompack.pyg.handoff import _batch_class

        empty = type.__call__(_batch_class(Data))
        _BATCH_STATE = {k: v for k, v in empty.__dict__.items() if k != "_store"}
    return _BATCH_STATE


class _PlainLayout:
    """How to rebuild batches of the usual shape from a bundle's tensors.

    Per batch: its graph count and, for each of its attribute, slice and increment
    dictionaries, the keys (one tuple object per distinct key list, so it is pickled
    once a bundle) and the number of each value among the bundle's tensors (``-1``:
    :obj:`None`, an increment of a non-tensor attribute).
    """

    __slots__ = ("batches",)

    def __init__(self, batches: list[tuple]) -> None:
        self.batches = batches

    def __getstate__(self) -> list[tuple]:
        return self.batches

    def __setstate__(self, state: list[tuple]) -> None:
        self.batches = state

    @staticmethod
    def of(batches: Sequence[Any]) -> tuple[_PlainLayout, list[torch.Tensor]] | None:
        """The layout and tensors of ``batches``, or :obj:`None` if one is not plain."""
        from pyg_atompack.pyg.handoff import _batch_class

        batch_class = _batch_class(Data)
        reference = _batch_state()
        tensors: list[torch.Tensor] = []
        numbers: dict[int, int] = {}
        keys: dict[tuple, tuple] = {}  # one tuple object per key list
        layout = []
        for batch in batches:
            state = batch.__dict__
            if type(batch) is not batch_class or len(state) != len(reference) + 1:
                return None
            for key, value in reference.items():
                if state.get(key) is not value:
                    return None
            store = state["_store"].__dict__
            if store.keys() != _STORE_KEYS or type(store["_num_graphs"]) is not int:
                return None
            entry: list[Any] = [store["_num_graphs"]]
            for mapping in (store["_mapping"], store["_slice_dict"], store["_inc_dict"]):
                slots = []
                for value in mapping.values():
                    number = numbers.get(id(value))
                    if number is None:
                        if value is None and mapping is store["_inc_dict"]:
                            slots.append(-1)
                            continue
                        if (type(value) is not torch.Tensor or value.dtype not in _PLAIN_DTYPES
                                or not value.is_cpu or value.requires_grad
                                or not value.is_contiguous()):
                            return None
                        number = numbers[id(value)] = len(tensors)
                        tensors.append(value)
                    slots.append(number)
                names = tuple(mapping)
                entry += [keys.setdefault(names, names), tuple(slots)]
            layout.append(tuple(entry))
        if _overlapping(tensors):
            return None
        return _PlainLayout(layout), tensors

    def rebuild(self, buffer: torch.Tensor, specs: Sequence[tuple]) -> list[Batch]:
        """The batches, their tensors views of ``buffer`` laid out as ``specs`` says."""
        from pyg_atompack.pyg.handoff import _batch_class

        batch_class = _batch_class(Data)
        reference = _batch_state()
        typed: dict[torch.dtype, torch.Tensor] = {}
        tensors = []
        for offset, size, dtype, shape, strides in specs:
            if size == 0:
                tensors.append(torch.empty(shape, dtype=dtype))
                continue
            view = typed.get(dtype)
            if view is None:
                view = typed[dtype] = buffer.view(dtype)
            tensors.append(view.as_strided(shape, strides, offset))
        batches = []
        new = object.__new__
        for graphs, keys, slots, slice_keys, slice_slots, inc_keys, inc_slots in self.batches:
            batch = new(batch_class)
            store = new(GlobalStorage)
            store.__dict__.update(
                _mapping={k: tensors[n] for k, n in zip(keys, slots)},
                _parent=weakref.ref(batch), _num_graphs=graphs,
                _slice_dict={k: tensors[n] for k, n in zip(slice_keys, slice_slots)},
                _inc_dict={k: None if n < 0 else tensors[n]
                           for k, n in zip(inc_keys, inc_slots)})
            batch.__dict__.update(reference)
            batch.__dict__["_store"] = store
            batches.append(batch)
        return batches


def _overlapping(tensors: Sequence[torch.Tensor]) -> bool:
    # distinct contiguous tensors whose bytes overlap alias each other, which separate
    # copies would break (the general path then sends them the default way)
    spans = sorted((t.data_ptr(), t.nbytes) for t in tensors if t.numel())
    end = 0
    for start, size in spans:
        if start < end:
            return True
        end = max(end, start + size)
    return False


_ALIGN = 64  # each dtype's run starts on a 64-byte boundary of the buffer


def _by_dtype(tensors: Sequence[torch.Tensor]) -> tuple[list[tuple], int]:
    # the tensors of one dtype back to back (one copy each way per dtype, not per tensor):
    # specs as pyg.handoff's, (offset in elements, bytes, dtype, shape, strides)
    runs: dict[torch.dtype, list[int]] = {}
    for number, tensor in enumerate(tensors):
        runs.setdefault(tensor.dtype, []).append(number)
    specs: list[tuple] = [()] * len(tensors)
    offset = 0
    for dtype, numbers in runs.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        width = tensors[numbers[0]].element_size()
        element = offset // width
        for number in numbers:
            tensor = tensors[number]
            count = tensor.numel()
            specs[number] = (element, count * width, dtype, tuple(tensor.shape),
                             tensor.stride())
            element += count
        offset = element * width
    return specs, -(-offset // _ALIGN) * _ALIGN


def _fill_by_dtype(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                   specs: Sequence[tuple]) -> None:
    runs: dict[torch.dtype, list[int]] = {}
    for number, tensor in enumerate(tensors):
        runs.setdefault(tensor.dtype, []).append(number)
    for dtype, numbers in runs.items():
        start = specs[numbers[0]][0]
        count = sum(tensors[n].numel() for n in numbers)
        if not count:
            continue
        target = buffer.view(dtype)[start:start + count]
        if dtype is torch.bfloat16:  # no numpy dtype
            torch.cat([tensors[n].reshape(-1) for n in numbers], out=target)
        else:  # numpy's copy is a memcpy, ~3x faster than torch's for these sizes
            np.concatenate([tensors[n].numpy().reshape(-1) for n in numbers],
                           out=target.numpy())
