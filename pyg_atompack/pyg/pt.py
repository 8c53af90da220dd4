"""Reading PyG ``.pt`` files safely: one allow-list, one layout classifier, one dispatcher.

Every ``.pt`` file the project reads (a streamed shard, a file given to the converter)
goes through :func:`decode_pt`:

1. If the bytes are a writable buffer, :func:`~pyg_atompack.pyg.pt_index.index_pt`
   indexes the layouts real datasets use in place, without unpickling: a list of
   ``Data`` (tensors of their own, or views of a storage the samples share, as list
   slices of an ``InMemoryDataset`` are) and a collated ``(data, slices)`` tuple or
   ``InMemoryDataset.save`` triple. Samples are built when taken.
2. Anything else is read by torch's own safe loader, ``torch.load(weights_only=True)``,
   with :data:`PYG_SAFE_GLOBALS` allowed (:func:`load_pt_object`); ``trusted=True``
   uses ``weights_only=False``, which can run code from the file.
3. :func:`as_samples` turns what was loaded into a sequence of samples (the one place
   that knows the accepted layouts).

Errors are :class:`~pyg_atompack.pyg.errors.PtPayloadError` (damaged or unsupported
file) and :class:`~pyg_atompack.pyg.errors.UnsafePtPayloadError` (objects outside the
allow-list), whose messages leave naming the file to the caller.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import pickletools
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.data.data import BaseData, DataEdgeAttr, DataTensorAttr
from torch_geometric.data.feature_store import TensorAttr
from torch_geometric.data.graph_store import EdgeAttr
from torch_geometric.data.separate import separate
from torch_geometric.data.storage import BaseStorage, EdgeStorage, GlobalStorage, NodeStorage

from pyg_atompack.transport.buffers import is_writable_buffer

from .errors import PtPayloadError, UnsafePtPayloadError
from .pt_index import index_pt
from .pt_pickle import NotLazyLayout
from .samples import CollatedSamples, bounds_problem

__all__ = ["PYG_SAFE_GLOBALS", "as_samples", "decode_pt", "load_pt_object",
           "pyg_safe_globals"]

#: Classes a ``.pt`` file may contain besides tensors and builtin containers: what
#: ``torch.load(weights_only=True)`` is allowed to rebuild, on top of torch's defaults
#: and what was registered with :func:`torch.serialization.add_safe_globals`.
PYG_SAFE_GLOBALS = [
    Data,
    HeteroData,
    Batch,
    DataEdgeAttr,
    DataTensorAttr,
    EdgeAttr,
    TensorAttr,
    BaseStorage,
    GlobalStorage,
    NodeStorage,
    EdgeStorage,
]

_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_registration_lock = threading.Lock()
_registration_users = 0
_registration: Any = None


@contextlib.contextmanager
def pyg_safe_globals() -> Iterator[None]:
    """Allow :data:`PYG_SAFE_GLOBALS` in ``torch.load(weights_only=True)`` meanwhile.

    ``torch.serialization.safe_globals`` edits one process-wide set: two threads that
    each enter and leave it would remove the classes while the other still loads, and
    leaving it removes classes that were registered before (PyG registers ``Data`` at
    import). This wrapper enters it once for all concurrent users, with only the classes
    not registered already, and leaves it when the last user is done.
    """
    global _registration_users, _registration
    with _registration_lock:
        if _registration_users == 0:
            registered = torch.serialization.get_safe_globals()
            _registration = torch.serialization.safe_globals(
                [cls for cls in PYG_SAFE_GLOBALS if cls not in registered])
            _registration.__enter__()
        _registration_users += 1
    try:
        yield
    finally:
        with _registration_lock:
            _registration_users -= 1
            if _registration_users == 0:
                _registration.__exit__(None, None, None)
                _registration = None


# what torch's safe loader says when it refuses something, as opposed to damage
_REFUSALS = ("GLOBAL", "Unsupported operand", "Trying to", "Can only", "unrecognized",
             "allowlist", "persistent_load")


def _refusal(error: pickle.UnpicklingError) -> PtPayloadError:
    """Name what torch's safe loader refused, from its message."""
    # torch wraps the reason in paragraphs of advice; keep the line that says it
    lines = [line.split("WeightsUnpickler error:", 1)[-1].strip()
             for line in str(error).splitlines() if line.strip()]
    detail = next((line for line in lines if any(m in line for m in _REFUSALS)), None)
    operand = re.search(r"Unsupported operand (\d+)", detail or "")
    if operand and int(operand.group(1)) not in _OPCODE_NAMES:
        return PtPayloadError(f"not a readable .pt file: byte {operand.group(1)} is not a "
                              f"pickle opcode")
    if detail is None:
        advice = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
        reason = next((line for line in lines if not line.startswith(advice)),
                      type(error).__name__)
        return PtPayloadError(f"not a readable .pt file: {reason}")
    if found := re.search(r"GLOBAL (\S+)", detail):
        what = f"it references {found.group(1)}, which is outside the allow-list"
    elif operand:
        what = (f"it uses the pickle opcode {_OPCODE_NAMES[int(operand.group(1))]}, which "
                f"torch.load(weights_only=True) does not run, outside the allow-list")
    else:
        what = f"it holds objects outside the allow-list ({detail})"
    return UnsafePtPayloadError(
        f"refusing to unpickle it, because {what} of tensors and PyG data classes. "
        f"Pickles can run arbitrary code; register a class you trust with "
        f"torch.serialization.add_safe_globals"
    )


