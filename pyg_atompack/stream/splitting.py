"""Which shards and how many samples each (rank, worker) stream reads in an epoch.

Every epoch the shard list is permuted (when shuffling) with a generator seeded by
``(seed, epoch)``, identical in every process, and dealt round-robin to the
``world_size * num_workers`` streams, so each shard is read by exactly one stream.

DDP needs every rank to produce the same number of samples (or batches), or the ranks
that run out first wait forever in a collective. When the record count of every shard
is known (from a manifest or the ``.atp`` index) each rank is cut to the smallest
rank's total, rounded down to whole batches: surplus samples at the end of a rank's
stream are **dropped** for that epoch (a different few each epoch when shuffling). When
counts are unknown, ranks get equal numbers of *shards* (surplus shards of the epoch's
order are dropped), which equalises samples only for equally sized shards.

After an elastic resume (a state merged from every stream of a run with another grid
of ranks and workers, :class:`~pyg_atompack.stream.progress.EpochConsumed`), the rest of
the epoch is cut at sample granularity when every count is known: the samples left, in
the epoch's shard order, are split into equal stretches per rank, so nothing is dropped
but the ``left % world_size`` at the end (a shard cut between two streams is read by
both, each skipping the other's samples). With unknown counts the shards with samples
left are dealt whole, as above.

``prefetch`` and ``concurrency`` are budgets *per rank*: a rank's DataLoader workers
share them in equal parts, rounded up (:func:`worker_share`), so adding workers neither
multiplies the decoded shards held in memory nor the connections opened to the server.
Each worker still keeps at least one shard ahead (when ``prefetch > 0``) and one
connection.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pyg_atompack.stream.progress import EpochConsumed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamSlot:
    """Position of one iterating process among all readers of the dataset.

    Attributes:
        rank: DDP rank.
        world_size: Number of DDP ranks.
        worker: DataLoader worker id within the rank.
        num_workers: DataLoader workers per rank (1 when loading in the main process).
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} outside num_workers {self.num_workers}")

    @property
    def index(self) -> int:
        """Global stream number, ``rank * num_workers + worker``."""
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        """Total number of streams."""
        return self.world_size * self.num_workers


