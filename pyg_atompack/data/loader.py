"""A batch-level loader: one ``read_batch`` and a few array operations per mini-batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data
from torch.utils.data import Sampler, SequentialSampler
from torch_geometric.data import Batch
from torchdata.stateful_dataloader import StatefulDataLoader

from pyg_atompack.data.dataset import AtompackDataset
from pyg_atompack.data.groups import AtompackGroupDataset
from pyg_atompack.pyg import AttributeNames, attribute_name, flat_to_batch, resolve_names
from pyg_atompack.pyg.arena import Arena, arenas_for_children
from pyg_atompack.pyg.budget import AtomBudgetBatchSampler
from pyg_atompack.pyg.bundle import BatchBundle, BundleSampler, bundle_size
from pyg_atompack.pyg.device import DeviceFeed
from pyg_atompack.pyg.handoff import install_in_worker
from pyg_atompack.pyg.resume import (
    BUNDLE_SKIP,
    ResumableSampler,
    StatefulBatchSampler,
    finished_pass_state,
    finished_workers_state,
    quiet_torchdata,
    restore_loader_state,
    wrap_loader_state,
)

__all__ = ["AtompackLoader"]


def atom_counts(dataset: AtompackDataset | AtompackGroupDataset) -> np.ndarray:
    """Atom count of every position of ``dataset``, from the ``.atp`` index alone (of a
    group: all its members' atoms)."""
    if isinstance(dataset, AtompackGroupDataset):
        return dataset.atom_counts()
    return np.asarray(dataset.reader.n_atoms, dtype=np.int64)[dataset.record_indices()]


class _RecordName:
    """Names a dataset position as its file and record (for atom-budget errors)."""

    def __init__(self, dataset: AtompackDataset) -> None:
        self.dataset = dataset

    def __call__(self, position: int) -> str:
        if isinstance(self.dataset, AtompackGroupDataset):
            return (f"group {position} of grouping {self.dataset.name!r} in "
                    f"{self.dataset.records._source_repr}")
        record = int(self.dataset.record_indices([position])[0])
        reader = self.dataset.reader
        paths = getattr(reader, "shard_paths", None)
        if paths is not None:
            shard, local = reader.locate(record)
            if paths[shard] is not None:
                return f"record {local} of {paths[shard]} (dataset position {position})"
        where = getattr(reader, "path", None) or self.dataset._source_repr
        return f"record {record} of {where} (dataset position {position})"


def _pass_through(batch: Batch) -> Batch:
    # The fetcher already returns a finished Batch; a module-level function
    # (not a lambda) keeps the loader picklable for spawned workers.
    return batch


class _Fetcher(torch.utils.data.Dataset):
    """Turns one list of positions (or a tuple of lists) into batches inside a worker.

    Subclasses build one batch in :meth:`_batch`; this class hands it over, through the
    worker's shared-memory arena (:mod:`pyg_atompack.pyg.handoff`) when there is one.
    """

    #: one shared-memory arena per worker, set by the loader before it forks them
    arenas: list[Arena] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a spawned worker cannot map the main process's arenas: it sends through pipes
        return {**self.__dict__, "arenas": None}

    def __getitem__(self, positions: Sequence[int]) -> Batch:
        return self.__getitems__(positions)

    def __getitems__(self, positions: Sequence[int] | tuple[list[int], ...]
                     ) -> Batch | BatchBundle:
        install_in_worker(self.arenas)
        if isinstance(positions, tuple):  # several batches, handed over as one item
            return BatchBundle([self._batch(batch) for batch in positions])
        return self._batch(positions)

    def _batch(self, positions: Sequence[int]) -> Batch:
        raise NotImplementedError


class _BatchFetcher(_Fetcher):
    """Turns one list of dataset positions into one ``Batch`` inside a worker."""

    def __init__(
        self,
        dataset: AtompackDataset,
        follow_batch: Sequence[str],
        exclude_keys: Sequence[str],
        names: AttributeNames | None = None,
    ) -> None:
        self.dataset = dataset
        # follow_batch / exclude_keys use the names batches are yielded with; the
        # fast path assembles with the project's names and renames afterwards
        self.names = names
        self.all_names = names if dataset.names is None else dataset.names.then(names)
        self.follow_batch = list(follow_batch)
        self.exclude_keys = list(exclude_keys)
        self.stored_follow_batch = self._stored(self.all_names, self.follow_batch)
        self.stored_exclude_keys = self._stored(self.all_names, self.exclude_keys)
        self.read_fields = self._fields_to_read()
        # Positions -> record indices (view, pre_filter), computed once here
        # instead of once per batch.
        self.records = dataset.record_indices()

    @staticmethod
    def _stored(names: AttributeNames | None, attributes: list[str]) -> list[str]:
        return attributes if names is None else [names.stored_name(a) for a in attributes]

    def _fields_to_read(self) -> tuple[str, ...] | None:
        """The dataset's fields minus excluded attributes, so they are never decoded."""
        if not self.exclude_keys:
            return self.dataset.fields
        fields = self.dataset.fields
        if fields is None:
            fields = ("positions", "atomic_numbers", *self.dataset.reader.fields)
        excluded = set(self.stored_exclude_keys)
        return tuple(f for f in dict.fromkeys(fields) if attribute_name(f) not in excluded)

    def __len__(self) -> int:
        return len(self.records)

    def _batch(self, positions: Sequence[int]) -> Batch:
        dataset = self.dataset
        if dataset.transform is not None:
            # A transform works on single Data objects, so build them (each
            # dataset[i] applies it and the dataset's names) and collate the PyG way.
            batch = Batch.from_data_list(
                [dataset[int(p)] for p in positions],
                follow_batch=self._stored(self.names, self.follow_batch),
                exclude_keys=self._stored(self.names, self.exclude_keys),
            )
            return batch if self.names is None else self.names.apply(batch)
        records = self.records[np.asarray(positions, dtype=np.int64)]
        flat = dataset.reader.read_batch(records, fields=self.read_fields)
        batch = flat_to_batch(
            flat, dtype=dataset.dtype, follow_batch=self.stored_follow_batch,
            exclude_keys=self.stored_exclude_keys, record_ids=records,
        )
        return batch if self.all_names is None else self.all_names.apply(batch)


class _GroupFetcher(_Fetcher):
    """Turns one list of group positions into one ``Batch`` of their members."""

    def __init__(self, dataset: AtompackGroupDataset, follow_batch: Sequence[str],
                 exclude_keys: Sequence[str], names: AttributeNames | None) -> None:
        self.dataset = dataset
        self.follow_batch = list(follow_batch)
        self.exclude_keys = list(exclude_keys)
        self.names = names

    def __len__(self) -> int:
        return len(self.dataset)

    def _batch(self, positions: Sequence[int]) -> Batch:
        return self.dataset.fetch(positions, self.names, self.exclude_keys, self.follow_batch)


class AtompackLoader(StatefulDataLoader):
    r"""A fast mini-batch loader for :class:`AtompackDataset`.

    Instead of building one :class:`~torch_geometric.data.Data` per molecule and
    collating them, every step draws a list of indices from a sampler, reads the
    records with a single ``read_batch`` call and assembles the
    :class:`~torch_geometric.data.Batch` directly from the concatenated arrays
    (see :func:`pyg_atompack.pyg.flat_to_batch`). The batches equal those of
    :class:`torch_geometric.loader.DataLoader` over the same dataset and indices,
    attribute by attribute, including ``batch``, ``ptr`` and ``to_data_list()``.

    Sampling is the standard PyTorch machinery, so a custom ``sampler`` such as
    :class:`~torch.utils.data.DistributedSampler`, ``num_workers``,
    ``pin_memory``, ``persistent_workers`` and so on behave as usual; each worker
    reads whole batches, several consecutive ones per item (``batches_per_item``), which
    the main process receives as views of one shared-memory buffer and hands out one
    by one. ``len(loader)`` is the number of batches. Subsets of the dataset
    (``index_select``, slicing, ``shuffle()``, ``pre_filter``) are respected.

    ``shuffle=True`` samples through a :class:`~pyg_atompack.pyg.resume.ResumableSampler`
    seeded with ``seed``: a new permutation every epoch (it advances by itself;
    :meth:`set_epoch` pins one), split between DDP ranks when
    :mod:`torch.distributed` is initialised (``DistributedSampler``'s order). The
    loader is a torchdata ``StatefulDataLoader``: :meth:`state_dict` between two
    steps, then :meth:`load_state_dict` on a loader built the same way (in a new
    process too), continues the epoch with exactly the batches that were left; with
    ``shuffle=True`` also on another number of workers or ranks (the indices no rank
    had handed out, dealt over the new ranks).

    ``max_atoms=N`` replaces ``batch_size``: batches hold at most ``N`` atoms, planned
    from the ``.atp`` index's atom counts without reading a record
    (:class:`~pyg_atompack.pyg.budget.AtomBudgetBatchSampler`): shuffled consecutive
    runs of the epoch's permutation (``seed``, epoch), the same number of steps on
    every DDP rank (the batches with most structures are split in two until the count
    divides between ranks; nothing dropped or repeated), resumable like
    ``shuffle=True``. A structure of more than ``N`` atoms is an
    :class:`~pyg_atompack.pyg.budget.AtomBudgetError` naming its file and record at
    construction, or a batch of its own with ``oversize="own_batch"``.

    When the dataset has a ``transform``, the loader falls back to the
    per-sample path (``dataset[i]`` for each index, then
    ``Batch.from_data_list``), because transforms act on single graphs; it is
    then no faster than PyG's ``DataLoader``. Apply batch-level work to the
    yielded ``Batch`` instead to keep the fast path.

    A field carried by only some molecules of a batch cannot be batched (PyG's
    own collate fails or drops it depending on which molecule comes first):
    the loader raises an error naming the field and the records; leave such
    fields out with ``fields=`` on the dataset or ``exclude_keys``.

    Args:
        dataset (AtompackDataset or AtompackGroupDataset): The dataset to load from; for
            an :class:`~pyg_atompack.data.AtompackGroupDataset`, ``batch_size`` counts
            groups and each batch holds all their members.
        batch_size (int, optional): Molecules per mini-batch. (default: :obj:`1`)
        shuffle (bool, optional): Reshuffle the data every epoch (see above); not
            allowed together with ``sampler``. (default: :obj:`False`)
        drop_last (bool, optional): Drop the last incomplete batch.
            (default: :obj:`False`)
        sampler (torch.utils.data.Sampler, optional): Draws dataset positions
            (e.g. a :class:`~torch.utils.data.DistributedSampler`); the loader
            groups them into batches. (default: :obj:`None`)
        num_workers (int, optional): Worker processes; each reopens the
            dataset's reader. (default: :obj:`0`)
        follow_batch (list[str], optional): Attributes that get
            ``<attr>_batch``/``<attr>_ptr`` assignment vectors. (default: :obj:`None`)
        exclude_keys (list[str], optional): Attributes to leave out of the
            batch; their fields are not even decoded. (default: :obj:`None`)
        rename (Mapping[str, str], optional): Further renames of batch attributes,
            applied after the dataset's own ``rename``/``names`` (which batches
            always follow). ``follow_batch`` and ``exclude_keys`` use the final
            names. (default: :obj:`None`)
        names (str, optional): A naming preset such as ``"pyg-md17"`` (see
            :class:`AtompackDataset`). (default: :obj:`None`)
        seed (int, optional): Seed of the ``shuffle=True`` permutations; the same
            on every rank. :obj:`None` draws one from ``generator`` (or torch's
            global generator), so ``torch.manual_seed`` makes runs repeatable.
            (default: :obj:`None`)
        max_atoms (int, optional): Atoms per batch, at most, instead of a number of
            molecules (see above); ``batch_size`` must stay :obj:`1` and ``sampler``
            unset. (default: :obj:`None`)
        oversize (str, optional): With ``max_atoms``, a molecule larger than the
            budget: ``"error"`` or ``"own_batch"``. (default: :obj:`"error"`)
        device (torch.device or str, optional): Hand batches out on this device, each
            copied from pinned memory on a side CUDA stream while the previous step
            runs (:class:`~pyg_atompack.pyg.device.DeviceFeeder`); resuming stays exact.
            (default: :obj:`None`, batches stay on the CPU)
        device_transform (Callable, optional): Applied to each batch on the device, on
            the side stream, e.g. ``InteractionGraph.transform()`` to build its
            neighbour graph there. (default: :obj:`None`)
        batches_per_item (int, optional): With workers, consecutive batches a worker
            hands over as one DataLoader item (:mod:`pyg_atompack.pyg.bundle`: one
            message, one shared-memory slab, one ``pin_memory`` copy for all of them);
            the batches, their order and resuming are unchanged. :obj:`None` picks
            about 4 MiB of batches (at most 32, at least two items per worker a pass;
            1 with ``snapshot_every_n_steps`` other than 1). (default: :obj:`None`)
        **kwargs (optional): Further arguments of
            :class:`torch.utils.data.DataLoader` (``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``, ``generator``, ...) and of
            ``StatefulDataLoader`` (``snapshot_every_n_steps``).
    """

    def __init__(
        self,
        dataset: AtompackDataset,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        sampler: Sampler[int] | Iterable[int] | None = None,
        num_workers: int = 0,
        follow_batch: Sequence[str] | None = None,
        exclude_keys: Sequence[str] | None = None,
        rename: Mapping[str, str] | None = None,
        names: str | None = None,
        seed: int | None = None,
        max_atoms: int | None = None,
        oversize: str = "error",
        device: torch.device | str | None = None,
        device_transform: Callable[[Batch], Batch] | None = None,
        batches_per_item: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.device_feed = DeviceFeed.of(device, device_transform)
        if not isinstance(dataset, (AtompackDataset, AtompackGroupDataset)):
            raise TypeError(
                "AtompackLoader needs an AtompackDataset or an AtompackGroupDataset, got "
                f"{type(dataset).__name__}; use torch_geometric.loader.DataLoader for others"
            )
        for key in ("batch_sampler", "collate_fn"):
            if key in kwargs:
                raise TypeError(f"AtompackLoader does not accept {key!r}: it builds its own")
        if sampler is not None and shuffle:
            raise ValueError("AtompackLoader: sampler and shuffle=True are mutually exclusive")
        generator = kwargs.get("generator")
        if shuffle and seed is None:
            seed = int(torch.randint(0, 2**62, (), generator=generator))
        batch_sampler: Sampler[list[int]]
        if max_atoms is not None:
            if sampler is not None or batch_size != 1 or drop_last:
                raise ValueError("AtompackLoader: max_atoms plans the batches itself; pass "
                                 "no sampler, batch_size or drop_last with it")
            batch_sampler = AtomBudgetBatchSampler(
                atom_counts(dataset), max_atoms, shuffle=shuffle, seed=seed or 0,
                oversize=oversize, describe=_RecordName(dataset))
        else:
            if sampler is None and shuffle:
                sampler = ResumableSampler(dataset, seed=seed, drop_last=drop_last)
            elif sampler is None:
                sampler = SequentialSampler(dataset)
            batch_sampler = StatefulBatchSampler(sampler, batch_size, drop_last)
        # the batches of a pass (DataLoader's batch_sampler is a BundleSampler over it when
        # workers hand over several batches per item)
        self.batch_plan = batch_sampler
        size = self._bundle_size(dataset, batches_per_item, num_workers, max_atoms, batch_size,
                                 kwargs.get("snapshot_every_n_steps", 1))
        if size > 1:
            batch_sampler = BundleSampler(batch_sampler, size)
        self.follow_batch = list(follow_batch or [])
        self.exclude_keys = list(exclude_keys or [])
        self.atompack_dataset = dataset
        fetcher: torch.utils.data.Dataset
        if isinstance(dataset, AtompackGroupDataset):  # each batch: whole groups
            fetcher = _GroupFetcher(dataset, self.follow_batch, self.exclude_keys,
                                    resolve_names(rename, names))
        else:
            fetcher = _BatchFetcher(dataset, self.follow_batch, self.exclude_keys,
                                    resolve_names(rename, names))
        # in-process iteration (the fast path below): its batch iterator, and the
        # state load_state_dict left for the next iteration
        self._in_process_batches: Any = None
        self._in_process_finished = False
        self._in_process_resume: dict[str, Any] | None = None
        # with bundles: (loader state before the current bundle, its batches handed out)
        # while a bundle is part-way handed out, and that of a loaded state until the
        # next iteration takes it over
        self._handoff_mark: tuple[dict[str, Any], int] | None = None
        self._resume_mark: tuple[dict[str, Any], int] | None = None
        with quiet_torchdata():
            super().__init__(
                fetcher,
                batch_sampler=batch_sampler,
                num_workers=num_workers,
                collate_fn=_pass_through,
                **kwargs,
            )

    def _bundle_size(self, dataset: AtompackDataset | AtompackGroupDataset,
                     requested: int | None, workers: int, max_atoms: int | None,
                     batch_size: int, snapshot_every: int) -> int:
        if requested is not None:
            if int(requested) < 1:
                raise ValueError(f"AtompackLoader: batches_per_item must be at least 1, "
                                 f"got {requested}")
            return int(requested) if workers > 0 else 1
        if workers <= 0 or snapshot_every != 1:
            # torchdata counts snapshot intervals in items; an elastic resume between
            # snapshots counts them in batches, so bundles need a snapshot every item
            return 1
        if max_atoms is not None:
            atoms = float(max_atoms)
        elif isinstance(dataset, AtompackGroupDataset):
            counts = dataset.atom_counts()
            atoms = batch_size * (float(counts.mean()) if len(counts) else 0.0)
        else:  # a sample of the index's atom counts is enough for a size estimate
            step = max(1, len(dataset) // 4096)
            sample = dataset.record_indices(np.arange(0, len(dataset), step))
            counts = np.asarray(dataset.reader.n_atoms)[sample]
            atoms = batch_size * (float(counts.mean()) if len(counts) else 0.0)
        return bundle_size(atoms, len(self.batch_plan), workers)

    def __len__(self) -> int:
        return len(self.batch_plan)

    def _in_process(self) -> bool:
        return self.num_workers == 0 and not self.pin_memory

    def __iter__(self) -> Iterator[Batch]:
        if self.device_feed is not None:
            return self.device_feed.wrap(self._cpu_batches(), snapshot=self._loader_state)
        return self._cpu_batches()

    def _cpu_batches(self) -> Iterator[Batch]:
        if self._in_process():
            # In-process loading needs none of the iterator machinery of
            # DataLoader (profiler scopes, worker bookkeeping: ~15 us a batch,
            # a fifth of the whole cost of a 32-molecule batch). The batch
            # sampler's iterator is then the whole state: it has produced
            # exactly the batches handed out.
            positions = iter(self.batch_plan)
            resume, self._in_process_resume = self._in_process_resume, None
            if resume is not None and resume["batch_sampler"] is not None:
                saved = resume["batch_sampler"]
                if not resume["finished"]:
                    positions.load_state_dict(saved)
                elif self._load_finished_pass(finished_pass_state(saved)):
                    positions = iter(self.batch_plan)
            # DataLoader draws a base seed per epoch from the loader's generator
            # (or the global one); draw it too so that shuffles stay identical.
            torch.empty((), dtype=torch.int64).random_(generator=self.generator)
            self._in_process_batches, self._in_process_finished = positions, False
            return self._batches_in_process(positions)
        items = super().__iter__()
        self._handoff_mark, self._resume_mark = self._resume_mark, None
        return self._handed_out(items, 0 if self._handoff_mark is None
                                else self._handoff_mark[1])

    def _get_iterator(self) -> Any:
        if self.num_workers > 0:  # fresh workers are forked: fresh arenas for them
            self.dataset.arenas = arenas_for_children(self.num_workers,
                                                      self.multiprocessing_context)
        return super()._get_iterator()

    def _batches_in_process(self, positions: Iterator[list[int]]) -> Iterator[Batch]:
        fetch = self.dataset.__getitems__
        for batch_positions in positions:
            yield fetch(batch_positions)
        self._in_process_finished = True

    def _handed_out(self, items: Any, skip: int) -> Iterator[Batch]:
        # The batches of the items the workers hand over (a bundle: several), the first
        # ``skip`` left out (handed out before a state taken inside a bundle was saved).
        # Before each item is drawn, DataLoader's state is that of the bundle boundary:
        # a state_dict() inside the bundle is it plus the batches handed out since.
        bundled = isinstance(self.batch_sampler, BundleSampler)
        while True:
            before = items.state_dict() if bundled else None
            try:
                item = next(items)
            except StopIteration:
                break
            batches = item.batches() if isinstance(item, BatchBundle) else [item]
            last = len(batches) - 1
            for index, batch in enumerate(batches):
                if skip:
                    skip -= 1
                    continue
                self._handoff_mark = (before, index + 1) if bundled and index < last else None
                yield batch
        self._handoff_mark = None

    def _load_finished_pass(self, state: dict[str, Any] | None) -> bool:
        # a state taken after a pass ended: the sampler starts the epoch after it
        if state is None:
            return False
        target = self.batch_plan
        if not isinstance(target, AtomBudgetBatchSampler):
            target = target.sampler
        target.load_state_dict(state)
        return True

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler (``ResumableSampler``, ``DistributedSampler``).

        Args:
            epoch (int): The epoch of the next pass.
        """
        sampler = self.batch_plan
        if not isinstance(sampler, AtomBudgetBatchSampler):
            sampler = sampler.sampler
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The position of the current pass, including every worker's.

        Take it between two steps; it is tagged with ``num_workers``.

        Returns:
            dict: The state, for :meth:`load_state_dict`.
        """
        if self.device_feed is not None:  # not the state of the batch drawn ahead
            return self.device_feed.state(self._loader_state)
        return self._loader_state()

    def _loader_state(self) -> dict[str, Any]:
        if self._in_process():
            batches = self._in_process_batches
            state = {"batch_sampler": None if batches is None else batches.state_dict(),
                     "finished": self._in_process_finished}
        else:
            state = super().state_dict()
            mark = self._handoff_mark if self._handoff_mark is not None else self._resume_mark
            if mark is not None:  # inside a bundle: its boundary, then the batches handed out
                state = {**mark[0], BUNDLE_SKIP: mark[1]}
        return wrap_loader_state(state, self.num_workers)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration continue the saved pass.

        A state taken with another ``num_workers`` or on another number of ranks
        resumes too when the loader shuffles (``ResumableSampler``) or batches by
        ``max_atoms``: the rest of the epoch is then the indices (batches) no rank had
        handed out, dealt over the new ranks.

        Args:
            state_dict (dict): Output of :meth:`state_dict` of a loader built the same
                way (dataset, batch size, sampler or ``seed``); any rank's.

        Raises:
            ValueError: If the state was taken with a different ``num_workers`` and a
                sampler whose position cannot be carried over.
        """
        if self.device_feed is not None:
            self.device_feed.reset()
        self._handoff_mark = self._resume_mark = None
        holder = self.batch_plan  # what keeps the position: the budget's batch sampler
        if not isinstance(holder, AtomBudgetBatchSampler):
            holder = holder.sampler
        state = restore_loader_state(state_dict, self.num_workers, holder,
                                     getattr(self.batch_plan, "batch_size", None))
        if state is None:  # carried over through the sampler alone
            self._in_process_resume = None
            if not self._in_process():
                super().load_state_dict({})
        elif self._in_process():
            self._in_process_resume = state
        elif self._load_finished_pass(finished_workers_state(state)):
            super().load_state_dict({})  # nothing of the finished pass is left
        else:
            state = dict(state)
            skip = int(state.pop(BUNDLE_SKIP, 0))
            if skip:
                self._resume_mark = (state, skip)
            super().load_state_dict(state)

    def __repr__(self) -> str:
        plan = self.batch_plan
        size = (f"max_atoms={plan.max_atoms}" if isinstance(plan, AtomBudgetBatchSampler)
                else f"batch_size={plan.batch_size}")
        return (
            f"{self.__class__.__name__}({self.atompack_dataset!r}, {size}, "
            f"num_workers={self.num_workers})"
        )
