"""Shared torch helpers: turn `.atp` records and flat batches into PyG objects.

Both the dataset layer (:mod:`pyg_atompack.data`) and the streaming layer
(:mod:`pyg_atompack.stream`) build their :class:`~torch_geometric.data.Data`
and :class:`~torch_geometric.data.Batch` objects here, so that every dataset in
the project exposes the same attribute names (the table in
``docs/architecture.md``):

========================  ==================  =================================
attribute                 shape / dtype       source
========================  ==================  =================================
``z``                     ``[N]`` int64       atomic numbers
``pos``                   ``[N, 3]``          positions (stored float dtype)
``natoms``                ``[1]`` int64       number of atoms
``energy``                ``[1]`` float64     energy (float32 values widened)
``forces``                ``[N, 3]``          forces
``charges``               ``[N]``             charges
``velocities``            ``[N, 3]``          velocities
``cell``                  ``[1, 3, 3]``       cell (rows are lattice vectors)
``stress``                ``[1, 3, 3]``       stress
``pbc``                   ``[1, 3]`` bool     periodic axes
``name``                  ``str``             name
per-atom custom ``key``   ``[N, ...]``        atom property (node level)
per-molecule ``key``      ``[1, ...]``        molecule property (graph level)
========================  ==================  =================================

A custom key that collides with a builtin attribute is renamed ``prop_<key>``
(per molecule) or ``atom_<key>`` (per atom).

:func:`flat_to_batch` assembles a ``Batch`` straight from the concatenated
arrays of ``Reader.read_batch`` without creating one ``Data`` per molecule. It
reproduces :meth:`torch_geometric.data.Batch.from_data_list` exactly (values,
dtypes, ``batch``, ``ptr``, ``_slice_dict``, ``_inc_dict``), so
``get_example``/``to_data_list`` work on the result.

Every dataset also accepts ``rename=`` and ``names=`` (e.g. ``"pyg-md17"``:
``force`` and a float32 ``energy``, PyG's ``MD17`` convention), applied to each
produced ``Data``/``Batch`` by :mod:`.names`.

:func:`decode_pt` reads every ``.pt`` file of the project (streamed shards and files
given to the converter): the layouts real datasets use are indexed in place without
unpickling (:mod:`.pt_index`), anything else goes to ``torch.load(weights_only=True)``
with the one allow-list :data:`PYG_SAFE_GLOBALS` (:mod:`.pt`).

Modules: :mod:`.fields` (names and ``fields=`` selections), :mod:`.names`
(read-side renames and presets), :mod:`.data`
(one ``Data`` per molecule), :mod:`.batch` (``Batch`` assembly), :mod:`.pt`,
:mod:`.pt_pickle`, :mod:`.pt_index`, :mod:`.pt_arriving` and :mod:`.pt_archive`
(``.pt`` files), :mod:`.samples` (samples
built when taken), :mod:`.budget` (batches by atom budget), :mod:`.errors`.
"""

from .batch import flat_to_batch
from .budget import (
    AtomBudgetBatchSampler,
    AtomBudgetError,
    EqualSteps,
    balance_batches,
    consumed_positions,
    group_by_atoms,
    plan_atom_batches,
    rank_batches,
)
from .data import flat_to_data_list, record_to_data
from .errors import (
    BatchAssemblyError,
    FieldSelectionError,
    PtPayloadError,
    PygConversionError,
    UnsafePtPayloadError,
)
from .fields import BUILTIN_FIELDS, attribute_name, resolve_fields
from .names import NAME_PRESETS, AttributeNames, names_transform, resolve_names
from .pt import PYG_SAFE_GLOBALS, decode_pt

__all__ = [
    "AtomBudgetBatchSampler",
    "AtomBudgetError",
    "AttributeNames",
    "EqualSteps",
    "BUILTIN_FIELDS",
    "NAME_PRESETS",
    "FieldSelectionError",
    "BatchAssemblyError",
    "PygConversionError",
    "PtPayloadError",
    "UnsafePtPayloadError",
    "PYG_SAFE_GLOBALS",
    "decode_pt",
    "attribute_name",
    "record_to_data",
    "flat_to_data_list",
    "flat_to_batch",
    "names_transform",
    "resolve_fields",
    "resolve_names",
    "balance_batches",
    "consumed_positions",
    "group_by_atoms",
    "plan_atom_batches",
    "rank_batches",
]