def load_pt_object(file: Any, *, trusted: bool = False) -> Any:
    """``torch.load`` a ``.pt`` file onto the CPU with torch's safe loader.

    Args:
        file (Any): A path or a readable, seekable binary file.
        trusted (bool, optional): Use ``weights_only=False``, which unpickles anything
            and so can run code from the file. (default: :obj:`False`)

    Returns:
        The unpickled object.

    Raises:
        UnsafePtPayloadError: The file needs globals or opcodes outside the allow-list.
        PtPayloadError: The file is not readable (damaged, truncated, not a pickle).
    """
    with pyg_safe_globals():
        try:
            return torch.load(file, map_location="cpu", weights_only=not trusted)
        except pickle.UnpicklingError as error:
            if not trusted:
                raise _refusal(error) from None
            raise PtPayloadError(f"not a readable .pt file: {error}") from error
        except Exception as error:  # damaged archives raise RuntimeError, KeyError, ...
            raise PtPayloadError(
                f"not a readable .pt file: {type(error).__name__}: {error}") from error


def _checked_items(items: Sequence[Any], limit: int | None) -> list[BaseData]:
    for position, item in enumerate(items):
        if not isinstance(item, BaseData):
            raise PtPayloadError(f"element {position} is a {type(item).__name__}, "
                                 f"expected torch_geometric Data")
        try:
            item.stores  # noqa: B018 - a Data whose storage did not survive raises here
        except Exception as error:  # PyG raises RuntimeError / AttributeError
            raise PtPayloadError(f"element {position} is a damaged "
                                 f"{type(item).__name__}: {error}") from None
    return _bounded(list(items), limit)


def _bounded(samples: list[BaseData], limit: int | None) -> list[BaseData]:
    """``samples``, once each is known to fit in a file of ``limit`` bytes."""
    if limit is not None:
        for position, sample in enumerate(samples):
            if (problem := bounds_problem(sample, limit)) is not None:
                raise PtPayloadError(f"sample {position}, {problem}")
    return samples


