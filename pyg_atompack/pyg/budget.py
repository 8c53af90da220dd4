"""Batches capped by atom count: planning, the split between DDP ranks, resume.

Structures of 10 to 300 atoms in batches of a fixed number of structures vary ten-fold
in atoms (and memory); a batch capped by atoms does not. Everything here works on an
array of atom counts, which :class:`~pyg_atompack.AtompackLoader` takes from the
``.atp`` index (no record is read) and :class:`~pyg_atompack.ShardStreamDataset` from
the samples in its look-ahead window.

* :func:`plan_atom_batches`: one epoch's batches. The positions are permuted by a
  generator seeded with ``(seed, epoch)`` and cut into consecutive runs whose atoms
  stay within the budget (*next fit*, one binary search per batch on the cumulative
  sum: 10^6 structures plan in 0.75 s on a loaded 2-core machine, once per epoch).
  Next fit keeps the shuffle exactly and wastes less than one structure per batch: on
  10-300 atoms and a budget of 2,000, batches hold a median 1,916 atoms.
* :func:`balance_batches` / :func:`rank_batches`: every DDP rank takes the same number
  of steps. The epoch's batches are dealt round-robin; when their number does not
  divide by the world size, the batches with the most structures are split in two
  halves (each still within the budget) until it does. Nothing is dropped and nothing
  repeated: an epoch gains at most ``world_size - 1`` smaller batches. Only an epoch
  with fewer structures than ranks has to repeat batches (from its start), as
  :class:`~torch.utils.data.DistributedSampler` pads.
* :class:`AtomBudgetBatchSampler`: the above as a resumable ``batch_sampler``; its
  state is ``(epoch, steps)``, the steps this rank has taken in the epoch, plus the
  ``[world_size, batches]`` handed out by earlier parts of the epoch on other grids
  (elastic resume: the rest is re-balanced for the new world size).
* :func:`group_by_atoms`: the streaming counterpart, packing a stream of samples into
  batches within the budget from a bounded look-ahead window (first fit).
* :class:`EqualSteps`: equal steps for streamed batches, whose count per rank is known
  only at the end: every step the ranks agree (one all-reduce of one integer) whether
  all of them still have a batch, and all stop at the shortest rank. The longer ranks'
  last batches are dropped (``cut_short``), as the stream already drops surplus
  samples to give ranks equal sample counts.

Edges: no edge budget. The edges of a radius graph depend on positions, which only
reading every record reveals. The one estimate the index allows is the bound
``n * min(n - 1, k)`` for a ``k``-neighbour cap; on the benchmark's structures (10-300
atoms, cutoff 5 A, ``k = 32``) the real count is 0.33-0.85 of it (median 0.53), so a
budget on it would leave batches about half full, and for all but the smallest
structures it is ``k`` times the atom count: ``max_atoms = max_edges / k`` already
bounds the edges.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import Sampler

from pyg_atompack.pyg.ranks import resolve_rank

__all__ = ["AtomBudgetBatchSampler", "AtomBudgetError", "OVERSIZE_CHOICES",
           "balance_batches", "consumed_positions", "EqualSteps", "group_by_atoms",
           "plan_atom_batches", "rank_batches"]

BUDGET_STATE_FORMAT = "pyg_atompack-atom-budget/2"

#: What to do with a structure larger than the budget: ``"error"`` raises
#: :class:`AtomBudgetError` naming it, ``"own_batch"`` gives it a batch of its own.
OVERSIZE_CHOICES = ("error", "own_batch")

T = TypeVar("T")


class AtomBudgetError(ValueError):
    """A structure has more atoms than the batch budget (the message names it)."""


def check_budget(max_atoms: int, oversize: str) -> None:
    """Validate ``max_atoms`` and ``oversize`` (at construction, not at the first batch).

    Args:
        max_atoms (int): The budget.
        oversize (str): One of :data:`OVERSIZE_CHOICES`.

    Raises:
        ValueError: If the budget is not positive or ``oversize`` is unknown.
    """
    if isinstance(max_atoms, bool) or not isinstance(max_atoms, (int, np.integer)) \
            or max_atoms < 1:
        raise ValueError(f"max_atoms must be a positive integer, got {max_atoms!r}")
    if oversize not in OVERSIZE_CHOICES:
        raise ValueError(f"oversize must be one of {OVERSIZE_CHOICES}, got {oversize!r}")


def _oversize_error(what: str, atoms: int, max_atoms: int) -> AtomBudgetError:
    return AtomBudgetError(
        f"{what} has {atoms} atoms, more than max_atoms={max_atoms}: raise max_atoms, "
        "leave the structure out (e.g. pre_filter), or pass oversize='own_batch'")


def plan_atom_batches(n_atoms: Sequence[int] | np.ndarray, max_atoms: int, *, seed: int = 0,
                      epoch: int = 0, shuffle: bool = True, oversize: str = "error",
                      describe: Callable[[int], str] | None = None) -> list[np.ndarray]:
    """One epoch's batches of positions, each holding at most ``max_atoms`` atoms.

    Args:
        n_atoms (Sequence[int] | np.ndarray): Atom count of every position.
        max_atoms (int): The budget of one batch.
        seed (int, optional): Base seed; the same on every rank. (default: :obj:`0`)
        epoch (int, optional): Mixed into the permutation's seed. (default: :obj:`0`)
        shuffle (bool, optional): Permute the positions (else keep ``0, 1, 2, ...``).
            (default: :obj:`True`)
        oversize (str, optional): A structure larger than the budget: ``"error"`` or
            ``"own_batch"`` (a batch of its own, at its place in the order).
            (default: :obj:`"error"`)
        describe (Callable[[int], str], optional): Names a position in the error
            (the file and record). (default: :obj:`None`, ``"position i"``)

    Returns:
        list[np.ndarray]: int64 positions of each batch, in order; every position
        appears exactly once.

    Raises:
        AtomBudgetError: If a structure exceeds the budget and ``oversize="error"``.
    """
    check_budget(max_atoms, oversize)
    atoms = np.asarray(n_atoms, dtype=np.int64)
    if shuffle:
        order = np.random.default_rng([int(seed), int(epoch), 34]).permutation(len(atoms))
    else:
        order = np.arange(len(atoms), dtype=np.int64)
    counts = atoms[order]
    big = counts > max_atoms
    if big.any():
        if oversize == "error":
            first = int(np.flatnonzero(atoms > max_atoms)[0])  # the lowest, whatever the order
            name = describe(first) if describe is not None else f"position {first}"
            raise _oversize_error(name, int(atoms[first]), max_atoms)
        return _with_own_batches(order, counts, big, max_atoms)
    return _next_fit(order, counts, max_atoms)


def _next_fit(order: np.ndarray, counts: np.ndarray, max_atoms: int) -> list[np.ndarray]:
    # batch k ends where the cumulative sum passes its start's sum + budget: one binary
    # search per batch instead of a Python step per structure (bisect on a list: a
    # tenth of np.searchsorted's cost on one scalar)
    ends = np.cumsum(counts).tolist()
    batches = []
    start, total = 0, len(order)
    while start < total:
        base = ends[start - 1] if start else 0
        stop = bisect.bisect_right(ends, base + max_atoms, start + 1)
        batches.append(order[start:stop])
        start = stop
    return batches


def _with_own_batches(order: np.ndarray, counts: np.ndarray, big: np.ndarray,
                      max_atoms: int) -> list[np.ndarray]:
    # the others are packed as if the oversize ones were absent; each oversize one is
    # then put before the first batch that starts after it in the shuffled order
    rank_in_order = np.arange(len(order))
    small = ~big
    packed = _next_fit(rank_in_order[small], counts[small], max_atoms)
    own = [rank_in_order[i:i + 1] for i in np.flatnonzero(big)]
    merged = sorted(packed + own, key=lambda batch: int(batch[0]))
    return [order[batch] for batch in merged]


def balance_batches(batches: Sequence[np.ndarray], world_size: int) -> list[np.ndarray]:
    """The batches rearranged so that their number divides by ``world_size``.

    The batches holding the most structures are split into halves (first half in its
    place, second half right after) until the count divides; nothing is dropped or
    repeated. Only when no batch has two structures left (fewer structures than ranks)
    are batches repeated from the start, so that every rank still gets a step.

    Args:
        batches (Sequence[np.ndarray]): One epoch's batches (:func:`plan_atom_batches`).
        world_size (int): The number of ranks.

    Returns:
        list[np.ndarray]: ``ceil(len(batches) / world_size) * world_size`` batches.
    """
    batches = list(batches)
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    missing = -len(batches) % world_size
    if not missing or not batches:
        return batches
    # split the largest batches, ties by place; one split adds one batch
    split: set[int] = set()
    sizes = np.asarray([len(b) for b in batches])
    for index in np.argsort(-sizes, kind="stable")[:missing]:
        if sizes[index] >= 2:
            split.add(int(index))
    out: list[np.ndarray] = []
    for index, batch in enumerate(batches):
        if index in split:
            half = (len(batch) + 1) // 2
            out.extend((batch[:half], batch[half:]))
        else:
            out.append(batch)
    if len(out) % world_size:  # fewer structures than ranks: splitting again cannot help
        missing = -len(out) % world_size
        halves_left = any(len(b) >= 2 for b in out)
        if halves_left:
            return balance_batches(out, world_size)
        out.extend(out[i % len(out)] for i in range(missing))
    return out


def rank_batches(batches: Sequence[np.ndarray], rank: int,
                 world_size: int) -> list[np.ndarray]:
    """The batches of ``rank``: every ``world_size``-th of :func:`balance_batches`.

    Every rank gets the same number of batches.

    Args:
        batches (Sequence[np.ndarray]): One epoch's batches, the same on every rank.
        rank (int): This rank.
        world_size (int): The number of ranks.

    Returns:
        list[np.ndarray]: This rank's batches, in order.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    return balance_batches(batches, world_size)[rank::world_size]


def consumed_positions(batches: Sequence[np.ndarray], steps: int,
                       world_size: int = 1) -> np.ndarray:
    """The positions handed out once every rank has taken ``steps`` steps.

    Args:
        batches (Sequence[np.ndarray]): One epoch's batches, as planned (before
            balancing).
        steps (int): Steps taken by each rank.
        world_size (int, optional): The number of ranks. (default: :obj:`1`)

    Returns:
        np.ndarray: int64 positions, in the order of the balanced batches (a padded
        epoch may repeat some).
    """
    taken = balance_batches(batches, world_size)[:int(steps) * world_size]
    return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)



class AtomBudgetBatchSampler(Sampler[list[int]]):
    r"""A resumable ``batch_sampler`` of shuffled batches within an atom budget.

    Every pass plans the epoch's batches with :func:`plan_atom_batches` (the same on
    every rank, from ``seed`` and the epoch) and hands out this rank's share of
    :func:`rank_batches`, so every rank takes the same number of steps. Like
    :class:`~pyg_atompack.pyg.resume.ResumableSampler`, the epoch advances by itself
    after every pass (:meth:`set_epoch` pins one), and :meth:`state_dict` records
    ``(epoch, steps)``: :meth:`load_state_dict` makes the next pass continue after the
    ``steps`` batches this rank had taken (on another number of ranks: after the
    batches all saved ranks had taken, the rest balanced anew); a state taken at the
    end of a pass starts the following epoch.

    Args:
        n_atoms (Sequence[int] | np.ndarray): Atom count of every dataset position.
        max_atoms (int): Atoms per batch, at most.
        shuffle (bool, optional): Permute the positions every epoch. (default:
            :obj:`True`)
        seed (int, optional): Base seed; the same on every rank. (default: :obj:`0`)
        rank (int, optional): This process's rank. (default: from
            :mod:`torch.distributed` when it is initialised, else :obj:`0`)
        world_size (int, optional): Number of ranks. (default: as for ``rank``, else
            :obj:`1`)
        oversize (str, optional): A structure larger than the budget: ``"error"``
            (:class:`AtomBudgetError` naming it, when the first pass is planned) or
            ``"own_batch"``. (default: :obj:`"error"`)
        describe (Callable[[int], str], optional): Names a position in errors.
            (default: :obj:`None`)
    """

    def __init__(self, n_atoms: Sequence[int] | np.ndarray, max_atoms: int, *,
                 shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, oversize: str = "error",
                 describe: Callable[[int], str] | None = None) -> None:
        check_budget(max_atoms, oversize)
        rank, world_size = resolve_rank(rank, world_size)
        self.n_atoms = np.asarray(n_atoms, dtype=np.int64)
        self.max_atoms = int(max_atoms)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.oversize = oversize
        self.describe = describe
        if oversize == "error" and len(self.n_atoms) and self.n_atoms.max() > max_atoms:
            plan_atom_batches(self.n_atoms, max_atoms, oversize=oversize,
                              describe=describe)  # raises, naming the structure
        self.epoch = 0
        self.steps = 0  # batches of the current pass handed out
        # elastic resume: [world_size, batches handed out by all ranks together] of each
        # earlier part of this epoch, on the grid it ran on (the epoch's plan, balanced
        # for that world size, minus what earlier parts took)
        self.history: list[list[int]] = []
        self._started = False
        self._resume = False
        self._epoch_pinned = False
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def batches(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's batches of one pass.

        Args:
            epoch (int, optional): The epoch. (default: :obj:`None`, the current one)

        Returns:
            list[np.ndarray]: int64 positions of each batch.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        history = self.history if epoch == self.epoch else []
        key = (epoch, repr(history))
        if self._cached is None or self._cached[0] != key:
            planned = plan_atom_batches(self.n_atoms, self.max_atoms, seed=self.seed,
                                        epoch=epoch, shuffle=self.shuffle,
                                        oversize=self.oversize, describe=self.describe)
            for world, taken in history:  # what earlier parts of the epoch handed out
                planned = balance_batches(planned, world)[taken:]
            self._cached = (key, rank_batches(planned, self.rank, self.world_size))
        return self._cached[1]

    def __len__(self) -> int:
        return len(self.batches())

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next pass (instead of advancing by one).

        Pinning the epoch a loaded state is about to continue keeps the resume.

        Args:
            epoch (int): The epoch, mixed into the permutation's seed.
        """
        if self._resume and int(epoch) == self.epoch:
            return
        if int(epoch) != self.epoch:
            self.history = []
        self.epoch = int(epoch)
        self._epoch_pinned = True
        self._resume = False

    def __iter__(self) -> Iterator[list[int]]:
        return _BudgetPass(self)

    def _begin(self) -> int:
        """Start a pass (at the first batch asked for); returns its first step."""
        if self._resume and self.steps < len(self.batches()):
            start = self.steps
        else:
            if self._started and not self._epoch_pinned:
                self.epoch += 1
            start = 0
            self.history = []
        self._resume = self._epoch_pinned = False
        self._started = True
        self.steps = start
        return start

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the steps of it taken (JSON-serialisable).

        Returns:
            dict: The state, for :meth:`load_state_dict`.
        """
        # ranks step together: after ``steps`` each they handed out the first
        # ``steps * world_size`` balanced batches, the same on every rank
        consumed = [*self.history, [self.world_size, self.steps * self.world_size]]
        return {"format": BUDGET_STATE_FORMAT, "epoch": self.epoch, "steps": self.steps,
                "started": self._started, "seed": self.seed, "shuffle": self.shuffle,
                "max_atoms": self.max_atoms, "rank": self.rank,
                "world_size": self.world_size, "length": len(self.n_atoms),
                "history": [list(h) for h in self.history], "consumed": consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved pass with the next iteration, on any number of ranks.

        With the saved ``world_size`` the pass goes on after this rank's ``steps``
        batches. With another (elastic resume) the saved ranks had handed out the first
        ``steps * world_size`` of the epoch's balanced batches (ranks step together); the
        batches after them are balanced for this ``world_size`` and dealt anew, so the
        epoch ends with every structure once. Any rank's state will do.

        Args:
            state (dict): Output of :meth:`state_dict` from a sampler over the same data
                with the same ``max_atoms``, ``seed`` and ``shuffle``.

        Raises:
            ValueError: If the state is not such a state (the message names the first
                difference).
        """
        if not isinstance(state, dict) or state.get("format") != BUDGET_STATE_FORMAT:
            raise ValueError("not an AtomBudgetBatchSampler state_dict")
        for key in ("seed", "shuffle", "max_atoms"):
            if state[key] != getattr(self, key):
                raise ValueError(f"AtomBudgetBatchSampler state_dict has {key}="
                                 f"{state[key]!r}, this sampler {getattr(self, key)!r}")
        if state["length"] != len(self.n_atoms):
            raise ValueError(f"AtomBudgetBatchSampler state_dict is of {state['length']} "
                             f"structures, this sampler has {len(self.n_atoms)}")
        self.epoch = int(state["epoch"])
        self._started = bool(state["started"])
        if state["world_size"] == self.world_size:
            self.history = [list(h) for h in state["history"]]
            self.steps = int(state["steps"])
        else:  # elastic: what all saved ranks handed out, then this grid's share of the rest
            self.history = [list(h) for h in state["consumed"]] if self._started else []
            self.steps = 0
        self._resume = self._started
        self._epoch_pinned = not self._started

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(length={len(self.n_atoms)}, "
                f"max_atoms={self.max_atoms}, shuffle={self.shuffle}, seed={self.seed}, "
                f"rank={self.rank}, world_size={self.world_size}, epoch={self.epoch}, "
                f"steps={self.steps})")


class _BudgetPass(Iterator[list[int]]):
    """One pass of an :class:`AtomBudgetBatchSampler`, with the sampler's state.

    Nothing happens until the first batch is asked for, so an iterator created and
    thrown away (as loaders do while restoring) changes nothing.
    """

    def __init__(self, sampler: AtomBudgetBatchSampler) -> None:
        self.sampler = sampler
        self.batches: list[np.ndarray] | None = None

    def __iter__(self) -> _BudgetPass:
        return self

    def __next__(self) -> list[int]:
        sampler = self.sampler
        if self.batches is None:
            sampler._begin()
            self.batches = sampler.batches()
        if sampler.steps >= len(self.batches):
            raise StopIteration
        batch = self.batches[sampler.steps]
        sampler.steps += 1
        return batch.tolist()

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.batches = None


def group_by_atoms(items: Iterable[T], max_atoms: int, atoms: Callable[[T], int], *,
                   window: int = 0, limit: int | None = None,
                   oversize: str = "error",
                   describe: Callable[[T], str] | None = None) -> Iterator[list[T]]:
    """Pack a stream of items into batches of at most ``max_atoms`` atoms.

    Items wait in a look-ahead window; once more than ``window`` items and more than a
    budget's worth of atoms wait, a batch is formed from them, oldest first, each taken
    if it still fits (first fit). The oldest waiting item always goes into the next
    batch, so none waits longer than one window; ``window=0`` is next fit (each batch
    a run of consecutive items). The batches depend only on the items' order and
    sizes, so a seeded order gives the same batches in every run.

    Args:
        items (Iterable[T]): The items, in order.
        max_atoms (int): The budget of one batch.
        atoms (Callable[[T], int]): An item's atom count.
        window (int, optional): Items held back to fill batches. (default: :obj:`0`)
        limit (int, optional): Take no more than this many items (the rest are not
            pulled). (default: :obj:`None`)
        oversize (str, optional): An item larger than the budget: ``"error"`` or
            ``"own_batch"``. (default: :obj:`"error"`)
        describe (Callable[[T], str], optional): Names an item in the error. (default:
            :obj:`None`)

    Yields:
        list[T]: The batches; every item pulled appears in exactly one.

    Raises:
        AtomBudgetError: If an item exceeds the budget and ``oversize="error"``.
    """
    check_budget(max_atoms, oversize)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    held: list[tuple[T, int]] = []
    held_atoms = 0
    smallest = max_atoms + 1  # the fewest atoms of any item so far

    def form() -> list[T]:
        nonlocal held_atoms
        taken: list[int] = []
        room = max_atoms
        for index, (_, count) in enumerate(held):
            if count <= room:
                taken.append(index)
                room -= count
                if room < smallest:  # nothing can fit any more: stop scanning
                    break
        batch = [held[index][0] for index in taken]
        for index in reversed(taken):  # (a memmove each, not a Python loop)
            del held[index]
        held_atoms -= max_atoms - room
        return batch

    if limit is not None:  # islice pulls nothing past the limit
        items = itertools.islice(items, limit)
    for item in items:
        count = int(atoms(item))
        if count > max_atoms:
            if oversize == "error":
                name = describe(item) if describe is not None else "an item"
                raise _oversize_error(name, count, max_atoms)
            yield [item]
        else:
            held.append((item, count))
            held_atoms += count
            smallest = min(smallest, count)
            while held_atoms > max_atoms and len(held) > window:
                yield form()
        del item
    while held:
        yield form()


_END = object()


class EqualSteps(Iterator[T]):
    """Iterate ``batches`` in step with the other DDP ranks: all stop at the shortest.

    Before each step the ranks all-reduce (minimum) whether they still have a batch;
    when one has none, every rank stops there, so DDP's gradient all-reduce never
    waits on a rank that has finished. Without an initialised process group the
    batches pass through unchanged. Use it in the main process (around the
    ``DataLoader``), not inside workers.

    .. code-block:: python

        steps = EqualSteps(loader)
        for batch in steps:
            ...
        print(steps.steps, steps.cut_short)   # whether this rank had batches left

    Args:
        batches (Iterable[T]): This rank's batches (e.g. a loader over a
            ``ShardStreamDataset(max_atoms=...)``).
        group (Any, optional): The process group. (default: :obj:`None`, the default
            group)

    Attributes:
        steps: Batches handed out.
        cut_short: This rank still had batches when the ranks stopped (they are not
            pulled, so nothing more is downloaded for them).
    """

    def __init__(self, batches: Iterable[T], *, group: Any = None) -> None:
        self.batches = iter(batches)
        self.group = group
        self.cut_short = False
        self.steps = 0
        self._done = False
        self._flag: torch.Tensor | None = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # NCCL reduces device tensors only
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.distributed.get_backend(group) == "nccl"
                      else torch.device("cpu"))
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)

    def __iter__(self) -> EqualSteps[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        batch = next(self.batches, _END)
        if self._flag is not None:
            self._flag.fill_(0 if batch is _END else 1)
            torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MIN,
                                         group=self.group)
            everyone = bool(self._flag.item())
        else:
            everyone = batch is not _END
        if not everyone:
            self._done = True
            self.cut_short = batch is not _END
            raise StopIteration
        self.steps += 1
        return batch
