"""Hypothesis strategies that describe whole `.atp` files for the differential tests.

A drawn :class:`FileSpec` says what goes into a file (codec, positions dtype, the
molecules of each append session) and what every molecule must read back as
(:attr:`MoleculeSpec.expected`, a plain "normal form" dict). The spec classes, the
writers for both libraries, the readers into the normal form and the exact comparison
live in ``atp_oracle.py``.

Hypothesis chooses the *structure* (atom counts, which fields, dtypes, shapes,
strings, special float values); bulk numbers come from a numpy generator seeded
by hypothesis, which keeps examples cheap to draw and still reproducible.

Two families of files exist because the reference library has two write paths
with different typing rules (spec `atp-format.md` §5.5):

* :func:`molecule_files`: one molecule at a time (`Molecule.from_arrays` +
  `set_property` / our `Writer.add`); every section optional per molecule.
* :func:`batch_files`: stacked arrays (`add_arrays_batch` / our `Writer.add_batch`);
  every column present in every molecule of a batch, one atom count per batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from atp_oracle import (
    BUILTIN_KEYS,
    CODECS,
    BatchSpec,
    FileSpec,
    MoleculeSpec,
    PropertyPlan,
)
from hypothesis import strategies as st

# dtypes a record-format-2 file allows, and the alternates record format 3 adds (spec §5.1)
CANONICAL_DTYPES = {
    "energy": np.float64, "forces": np.float32, "velocities": np.float32,
    "charges": np.float64, "cell": np.float64, "stress": np.float64,
}
ALTERNATE_DTYPES = {
    "energy": np.float32, "forces": np.float64, "velocities": np.float64,
    "charges": np.float32, "cell": np.float32, "stress": np.float32,
}
ARRAY_DTYPES = (np.float64, np.float32, np.int64, np.int32)
FLOAT_SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 0.0, 5e-324, 1e-40, 3.0e38)

# keys are unique per file; a few collide with builtin names on purpose (kind disambiguates)
_key_text = st.text(alphabet=st.characters(exclude_categories=("Cs",), min_codepoint=0x20),
                    min_size=1, max_size=12)
property_keys = st.one_of(st.sampled_from(("energy", "forces", "pbc", "name")), _key_text)
texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24)


def random_floats(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any,
                  specials: bool) -> np.ndarray:
    """Normal-distributed floats with optional NaN/inf/-0.0/subnormal values sprinkled in."""
    values = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
    if specials and values.size:
        hits = rng.random(shape) < 0.2
        picks = rng.choice(np.array(FLOAT_SPECIALS), size=shape).astype(dtype)
        values = np.where(hits, picks, values).astype(dtype)
    return values


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any,
                 specials: bool) -> np.ndarray:
    """Random values of any of the four storable dtypes, covering the full integer range."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return random_floats(rng, shape, dtype, specials)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)


def _tensor_shape(draw: st.DrawFn, rank: int, dtype: Any) -> tuple[int, ...]:
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank)))
    # a 2-D float array with 3 columns is written as vec3, never as a tensor (spec §5.5)
    if rank == 2 and np.dtype(dtype).kind == "f" and shape[1] == 3:
        shape = (shape[0], 2)
    return shape


def _atom_tensor_inner(draw: st.DrawFn, dtype: Any) -> tuple[int, ...]:
    # per-atom tensors are (n, *inner) with rank 2-3 overall; (n, 3) floats would be vec3
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=2)))
    if shape == (3,) and np.dtype(dtype).kind == "f":
        shape = (2,)
    return shape


