"""ShardStreamDataset: stream remote shards into PyG training with bounded prefetch.

This module holds what a stream *is*: its source and :class:`SourceOptions`, the
iteration settings, the epoch's plan for each (rank, worker) stream, the resume state
and the traces. What one pass *does* (the prefetcher, ordering, batching and the loop
that hands items out) is :mod:`pyg_atompack.stream.iteration`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torch_geometric.data.data import BaseData

from pyg_atompack.pyg import resolve_names
from pyg_atompack.pyg.budget import check_budget
from pyg_atompack.pyg.device import DeviceFeed
from pyg_atompack.pyg.handoff import install as install_handoff
from pyg_atompack.pyg.ranks import resolve_rank
from pyg_atompack.stream.autotune import check_memory_budget
from pyg_atompack.stream.blocks import (
    BlockPlan,
    plan_block_stream,
    plan_source_blocks,
    wants_blocks,
)
from pyg_atompack.stream.errors import ShardFetchError
from pyg_atompack.stream.iteration import hand_out, start_prefetcher
from pyg_atompack.stream.loading import check_on_error
from pyg_atompack.stream.offproc import iterate_in_child, use_child_process
from pyg_atompack.stream.open import open_source
from pyg_atompack.stream.options import SourceOptions, source_options
from pyg_atompack.stream.progress import (
    EpochConsumed,
    StreamProgress,
    merge_stream_states,
    plan_units,
)
from pyg_atompack.stream.sources import ShardInfo, Source
from pyg_atompack.stream.splitting import StreamPlan, StreamSlot, plan_stream
from pyg_atompack.stream.trace import (
    StepWaitMeter,
    TraceRecorder,
    merge_traces,
    summarize,
)
from pyg_atompack.transport.retry import RetryPolicy


def _remove_directory_if_owner(path: str, owner_pid: int) -> None:
    # forked DataLoader workers inherit this finaliser; only the creating process cleans up
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)


class ShardStreamDataset(IterableDataset):
    r"""Stream ``.pt`` / ``.atp`` shards from a :class:`~pyg_atompack.stream.Source` as PyG data.

    Shards are downloaded and deserialised ahead of the consumer on background threads,
    so the retrieval of shard ``i + 1`` overlaps training on shard ``i``; by default
    (``SourceOptions(retrieval="auto")``) those threads and the batching run in a child process, off
    the consumer's GIL (:mod:`pyg_atompack.stream.offproc`). Memory stays
    bounded by shard size: at most ``prefetch + 1`` decoded shards are alive (one more
    in a retrieval process, plus the items it has built ahead), and a
    shard's bytes are held once: either as the storage a lazily decoded shard reads its
    samples from (``.atp`` shards, ``.pt`` lists of ``Data``), or until it is unpickled.
    Downloads of known size go to anonymous memory maps that are unmapped the moment a
    shard is dropped (:mod:`pyg_atompack.transport.buffers`).

    Every epoch, shards are (optionally) permuted with a generator seeded by
    ``(seed, epoch)`` and split between DDP ranks and DataLoader workers so that each
    shard is read exactly once; see :mod:`pyg_atompack.stream.splitting` for how ranks
    are given equal sample counts (surplus samples are dropped, never padded).

    With DataLoader workers, ``prefetch`` and ``concurrency`` are the rank's budget,
    split in equal parts, rounded up, between its workers
    (:func:`~pyg_atompack.stream.splitting.worker_share`): two workers at
    ``prefetch=2, concurrency=2`` each keep one shard ahead over one connection, so
    adding workers multiplies neither memory nor connections. Workers
    send their samples and batches to the main process packed into one buffer each
    (:mod:`pyg_atompack.pyg.handoff`) instead of one shared-memory segment per tensor.

    Traces: :attr:`trace` and :meth:`stats` describe the latest iteration (per-shard
    download / deserialise / consume times and a summary). DataLoader workers write
    their traces as JSON into :attr:`trace_dir` when their iteration ends or is closed;
    the main process merges the files of the current epoch.

    Args:
        source (Source | str | os.PathLike): Where shards come from
            (:class:`~pyg_atompack.stream.RemoteSource`, :class:`~pyg_atompack.stream.LocalSource`
            or any :class:`~pyg_atompack.stream.Source`), or
            a URL or path that :func:`~pyg_atompack.stream.open_source` turns into one (``hf://``,
            ``http(s)://``, object stores, a local directory). Listed once, here.
        options (SourceOptions, optional): How the shards of a URL or path ``source`` are
            fetched, checked and decoded (:class:`~pyg_atompack.stream.SourceOptions`:
            retries, integrity checks, record blocks, the metadata cache, decoding,
            where retrieval runs). A :class:`~pyg_atompack.stream.Source` object made
            with options (:func:`~pyg_atompack.stream.open_source`,
            :class:`~pyg_atompack.stream.RemoteSource` ``(options=)``) keeps its own:
            passing options here too raises :class:`ValueError`; a source without any
            takes these. (default: :obj:`None`, the source's or the defaults)
        prefetch (int, optional): Shards retrieved and decoded ahead of the one being consumed;
            ``0`` loads each shard on demand in the consumer's thread. A budget per rank:
            each of ``n`` DataLoader workers gets ``ceil(prefetch / n)``
            (:func:`~pyg_atompack.stream.splitting.worker_share`). (default: :obj:`1`)
        concurrency (int, optional): Connections open at once (a shard's byte ranges, see
            ``SourceOptions.split_shards``, or downloads of up to ``prefetch`` shards),
            per rank like ``prefetch`` (each worker gets at least one connection).
            :obj:`None`: chosen while the stream runs from measured download and
            consumption times, more while downloads are the bottleneck, one when the
            consumer is (up to
            :data:`~pyg_atompack.stream.autotune.DEFAULT_MAX_CONCURRENCY` per rank; every
            one of them on the first shard). ``prefetch`` stays as given, so memory stays
            within ``prefetch + 1`` live shards; :meth:`stats` reports the choices under
            ``autotune``. ``prefetch=0`` (the sequential baseline) and record blocks
            (``SourceOptions.blocks``) use one.
            (default: :obj:`None`)
        memory_budget (int, optional): Bytes this rank's live shards may take; turns on
            tuning: ``prefetch`` and ``concurrency`` are then chosen while the stream
            runs, from measured download and consumption times, more connections while
            downloads are the bottleneck and less prefetch when memory is short
            (:mod:`pyg_atompack.stream.autotune`; the choices are in :meth:`stats` under
            ``autotune``). :obj:`None` keeps ``prefetch`` as given.
            (default: :obj:`None`)
        shuffle (bool, optional): Permute shard order per epoch and samples within each shard.
            (default: :obj:`False`)
        seed (int, optional): Base seed of every permutation. (default: :obj:`0`)
        shuffle_buffer (int, optional): Size of a buffer mixing samples across shards (``0``: off).
            (default: :obj:`0`)
        batch_size (int, optional): Yield :class:`~torch_geometric.data.Batch` objects of this many
            samples instead of single samples. (default: :obj:`None`)
        max_atoms (int, optional): Yield batches of at most this many atoms instead of
            ``batch_size`` samples (:func:`~pyg_atompack.pyg.budget.group_by_atoms`):
            each filled first fit from a look-ahead of ``shuffle_buffer`` samples (next
            fit without one), every sample in exactly one batch, the same batches for
            a given seed and epoch. Ranks may form different numbers of batches (atom
            counts are known only once samples are decoded): under DDP iterate through
            :class:`~pyg_atompack.pyg.budget.EqualSteps`, which stops every rank at the
            shortest one. (default: :obj:`None`)
        oversize (str, optional): With ``max_atoms``, a sample larger than the budget:
            ``"error"`` (:class:`~pyg_atompack.pyg.budget.AtomBudgetError` naming the
            shard and sample) or ``"own_batch"``. (default: :obj:`"error"`)
        transform (Callable[[BaseData], BaseData], optional): Function applied to every sample
            before batching. (default: :obj:`None`)
        on_error (str, optional): ``"raise"`` stops iteration at a shard that cannot be fetched or
            decoded, naming it; ``"skip"`` logs a warning and continues.
            (default: :obj:`"raise"`)
        rank (int, optional): DDP rank
            (default: from :mod:`torch.distributed` when initialised, else 0).
        world_size (int, optional): Number of DDP ranks (default: as for ``rank``, else 1).
        device (torch.device or str, optional): Hand items out on this device, each
            copied one step ahead on a side CUDA stream
            (:class:`~pyg_atompack.pyg.device.DeviceFeeder`; ``state_dict`` stays exact).
            Iterating in the main process only: behind DataLoader workers pass
            ``device=`` to :class:`~pyg_atompack.StatefulLoader`. (default: :obj:`None`)
        device_transform (Callable, optional): Applied to each item on the device, e.g.
            ``InteractionGraph.transform()``. (default: :obj:`None`)
        trace_dir (str | os.PathLike, optional): Directory for worker trace files. (default: a
            temporary directory removed with the dataset)
    """

    def __init__(self, source: Source | str | os.PathLike, *,
                 options: SourceOptions | None = None, prefetch: int = 1,
                 concurrency: int | None = None, memory_budget: int | None = None,
                 shuffle: bool = False, seed: int = 0, shuffle_buffer: int = 0,
                 batch_size: int | None = None, max_atoms: int | None = None,
                 oversize: str = "error",
                 transform: Callable[[BaseData], BaseData] | None = None,
                 on_error: str = "raise", rank: int | None = None,
                 world_size: int | None = None,
                 device: torch.device | str | None = None,
                 device_transform: Callable[[BaseData], BaseData] | None = None,
                 trace_dir: str | os.PathLike | None = None):
        super().__init__()
        if max_atoms is not None:
            check_budget(max_atoms, oversize)
            if batch_size is not None:
                raise ValueError("pass batch_size or max_atoms, not both")
        if prefetch < 0 or (concurrency is not None and concurrency < 1) or shuffle_buffer < 0:
            raise ValueError("need prefetch >= 0, concurrency >= 1 and shuffle_buffer >= 0")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        check_on_error(on_error)  # at construction, not at the first iteration
        if (rank is None) != (world_size is None):
            raise ValueError("pass rank and world_size together")
        if isinstance(source, (str, os.PathLike)):
            source, options = open_source(source, options), None  # the source's now
        self.options = options = source_options(source, options)
        if (getattr(source, "options", None) is None and options.retries is not None
                and isinstance(getattr(source, "retry", None), RetryPolicy)):
            # a source made without options takes the dataset's retries on a copy of its
            # own (one with options applied them when it was made)
            source = copy.copy(source)
            source.retry = dataclasses.replace(source.retry, retries=options.retries)
        self.source = source
        self.shards: tuple[ShardInfo, ...] = tuple(source.list_shards())
        if not self.shards:
            raise ShardFetchError(f"{source!r} lists no shards")
        # the block table is small (a few numbers per block) and pickled into workers;
        # each worker reads the shards' metadata from the disk cache filled here
        self.blocks = (plan_source_blocks(source, self.shards, options.block_bytes,
                                          options.cache_dir)
                       if wants_blocks(source, self.shards, options.block_bytes,
                                       options.blocks) else None)
        self.prefetch = prefetch
        self.concurrency = concurrency
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.batch_size = batch_size
        self.max_atoms, self.oversize = max_atoms, oversize
        self.transform = transform
        self._names = resolve_names(options.rename, options.names)
        self.on_error = on_error
        self.device_feed = DeviceFeed.of(device, device_transform)
        check_memory_budget(memory_budget)
        self.memory_budget = memory_budget
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        if trace_dir is None:
            trace_dir = tempfile.mkdtemp(prefix="pyg_atompack-trace-")
            weakref.finalize(self, _remove_directory_if_owner, trace_dir, os.getpid())
        self.trace_dir = Path(trace_dir)
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._recorder: TraceRecorder | None = None
        self._progress: StreamProgress | None = None
        self._resume: StreamProgress | None = None
        # what every stream had handed out of an epoch before an elastic resume
        self._base: EpochConsumed | None = None

    # ----------------------------------------------------------------- configuration
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch that seeds shard and sample order (call before each epoch).

        Like :meth:`torch.utils.data.distributed.DistributedSampler.set_epoch`: every
        rank and worker must see the same epoch so that together they read each shard
        exactly once. Call it in the main process before iterating, so that DataLoader
        workers started afterwards inherit it.

        Args:
            epoch (int): The epoch number, mixed into every permutation's seed.
        """
        self.epoch = int(epoch)

    def slot(self) -> StreamSlot:
        """The (rank, worker) stream this process reads when iterating now.

        Returns:
            The slot from ``rank`` / ``world_size`` (or :mod:`torch.distributed`) and
            the current DataLoader worker, if any.
        """
        rank, world_size = resolve_rank(self.rank, self.world_size)
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return StreamSlot(rank, world_size, worker, num_workers)

    def plan(self, slot: StreamSlot | None = None) -> StreamPlan | BlockPlan:
        """The shards and sample quota of ``slot`` (default: this process) this epoch.

        Args:
            slot (StreamSlot, optional): The (rank, worker) stream to plan for. (default:
                :obj:`None`, the stream of the calling process, see :meth:`slot`)

        Returns:
            The shards, in reading order, assigned to the slot for the current
            :attr:`epoch`, and the number of samples it may hand out.
        """
        base = self._base if self._base is not None and self._base.epoch == self.epoch else None
        return self._plan(slot or self.slot(), self.epoch, base)

    def _plan(self, slot: StreamSlot, epoch: int,
              base: EpochConsumed | None) -> StreamPlan | BlockPlan:
        if self.blocks is not None:
            return plan_block_stream(self.blocks, slot, shuffle=self.shuffle, seed=self.seed,
                                     epoch=epoch, consumed=base)
        return plan_stream([s.records for s in self.shards], slot, shuffle=self.shuffle,
                           seed=self.seed, epoch=epoch, batch_size=self.batch_size,
                           consumed=base)

    # ----------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        """Position of this process's iteration, JSON-serialisable.

        Captures the samples handed out so far in the current epoch by this process.
        With DataLoader workers, let torchdata's ``StatefulDataLoader`` (or
        :class:`~pyg_atompack.StatefulLoader`) call it inside every worker: its own
        ``state_dict()`` then holds every worker's position, and a loader with the same
        ``num_workers`` resumes exactly. For another grid of ranks and workers, merge
        the states of every stream first (:meth:`merge_states`).

        Returns:
            The state, to pass to :meth:`load_state_dict`.
        """
        if self.device_feed is not None and get_worker_info() is None:
            return self.device_feed.state(self._state)  # not the item drawn ahead
        return self._state()

    def _state(self) -> dict:
        progress = self._progress or StreamProgress(self.epoch, self.slot())
        base = self._base if self._base is not None and self._base.epoch == progress.epoch \
            else None
        return {**progress.to_state(), "seed": self.seed, "shuffle": self.shuffle,
                "block_bytes": self.options.block_bytes if self.blocks is not None else None,
                "base": None if base is None else base.to_state()}

    def merge_states(self, states: list[dict]) -> dict:
        """One state from those of every (rank, worker) stream of a run, for any grid.

        The merged state names what all streams handed out by shard and sample; loaded
        into the datasets of a run with any number of ranks and DataLoader workers,
        every stream takes its share of what is left of the epoch (rank equalisation
        as for a whole epoch, over the samples left), so the interrupted and the
        resumed parts together are the epoch: none lost, none repeated.
        :class:`~pyg_atompack.StatefulLoader` merges by itself when given every rank's
        loader state.

        Args:
            states (list[dict]): :meth:`state_dict` of every stream of the saved run.

        Returns:
            dict: A state for :meth:`load_state_dict`.
        """
        for state in states:
            self._check_state(state)
        epoch = int(states[0]["epoch"]) if states else self.epoch
        merged = merge_stream_states(states, lambda slot, before: plan_units(
            self._plan(slot, epoch, before), self.shards))
        return {**merged, "seed": self.seed, "shuffle": self.shuffle,
                "block_bytes": states[0].get("block_bytes")}

    def _check_state(self, state: dict) -> None:
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise ValueError("state_dict was saved with a different seed or shuffle setting")
        blocks = self.options.block_bytes if self.blocks is not None else None
        if state.get("block_bytes", blocks) != blocks:
            raise ValueError("state_dict was saved with different record blocks "
                             f"(block_bytes {state.get('block_bytes')}, now {blocks})")

    def load_state_dict(self, state: dict) -> None:
        """Resume the next iteration at the first unread shard and sample of ``state``.

        Also sets the epoch to the saved one.

        Args:
            state (dict): Output of :meth:`state_dict` (this stream's) or of
                :meth:`merge_states` (every stream's), from a dataset with the same
                source, seed and shuffle settings.
        """
        self._check_state(state)
        if self.device_feed is not None:
            self.device_feed.reset()
        if state.get("merged"):
            self._resume = None
            self._base = EpochConsumed.from_state(state["consumed"])
            self.epoch = int(state["epoch"])
            return
        self._resume = StreamProgress.from_state(state)
        self.epoch = self._resume.epoch
        base = state.get("base")
        self._base = None if base is None else EpochConsumed.from_state(base)

    def _start_progress(self, slot: StreamSlot, plan: StreamPlan | BlockPlan) -> StreamProgress:
        resume, self._resume = self._resume, None
        if resume is None or resume.epoch != self.epoch:
            # after an elastic resume, what other streams handed out of this stream's
            # shards counts as handed out
            return StreamProgress(self.epoch, slot,
                                  partial={p: set(s) for p, s in plan.handed.items()})
        if resume.slot != slot:
            raise ValueError(f"state_dict belongs to stream {resume.slot}, not {slot}: "
                             "to resume on another grid of ranks or workers, load the "
                             "merge_states() of every stream's state")
        resume.finished = False
        return resume

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[BaseData]:
        if use_child_process(self.options.retrieval, self.prefetch, get_worker_info() is not None):
            return iterate_in_child(self)  # the loop below, in a child process
        return self._iterate_here()

    def _iterate_here(self) -> Iterator[BaseData]:
        slot = self.slot()
        if get_worker_info() is not None:
            if self.device_feed is not None:
                raise ValueError("ShardStreamDataset(device=...) hands items out on a device "
                                 "in the main process; behind DataLoader workers pass "
                                 "device= to the loader (pyg_atompack.StatefulLoader)")
            install_handoff()  # batches leave this worker as one buffer each
        plan = self.plan(slot)
        progress = self._start_progress(slot, plan)
        recorder = TraceRecorder(slot.rank, slot.worker)
        if get_worker_info() is None:  # a worker cannot see the main process's steps
            recorder.meter = StepWaitMeter("auto")
        self._recorder, self._progress = recorder, progress
        jobs = [(position, shard) for position, shard in enumerate(plan.shards)
                if not progress.is_complete(position)]
        quota = None if plan.sample_quota is None else plan.sample_quota - progress.samples_emitted
        if quota is not None and quota <= 0:
            jobs = []
        # downloads start here, not at the first next(): a DataLoader worker calls
        # iter() when it starts and next() only once the main process has started every
        # worker and sent the first request (40-60 ms later with 2 workers, measured)
        prefetcher = start_prefetcher(self, plan, slot, jobs, recorder)
        samples = hand_out(self, plan, slot, progress, recorder, prefetcher, quota)
        # an iterator dropped before its first next() never runs its finally clause
        weakref.finalize(samples, prefetcher.close)
        if self.device_feed is not None:
            return self.device_feed.wrap(samples, snapshot=self._state)
        return samples

    # ----------------------------------------------------------------- traces
    def _snapshots(self) -> list[dict]:
        snapshots = []
        for path in sorted(self.trace_dir.glob(f"epoch{self.epoch:06d}-rank*-worker*.json")):
            try:
                snapshots.append(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError):  # a worker may be mid-write
                continue
        if not snapshots and self._recorder is not None:
            snapshots.append(self._recorder.to_dict())
        return snapshots

    @property
    def trace(self) -> list[dict]:
        """Per-shard trace records of the latest iteration (all DataLoader workers merged).

        Each record has ``shard_index, identifier, download_start_s, download_finish_s,
        deserialize_finish_s, consume_start_s, consume_finish_s, bytes, structures`` plus
        ``rank``, ``worker`` and ``status``; times in seconds from the iteration start.
        """
        return merge_traces(self._snapshots())["records"]

    def stats(self) -> dict:
        """Summary of the latest iteration (see :func:`pyg_atompack.stream.trace.summarize`).

        ``wait_share`` is the share of the consumer's steps spent waiting for data. A
        step runs from the consumer asking for a sample or batch (``next()``) to its
        asking for the next one; its wait is the time from asking to receiving, the
        rest is the consumer's compute; ``wait_share = step_wait_s / step_s``, summed
        over the steps (:class:`~pyg_atompack.stream.trace.StepWaitMeter`). Timed with
        CUDA events when CUDA is initialised in the consuming process when iteration
        starts (the model runs on a GPU), where it is the share of GPU time spent idle
        for lack of data; on the wall clock otherwise (``wait_clock`` says which).
        For another clock, wrap the loop in your own
        :class:`~pyg_atompack.stream.trace.StepWaitMeter`. It
        includes every cost of handing an item out (waiting for a shard, building
        samples and batches); ``wait_s`` counts only the time blocked on shards. Behind
        DataLoader worker processes the dataset does not see the consumer's steps
        (``wait_share`` is :obj:`None`): wrap the loader instead,
        ``for batch in meter.wrap(loader)`` with a ``StepWaitMeter``.

        Returns:
            A JSON-serialisable dict with ``total_s, io_s, deserialize_s, consume_s,
            overlap_s, wait_s, peak_live_shards, bytes, structures, shards, skipped``,
            the consumer's ``steps, step_wait_s, step_s, wait_share, wait_clock``,
            plus ``epoch``, ``prefetch`` and ``concurrency`` (as given: :obj:`None` when
            tuned), and ``autotune`` (with ``memory_budget`` or ``concurrency=None``: the
            budget, the settings chosen and every decision with its reason; one per
            DataLoader worker; :obj:`None` when nothing is tuned).
        """
        snapshots = self._snapshots()
        summary = summarize(merge_traces(snapshots))
        tuned = [s["autotune"] for s in snapshots if s.get("autotune")]
        return {**summary, "epoch": self.epoch, "prefetch": self.prefetch,
                "concurrency": self.concurrency,
                "autotune": (tuned[0] if len(tuned) == 1 else tuned) or None}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.source!r}, shards={len(self.shards)}, "
                f"prefetch={self.prefetch}, concurrency={self.concurrency}, "
                f"shuffle={self.shuffle}, batch_size={self.batch_size})")
