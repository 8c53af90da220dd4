"""One iteration of one (rank, worker) stream: its prefetcher and the loop that hands
items out.

:class:`~pyg_atompack.stream.ShardStreamDataset` (``stream/dataset.py``) holds what a
stream *is*: its source and options, planning, resume state and traces. This module
holds what one pass *does* with them: choose the loader (whole shards or record blocks),
start the :class:`~pyg_atompack.stream.prefetch.Prefetcher` with its connections (and
the shard handed out as it arrives), then order, batch and hand out the samples, marking
each in the stream's progress and timing the consumer's steps. It runs in the iterating
process, or in the retrieval child (:mod:`pyg_atompack.stream.offproc`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
from torch.utils.data import get_worker_info
from torch_geometric.data import Batch
from torch_geometric.data.data import BaseData

from pyg_atompack.pyg import names_transform
from pyg_atompack.pyg.budget import group_by_atoms
from pyg_atompack.stream.autotune import attach, stream_tuner
from pyg_atompack.stream.blocks import BlockLoader, BlockPlan
from pyg_atompack.stream.loading import LoadedShard, ShardLoader
from pyg_atompack.stream.memory import release_free_memory
from pyg_atompack.stream.ordering import group_items, interleave_shards, mix_across_shards
from pyg_atompack.stream.prefetch import Prefetcher
from pyg_atompack.stream.progress import StreamProgress
from pyg_atompack.stream.readahead import ReadAhead
from pyg_atompack.stream.splitting import StreamPlan, StreamSlot, worker_share
from pyg_atompack.stream.trace import TraceRecorder

if TYPE_CHECKING:  # dataset.py imports this module
    from pyg_atompack.stream.dataset import ShardStreamDataset

#: Shard bytes to consume between two ``malloc_trim`` calls. A trim also returns the
#: training loop's own freed heap, which the next steps then fault back in: measured on
#: CPU SchNet training with 0.26 MB shards, trimming after every shard cost 4% of the
#: pass. Shards this large are worth it; small shards are trimmed after several.
TRIM_AFTER_BYTES = 8 << 20


def _download_ended(shard: LoadedShard) -> None:
    # a shard handed out as it arrives gives its connections back once its download ends
    if shard.arriving is not None:
        shard.arriving.wait_done()


def start_prefetcher(dataset: ShardStreamDataset, plan: StreamPlan | BlockPlan,
                     slot: StreamSlot, jobs: list[tuple[int, int]],
                     recorder: TraceRecorder) -> Prefetcher:
    """Start downloading and decoding ``jobs`` of ``plan`` on background threads.

    Args:
        dataset (ShardStreamDataset): The stream (its source, options and budgets).
        plan (StreamPlan | BlockPlan): The slot's shards or record blocks this epoch.
        slot (StreamSlot): The (rank, worker) stream iterating.
        jobs (list[tuple[int, int]]): ``(position, shard or block)`` still to read.
        recorder (TraceRecorder): Where the jobs' traces (and the tuner) go.

    Returns:
        Prefetcher: The running prefetcher, at this worker's share of ``prefetch`` and
        ``concurrency`` (or the tuner's choice).
    """
    if isinstance(plan, BlockPlan):
        loader = BlockLoader(dataset.source, dataset.shards, plan,
                             cache_dir=dataset.options.cache_dir, on_error=dataset.on_error,
                             block_bytes=dataset.options.block_bytes)
    else:
        loader = ShardLoader(dataset.source, dataset.shards, trusted=dataset.options.trusted,
                             verify=dataset.options.verify, on_error=dataset.on_error,
                             lazy_decode=dataset.options.lazy_decode,
                             verify_before_use=dataset.options.verify_before_use)
    # prefetch and concurrency are per rank: this worker gets its share of both
    prefetch = worker_share(dataset.prefetch, slot, minimum=min(dataset.prefetch, 1))
    concurrency = worker_share(dataset.concurrency or 1, slot)
    blocks = isinstance(plan, BlockPlan)
    tuner = recorder.tuner = stream_tuner(
        dataset.memory_budget, [dataset.options.block_bytes] if blocks
        else [dataset.shards[number].size for number in plan.shards], slot.num_workers,
        # record blocks fix their ranges per block when iteration starts and each
        # connection holds a block: the default keeps them at one (memory as given)
        concurrency=1 if blocks and dataset.concurrency is None else dataset.concurrency,
        prefetch=prefetch)
    if tuner is not None:  # settings chosen by measurement from here on
        prefetch, concurrency = tuner.start()
    # a download takes the free connections it can use (Prefetcher)
    budget = concurrency if dataset.options.split_shards else 1
    first = jobs[0] if jobs else None
    if isinstance(plan, BlockPlan):
        block_parts = loader.connections(budget)
        return attach(tuner, Prefetcher(
            jobs, lambda job, cancel, lease: loader.load(*job, cancel, recorder,
                                                         parts=lease.connections,
                                                         downloaded=lease.release),
            depth=prefetch, concurrency=concurrency, connections=lambda job: block_parts))
    # .pt shards handed out as their bytes arrive (stream/arriving.py): the first
    # one, or all; a download keeps its connections until it ends. "First" is the
    # epoch's first shard of this slot, not the first left after a resume: whether a
    # shard arrives decides its sample order, which a resumed epoch must repeat
    every = dataset.options.stream_shards == "all" and prefetch > 0
    opening = first if first is not None and first[0] == 0 else None
    arriving = (dataset.options.stream_shards != "none" and prefetch > 0
                and opening is not None and loader.streams_as_it_arrives(opening[1]))

    def connections(job: tuple[int, int]) -> int:
        # a first shard handed out as it arrives downloads alone (over at most
        # ``budget`` ranges): nothing else takes its bandwidth while the consumer
        # waits on its bytes
        if arriving and job is opening:
            return concurrency
        return loader.connections(job[1], budget)

    return attach(tuner, Prefetcher(
        jobs, lambda job, cancel, lease: loader.load(
            *job, cancel, recorder, parts=min(lease.connections, budget),
            arriving=every or (arriving and job is opening), downloaded=lease.release),
        depth=prefetch, concurrency=concurrency, connections=connections,
        settled=_download_ended if arriving or every else None,
    ))


def hand_out(dataset: ShardStreamDataset, plan: StreamPlan | BlockPlan, slot: StreamSlot,
             progress: StreamProgress, recorder: TraceRecorder, prefetcher: Prefetcher,
             quota: int | None) -> Iterator[BaseData]:
    """The items of one iteration: samples or batches, in order, marked as handed out.

    Args:
        dataset (ShardStreamDataset): The stream (order, batching, transform settings).
        plan (StreamPlan | BlockPlan): The slot's shards or record blocks this epoch.
        slot (StreamSlot): The (rank, worker) stream iterating.
        progress (StreamProgress): Marked with every sample handed out (resume).
        recorder (TraceRecorder): Consumption times and the consumer's steps.
        prefetcher (Prefetcher): The running jobs (:func:`start_prefetcher`).
        quota (int | None): Samples this stream may still hand out (:obj:`None`: all).

    Returns:
        Iterator[BaseData]: The items; closing it stops the prefetcher, records the
        traces and, in a DataLoader worker, writes them to ``dataset.trace_dir``.
    """
    # this body runs when the consumer first calls next(): its first wait starts
    meter = recorder.meter
    if meter is not None:
        meter.asked()
    # samples are built ahead in the background only where shards are fetched there
    ahead = ReadAhead(dataset.options.read_ahead if prefetcher.depth > 0 else 0)
    pending: dict[int, int] = {}  # samples of each started shard not yet handed out
    started: set[int] = set()  # positions whose consume_start_s is set
    handed = 0
    try:
        mixing = np.random.default_rng([dataset.seed, dataset.epoch, slot.rank, slot.worker, 11])
        items = interleave_shards(iter(prefetcher), dataset.options.interleave, mixing,
                                  progress, pending, shuffle=dataset.shuffle,
                                  seed=dataset.seed, epoch=dataset.epoch,
                                  transform=names_transform(dataset._names, dataset.transform),
                                  detach=dataset.shuffle_buffer > 0, ahead=ahead)
        items = mix_across_shards(items, dataset.shuffle_buffer, mixing)
        trim, trim_due = dataset.options.trim_memory, False
        untrimmed_bytes = 0  # shard bytes consumed since the last trim
        for unit in (group_items(items, dataset.batch_size) if dataset.max_atoms is None
                     else _atom_batches(dataset, items, plan, quota)):
            if trim_due:
                # the shard finished last time has been dropped by now (pulling this
                # unit advanced past it): give its memory back to the OS
                release_free_memory()
                trim_due = False
            if quota is not None and handed + len(unit) > quota:
                break
            finishing = []
            # (no loop variable may keep a sample alive: a sample cut from a collated
            # shard is a view that pins the whole shard's storage)
            for position, index in [(position, index) for position, index, _ in unit]:
                if position not in started:  # its first sample: consuming it starts
                    started.add(position)
                    recorder.consumption_started(position, plan.shards[position])
                progress.mark_sample(position, index)
                pending[position] -= 1
                if pending[position] == 0:
                    finishing.append(position)
                    progress.mark_complete(position)
            handed += len(unit)
            samples = [sample for _, _, sample in unit]
            last_shard = unit[-1][0]  # a step waits, if at all, on its last sample
            del unit
            item = (samples[0] if dataset.batch_size is None and dataset.max_atoms is None
                    else Batch.from_data_list(samples))
            del samples
            if meter is not None:
                meter.received(last_shard)
            yield item
            del item
            if meter is not None:  # the consumer asks for the next item
                meter.asked()
            now = recorder.now() if finishing else 0.0  # the consumer is back: it
            for position in finishing:  # is done with the shards in `finishing`
                record = recorder.record(position, plan.shards[position], "")
                record.consume_finish_s = now
                untrimmed_bytes += record.bytes or 0
            if trim and untrimmed_bytes >= TRIM_AFTER_BYTES:
                trim_due, untrimmed_bytes = True, 0
            if quota is not None and handed >= quota:
                break  # do not pull (and download) anything past the quota
        progress.finished = True
    finally:
        prefetcher.close()
        ahead.close()
        recorder.wait_s = prefetcher.wait_s
        recorder.cut_short(pending)  # shards cut short by a quota, break or error
        dataset._progress = progress
        if get_worker_info() is not None:
            name = f"epoch{dataset.epoch:06d}-rank{slot.rank}-worker{slot.worker}.json"
            recorder.write(dataset.trace_dir / name)


def _atom_batches(dataset: ShardStreamDataset, items: Iterator, plan: StreamPlan | BlockPlan,
                  quota: int | None) -> Iterator[list]:
    # max_atoms: the batching lives in pyg.budget; a batch never crosses the quota
    def describe(item: tuple) -> str:
        position, index = item[0], item[1]
        if isinstance(plan, BlockPlan):
            block = plan.blocks[position]
            return f"record {block.first + index} of shard {dataset.shards[block.shard].name}"
        return f"sample {index} of shard {dataset.shards[plan.shards[position]].name}"

    return group_by_atoms(items, dataset.max_atoms, lambda item: item[2].num_nodes,
                          window=dataset.shuffle_buffer, limit=quota,
                          oversize=dataset.oversize, describe=describe)


__all__ = ["start_prefetcher", "hand_out", "TRIM_AFTER_BYTES"]