@st.composite
def property_plans(draw: st.DrawFn, max_plans: int = 6) -> list[PropertyPlan]:
    """Custom property plans for a per-molecule file: every kind of both scopes."""
    keys = draw(st.lists(property_keys, max_size=max_plans, unique=True))
    plans = []
    for key in keys:
        scope = draw(st.sampled_from(("molecule", "atom")))
        if scope == "molecule":
            kind = draw(st.sampled_from(
                ("none", "int", "bool", "float", "str", "array", "vec3", "tensor")))
        else:
            kind = draw(st.sampled_from(("array", "vec3", "tensor")))
        dtype = draw(st.sampled_from(ARRAY_DTYPES))
        shape: tuple[int, ...] = ()
        ragged = False
        if kind == "vec3":
            dtype = draw(st.sampled_from((np.float32, np.float64)))
            shape = (draw(st.integers(0, 4)), 3)
        elif kind == "array" and scope == "molecule":
            shape = (draw(st.integers(0, 5)),)
        elif kind == "tensor" and scope == "molecule":
            shape = _tensor_shape(draw, draw(st.integers(2, 3)), dtype)
            ragged = draw(st.booleans())
        elif kind == "tensor":
            shape = _atom_tensor_inner(draw, dtype)
        plans.append(PropertyPlan(key, scope, kind, dtype, shape, ragged))
    return plans


def _molecule_value(draw: st.DrawFn, plan: PropertyPlan, rng: np.random.Generator, n_atoms: int,
                    specials: bool) -> Any:
    if plan.kind == "none":
        return None
    if plan.kind == "int":
        return int(rng.integers(-(2**63), 2**63 - 1, endpoint=True))
    if plan.kind == "bool":
        return draw(st.booleans())
    if plan.kind == "float":
        return float(random_floats(rng, (), np.float64, specials))
    if plan.kind == "str":
        return draw(texts)
    if plan.scope == "atom":
        # per-atom values lead with the atom axis; vec3 plans carry (k, 3), arrays ()
        inner = plan.shape[1:] if plan.kind == "vec3" else plan.shape
        shape = (n_atoms, *inner)
    elif plan.kind == "tensor" and plan.ragged:
        shape = _tensor_shape(draw, len(plan.shape), plan.dtype)
    else:
        shape = plan.shape
    return random_array(rng, shape, plan.dtype, specials)


def _file_settings(draw, codecs, alternate_keys):
    """Seeded rng, specials flag, codec, level, positions dtype and builtin dtypes.

    Alternate builtin dtypes need record format 3, which float64 positions guarantee,
    so they are drawn only then (for the builtins in ``alternate_keys``).
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    specials = draw(st.booleans())
    codec = draw(st.sampled_from(codecs))
    level = draw(st.sampled_from((1, 3, 7))) if codec == "zstd" else 3
    pos_dtype = draw(st.sampled_from((np.float32, np.float64)))
    dtypes = dict(CANONICAL_DTYPES)
    if pos_dtype is np.float64:
        for key in alternate_keys:
            if draw(st.booleans()):
                dtypes[key] = ALTERNATE_DTYPES[key]
    return rng, specials, codec, level, pos_dtype, dtypes


@st.composite
def molecule_files(draw: st.DrawFn, *, max_atoms: int = 300, max_sessions: int = 3,
                   max_per_session: int = 4, codecs: tuple[str, ...] = CODECS) -> FileSpec:
    """Files for the per-molecule write paths (`add_molecule(s)` / `Writer.add`).

    Args:
        max_atoms: largest molecule.
        max_sessions: sessions (the first creates the file, the others append after reopen).
        max_per_session: molecules per session (a session may add none).
        codecs: codecs to choose from.

    Returns:
        A :class:`FileSpec` whose sessions hold :class:`MoleculeSpec` objects.
    """
    # from_arrays always stores the energy as float64
    rng, specials, codec, level, pos_dtype, dtypes = _file_settings(
        draw, codecs, ("forces", "velocities", "charges", "cell", "stress"))
    plans = draw(property_plans())
    n_sessions = draw(st.integers(1, max_sessions))
    sessions = []
    for number in range(n_sessions):
        session = []
        # the first session is never empty: empty files are covered by the golden files
        for _ in range(draw(st.integers(int(number == 0), max_per_session))):
            n = draw(st.one_of(st.integers(0, 8), st.integers(0, max_atoms)))
            session.append(_draw_molecule(draw, rng, n, pos_dtype, dtypes, plans, specials))
        sessions.append(session)
    one_by_one = [draw(st.booleans()) for _ in sessions]
    return FileSpec(codec, level, pos_dtype, sessions, one_by_one)


def _draw_molecule(draw: st.DrawFn, rng: np.random.Generator, n: int, pos_dtype: Any,
                   dtypes: dict[str, Any], plans: list[PropertyPlan],
                   specials: bool) -> MoleculeSpec:
    positions = random_floats(rng, (n, 3), pos_dtype, specials)
    numbers = rng.integers(0, 255, size=n, endpoint=True, dtype=np.uint8)
    present = draw(st.sets(st.sampled_from(BUILTIN_KEYS)))
    builtins: dict[str, Any] = {}
    for key in sorted(present):
        if key == "energy":
            builtins[key] = float(random_floats(rng, (), np.float64, specials))
        elif key in ("forces", "velocities"):
            builtins[key] = random_floats(rng, (n, 3), dtypes[key], specials)
        elif key == "charges":
            builtins[key] = random_floats(rng, (n,), dtypes[key], specials)
        elif key in ("cell", "stress"):
            builtins[key] = random_floats(rng, (3, 3), dtypes[key], specials)
        elif key == "pbc":
            builtins[key] = tuple(draw(st.lists(st.booleans(), min_size=3, max_size=3)))
        else:
            builtins[key] = draw(texts)
    properties: dict[str, Any] = {}
    atom_properties: dict[str, Any] = {}
    for plan in plans:
        if not draw(st.booleans()):
            continue  # every custom section is optional per molecule
        value = _molecule_value(draw, plan, rng, n, specials)
        (properties if plan.scope == "molecule" else atom_properties)[plan.key] = value
    return MoleculeSpec(positions, numbers, builtins, properties, atom_properties)


# ---------------------------------------------------------------- stacked-array (batch) files

@st.composite
def batch_column_plans(draw: st.DrawFn, max_plans: int = 5) -> list[PropertyPlan]:
    """Column plans for `add_arrays_batch` / `add_batch` (spec §5.5, batch typing rules)."""
    # builtin names are refused as column keys by add_arrays_batch (e.g. "stress")
    keys = draw(st.lists(_key_text.filter(lambda k: k not in BUILTIN_KEYS), max_size=max_plans,
                         unique=True))
    plans = []
    for key in keys:
        scope = draw(st.sampled_from(("molecule", "atom")))
        dtype = draw(st.sampled_from(ARRAY_DTYPES))
        float_dtype = draw(st.sampled_from((np.float32, np.float64)))
        if scope == "molecule":
            kind = draw(st.sampled_from(("str", "scalar", "array", "vec3", "tensor")))
        else:
            kind = draw(st.sampled_from(("array", "vec3", "tensor")))
        shape: tuple[int, ...] = ()
        if kind == "vec3":
            dtype = float_dtype
            shape = (draw(st.integers(0, 4)), 3) if scope == "molecule" else (3,)
        elif kind == "array" and scope == "molecule":
            shape = (draw(st.integers(0, 5)),)
        elif kind == "tensor" and scope == "molecule":
            shape = _tensor_shape(draw, draw(st.integers(2, 3)), dtype)
        elif kind == "tensor":
            shape = _atom_tensor_inner(draw, dtype)
        plans.append(PropertyPlan(key, scope, kind, dtype, shape))
    return plans


def _batch_column(draw: st.DrawFn, plan: PropertyPlan, rng: np.random.Generator, size: int,
                  n: int, specials: bool) -> tuple[Any, list[Any]]:
    """A stacked column and the per-molecule values it must read back as."""
    if plan.kind == "str":
        values = draw(st.lists(texts, min_size=size, max_size=size))
        return values, list(values)
    if plan.kind == "scalar":
        column = random_array(rng, (size,), plan.dtype, specials)
        if column.dtype.kind == "f":  # float32 columns are widened to f64 scalars
            return column, [float(v) for v in column.astype(np.float64)]
        return column, [int(v) for v in column]
    inner = plan.shape if plan.scope == "molecule" else (n, *plan.shape)
    column = random_array(rng, (size, *inner), plan.dtype, specials)
    return column, [column[b] for b in range(size)]


@st.composite
def batch_files(draw: st.DrawFn, *, max_atoms: int = 300, max_sessions: int = 3,
                max_batches: int = 2, max_batch_size: int = 4,
                codecs: tuple[str, ...] = CODECS) -> FileSpec:
    """Files for the stacked-array write paths (`add_arrays_batch` / `Writer.add_batch`).

    Args:
        max_atoms: largest atom count of a batch.
        max_sessions: sessions (the first creates the file, the others append after reopen).
        max_batches: batches per session.
        max_batch_size: molecules per batch (at least one).
        codecs: codecs to choose from.

    Returns:
        A :class:`FileSpec` whose sessions hold :class:`BatchSpec` objects.
    """
    rng, specials, codec, level, pos_dtype, dtypes = _file_settings(
        draw, codecs, tuple(ALTERNATE_DTYPES))
    plans = draw(batch_column_plans())
    sessions = []
    for number in range(draw(st.integers(1, max_sessions))):
        session = []
        for _ in range(draw(st.integers(int(number == 0), max_batches))):
            size = draw(st.integers(1, max_batch_size))
            n = draw(st.one_of(st.integers(0, 8), st.integers(0, max_atoms)))
            session.append(_draw_batch(draw, rng, size, n, pos_dtype, dtypes, plans, specials))
        sessions.append(session)
    return FileSpec(codec, level, pos_dtype, sessions, [False] * len(sessions))


def _draw_batch(draw: st.DrawFn, rng: np.random.Generator, size: int, n: int, pos_dtype: Any,
                dtypes: dict[str, Any], plans: list[PropertyPlan], specials: bool) -> BatchSpec:
    positions = random_floats(rng, (size, n, 3), pos_dtype, specials)
    numbers = rng.integers(0, 255, size=(size, n), endpoint=True, dtype=np.uint8)
    expected: list[dict[str, Any]] = [
        {"positions": positions[b], "atomic_numbers": numbers[b], **dict.fromkeys(BUILTIN_KEYS),
         "properties": {}, "atom_properties": {}}
        for b in range(size)
    ]
    builtins: dict[str, Any] = {}
    for key in sorted(draw(st.sets(st.sampled_from(BUILTIN_KEYS)))):
        if key == "energy":
            column = random_floats(rng, (size,), dtypes[key], specials)
            values = [float(v) for v in column.astype(np.float64)]
        elif key in ("forces", "velocities"):
            column = random_floats(rng, (size, n, 3), dtypes[key], specials)
            values = list(column)
        elif key == "charges":
            column = random_floats(rng, (size, n), dtypes[key], specials)
            values = list(column)
        elif key in ("cell", "stress"):
            column = random_floats(rng, (size, 3, 3), dtypes[key], specials)
            values = list(column)
        elif key == "pbc":
            column = rng.random((size, 3)) < 0.5
            values = [tuple(bool(v) for v in row) for row in column]
        else:
            column = draw(st.lists(texts, min_size=size, max_size=size))
            values = list(column)
        builtins[key] = column
        for b in range(size):
            expected[b][key] = values[b]
    properties: dict[str, Any] = {}
    atom_properties: dict[str, Any] = {}
    for plan in plans:
        column, values = _batch_column(draw, plan, rng, size, n, specials)
        target = "properties" if plan.scope == "molecule" else "atom_properties"
        (properties if plan.scope == "molecule" else atom_properties)[plan.key] = column
        for b in range(size):
            expected[b][target][plan.key] = values[b]
    return BatchSpec(positions, numbers, builtins, properties, atom_properties, expected)
