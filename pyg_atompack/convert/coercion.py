"""One type per custom key for a whole conversion: drops, casts and promotion.

Sources such as extxyz carry no schema: ASE parses ``mu=0`` as an integer and
``mu=1.6256`` as a float, so one key can arrive with several types. Every
destination wants one type per key (`.atp` locks it in the schema at the first
record), so :class:`Coercer` decides it:

* ``drop_keys`` / ``skip_targets`` are removed, ``casts`` applied first;
* a value that widens the key's type (integer -> float, float32 -> float64,
  a scalar -> a one-element array) promotes the key **for the whole output**,
  with numpy's promotion rules (:func:`numpy.result_type`); values that are
  narrower than the key's type are converted up to it;
* ``None`` counts as "missing" next to any other type;
* the floating-point builtin arrays (positions, forces, ...) are promoted the
  same way (float32 in some structures, float64 in others);
* anything else (a string next to a number, arrays of different rank, vectors
  of different lengths) is a real conflict: :class:`ConvertError` naming the
  user's output file, the structure, the key and both types in words.

A promotion found after structures were written with the narrower type
restarts the conversion with the wider one (:class:`Widened`); the
destination is written to a temporary name, so nothing half-typed is ever
published. Each key widens at most a few times (None < int < float32 <
float64), so a file is read at most a few extra times, and only when its
types really change.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from pyg_atompack.atp.types import BUILTINS

from .errors import ConvertError
from .options import ReadOptions
from .structure import Structure

_SCOPES = ("properties", "atom_properties")
# builtin arrays whose dtype may change between structures (float32 forces, then
# float64 ones): promoted like custom keys, since `.atp` locks their dtype too
_BUILTIN_ARRAYS = {name: field.per_atom for name, field in BUILTINS.items()
                   if len(field.dtypes) > 1 and (field.per_atom or field.shape)}
_BUILTIN_ITEMS = tuple(_BUILTIN_ARRAYS.items())
_SCOPE_ITEMS = (("properties", False), ("atom_properties", True))
_MISSING = object()


class Kind(NamedTuple):
    """The type of one custom value (a tuple: compared and built at C speed).

    Args:
        form (str): ``"none"``, ``"str"``, ``"int"``, ``"float"`` (Python scalars) or ``"array"``.
        dtype (np.dtype, optional): numpy dtype of an array (``None`` otherwise).
            (default: :obj:`None`)
        shape (tuple[int, ...], optional): Shape of an array; per-atom values leave out the atom
            axis. (default: :obj:`None`)
    """

    form: str
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None

    def words(self, per_atom: bool) -> str:
        """The kind as a phrase for error messages (``"a float64 array of shape (3,)"``)."""
        if self.form == "none":
            return "None"
        if self.form == "str":
            return "a string"
        if self.form == "int":
            return "an integer"
        if self.form == "float":
            return "a float"
        dims = ("n", *self.shape) if per_atom else self.shape
        shown = "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
        return f"a {'per-atom ' if per_atom else ''}{self.dtype} array of shape {shown}"


_NONE, _STR, _INT, _FLOAT = Kind("none"), Kind("str"), Kind("int"), Kind("float")
_SCALAR_KINDS = {type(None): _NONE, str: _STR, int: _INT, bool: _INT, float: _FLOAT}


def kind_of(value: Any, per_atom: bool) -> Kind:
    """The :class:`Kind` of a normalised custom value."""
    kind = _SCALAR_KINDS.get(type(value))  # the common cases without isinstance chains
    if kind is not None:
        return kind
    if isinstance(value, np.integer):
        return _INT
    if isinstance(value, np.floating):
        return _FLOAT
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    return Kind("array", array.dtype, array.shape[1:] if per_atom else array.shape)


def _scalar_dtype(kind: Kind) -> np.dtype:
    return np.dtype(np.int64 if kind.form == "int" else np.float64)


def _size(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def promote(old: Kind, new: Kind) -> Kind | None:
    """The narrowest kind holding both, or ``None`` when they conflict.

    Args:
        old (Kind): The key's kind so far.
        new (Kind): The kind of the value just read.

    Returns:
        The promoted kind (``old`` itself when ``new`` fits it).
    """
    if old == new or new.form == "none":
        return old
    if old.form == "none":
        return new
    if "str" in (old.form, new.form):
        return None
    numeric_scalars = {"int", "float"}
    if old.form in numeric_scalars and new.form in numeric_scalars:
        return Kind("float")
    if old.form == "array" and new.form == "array":
        dtype = np.result_type(old.dtype, new.dtype)
        if old.shape == new.shape:
            return Kind("array", dtype, old.shape)
        # Tensors of rank 2 and more may be ragged (the .atp format stores their
        # shapes per record); vectors and per-atom rows must agree.
        if len(old.shape) == len(new.shape) and len(old.shape) >= 2:
            return Kind("array", dtype, old.shape)
        return None
    scalar, array = (old, new) if old.form != "array" else (new, old)
    if _size(array.shape) != 1:
        return None  # a scalar next to a real vector: which element would it be?
    dtype = np.result_type(_scalar_dtype(scalar), array.dtype)
    return Kind("array", dtype, array.shape)


def kinds_to_json(kinds: dict[tuple[str, str], Kind]) -> dict[str, list]:
    """The kinds a conversion settled on, for a part's manifest (``"scope/key"`` keys).

    Args:
        kinds (dict[tuple[str, str], Kind]): :attr:`Coercer.kinds`.

    Returns:
        dict[str, list]: ``{"properties/mu": ["float", None, None], ...}``.
    """
    return {f"{scope}/{key}": [kind.form, None if kind.dtype is None else kind.dtype.str,
                               None if kind.shape is None else list(kind.shape)]
            for (scope, key), kind in sorted(kinds.items())}


def kinds_from_json(data: dict[str, list]) -> dict[tuple[str, str], Kind]:
    """The inverse of :func:`kinds_to_json`.

    Args:
        data (dict[str, list]): What :func:`kinds_to_json` returned.

    Returns:
        dict[tuple[str, str], Kind]: The kinds by ``(scope, key)``.
    """
    kinds = {}
    for slot, (form, dtype, shape) in data.items():
        scope, key = slot.split("/", 1)
        kinds[(scope, key)] = Kind(form, None if dtype is None else np.dtype(dtype),
                                   None if shape is None else tuple(shape))
    return kinds


def conform(value: Any, kind: Kind, per_atom: bool) -> Any:
    """Convert ``value`` (of a kind :func:`promote` accepted) to ``kind``."""
    if value is None or kind.form in ("none", "str"):
        return value
    if kind.form == "float":
        return float(value)
    if kind.form == "int":
        return int(value)
    array = np.asarray(value)
    if array.dtype != kind.dtype:
        array = array.astype(kind.dtype)
    if not per_atom and array.shape != kind.shape and array.size == _size(kind.shape) == 1:
        array = array.reshape(kind.shape)
    return array


def cast_value(value: Any, dtype: str) -> Any:
    """Apply a ``--cast KEY=DTYPE`` to one value (scalars stay Python scalars)."""
    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.kind in "US":  # numbers written as text
        array = array.astype(np.float64)
    cast = array.astype(dtype)
    if cast.dtype.kind == "i" and not np.array_equal(cast, array):
        raise ValueError("the value is not a whole number in range; an integer cast "
                         "would change it")
    if cast.ndim == 0:
        return cast.item()
    return cast


class Widened(Exception):
    """A key's type widened after structures were written narrower: start again."""