def _collated(data: Any, slices: dict, data_class: Any = None,
              limit: int | None = None) -> Sequence[BaseData]:
    try:
        if isinstance(data, dict):
            data_class = Data if data_class is None else data_class
            if not (isinstance(data_class, type) and issubclass(data_class, BaseData)):
                raise PtPayloadError("third element is not a PyG data class")
            data = data_class.from_dict(data)
        if not isinstance(data, BaseData) or not slices:
            raise PtPayloadError("malformed (data, slices) tuple")
        data.stores  # noqa: B018 - a Data whose storage did not survive raises here
        if limit is not None:  # before any slice is read or cut
            for what, value in (("slices", slices), ("the collated data", data)):
                if (problem := bounds_problem(value, limit)) is not None:
                    raise PtPayloadError(f"{what}, {problem}")
        if CollatedSamples.indexes(data, slices):
            return CollatedSamples(data, slices)
        # other data classes: PyG's own separate, all at once so that damage shows now
        lengths = {int(value.numel()) for value in slices.values()
                   if isinstance(value, torch.Tensor)}
        if len(lengths) != 1 or not all(isinstance(value, torch.Tensor)
                                        for value in slices.values()):
            raise ValueError("slice tensors differ in length or are not tensors")
        count = lengths.pop() - 1
        return _bounded([separate(type(data), batch=data, idx=index, slice_dict=slices,
                                  decrement=False) for index in range(max(count, 0))], limit)
    except PtPayloadError:
        raise
    except Exception as error:  # torch/PyG raise RuntimeError, KeyError, ... on bad input
        raise PtPayloadError(f"malformed (data, slices) payload: {type(error).__name__}: "
                             f"{error}") from error


def as_samples(obj: Any, *, limit: int | None = None) -> Sequence[BaseData]:
    """The samples of what a ``.pt`` file held: the one place that knows its layouts.

    Accepted: a list or tuple of ``Data``/``HeteroData``; a single one; a ``Batch``
    (only loadable with ``trusted=True``); an ``InMemoryDataset`` ``(data, slices)``
    tuple or the ``(data.to_dict(), slices, data_class)`` triple of
    ``InMemoryDataset.save``, cut into samples when taken (:class:`CollatedSamples`).

    Args:
        obj (Any): The unpickled object.
        limit (int, optional): The size of the file it came from: refuse samples with
            tensors that reuse storage elements or claim more bytes than that
            (:func:`~pyg_atompack.pyg.samples.bounds_problem`). (default: no check)

    Returns:
        A sequence of samples (``len`` and integer indexing).

    Raises:
        PtPayloadError: Any other object, or a damaged one.
    """
    if isinstance(obj, Batch):
        if limit is not None and (problem := bounds_problem(obj, limit)) is not None:
            raise PtPayloadError(f"the Batch, {problem}")
        try:
            return obj.to_data_list()
        except Exception as error:  # a damaged Batch: PyG raises RuntimeError, ...
            raise PtPayloadError(f"damaged Batch: {type(error).__name__}: {error}") from None
    if isinstance(obj, BaseData):
        return _checked_items([obj], limit)
    if isinstance(obj, tuple) and len(obj) in (2, 3) and isinstance(obj[1], dict):
        return _collated(obj[0], obj[1], obj[2] if len(obj) == 3 else None, limit)
    if isinstance(obj, (list, tuple)):
        return _checked_items(obj, limit)
    raise PtPayloadError(f"expected a list of Data, a Batch or a (data, slices) tuple, "
                         f"got {type(obj).__name__}")


def decode_pt(buffer: bytes | bytearray | memoryview, *, trusted: bool = False,
              lazy: bool = True) -> Sequence[BaseData]:
    """Turn the bytes of a ``.pt`` file into a sequence of PyG samples.

    Args:
        buffer (bytes | bytearray | mmap.mmap): The whole file. A writable buffer
            (:class:`bytearray`, :class:`mmap.mmap`) holding an indexed layout is kept
            as the samples' storage: do not modify it afterwards. Other buffers are
            unpickled and not referenced.
        trusted (bool, optional): Unpickle layouts the indexer does not know with
            ``weights_only=False``, which can run code from the file.
            (default: :obj:`False`)
        lazy (bool, optional): Index the file in place when it is a writable buffer.
            (default: :obj:`True`)

    Returns:
        The samples.

    Raises:
        UnsafePtPayloadError: The file needs globals outside the allow-list.
        PtPayloadError: The file is not a readable ``.pt`` file of PyG samples, or a
            sample's tensors reuse storage elements or claim more bytes than the file
            holds (the message names the sample and the attribute).
    """
    if lazy and is_writable_buffer(buffer):
        try:
            return index_pt(buffer)
        except NotLazyLayout:
            pass  # another layout (or a damaged file): torch.load decides
    # BytesIO shares ``bytes`` and copies anything else
    return as_samples(load_pt_object(io.BytesIO(buffer), trusted=trusted),
                      limit=len(buffer))
