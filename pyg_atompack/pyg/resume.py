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

:class:`StatefulLoader` is ``StatefulDataLoader`` with PyG's collation, and checks that a
state is loaded into a loader with the same number of workers (the per-worker states of
an iterable dataset cannot be redistributed over a different count).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler

__all__ = ["ResumableSampler", "StatefulLoader", "StatefulBatchSampler", "check_loader_state",
           "finished_pass_state", "quiet_torchdata", "wrap_loader_state"]

SAMPLER_STATE_FORMAT = "pyg_atompack-sampler/1"
LOADER_STATE_FORMAT = "pyg_atompack-loader/1"

#: torchdata's batch sampler, whose iterator saves the wrapped sampler's state.
StatefulBatchSampler = BatchSampler


def _distributed_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


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
        if (rank is None) != (world_size is None):
            raise ValueError("pass rank and world_size together")
        if rank is None:
            rank, world_size = _distributed_rank_world()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.length = data_source if isinstance(data_source, int) else len(data_source)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.drop_last = drop_last
        if drop_last:
            self.num_samples = self.length // self.world_size
        else:
            self.num_samples = -(-self.length // self.world_size)
        self.epoch = 0
        # indices of the current pass handed out so far, and whether the next pass
        # continues this one (after load_state_dict) or starts a new one
        self.position = 0
        self._started = False
        self._resume = False
        self._epoch_pinned = False

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
        total = self.num_samples * self.world_size
        if total > len(order):
            repeats = -(-(total - len(order)) // max(len(order), 1))
            order = torch.cat([order, order.repeat(repeats)])
        return order[:total][self.rank::self.world_size]

    def __iter__(self) -> Iterator[int]:
        return self._iterate()

    def _iterate(self) -> Iterator[int]:
        # a generator: nothing below runs until the first index is requested, so an
        # iterator created and thrown away (as loaders do while restoring) changes nothing
        if self._resume and self.position < self.num_samples:
            start = self.position
        else:
            if self._started and not self._epoch_pinned:
                self.epoch += 1
            start = 0
        self._resume = self._epoch_pinned = False
        self._started = True
        self.position = start
        # Python ints a block at a time: a list of all of them would cost ~36 bytes
        # an index (3.6 GB for 10^8 structures)
        for block in self.indices()[start:].split(1 << 16):
            for index in block.tolist():
                self.position += 1
                yield index

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the number of indices of it handed out (JSON-serialisable).

        Returns:
            dict: The state, for :meth:`load_state_dict`.
        """
        return {"format": SAMPLER_STATE_FORMAT, "epoch": self.epoch,
                "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "rank": self.rank, "world_size": self.world_size,
                "num_samples": self.num_samples, "started": self._started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass with the next iteration.

        A state taken at the end of a pass makes the next iteration start the following
        epoch, as it would have without the interruption.

        Args:
            state (dict): Output of :meth:`state_dict` from a sampler over the same data
                with the same ``seed``, ``shuffle``, ``rank`` and ``world_size``.

        Raises:
            ValueError: If the state is not a sampler state or belongs to a different
                configuration (the message names the first difference).
        """
        if not isinstance(state, dict) or state.get("format") != SAMPLER_STATE_FORMAT:
            raise ValueError("not a ResumableSampler state_dict")
        for key in ("seed", "shuffle", "rank", "world_size", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"ResumableSampler state_dict has {key}={state[key]!r}, "
                                 f"this sampler {getattr(self, key)!r}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._started = bool(state["started"])
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


def wrap_loader_state(state: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """Tag a loader state with the worker count it was taken with."""
    return {"format": LOADER_STATE_FORMAT, "num_workers": num_workers, "loader": state}


def check_loader_state(state: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """Unwrap a state of :func:`wrap_loader_state`, checking the worker count.

    Raises:
        ValueError: If ``state`` is not such a state, or was taken with another
            number of workers.
    """
    if not isinstance(state, dict) or state.get("format") != LOADER_STATE_FORMAT:
        raise ValueError("not a pyg_atompack loader state_dict (from StatefulLoader or "
                         "AtompackLoader.state_dict())")
    if state["num_workers"] != num_workers:
        raise ValueError(
            f"the loader state was taken with num_workers={state['num_workers']}, this "
            f"loader has num_workers={num_workers}: resume with the same number of "
            "workers (each worker's position is saved separately and cannot be "
            "redistributed)")
    return state["loader"]


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
        **kwargs (optional): Further arguments of ``StatefulDataLoader``
            (``num_workers``, ``sampler``, ``drop_last``, ``snapshot_every_n_steps``,
            ...).
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool = False,
                 seed: int = 0, follow_batch: Sequence[str] | None = None,
                 exclude_keys: Sequence[str] | None = None, **kwargs: Any) -> None:
        from torch_geometric.loader.dataloader import Collater

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

    def state_dict(self) -> dict[str, Any]:
        """The position of the current iteration, including every worker's.

        Returns:
            dict: The state, tagged with the number of workers.
        """
        return wrap_loader_state(super().state_dict(), self.num_workers)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration continue where the saved one stopped.

        Args:
            state_dict (dict): Output of :meth:`state_dict`.

        Raises:
            ValueError: If the state was taken with a different ``num_workers``.
        """
        state = check_loader_state(state_dict, self.num_workers)
        finished = finished_workers_state(state) if self.num_workers > 0 else None
        if finished is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(finished)  # the next epoch, not the one after
            state = {}
        super().load_state_dict(state)


def _first_item(item: Any) -> Any:
    # batch_size=None: the dataset's items are already batches (a module-level function,
    # not a lambda, so that spawned workers can unpickle the loader)
    return item