class Coercer:
    """Gives every custom key one type across a conversion (see the module docstring).

    Args:
        options (ReadOptions): ``drop_keys``, ``skip_targets`` and ``casts`` of the conversion.
        source (str or os.PathLike): The source path, for messages.
        destination (str or os.PathLike): The user's destination path, named by errors and notes.
        kinds (dict[tuple[str, str], Kind], optional): Kinds to start from (values narrower
            than these are converted up to them): how :func:`~.merge.merge_parts` re-encodes a
            part with the types the other parts settled on. (default: :obj:`None`)
    """

    def __init__(self, options: ReadOptions, source: str | os.PathLike,
                 destination: str | os.PathLike,
                 kinds: dict[tuple[str, str], Kind] | None = None) -> None:
        self.left_out = options.left_out()
        self.casts = dict(options.casts)
        self.source = os.fspath(source)
        self.destination = os.fspath(destination)
        self.kinds: dict[tuple[str, str], Kind] = dict(kinds or {})
        self.first_seen: dict[tuple[str, str], tuple[int, Kind]] = {}
        self.promotions: dict[tuple[str, str], tuple[Kind, Kind, int]] = {}

    def __call__(self, structure: Structure, index: int) -> Structure:
        """The structure with dropped keys removed and every custom value of the key's type.

        Raises:
            Widened: A key must be stored wider than structures already written.
            ConvertError: Two values of a key have no common type.
        """
        for name, per_atom in _BUILTIN_ITEMS:
            value = getattr(structure, name)
            if value is not None and type(value) is np.ndarray and value.dtype.kind == "f":
                settled = self._settle("builtin", name, value, index, per_atom)
                if settled is not value:
                    setattr(structure, name, settled)
        for scope, per_atom in _SCOPE_ITEMS:
            values: dict[str, Any] = getattr(structure, scope)
            if not values:
                continue
            kept: dict[str, Any] = {}
            changed = False
            for key, original in values.items():
                if key in self.left_out:
                    changed = True
                    continue
                value = self._cast(key, original, index) if key in self.casts else original
                settled = self._settle(scope, key, value, index, per_atom)
                changed = changed or settled is not original
                if settled is not _MISSING:
                    kept[key] = settled
            if changed:
                setattr(structure, scope, kept)
        return structure

    def _cast(self, key: str, value: Any, index: int) -> Any:
        try:
            return cast_value(value, self.casts[key])
        except (TypeError, ValueError) as exc:
            raise ConvertError(
                self.destination,
                f"key {key!r}: structure {index} of {self.source} holds {value!r}, "
                f"which cannot be cast to {self.casts[key]} ({exc})",
                index,
            ) from exc

    def _settle(self, scope: str, key: str, value: Any, index: int, per_atom: bool) -> Any:
        slot = (scope, key)
        old = self.kinds.get(slot)
        if old is not None and slot in self.first_seen:
            # fast path, the common case: the same type as before (dtypes of the
            # builtin numpy types are singletons, so `is` compares them)
            if type(value) is np.ndarray:
                if value.dtype is old.dtype and old.shape == (
                        value.shape[1:] if per_atom else value.shape):
                    return value
            elif _SCALAR_KINDS.get(type(value)) is old:
                return value
        new = kind_of(value, per_atom)
        self.first_seen.setdefault(slot, (index, new))
        if old is None:
            self.kinds[slot] = old = new
        if new == old:
            return value
        wider = promote(old, new)
        if wider is None:
            first_index, first_kind = self.first_seen[slot]
            raise ConvertError(
                self.destination,
                f"key {key!r} has no common type: structure {index} of {self.source} holds "
                f"{new.words(per_atom)}, structure {first_index} holds "
                f"{first_kind.words(per_atom)}; convert it with --cast {key}=DTYPE or "
                f"leave it out with --drop-key {key}",
                index,
            )
        if wider != old:
            self.kinds[slot] = wider
            first = self.promotions.get(slot, (old, wider, index))[0]
            self.promotions[slot] = (first, wider, index)
            if self.first_seen[slot][0] < index:
                # structures before this one were written with the narrower type
                raise Widened(key)
        if value is None:
            return _MISSING  # the key has a real type: a None is a missing value
        return conform(value, self.kinds[slot], per_atom)

    def restart(self) -> None:
        """Start a new pass: forget where keys were first seen, keep the kinds learned."""
        self.first_seen = {}

    def notes(self) -> list[str]:
        """One line per promoted key, for stderr."""
        lines = []
        for (scope, key), (old, new, index) in self.promotions.items():
            per_atom = scope == "atom_properties" or _BUILTIN_ARRAYS.get(key, False) and \
                scope == "builtin"
            if old.form == "none":
                lines.append(
                    f"{self.destination}: key {key!r} is None in some structures of "
                    f"{self.source}; those structures store it as missing"
                )
                continue
            lines.append(
                f"{self.destination}: key {key!r} promoted from {old.words(per_atom)} to "
                f"{new.words(per_atom)} for the whole file (structure {index} of "
                f"{self.source} needs it)"
            )
        return lines
