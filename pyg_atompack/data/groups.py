"""Groups of `.atp` records as PyG mini-batches (adsorbate+slab with its references, ...).

A grouping (see :mod:`pyg_atompack.atp.groups`) ties records together: an
adsorbate+slab structure with its clean slab and gas references, a reaction's
reactants and products. Models still see molecules: a mini-batch of groups is one
ordinary PyG :class:`~torch_geometric.data.Batch` of all their member structures, which
any PyG model takes as it is (``z``, ``pos``, ``batch``), plus a few attributes that
say which group and role each member has. One forward pass gives one value per member
(an energy); :meth:`AtompackGroupDataset.combine` sums them per group with a weight per
role, e.g. ``E(adslab) - E(slab) - E(gas)`` for an adsorption energy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Batch

from pyg_atompack.atp.groups import Grouping
from pyg_atompack.atp.reorder import reorder_flat
from pyg_atompack.data.dataset import AtompackDataset
from pyg_atompack.pyg import AttributeNames, flat_to_batch
from pyg_atompack.pyg.handoff import install_in_worker

__all__ = ["AtompackGroupDataset"]

#: Attributes every group batch carries besides the members' own.
MEMBER_ATTRIBUTES = ("role", "group", "record")
GROUP_ATTRIBUTES = ("group_id", "num_groups")


def _reader_groupings(reader: Any, source: str) -> Mapping[str, Grouping]:
    groups = getattr(reader, "groups", None)
    if groups is None:
        raise TypeError(f"AtompackGroupDataset({source}): {type(reader).__name__} does not "
                        "read groups")
    return {name: groups[name].grouping for name in groups}


class AtompackGroupDataset(torch.utils.data.Dataset):
    r"""The groups of one grouping of an `.atp` source; each item is one group's members.

    ``dataset[i]`` is a :class:`~torch_geometric.data.Batch` of the member structures of
    group ``i`` (in stored member order), and :class:`~pyg_atompack.data.AtompackLoader`
    batches groups: a mini-batch of ``G`` groups is one ``Batch`` of all their members,
    each shared record (a clean slab used by many groups) decoded once. Next to the
    members' usual attributes (``z``, ``pos``, ``natoms``, ``energy``, ..., ``batch``,
    ``ptr``) it holds:

    * ``role`` (``[num_graphs]``, int64): the member's role id, an index into
      :attr:`roles` (for ordered groups, its position in the group);
    * ``group`` (``[num_graphs]``, int64): which group of the mini-batch the member
      belongs to, ``0..G-1`` (what ``batch`` is to atoms, ``group`` is to members);
    * ``record`` (``[num_graphs]``, int64): the member's record index in the source;
    * ``group_id`` (``[G]``, int64): the groups' positions in the grouping;
    * ``num_groups`` (int): ``G``;
    * one attribute per group column, one value per group: float columns as
      ``[G]`` tensors (``dtype`` when given, else float64), int columns as int64,
      str columns as lists of ``G`` strings.

    Example:
        >>> ds = AtompackGroupDataset("ads.atp", "adsorption", fields=["energy"])
        >>> loader = AtompackLoader(ds, batch_size=16, shuffle=True)  # doctest: +SKIP
        >>> for batch in loader:                                      # doctest: +SKIP
        ...     energy = model(batch.z, batch.pos, batch.batch).view(-1)
        ...     e_ads = ds.combine(energy, batch, {"adslab": 1, "slab": -1, "gas": -1})
        ...     loss = (e_ads - batch.e_ads).square().mean()

    Args:
        source (Any): Anything :class:`~pyg_atompack.data.AtompackDataset` opens (a
            file, an open reader, a URL), or an :class:`AtompackDataset` itself (its
            ``fields``, ``dtype`` and names are used).
        grouping (str): The grouping's name.
        **kwargs (optional): Forwarded to :class:`~pyg_atompack.data.AtompackDataset`
            when ``source`` is not one (``fields``, ``dtype``, ``access``, ``rename``,
            ``names``, ``cache_dir``, ...; not ``transform`` or ``pre_filter``, which act
            on single records).

    Raises:
        KeyError: The source has no grouping of that name (the message lists those it has).
        ValueError: A group column is named like a member attribute.
    """

    def __init__(self, source: Any, grouping: str, **kwargs: Any) -> None:
        for key in ("transform", "pre_filter"):
            if kwargs.get(key) is not None:
                raise TypeError(f"AtompackGroupDataset does not take {key}=: groups are "
                                "read as whole batches")
        self.records = source if isinstance(source, AtompackDataset) else AtompackDataset(
            source, **kwargs)
        if self.records.transform is not None or self.records.pre_filter is not None:
            raise TypeError("AtompackGroupDataset needs an AtompackDataset without transform "
                            "or pre_filter: members are addressed by record index")
        where = self.records._source_repr
        groupings = _reader_groupings(self.records.reader, where)
        if grouping not in groupings:
            raise KeyError(f"AtompackGroupDataset({where}): no grouping named {grouping!r} "
                           f"(groupings: {sorted(groupings) or 'none'})")
        self.name = grouping
        self.grouping = groupings[grouping]
        reserved = set(MEMBER_ATTRIBUTES) | set(GROUP_ATTRIBUTES) | {"batch", "ptr"}
        clash = sorted(reserved & set(self.grouping.properties))
        if clash:
            raise ValueError(f"AtompackGroupDataset({where}): grouping {grouping!r} has "
                             f"column(s) {clash} named like the attributes every group "
                             "batch carries")

    @property
    def roles(self) -> list[str]:
        """Role names of the grouping (``role`` indexes them; empty for ordered groups)."""
        return list(self.grouping.roles)

    def __len__(self) -> int:
        return len(self.grouping)

    def atom_counts(self) -> np.ndarray:
        """Atoms of every group (its members' atoms summed), from the index alone: what
        ``AtompackLoader(..., max_atoms=N)`` packs batches of groups by.

        Returns:
            np.ndarray: int64, one count per group.
        """
        n_atoms = np.asarray(self.records.reader.n_atoms, dtype=np.int64)
        per_member = n_atoms[self.grouping.records]
        return np.add.reduceat(per_member, self.grouping.offsets[:-1]) if len(self) else \
            np.zeros(0, np.int64)

    def __getitem__(self, index: int) -> Batch:
        n = len(self)
        if not -n <= int(index) < n:
            raise IndexError(f"group {int(index)} is out of range for grouping "
                             f"{self.name!r} of {n} groups")
        return self.__getitems__([int(index) % n])

    def __getitems__(self, positions: Sequence[int]) -> Batch:
        return self.fetch(positions)

    def fetch(self, positions: Sequence[int], names: AttributeNames | None = None,
              exclude_keys: Sequence[str] = (), follow_batch: Sequence[str] = ()) -> Batch:
        """One ``Batch`` of the members of the groups at ``positions`` (see the class).

        Args:
            positions (Sequence[int]): Group positions in the grouping.
            names (AttributeNames, optional): Further renames of member attributes,
                applied after the dataset's own. (default: :obj:`None`)
            exclude_keys (Sequence[str], optional): Member attributes to leave out.
                (default: :obj:`()`)
            follow_batch (Sequence[str], optional): Member attributes that get
                ``<attr>_batch`` / ``<attr>_ptr`` vectors. (default: :obj:`()`)

        Returns:
            Batch: The mini-batch.
        """
        install_in_worker()  # in a DataLoader worker, the batch leaves packed (pyg.handoff)
        g = self.grouping
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        starts, stops = g.offsets[positions], g.offsets[positions + 1]
        sizes = stops - starts
        member = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])
        records = g.records[member]
        role = (g.member_roles[member].astype(np.int64) if g.roles
                else member - np.repeat(starts, sizes))
        # a record shared by several groups of the batch (a clean slab) is decoded once
        unique, inverse = np.unique(records, return_inverse=True)
        dataset = self.records
        flat = dataset.reader.read_batch(unique, fields=dataset.fields)
        if len(unique) != len(records) or not np.array_equal(unique, records):
            flat = reorder_flat(flat, inverse.reshape(-1))
        all_names = dataset.names if names is None else (
            names if dataset.names is None else dataset.names.then(names))
        stored = [a if all_names is None else all_names.stored_name(a)
                  for a in (*exclude_keys, *follow_batch)]
        batch = flat_to_batch(flat, dtype=dataset.dtype, exclude_keys=stored[:len(exclude_keys)],
                              follow_batch=stored[len(exclude_keys):], record_ids=records)
        if all_names is not None:
            batch = all_names.apply(batch)
        return self._add_group_attributes(batch, positions, sizes, role, records)

    def _add_group_attributes(self, batch: Batch, positions: np.ndarray, sizes: np.ndarray,
                              role: np.ndarray, records: np.ndarray) -> Batch:
        taken = set(batch.keys()) & (set(MEMBER_ATTRIBUTES) | set(GROUP_ATTRIBUTES)
                                     | set(self.grouping.properties))
        if taken:
            raise ValueError(f"grouping {self.name!r}: the member records already have "
                             f"attribute(s) {sorted(taken)}; rename them (rename=...) or "
                             "leave them out (fields=...)")
        count = len(positions)
        graph_slices = torch.arange(len(records) + 1)
        no_increment = torch.zeros(len(records), dtype=torch.long)
        for key, value in (("role", role), ("group", np.repeat(np.arange(count), sizes)),
                           ("record", records)):
            batch[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.int64))
            # per member, like a graph-level attribute: to_data_list() still works
            batch._slice_dict[key] = graph_slices
            batch._inc_dict[key] = no_increment
        batch.group_id = torch.from_numpy(positions.copy())
        batch.num_groups = count
        float_dtype = self.records.dtype or torch.float64
        for key, column in self.grouping.properties.items():
            if isinstance(column, list):
                batch[key] = [column[int(p)] for p in positions]
            elif column.dtype.kind == "f":
                batch[key] = torch.from_numpy(column[positions]).to(float_dtype)
            else:
                batch[key] = torch.from_numpy(column[positions])
        return batch

    def combine(self, values: torch.Tensor, batch: Batch,
                weights: Mapping[str, float] | None = None) -> torch.Tensor:
        r"""Per group, the weighted sum of one value per member: :math:`\sum_m w_{role(m)} v_m`.

        Args:
            values (torch.Tensor): ``[num_graphs]`` (or ``[num_graphs, 1]``) values, one
                per member of ``batch`` (e.g. the model's energies).
            batch (Batch): A batch of this dataset.
            weights (Mapping[str, float], optional): A weight for every role of the
                grouping, e.g. ``{"adslab": 1, "slab": -1, "gas": -1}``; :obj:`None` sums
                (the only choice for ordered groups). (default: :obj:`None`)

        Returns:
            torch.Tensor: ``[num_groups]`` sums, differentiable through ``values``.

        Raises:
            KeyError: ``weights`` misses a role of the grouping (never silently 0).
        """
        values = values.reshape(-1)
        if values.numel() != batch.group.numel():
            raise ValueError(f"combine: {values.numel()} values for {batch.group.numel()} "
                             "members")
        if weights is not None:
            missing = [r for r in self.grouping.roles if r not in weights]
            if missing or not self.grouping.roles:
                raise KeyError(f"combine: grouping {self.name!r} has roles "
                               f"{self.roles}; weights miss {missing or 'them all'}")
            table = torch.tensor([float(weights[r]) for r in self.grouping.roles],
                                 dtype=values.dtype, device=values.device)
            values = values * table[batch.role.to(values.device)]
        out = torch.zeros(batch.num_groups, dtype=values.dtype, device=values.device)
        return out.index_add(0, batch.group.to(values.device), values)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.records._source_repr}, {self.name!r}, "
                f"groups={len(self)}, roles={self.roles})")
