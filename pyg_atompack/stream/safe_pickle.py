"""A restricted unpickler for ``.pt`` shards that runs at the speed of CPython's C pickle.

``torch.load(weights_only=True)`` is safe but unpickles in pure Python: on a shard of a
few thousand small ``Data`` objects it costs two to three times FoldPipe's unrestricted
``weights_only=False`` load, and it holds the GIL on the prefetch thread while the model
wants it. This module keeps the safety and drops the cost.

How: ``torch.load(..., weights_only=False, pickle_module=RESTRICTED_PICKLE)`` makes torch
build its archive unpickler on :class:`RestrictedUnpickler`, a subclass of the C
``pickle.Unpickler``. The C unpickler can only reach a Python object that is not a plain
container or scalar through :meth:`~pickle.Unpickler.find_class` (``GLOBAL``,
``STACK_GLOBAL``, ``INST`` and ``OBJ`` resolve through it; extension codes do too, but
see :func:`restricted_torch_load` for their process-wide cache), so
refusing every global outside an explicit allow-list means ``REDUCE``, ``NEWOBJ`` and
``BUILD`` can only ever call allow-listed tensor rebuild functions and PyG classes. This
is the "restricting globals" pattern of the Python ``pickle`` documentation; torch still
resolves tensor storages through its own ``persistent_load``.

The allow-list is a subset of torch's own ``weights_only`` list: dense tensors and
parameters, dtypes, ``torch.Size``/``torch.device``, a few builtin containers, plus the
PyG data classes and whatever was registered with
:func:`torch.serialization.add_safe_globals` (torch and PyG register some of their own
classes at import, and ``weights_only`` honours those too). Sparse, quantized and
device-moving rebuild functions are left out because atomistic shards never need them.
"""

from __future__ import annotations

import _codecs
import _compat_pickle
import builtins
import collections
import copyreg
import functools
import os
import pickle
import types
from typing import Any

import torch
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.data.data import DataEdgeAttr, DataTensorAttr
from torch_geometric.data.feature_store import TensorAttr
from torch_geometric.data.graph_store import EdgeAttr
from torch_geometric.data.storage import BaseStorage, EdgeStorage, GlobalStorage, NodeStorage

#: Classes a ``.pt`` shard may contain besides tensors and builtin containers.
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

# torch rebuild helpers a dense tensor or parameter pickle calls; looked up by name so a
# torch release that renames one narrows the list instead of failing at import
_TENSOR_REBUILDERS = (
    "_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
    "_rebuild_parameter_with_state", "_rebuild_meta_tensor_no_storage",
)


class ForbiddenGlobalError(pickle.UnpicklingError):
    """A pickle referenced a global outside the allow-list; nothing of it was called.

    Args:
        module: The module name the pickle asked for.
        name: The attribute name the pickle asked for.
    """

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"forbidden global {module}.{name}")
        self.module = module
        self.name = name


def _qualified_name(obj: Any) -> tuple[str, str] | None:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return (module, name) if module and name else None


@functools.lru_cache(maxsize=1)
def _fixed_globals() -> dict[tuple[str, str], Any]:
    """The part of the allow-list that never changes, built once per process."""
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("builtins", "set"): builtins.set,
        ("builtins", "bytearray"): builtins.bytearray,
        ("builtins", "complex"): builtins.complex,
        # protocol-2 pickles spell ``bytes`` as _codecs.encode(latin-1 text)
        ("_codecs", "encode"): _codecs.encode,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch", "Tensor"): torch.Tensor,
        ("torch._tensor", "Tensor"): torch.Tensor,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    }
    for name in _TENSOR_REBUILDERS:
        function = getattr(torch._utils, name, None)
        if function is not None:
            allowed[("torch._utils", name)] = function
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for data_class in PYG_SAFE_GLOBALS:
        allowed[_qualified_name(data_class)] = data_class
    return allowed


def allowed_globals() -> dict[tuple[str, str], Any]:
    """Return the ``(module, name) -> object`` map a restricted load may resolve.

    The globals registered with :func:`torch.serialization.add_safe_globals` are read on
    every call, so that later registrations are honoured, as ``weights_only`` does.
    """
    allowed = dict(_fixed_globals())
    for entry in torch.serialization.get_safe_globals():
        if isinstance(entry, tuple):  # (object, "module.name") as torch documents it
            obj, dotted = entry
            module, _, name = dotted.rpartition(".")
            allowed[(module, name)] = obj
        elif (key := _qualified_name(entry)) is not None:
            allowed[key] = entry
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """The C unpickler with :meth:`find_class` limited to :func:`allowed_globals`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._allowed = allowed_globals()

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        # protocol-2 pickles written by Python 2 spelling (``__builtin__.set``), mapped the
        # way the base class would have before resolving them
        key = _compat_pickle.NAME_MAPPING.get(key, key)
        key = (_compat_pickle.IMPORT_MAPPING.get(key[0], key[0]), key[1])
        try:
            return self._allowed[key]
        except KeyError:
            raise ForbiddenGlobalError(module, name) from None


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return RestrictedUnpickler(file, **kwargs).load()


#: A stand-in ``pickle`` module for ``torch.load(pickle_module=...)``. torch subclasses its
#: ``Unpickler`` and routes every global it does not handle itself (storage type names)
#: to our ``find_class``; ``load`` serves torch's legacy (pre-zip) archive reader.
RESTRICTED_PICKLE = types.ModuleType("pyg_atompack_restricted_pickle")
RESTRICTED_PICKLE.Unpickler = RestrictedUnpickler
RESTRICTED_PICKLE.load = _restricted_load
RESTRICTED_PICKLE.UnpicklingError = pickle.UnpicklingError


def restricted_torch_load(stream: Any) -> Any:
    """``torch.load`` a stream onto the CPU through :class:`RestrictedUnpickler`.

    Args:
        stream: A readable, seekable binary file holding a ``torch.save`` archive.

    Returns:
        The unpickled object.

    Raises:
        ForbiddenGlobalError: The archive references a global outside the allow-list.
    """
    if _forced_weights_only() or copyreg._inverted_registry:
        # Two cases where we hand over to torch's pure-Python checker: torch refuses a
        # custom pickle module when the user forces weights_only; and the C unpickler
        # serves copyreg extension codes from a process-wide cache without asking
        # find_class again, so once anything registers an extension, a code another
        # unpickler resolved earlier could slip past the allow-list (torch's checker
        # rejects extension opcodes outright). Neither happens in a default process.
        with torch.serialization.safe_globals(PYG_SAFE_GLOBALS):
            return torch.load(stream, map_location="cpu", weights_only=True)
    return torch.load(stream, map_location="cpu", weights_only=False,
                      pickle_module=RESTRICTED_PICKLE)


def _forced_weights_only() -> bool:
    return os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes",
                                                                            "true")
