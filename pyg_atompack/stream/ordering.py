"""Sample order within an epoch: in-shard permutation, cross-shard mixing, batching.

Every step is a generator over ``(position, index, sample)`` items, so that the dataset
can record, for each sample it hands out, which shard and which record it came from
(the resume state is kept per record). All randomness comes from generators seeded by
``(seed, epoch, ...)``, so an epoch's order is the same in every run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from torch_geometric.data.data import BaseData

from pyg_atompack.pyg.samples import BufferViewSamples
from pyg_atompack.stream.arriving import arrival_order
from pyg_atompack.stream.loading import LoadedShard
from pyg_atompack.stream.progress import StreamProgress
from pyg_atompack.stream.readahead import ReadAhead

# (position in the stream's shard list, sample index within the decoded shard, sample)
Item = tuple[int, int, BaseData]


def shard_sample_order(count: int, *, shuffle: bool, seed: int, epoch: int,
                       shard_index: int) -> list[int] | range:
    """The order in which the samples of one shard are handed out this epoch.

    Args:
        count (int): Number of samples in the shard.
        shuffle (bool): Permute (else keep the stored order).
        seed (int): Base seed of the dataset.
        epoch (int): Current epoch.
        shard_index (int): The shard's index in the source listing (not its position in the
            epoch), so a shard is permuted the same way whichever stream reads it.

    Returns:
        A permutation of ``range(count)``.
    """
    if not shuffle:
        return range(count)
    rng = np.random.default_rng([seed, epoch, shard_index, 7])
    return rng.permutation(count).tolist()


def shard_samples(shards: Iterable[LoadedShard], progress: StreamProgress,
                  pending: dict[int, int], *, shuffle: bool, seed: int, epoch: int,
                  transform: Callable[[BaseData], BaseData] | None,
                  detach: bool = False, ahead: ReadAhead | None = None) -> Iterator[Item]:
    """The samples of each shard in turn, skipping those ``progress`` already handed out.

    Args:
        shards (Iterable[LoadedShard]): Decoded shards in stream order.
        progress (StreamProgress): Resume state; samples it has seen are left out and a shard with
            nothing left is marked complete.
        pending (dict[int, int]): Filled with the number of samples still to hand out per shard
            position.
        shuffle (bool): Permute the samples within each shard.
        seed (int): Base seed of the dataset.
        epoch (int): Current epoch.
        transform (Callable[[BaseData], BaseData] | None): Applied to each sample as it is taken.
        detach (bool, optional): Copy every sample of a lazily decoded shard out of the shard's
            buffer (when samples are held beyond their shard, e.g. in a mixing buffer); the
            last sample of each shard is always copied. (default: :obj:`False`)
        ahead (ReadAhead, optional): Builds the samples of lazily decoded shards ahead of the
            consumer, on its thread; :obj:`None` builds each one here, when it is taken.
            (default: :obj:`None`)

    Yields:
        ``(position, index in shard, sample)``.
    """
    for shard in shards:
        position = shard.position
        already = progress.emitted_in(position)
        arriving = shard.arriving
        # a shard handed out as it arrives can only draw from what has arrived
        order = (arrival_order if arriving is not None else shard_sample_order)(
            len(shard.samples), shuffle=shuffle, seed=seed, epoch=epoch,
            shard_index=shard.index)
        todo = [i for i in order if i not in already]
        pending[position] = len(todo)
        if not todo:
            progress.mark_complete(position)
        built = _taken_samples(shard.samples, todo, detach, ahead,
                               None if arriving is None else arriving.wait_ready)
        for index in todo:
            sample = next(built)
            if transform is not None:
                sample = transform(sample)
            yield position, index, sample
        if arriving is not None:
            # what the end of the download found (a hash or directory mismatch) is
            # raised before anything of the next shard is handed out
            arriving.settle()
        # release the decoded shard (and the last sample, which may be a view into a
        # collated shard's storage) before the next one is taken
        del shard, built, arriving
        sample = None


def _taken_samples(samples: Sequence[BaseData], todo: list[int], detach: bool,
                   ahead: ReadAhead | None,
                   wait: Callable[[int], None] | None = None) -> Iterator[BaseData]:
    """The samples of ``todo`` in order, built (ahead) if the shard is decoded lazily.

    ``wait(index)``, for a shard still arriving, returns once sample ``index`` has.
    """
    if not isinstance(samples, BufferViewSamples):
        return map(samples.__getitem__, todo)
    # a lazily decoded sample's tensors view its whole shard's buffer; one that may
    # outlive the shard (held in a mixing buffer, or by the consumer while the next
    # shard is fetched) gets its own copies
    if detach:
        make = samples.detached
    else:
        get, detached, last = samples.__getitem__, samples.detached, todo[-1] if todo else None

        def make(index: int) -> BaseData:
            return detached(index) if index == last else get(index)
    if wait is not None:
        build = make

        def make(index: int) -> BaseData:
            wait(index)
            return build(index)
    return ahead.run(make, todo) if ahead is not None else map(make, todo)


def interleave_shards(shards: Iterable[LoadedShard], width: int, rng: np.random.Generator,
                      progress: StreamProgress, pending: dict[int, int],
                      **options) -> Iterator[Item]:
    """Draw samples from ``width`` shards (or record blocks) at once, in random turns.

    Each shard's samples come in their :func:`shard_samples` order; every next sample is
    taken from one of the ``width`` open shards picked by ``rng``, and a finished shard
    is replaced by the next one. Consecutive samples therefore come from different parts
    of the dataset, at the cost of holding ``width`` decoded shards instead of one.

    Args:
        shards (Iterable[LoadedShard]): Decoded shards in stream order.
        width (int): Shards open at once; ``1`` is :func:`shard_samples` unchanged.
        rng (np.random.Generator): Picks the shard each sample comes from.
        progress (StreamProgress): Resume state (see :func:`shard_samples`).
        pending (dict[int, int]): Filled as by :func:`shard_samples`.
        **options (optional): ``shuffle``, ``seed``, ``epoch``, ``transform``, ``detach`` and
            ``ahead`` of :func:`shard_samples`.

    Yields:
        ``(position, index in shard, sample)``.
    """
    if width <= 1:
        yield from shard_samples(shards, progress, pending, **options)
        return
    upcoming = iter(shards)
    active: list[Iterator[Item]] = []
    while True:
        while len(active) < width:
            shard = next(upcoming, None)
            if shard is None:
                break
            active.append(shard_samples(iter([shard]), progress, pending, **options))
            del shard
        if not active:
            return
        pick = int(rng.integers(len(active))) if len(active) > 1 else 0
        item = next(active[pick], None)
        if item is None:
            active.pop(pick)
            continue
        yield item
        del item


def mix_across_shards(items: Iterable[Item], buffer_size: int,
                      rng: np.random.Generator) -> Iterator[Item]:
    """Mix items from neighbouring shards through a buffer of ``buffer_size`` items.

    Args:
        items (Iterable[Item]): Items in shard order.
        buffer_size (int): Items held back; ``0`` passes the items through unchanged.
        rng (np.random.Generator): Picks which buffered item leaves next.

    Yields:
        The same items, in a mixed order.
    """
    if buffer_size == 0:
        yield from items
        return
    buffer: list[Item] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        pick = int(rng.integers(len(buffer)))
        buffer[pick], item = item, buffer[pick]
        yield item
    rng.shuffle(buffer)
    yield from buffer


def group_items(items: Iterable[Item], batch_size: int | None) -> Iterator[list[Item]]:
    """Group items into the units the dataset yields.

    Args:
        items (Iterable[Item]): The items.
        batch_size (int | None): Items per group (the last one may be smaller); :obj:`None` makes
            every item its own unit.

    Yields:
        Lists of items.
    """
    if batch_size is None:
        for item in items:
            yield [item]
        return
    batch: list[Item] = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch
