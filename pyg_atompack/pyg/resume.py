"""Exact mid-epoch resume: a stateful shuffling sampler and a stateful PyG loader.

Resuming is built on torchdata's :class:`~torchdata.stateful_dataloader.StatefulDataLoader`
rather than on a loader of our own: it already snapshots the main process's sampler
state together with every DataLoader worker's dataset state, per yielded batch, so a
``state_dict()`` taken between two steps describes exactly the batches handed out so
far, even while workers have prefetched further. What it needs from us is

* a sampler whose position can be saved and restored: :class:`ResumableSampler`
  (torch's ``RandomSampler`` and ``DistributedSampler`` have no ``state_dict``), and
* datasets with ``state_dict`` / ``load_state_dict`` (``ShardStreamDataset`` has one;
  a map-style ``AtompackDataset`` needs none, its position is the sampler's).

:class:`StatefulLoader` is ``StatefulDataLoader`` with PyG's collation.

Elastic resume (another number of workers or ranks): what was handed out is kept in a
form that does not depend on the (rank, worker) grid. For a map-style dataset that is
one number: ranks step together, so after ``p`` indices on each of ``R`` ranks they have
handed out exactly the first ``start + p * R`` positions of the epoch's order
(:attr:`ResumableSampler.consumed`); any rank's state carries it, and a sampler on
``R'`` ranks deals the rest round-robin. torchdata's per-worker states are then not
needed (:func:`restore_loader_state`). An iterable dataset's workers each hold part of
the position: their states are merged (the dataset's ``merge_states``) and every new
worker takes its share of what is left.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler

from pyg_atompack.pyg.ranks import resolve_rank

__all__ = ["ResumableSampler", "StatefulLoader", "StatefulBatchSampler", "finished_pass_state",
           "gather_loader_states", "pass_length", "quiet_torchdata", "restore_loader_state",
           "saved_sampler_state", "wrap_loader_state"]

SAMPLER_STATE_FORMAT = "pyg_atompack-sampler/2"
LOADER_STATE_FORMAT = "pyg_atompack-loader/1"

#: torchdata's batch sampler, whose iterator saves the wrapped sampler's state.
StatefulBatchSampler = BatchSampler


def pass_length(remaining: int, world_size: int, drop_last: bool) -> int:
    """Indices each of ``world_size`` ranks takes from ``remaining`` positions.

    Args:
        remaining (int): Positions of the epoch's order not handed out yet.
        world_size (int): Number of ranks.
        drop_last (bool): Leave out the tail that does not divide (else pad it).

    Returns:
        int: The same count for every rank.
    """
    remaining = max(remaining, 0)
    return remaining // world_size if drop_last else -(-remaining // world_size)



class ResumableSampler(Sampler[int]):
    r"""A seeded, per-epoch, DDP-aware sampler whose position can be saved and restored.

    The indices of a pass are those of
    :class:`~torch.utils.data.distributed.DistributedSampler` with the same ``seed``,
    ``epoch``, ``rank``, ``world_size`` and ``drop_last`` (a ``torch.randperm`` seeded
    with ``seed + epoch``, padded by repeating or cut to a multiple of ``world_size``,
    then every ``world_size``-th index from ``rank``), so switching to it changes no
    order. Unlike it, the epoch advances by itself after every pass (calling
    :meth:`set_epoch` before each epoch, as with ``DistributedSampler``, gives the same
    result), and :meth:`state_dict` records how many indices of the current pass were
    handed out: :meth:`load_state_dict` makes the next pass continue right after them.

    Args:
        data_source (Sized or int): The dataset (or its length).
        shuffle (bool, optional): Permute the indices every epoch; :obj:`False` keeps
            ``0, 1, 2, ...`` (split between ranks). (default: :obj:`True`)
        seed (int, optional): Base seed; the same on every rank. (default: :obj:`0`)
        rank (int, optional): This process's rank. (default: from
            :mod:`torch.distributed` when it is initialised, else :obj:`0`)
        world_size (int, optional): Number of ranks. (default: as for ``rank``,
            else :obj:`1`)
        drop_last (bool, optional): Cut the tail that does not divide between ranks
            instead of padding with repeated indices. (default: :obj:`False`)
    """

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False) -> None:
        rank, world_size = resolve_rank(rank, world_size)
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.drop_last = drop_last
        self.epoch = 0
        # where in the epoch's order the current pass began (0, or what every rank had
        # handed out together when a state was loaded), indices of this pass handed out
        # so far, and whether the next pass continues this one (after load_state_dict)
        # or starts a new one
        self.start = 0
        self.position = 0
        self._started = False
        self._resume = False
        self._epoch_pinned = False

    @property
    def num_samples(self) -> int:
        """Indices this rank hands out in the current pass."""
        return pass_length(self.length - self.start, self.world_size, self.drop_last)

    @property
    def consumed(self) -> int:
        """Positions of the epoch's order that all ranks together have handed out.

        Ranks step together (every one takes ``len(self)`` indices a pass), so after
        ``position`` indices on each rank the ranks have handed out exactly the first
        ``start + position * world_size`` positions of the epoch's order, whatever
        ``world_size`` is: the state a resume with another number of ranks needs.
        """
        return min(self.length, self.start + self.position * self.world_size)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (instead of advancing by one).

        Pinning the epoch a loaded state is about to continue keeps the resume, so a
        training loop may call it before every epoch, the resumed one included.

        Args:
            epoch (int): The epoch, mixed into the permutation's seed.
        """
        if self._resume and int(epoch) == self.epoch:
            return
        if int(epoch) != self.epoch:  # what was handed out belongs to another epoch
            self.start = self.position = 0
        self.epoch = int(epoch)
        self._epoch_pinned = True
        self._resume = False

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices of one pass, in order.

        Args:
            epoch (int, optional): The epoch. (default: :obj:`None`, the current one)

        Returns:
            torch.Tensor: int64 indices, ``len(self)`` of them.
        """
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(self.length, generator=generator)
        else:
            order = torch.arange(self.length)
        # the pass deals positions start, start + 1, ... of the order round-robin over
        # the ranks, padded (drop_last=False) by repeating the order from its beginning:
        # from start 0 exactly DistributedSampler's indices
        end = self.start + self.num_samples * self.world_size
        if end > len(order):
            repeats = -(-(end - len(order)) // max(len(order), 1))
            order = torch.cat([order, order.repeat(repeats)])
        return order[self.start + self.rank:end:self.world_size]

    def __iter__(self) -> Iterator[int]:
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        # a generator: nothing below runs until the first index is requested, so an
        # iterator created and thrown away (as loaders do while restoring) changes nothing
        if self._resume and self.position < self.num_samples:
            skip = self.position
        else:
            if self._started and not self._epoch_pinned:
                self.epoch += 1
            self.start = skip = 0
        self._resume = self._epoch_pinned = False
        self._started = True
        self.position = skip
        # Python ints a block at a time: a list of all of them would cost ~36 bytes
        # an index (3.6 GB for 10^8 structures)
        for block in self.indices()[skip:].split(1 << 16):
            for index in block.tolist():
                self.position += 1
                yield index

    def state_dict(self) -> dict[str, Any]:
        """The epoch and how much of it was handed out (JSON-serialisable).

        ``consumed`` (see :attr:`consumed`) is the same on every rank and says what all
        of them handed out together, so any rank's state resumes the epoch on any
        number of ranks.

        Returns:
            dict: The state, for :meth:`load_state_dict`.
        """
        return {"format": SAMPLER_STATE_FORMAT, "epoch": self.epoch,
                "start": self.start, "position": self.position,
                "consumed": self.consumed, "seed": self.seed, "shuffle": self.shuffle,
                "length": self.length, "drop_last": self.drop_last,
                "rank": self.rank, "world_size": self.world_size,
                "started": self._started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass with the next iteration, on any number of ranks.

        The next iteration deals the positions of the epoch's order that the saved
        ranks had not handed out (:attr:`consumed` onwards) over this sampler's ranks,
        so the epoch ends with every index handed out once (plus the usual padding of
        the last round, or minus the ``drop_last`` tail). With the saved number of
        ranks that is exactly the rest of each rank's saved pass. A state taken at the
        end of a pass makes the next iteration start the following epoch, as it would
        have without the interruption.

        Args:
            state (dict): Output of :meth:`state_dict` from a sampler over the same data
                with the same ``seed``, ``shuffle`` and ``drop_last``; any rank's (they
                agree), any ``world_size``.

        Raises:
            ValueError: If the state is not a sampler state or belongs to a different
                configuration (the message names the first difference).
        """
        if not isinstance(state, dict) or state.get("format") != SAMPLER_STATE_FORMAT:
            raise ValueError("not a ResumableSampler state_dict")
        for key in ("seed", "shuffle", "length", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(f"ResumableSampler state_dict has {key}={state[key]!r}, "
                                 f"this sampler {getattr(self, key)!r}")
        self.epoch = int(state["epoch"])
        self._started = bool(state["started"])
        # what is left of the epoch, re-dealt over this sampler's ranks
        self.start, self.position = int(state["consumed"]), 0
        self._resume = self._started
        self._epoch_pinned = not self._started

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(length={self.length}, shuffle={self.shuffle}, "
                f"seed={self.seed}, rank={self.rank}, world_size={self.world_size}, "
                f"epoch={self.epoch}, position={self.position})")


@contextlib.contextmanager
def quiet_torchdata() -> Iterator[None]:
    """Silence torchdata 0.11's warning about torch's deprecated ``set_vital`` call.

    The call is torchdata's own, made on every loader construction, and says nothing
    about the user's code.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        yield


def gather_loader_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's loader state, on every rank (one ``all_gather_object``).

    What a stream or a mix needs to resume on another grid: call it on every rank at
    the same step, and save the list (from rank 0, say) with the checkpoint. Without
    an initialised process group it is ``[state]``.

    Args:
        state (dict): This rank's ``loader.state_dict()``.

    Returns:
        list[dict]: The states of ranks ``0 .. world_size - 1``, for
        ``load_state_dict`` on any grid.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [state]
    states: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(states, state)
    return states


def wrap_loader_state(state: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """Tag a loader state with the worker count it was taken with."""
    return {"format": LOADER_STATE_FORMAT, "num_workers": num_workers, "loader": state}


def _unwrap_loader_state(state: Any) -> tuple[dict[str, Any], int]:
    if not isinstance(state, dict) or state.get("format") != LOADER_STATE_FORMAT:
        raise ValueError("not a pyg_atompack loader state_dict (from StatefulLoader or "
                         "AtompackLoader.state_dict())")
    return state["loader"], int(state["num_workers"])


def saved_sampler_state(state: dict[str, Any], batch_size: int | None,
                        state_format: str = SAMPLER_STATE_FORMAT) -> dict[str, Any] | None:
    """The sampler state inside an unwrapped loader state (a :class:`ResumableSampler`'s).

    Finds it in each layout a loader state has (``AtompackLoader``'s in-process one,
    torchdata's single- and multi-process ones) and counts in the steps torchdata
    took since its last snapshot (``snapshot_every_n_steps > 1``).

    Args:
        state (dict): The ``"loader"`` part of a :func:`wrap_loader_state` state.
        batch_size (int | None): Indices per step.
        state_format (str, optional): The ``"format"`` of the state looked for: a
            ``batch_sampler`` that keeps its own state (atom budgets) is found too.
            (default: :obj:`SAMPLER_STATE_FORMAT`)

    Returns:
        dict, optional: The sampler state, or :obj:`None` when the loader's sampler
        keeps none (another sampler, or an iterable dataset).
    """
    steps = 0
    if "batch_sampler" in state:  # AtompackLoader's in-process iteration
        iterator = state["batch_sampler"]
        if iterator is None:
            return None
    elif "_snapshot" in state:  # torchdata, with workers
        iterator = state["_snapshot"]["_main_snapshot"].get("_sampler_iter_state")
        steps = int(state.get("_steps_since_snapshot", 0))
    else:  # torchdata, in the main process
        iterator = state.get("_sampler_iter_state")
    saved = iterator.get("sampler_state", iterator) if isinstance(iterator, dict) else None
    if not isinstance(saved, dict) or saved.get("format") != state_format:
        return None
    if steps and state_format != SAMPLER_STATE_FORMAT:
        raise ValueError("a loader state taken between two snapshots "
                         "(snapshot_every_n_steps > 1) cannot resume on another grid")
    if steps and batch_size:
        saved = dict(saved)
        saved["consumed"] = min(int(saved["length"]), int(saved["consumed"])
                                + steps * batch_size * int(saved["world_size"]))
        saved["started"] = True
    return saved


def _dataset_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every worker's dataset state inside an unwrapped torchdata loader state."""
    if "_snapshot" not in state:
        return [state["dataset_state"]]
    if state.get("_steps_since_snapshot"):
        raise ValueError("a loader state taken between two snapshots "
                         "(snapshot_every_n_steps > 1) cannot resume on another grid")
    workers = state["_snapshot"]["_worker_snapshots"]
    return [workers[key]["dataset_state"] for key in sorted(workers)]


def restore_loader_state(state: Any, num_workers: int, sampler: Any,
                         batch_size: int | None, dataset: Any = None) -> dict[str, Any] | None:
    """Unwrap loader states of :func:`wrap_loader_state` for a loader with ``num_workers``.

    One state of the same worker count (and, for an iterable dataset, the same number
    of ranks) is returned unwrapped, for the loader to load as it is. Otherwise the
    position is carried over to the new grid here, and :obj:`None` is returned:

    * a map-style loader's is its :class:`ResumableSampler`'s, the same on every rank:
      any rank's state is loaded into ``sampler`` (the pass goes on with the indices
      not handed out yet, see :meth:`ResumableSampler.load_state_dict`);
    * an iterable dataset with ``merge_states`` (``ShardStreamDataset``,
      ``MixedDataset``) gets the merge of every worker's state of every rank
      (``state`` is then the list of every rank's loader state), and each new worker
      takes its share of what is left.

    Args:
        state (dict | list[dict]): Output of :func:`wrap_loader_state`, or a list of
            them, one per rank of the saved run.
        num_workers (int): The loader's workers.
        sampler (Sampler): The loader's sampler.
        batch_size (int | None): Indices per step.
        dataset (Dataset, optional): The loader's dataset. (default: :obj:`None`)

    Returns:
        dict, optional: The loader's own state to load, or :obj:`None`.

    Raises:
        ValueError: If a state is not such a state, or cannot be carried over to this
            loader (the message says why).
    """
    states = [_unwrap_loader_state(s) for s in (state if isinstance(state, list) else [state])]
    if not states:
        raise ValueError("no loader state given")
    inner, saved_workers = states[0]
    if isinstance(dataset, torch.utils.data.IterableDataset) and hasattr(dataset,
                                                                          "merge_states"):
        rank_world = resolve_rank() if getattr(dataset, "rank", None) is None \
            else (dataset.rank, dataset.world_size)
        datasets = [d for s, _ in states for d in _dataset_states(s)]
        same = (len(states) == 1 and saved_workers == num_workers
                and all(d.get("world_size") == rank_world[1] for d in datasets))
        if same:
            return inner
        dataset.load_state_dict(dataset.merge_states(datasets))
        return None
    if len(states) == 1 and saved_workers == num_workers:
        return inner
    # a sampler whose state is the same on every rank and whose load_state_dict takes
    # it on any grid: ResumableSampler; AtomBudgetBatchSampler for another worker count
    state_format = sampler.state_dict().get("format") if hasattr(sampler, "state_dict") \
        and hasattr(sampler, "load_state_dict") else None
    if isinstance(state_format, str):
        saved = [saved_sampler_state(s, batch_size, state_format) for s, _ in states]
        if saved[0] is not None and all(x is not None and x.get("consumed")
                                        == saved[0].get("consumed") for x in saved):
            sampler.load_state_dict(saved[0])
            return None
    raise ValueError(
        f"the loader state was taken with num_workers={saved_workers}, this "
        f"loader has num_workers={num_workers}: only a ResumableSampler's position "
        "(shuffle=True) or a dataset with merge_states can be carried over to another "
        "number of workers; resume with the same number of workers")


def finished_pass_state(saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """A sampler state of a pass that ran to its end, set to start the next epoch.

    torchdata restores the state of a finished multi-process pass by starting a pass
    (whose sampler, at its end, begins the next epoch), marking it finished and then
    starting another: an epoch is skipped. Loading this state into the sampler and
    nothing into the loader starts the next epoch at its first batch instead.

    Args:
        saved (dict | None): A sampler state (``ResumableSampler``,
            ``AtomBudgetBatchSampler``) or torchdata's batch-sampler iterator state
            holding one (``sampler_state``).

    Returns:
        dict | None: The state, or :obj:`None` when ``saved`` holds no such state.
    """
    if not isinstance(saved, dict):
        return None
    saved = saved.get("sampler_state", saved)
    if not isinstance(saved, dict) or "epoch" not in saved or "started" not in saved:
        return None
    return {**saved, "epoch": int(saved["epoch"]) + 1, "started": False}


def finished_workers_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`finished_pass_state` of a multi-process loader state, if its pass ended."""
    if not state.get("_iterator_finished"):
        return None
    main = state.get("_snapshot", {}).get("_main_snapshot", {})
    return finished_pass_state(main.get("_sampler_iter_state"))


class StatefulLoader(StatefulDataLoader):
    r"""A resumable PyG data loader: torchdata's ``StatefulDataLoader`` with PyG collation.

    ``state_dict()`` may be called between any two steps, with or without DataLoader
    workers; a new loader (in a new process too) built the same way and given the state
    with :meth:`load_state_dict` yields exactly the batches the interrupted one had left.
    For an :class:`~torch.utils.data.IterableDataset` such as
    :class:`~pyg_atompack.stream.ShardStreamDataset` every worker's position is saved
    (the dataset's own ``state_dict`` taken inside the worker); for a map-style dataset
    the sampler's (use :class:`ResumableSampler`, which ``shuffle=True`` picks).

    Args:
        dataset (Dataset): A map-style or iterable dataset of PyG data objects.
        batch_size (int, optional): Samples per mini-batch; :obj:`None` passes the
            dataset's items through (a ``ShardStreamDataset(batch_size=...)`` yielding
            ``Batch`` objects itself). (default: :obj:`1`)
        shuffle (bool, optional): For a map-style dataset, sample through a
            :class:`ResumableSampler` seeded with ``seed``. (default: :obj:`False`)
        seed (int, optional): The sampler's seed. (default: :obj:`0`)
        follow_batch (list[str], optional): Attributes that get ``<attr>_batch``
            vectors. (default: :obj:`None`)
        exclude_keys (list[str], optional): Attributes to leave out of batches.
            (default: :obj:`None`)
        device (torch.device or str, optional): Hand batches out on this device, copied
            one step ahead on a side CUDA stream (:class:`~pyg_atompack.pyg.device.DeviceFeeder`);
            resuming stays exact. (default: :obj:`None`)
        device_transform (Callable, optional): Applied to each batch on the device, e.g.
            ``InteractionGraph.transform()``. (default: :obj:`None`)
        **kwargs (optional): Further arguments of ``StatefulDataLoader``
            (``num_workers``, ``sampler``, ``drop_last``, ``snapshot_every_n_steps``,
            ...).
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool = False,
                 seed: int = 0, follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None,
                 device: torch.device | str | None = None,
                 device_transform: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        from torch_geometric.loader.dataloader import Collater

        from pyg_atompack.pyg.device import DeviceFeed

        self.device_feed = DeviceFeed.of(device, device_transform)
        if "collate_fn" in kwargs:
            raise TypeError("StatefulLoader does not accept 'collate_fn': it collates the "
                            "PyG way")
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if shuffle and not iterable:
            if kwargs.get("sampler") is not None:
                raise ValueError("StatefulLoader: sampler and shuffle=True are mutually "
                                 "exclusive")
            kwargs["sampler"] = ResumableSampler(dataset, seed=seed,
                                                 drop_last=kwargs.get("drop_last", False))
        elif shuffle:
            raise ValueError("StatefulLoader: an iterable dataset shuffles itself "
                             "(e.g. ShardStreamDataset(shuffle=True))")
        collate = (Collater(dataset, follow_batch, exclude_keys) if batch_size is not None
                   else _first_item)
        with quiet_torchdata():
            super().__init__(dataset, batch_size=batch_size, collate_fn=collate, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler (map-style) or the dataset (iterable).

        Args:
            epoch (int): The epoch.
        """
        target = self.dataset if isinstance(self.dataset, torch.utils.data.IterableDataset) \
            else self.sampler
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.device_feed is None:
            return super().__iter__()
        return self.device_feed.wrap(super().__iter__(), snapshot=self._loader_state)

    def _loader_state(self) -> dict[str, Any]:
        return wrap_loader_state(super().state_dict(), self.num_workers)

    def state_dict(self) -> dict[str, Any]:
        """The position of the current iteration, including every worker's.

        Returns:
            dict: The state, tagged with the number of workers.
        """
        if self.device_feed is not None:  # not the state of the batch drawn ahead
            return self.device_feed.state(self._loader_state)
        return self._loader_state()

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Make the next iteration continue where the saved one stopped.

        On another number of workers or ranks too (elastic resume, see
        :func:`restore_loader_state`): an iterable dataset then needs every rank's
        state, as a list.

        Args:
            state_dict (dict | list[dict]): Output of :meth:`state_dict`, or that of
                every rank of the saved run.

        Raises:
            ValueError: If the state cannot be carried over to this loader (see
                :func:`restore_loader_state`).
        """
        if self.device_feed is not None:
            self.device_feed.reset()
        state = restore_loader_state(state_dict, self.num_workers, self.sampler,
                                     self.batch_size, self.dataset)
        finished = (finished_workers_state(state) if state is not None and self.num_workers > 0
                    else None)
        if finished is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(finished)  # the next epoch, not the one after
            state = {}
        super().load_state_dict({} if state is None else state)


def _first_item(item: Any) -> Any:
    # batch_size=None: the dataset's items are already batches (a module-level function,
    # not a lambda, so that spawned workers can unpickle the loader)
    return item