def epoch_shard_order(num_shards: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """Shard indices in the order they are dealt out this epoch.

    Args:
        num_shards (int): Number of shards in the source.
        shuffle (bool): Permute the order (else the source order).
        seed (int): Base seed shared by all processes.
        epoch (int): Epoch number (see ``set_epoch``).

    Returns:
        A permutation of ``range(num_shards)``.
    """
    if not shuffle:
        return list(range(num_shards))
    rng = np.random.default_rng([seed, epoch, 0x5A4D])
    return [int(i) for i in rng.permutation(num_shards)]


def _water_fill(capacities: Sequence[int], total: int) -> list[int]:
    """Split ``total`` units over bins of the given capacities as evenly as possible."""
    quotas = [0] * len(capacities)
    remaining = total
    open_bins = sorted(range(len(capacities)), key=lambda b: capacities[b])
    while remaining > 0:
        # full bins (capacity 0 ones from the start) take nothing more; every open bin
        # has been filled to the same level, so each still has room for one unit
        open_bins = [b for b in open_bins if quotas[b] < capacities[b]]
        if not open_bins:
            break
        share = remaining // len(open_bins)
        smallest = open_bins[0]
        if capacities[smallest] - quotas[smallest] <= share or share == 0:
            if share == 0:  # fewer units than bins: one each until none left
                for b in open_bins[:remaining]:
                    quotas[b] += 1
                break
            give = capacities[smallest] - quotas[smallest]
            quotas[smallest] += give
            remaining -= give
            open_bins.pop(0)
        else:
            for b in open_bins:
                quotas[b] += share
            remaining -= share * len(open_bins)
    return quotas


def worker_share(budget: int, slot: StreamSlot, *, minimum: int = 1) -> int:
    """This stream's part of a per-rank ``budget`` split between the rank's workers.

    Every worker gets the same share, rounded up: a DataLoader takes batches from its
    workers in turn, so one worker with less prefetch or fewer connections than the
    others would set the pace of all of them. The shares add up to at most
    ``budget + num_workers - 1``.

    Args:
        budget (int): The rank's total (``prefetch`` or ``concurrency``).
        slot (StreamSlot): The stream (its ``num_workers`` count; ranks do not share).
        minimum (int, optional): The least any worker gets. (default: :obj:`1`)

    Returns:
        ``max(minimum, ceil(budget / num_workers))``.
    """
    return max(minimum, -(-budget // slot.num_workers))


@dataclass(frozen=True)
class StreamPlan:
    """What one stream reads in one epoch.

    Attributes:
        shards: Shard indices (into the source listing), in reading order.
        sample_quota: Maximum samples this stream yields (``None``: all of them).
        dropped_shards: Shards nobody reads this epoch (rank equalisation without counts).
        handed: Per position, the samples other streams handed out before an elastic
            resume (they are skipped).
    """

    shards: tuple[int, ...]
    sample_quota: int | None
    dropped_shards: tuple[int, ...] = ()
    handed: Mapping[int, frozenset[int]] = field(default_factory=dict)


def plan_stream(records: Sequence[int | None], slot: StreamSlot, *, shuffle: bool, seed: int,
                epoch: int, batch_size: int | None = None,
                consumed: EpochConsumed | None = None) -> StreamPlan:
    """Compute the shards and sample quota of ``slot`` for ``epoch``.

    After an elastic resume (``consumed``), the shards with samples left are dealt in
    the epoch's order, as a whole epoch's are, and rank equalisation counts only the
    samples left.

    Args:
        records (Sequence[int | None]): Record count of every shard in source order (``None`` when
            unknown).
        slot (StreamSlot): The stream being planned.
        shuffle (bool): Permute shard order per epoch.
        seed (int): Shared seed.
        epoch (int): Epoch number.
        batch_size (int, optional): When set, quotas are whole batches so every rank yields the same
            number of full batches. (default: :obj:`None`)
        consumed (EpochConsumed, optional): What all streams had handed out of this epoch
            before an elastic resume. (default: :obj:`None`)

    Returns:
        The :class:`StreamPlan`.
    """
    order = epoch_shard_order(len(records), shuffle=shuffle, seed=seed, epoch=epoch)
    if consumed is not None:
        order = [s for s in order if s not in consumed.done]
        if all(r is not None for r in records):
            return _plan_rest(records, slot, order, consumed)
        records = [None if r is None else r - consumed.count(s) for s, r in enumerate(records)]
    dropped: tuple[int, ...] = ()
    known = all(r is not None for r in records)
    if slot.world_size > 1 and not known:
        keep = len(order) - len(order) % slot.world_size
        order, dropped = order[:keep], tuple(order[keep:])
    # deal rank-major blocks of num_workers consecutive shards so that every rank sees a
    # contiguous stripe of the order, then split that stripe among its workers
    streams: list[list[int]] = [[] for _ in range(slot.count)]
    for position, shard in enumerate(order):
        rank = position % slot.world_size
        worker = (position // slot.world_size) % slot.num_workers
        streams[rank * slot.num_workers + worker].append(shard)
    mine = tuple(streams[slot.index])
    handed = {} if consumed is None else {
        position: frozenset(consumed.taken(shard)) for position, shard in enumerate(mine)
        if shard in consumed.runs}  # (shards of unknown size: dealt whole, as above)
    if slot.world_size == 1 or not known:
        return StreamPlan(mine, None, dropped, handed)
    unit = batch_size or 1
    capacity = [sum(records[s] for s in stream) // unit for stream in streams]
    per_rank = [
        sum(capacity[r * slot.num_workers:(r + 1) * slot.num_workers])
        for r in range(slot.world_size)
    ]
    units = min(per_rank)
    if units == 0:
        logger.warning("rank equalisation leaves no samples: some rank has fewer than one "
                       "batch this epoch (%d shards over %d streams)", len(order), slot.count)
    first = slot.rank * slot.num_workers
    quotas = _water_fill(capacity[first:first + slot.num_workers], units)
    return StreamPlan(mine, quotas[slot.worker] * unit, dropped, handed)


def _plan_rest(records: Sequence[int], slot: StreamSlot, order: list[int],
               consumed: EpochConsumed) -> StreamPlan:
    """The rest of an epoch after an elastic resume, cut at sample granularity.

    The samples left, in the epoch's shard order, are cut into ``world_size`` equal
    stretches of ``left // world_size`` samples, each split between the rank's
    workers, as record blocks are (:func:`pyg_atompack.stream.blocks.plan_block_stream`):
    every rank takes the same number of steps and nothing is dropped but the
    ``left % world_size`` samples at the end of the order. A shard cut between two
    streams is read by both, each skipping the other's samples (``handed``).
    """
    left = [records[s] - consumed.count(s) for s in order]
    starts = np.concatenate([[0], np.cumsum(left, dtype=np.int64)])
    per_rank = int(starts[-1]) // slot.world_size
    lo = slot.rank * per_rank + per_rank * slot.worker // slot.num_workers
    hi = slot.rank * per_rank + per_rank * (slot.worker + 1) // slot.num_workers
    shards: list[int] = []
    handed: dict[int, frozenset[int]] = {}
    for position, shard in enumerate(order):
        a, b = int(starts[position]), int(starts[position + 1])
        cut_a, cut_b = max(a, lo) - a, min(b, hi) - a
        if cut_b <= cut_a:
            continue
        taken = consumed.taken(shard)
        if taken or cut_b - cut_a < left[position]:
            rest = [i for i in range(records[shard]) if i not in taken]
            handed[len(shards)] = frozenset(range(records[shard])) - set(rest[cut_a:cut_b])
        shards.append(shard)
    return StreamPlan(tuple(shards), None, (), handed)
