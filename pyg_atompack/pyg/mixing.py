"""Several datasets drawn by weight as one: :class:`MixedDataset`.

Foundation models train on several datasets at once (OMat, OMol, MPtrj, ...), each
drawn at its own rate. :class:`MixedDataset` takes map-style datasets (``len`` and
``[i]``: :class:`~pyg_atompack.AtompackDataset`, local or remote) and iterable ones with
``set_epoch`` / ``state_dict`` / ``load_state_dict`` / ``merge_states``
(:class:`~pyg_atompack.ShardStreamDataset`) through those few methods only, so it
lives below both the dataset and the streaming layer.

*Draws.* Each (rank, DataLoader worker) stream draws its share of
``samples_per_epoch`` one sample at a time: the source is picked with probability
``weight / sum(weights)`` by a generator seeded with ``(seed, epoch, rank, worker)``,
and the sample is the source's next one in the stream's own pass over its share of the
source (a map-style source: a permutation seeded by ``(seed, source, pass)`` dealt
round-robin over the streams; an iterable one splits itself). The order is therefore
the same in every run with the same seed and grid.

*A source that runs out* (decided: **cycle**): when a stream has drawn every sample of
its share of a source's pass, that source starts its next pass (a new permutation),
so the weights hold over the whole epoch and every epoch has exactly
``samples_per_epoch`` samples. Stopping the epoch at the first exhausted source would
leave most of the large sources unread; re-weighting the rest would drift the mix
toward the large sources at the end of every epoch and make ranks end at different
steps. With the default weights (proportional to the sources' sizes) and
``samples_per_epoch`` (their total), an epoch reads each source about once.

*Equal steps.* Every rank draws ``samples_per_epoch // world_size`` samples, split
between its workers by the same rule on every rank, so ranks take the same number of
steps (the ``samples_per_epoch % world_size`` rest is not drawn).

*Resume.* :meth:`MixedDataset.state_dict` (taken in each worker by torchdata's
``StatefulDataLoader`` or :class:`~pyg_atompack.StatefulLoader`) holds the stream's
draws and each source's pass and position; loaded on the same grid, the epoch goes on
exactly. On another grid (:meth:`MixedDataset.merge_states` of every stream's state,
which ``StatefulLoader`` does when given every rank's state) each source's passes in
flight are merged by what was drawn from them, and the new streams draw the rest of
the epoch's samples from what each pass has left (none of a pass drawn twice, none
skipped); the sources are then picked by a generator of the new grid.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pyg_atompack.pyg.ranks import resolve_rank

__all__ = ["MixedDataset"]

MIXED_STATE_FORMAT = "pyg_atompack-mixed/1"
MAP_STATE_FORMAT = "pyg_atompack-mixed-map/1"
#: A source's pass ``p`` in epoch ``e`` is the source's epoch ``e * PASS_STRIDE + p``.
PASS_STRIDE = 1 << 20
_CHOICE_CHUNK = 1 << 16


def _runs(mask: np.ndarray) -> list[list[int]]:
    """``[a, b)`` runs of the True entries of a boolean mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.view(np.int8), [0]])))
    return [[int(a), int(b)] for a, b in zip(edges[::2], edges[1::2])]


def _mask(runs: list[list[int]] | None, length: int) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    for a, b in runs or ():
        mask[a:b] = True
    return mask


def _is_map_style(source: Any) -> bool:
    return not isinstance(source, IterableDataset)


class _MapCursor:
    """One stream's passes over a map-style source.

    Pass ``p`` is a permutation of the source (seeded by ``(seed, source, epoch,
    p)``); the positions of it not handed out before an elastic resume (``base``)
    are dealt round-robin over the ``count`` streams, and this stream takes its
    share in order.
    """

    def __init__(self, source: Any, number: int, seed: int, shuffle: bool, epoch: int,
                 stream: int, count: int) -> None:
        self.source, self.number, self.seed, self.shuffle = source, number, seed, shuffle
        self.epoch, self.stream, self.count = epoch, stream, count
        self.length = len(source)
        self.bases: dict[int, list[list[int]]] = {}
        self.pass_number, self.taken = 0, 0
        self._share: list[int] | None = None

    def order(self, pass_number: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.length)
        rng = np.random.default_rng([self.seed, self.number, self.epoch, pass_number, 0x4D50])
        return rng.permutation(self.length)

    def share(self, pass_number: int, stream: int, count: int,
              base: list[list[int]] | None) -> np.ndarray:
        """Positions (in the pass's order) of ``stream``'s share."""
        left = np.flatnonzero(~_mask(base, self.length))
        return left[stream::count]

    def _indices(self) -> list[int]:
        # this stream's dataset indices of the current pass, as Python ints
        share = self.share(self.pass_number, self.stream, self.count,
                           self.bases.get(self.pass_number))
        return self.order(self.pass_number)[share].tolist()

    def next(self) -> Any:
        if self._share is None:
            self._share = self._indices()
        while self.taken >= len(self._share):  # this share is used up: the next pass
            if self.length == 0:
                raise ValueError(f"mixed source {self.number} is empty")
            self.pass_number, self.taken = self.pass_number + 1, 0
            self._share = self._indices()
        index = self._share[self.taken]
        self.taken += 1
        return self.source[index]

    def state(self) -> dict[str, Any]:
        return {"format": MAP_STATE_FORMAT, "pass": self.pass_number, "taken": self.taken,
                "bases": {str(p): runs for p, runs in self.bases.items()}}

    def load(self, state: dict[str, Any]) -> None:
        self.pass_number, self.taken = int(state["pass"]), int(state["taken"])
        self.bases = {int(p): runs for p, runs in state["bases"].items()}
        self._share = None


class _IterCursor:
    """One stream's passes over an iterable source (which splits itself)."""

    def __init__(self, source: Any, epoch: int) -> None:
        self.source, self.epoch = source, epoch
        self.bases: dict[int, dict] = {}  # pass -> merged state of an elastic resume
        self.pass_number = 0
        self.resume: dict | None = None
        self._iterator: Iterator[Any] | None = None
        self.state_of_pass: dict | None = None

    def _open(self) -> None:
        self.source.set_epoch(self.epoch * PASS_STRIDE + self.pass_number)
        state = self.resume if self.resume is not None else self.bases.get(self.pass_number)
        self.resume = None
        if state is not None:
            self.source.load_state_dict(state)
        self._iterator = iter(self.source)

    def next(self) -> Any:
        if self._iterator is None:
            self._open()
        for _ in range(2):
            sample = next(self._iterator, None)
            if sample is not None:
                return sample
            self.close()
            self.pass_number += 1
            self._open()
        raise ValueError(f"mixed source {self.source!r} gives this stream no samples in a "
                         "whole pass (fewer shards than ranks x workers?)")

    def close(self) -> None:
        iterator, self._iterator = self._iterator, None
        if iterator is not None and hasattr(iterator, "close"):
            iterator.close()

    def state(self) -> dict[str, Any]:
        # None: nothing of this pass drawn yet (and no resume pending)
        saved = self.source.state_dict() if self._iterator is not None else self.resume
        return {"pass": self.pass_number, "state": saved,
                "bases": {str(p): s for p, s in self.bases.items()}}

    def load(self, state: dict[str, Any]) -> None:
        self.pass_number = int(state["pass"])
        self.resume = state["state"]
        self.bases = {int(p): s for p, s in state["bases"].items()}


def _remove_if_owner(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


class MixedDataset(IterableDataset):
    r"""Several datasets as one, each sample drawn from a source picked by weight.

    See :mod:`pyg_atompack.pyg.mixing` for the draws, what happens when a source runs
    out (its next pass starts: **cycle**), equal steps per rank and resume.

    .. code-block:: python

        mixed = MixedDataset([AtompackDataset("omat.atp"),
                              ShardStreamDataset("hf://datasets/me/mptrj")],
                             weights=[0.7, 0.3], seed=0, source_key="source")
        loader = StatefulLoader(mixed, batch_size=32, num_workers=2)

    Args:
        sources (Sequence): Map-style datasets (``len`` and ``[i]``) and iterable
            datasets with ``set_epoch``, ``state_dict``, ``load_state_dict`` and
            ``merge_states`` (:class:`~pyg_atompack.ShardStreamDataset` yielding single
            samples); each iterable source splits itself between ranks and workers.
        weights (Sequence[float], optional): Relative rate of each source.
            (default: :obj:`None`, proportional to the sources' sizes)
        samples_per_epoch (int, optional): Samples of one epoch over all ranks.
            (default: :obj:`None`, the sources' total size)
        seed (int, optional): Seed of the draws and of the map-style sources' orders.
            (default: :obj:`0`)
        shuffle (bool, optional): Permute map-style sources every pass (iterable ones
            shuffle as they were built). (default: :obj:`True`)
        source_key (str, optional): Set this attribute of every sample to the index of
            its source (e.g. for a head per dataset), a ``[1]`` tensor. Avoid names
            containing ``"index"``: PyG's batching offsets those by the node count.
            (default: :obj:`None`)
        rank (int, optional): This process's rank. (default: from
            :mod:`torch.distributed` when initialised, else :obj:`0`)
        world_size (int, optional): Number of ranks. (default: as for ``rank``)
    """

    def __init__(self, sources: Sequence[Any], weights: Sequence[float] | None = None, *,
                 samples_per_epoch: int | None = None, seed: int = 0, shuffle: bool = True,
                 source_key: str | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        if not sources:
            raise ValueError("MixedDataset needs at least one source")
        if source_key is not None and ("index" in source_key or source_key == "face"):
            raise ValueError(f"source_key {source_key!r}: PyG's batching offsets attributes "
                             "named '*index*' or 'face' by the node count; pick another name")
        if (rank is None) != (world_size is None):
            raise ValueError("pass rank and world_size together")
        self.sources = list(sources)
        for number, source in enumerate(self.sources):
            if not _is_map_style(source):
                missing = [m for m in ("set_epoch", "state_dict", "load_state_dict",
                                       "merge_states") if not hasattr(source, m)]
                if missing:
                    raise TypeError(f"mixed source {number} ({type(source).__name__}) is "
                                    f"iterable but has no {', '.join(missing)}")
                if getattr(source, "batch_size", None) is not None:
                    raise ValueError(f"mixed source {number} yields batches "
                                     "(batch_size is set): mix single samples")
        self.sizes = [self._size(number, source) for number, source in enumerate(self.sources)]
        if weights is None:
            if any(size is None for size in self.sizes):
                raise ValueError("pass weights: a source's size is unknown")
            weights = self.sizes
        if len(weights) != len(self.sources):
            raise ValueError(f"{len(weights)} weights for {len(self.sources)} sources")
        weights = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise ValueError(f"weights must be non-negative with a positive sum, got "
                             f"{weights.tolist()}")
        self.weights = weights / weights.sum()
        if samples_per_epoch is None:
            if any(size is None for size in self.sizes):
                raise ValueError("pass samples_per_epoch: a source's size is unknown")
            samples_per_epoch = int(sum(self.sizes))
        if samples_per_epoch < 1:
            raise ValueError(f"samples_per_epoch must be positive, got {samples_per_epoch}")
        self.samples_per_epoch = int(samples_per_epoch)
        self.seed, self.shuffle, self.source_key = int(seed), bool(shuffle), source_key
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._resume: dict | None = None
        self._cursors: list[Any] | None = None
        self._counts = [0] * len(self.sources)
        self._drawn = 0
        self._slot: tuple[int, int, int, int] | None = None
        self.stats_dir = Path(tempfile.mkdtemp(prefix="pyg_atompack-mixed-"))
        weakref.finalize(self, _remove_if_owner, str(self.stats_dir), os.getpid())

    @staticmethod
    def _size(number: int, source: Any) -> int | None:
        if _is_map_style(source):
            return len(source)
        shards = getattr(source, "shards", None)
        records = [getattr(s, "records", None) for s in shards or ()]
        return None if not records or None in records else int(sum(records))

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch that seeds the draws (call before each epoch, on every rank).

        Args:
            epoch (int): The epoch.
        """
        self.epoch = int(epoch)

    def slot(self) -> tuple[int, int, int, int]:
        """``(rank, world_size, worker, num_workers)`` of the calling process."""
        rank, world = resolve_rank(self.rank, self.world_size)
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank, world, worker, workers

    # ----------------------------------------------------------------- iteration
    def _quota(self, slot: tuple[int, int, int, int], left: int) -> int:
        rank, world, worker, workers = slot
        per_rank = left // world
        return per_rank * (worker + 1) // workers - per_rank * worker // workers

    def _choices(self, slot: tuple[int, int, int, int], generation: int,
                 skip: int) -> Iterator[int]:
        rank, _, worker, _ = slot
        rng = np.random.default_rng([self.seed, self.epoch, generation, rank, worker, 0x313])
        position = 0
        while True:
            chunk = rng.choice(len(self.sources), size=_CHOICE_CHUNK, p=self.weights)
            if position + _CHOICE_CHUNK > skip:
                yield from chunk[max(0, skip - position):].tolist()
            position += _CHOICE_CHUNK

    def __iter__(self) -> Iterator[Any]:
        slot = self.slot()
        rank, world, worker, workers = slot
        stream, count = rank * workers + worker, world * workers
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["epoch"]) != self.epoch:
            resume = None
        cursors = [_MapCursor(s, n, self.seed, self.shuffle, self.epoch, stream, count)
                   if _is_map_style(s) else _IterCursor(s, self.epoch)
                   for n, s in enumerate(self.sources)]
        counts, drawn, generation = [0] * len(self.sources), 0, 0
        left = self.samples_per_epoch
        if resume is not None and resume.get("merged"):
            generation, left = int(resume["generation"]), int(resume["left"])
            counts = [0] * len(self.sources)
            for cursor, saved in zip(cursors, resume["sources"]):
                cursor.load(saved)
        elif resume is not None:
            if tuple(resume["slot"]) != slot:
                raise ValueError(f"MixedDataset state_dict belongs to stream "
                                 f"{tuple(resume['slot'])}, not {slot}: to resume on another "
                                 "grid, load the merge_states() of every stream's state")
            generation, left = int(resume["generation"]), int(resume["left"])
            counts, drawn = list(resume["counts"]), int(resume["drawn"])
            for cursor, saved in zip(cursors, resume["sources"]):
                cursor.load(saved)
        self._cursors, self._slot = cursors, slot
        self._counts, self._drawn = counts, drawn
        self._generation, self._left = generation, left
        return self._draw(slot, cursors, self._quota(slot, left), generation, drawn)

    def _draw(self, slot: tuple[int, int, int, int], cursors: list[Any], quota: int,
              generation: int, drawn: int) -> Iterator[Any]:
        choices = self._choices(slot, generation, drawn)
        take = [cursor.next for cursor in cursors]
        counts, key = self._counts, self.source_key
        try:
            while drawn < quota:
                number = next(choices)
                sample = take[number]()
                if key is not None:
                    sample[key] = torch.tensor([number])
                counts[number] += 1
                drawn += 1
                self._drawn = drawn  # before the yield: state_dict() may be taken there
                yield sample
        finally:
            for cursor in cursors:
                if isinstance(cursor, _IterCursor):
                    cursor.close()
            self._write_stats(slot)

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """This stream's draws and each source's pass and position (JSON-serialisable).

        Returns:
            dict: The state, for :meth:`load_state_dict` (same grid) or
            :meth:`merge_states` (any grid).
        """
        slot = self._slot or self.slot()
        state = {"format": MIXED_STATE_FORMAT, "epoch": self.epoch, "slot": list(slot),
                 "world_size": slot[1], "seed": self.seed, "generation": 0,
                 "left": self.samples_per_epoch, "drawn": 0,
                 "counts": [0] * len(self.sources), "sources": None}
        if self._cursors is None:  # not iterated yet
            return state
        return {**state, "generation": self._generation, "left": self._left,
                "drawn": self._drawn, "counts": list(self._counts),
                "sources": [cursor.state() for cursor in self._cursors]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the next iteration where ``state`` stopped (and set its epoch).

        Args:
            state (dict): :meth:`state_dict` of this stream, or :meth:`merge_states` of
                every stream of a run on another grid.

        Raises:
            ValueError: If the state is not a ``MixedDataset`` state of this seed.
        """
        if not isinstance(state, dict) or state.get("format") != MIXED_STATE_FORMAT:
            raise ValueError("not a MixedDataset state_dict")
        if state["seed"] != self.seed:
            raise ValueError(f"MixedDataset state_dict has seed={state['seed']}, this "
                             f"dataset {self.seed}")
        self.epoch = int(state["epoch"])
        self._resume = state if state.get("sources") is not None else None

    def merge_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """One state from those of every (rank, worker) stream of a run, for any grid.

        Args:
            states (list[dict]): :meth:`state_dict` of every stream of the saved run.

        Returns:
            dict: A state for :meth:`load_state_dict` on any grid.

        Raises:
            ValueError: If a stream's state is missing or the states disagree.
        """
        for state in states:
            if state.get("format") != MIXED_STATE_FORMAT or state["seed"] != self.seed:
                raise ValueError("merge_states: not MixedDataset states of this seed")
        epochs = {int(s["epoch"]) for s in states}
        generations = {(int(s["generation"]), int(s["left"])) for s in states}
        if len(epochs) != 1 or len(generations) != 1:
            raise ValueError("merge_states: the states belong to different epochs or runs")
        world, workers = states[0]["slot"][1], states[0]["slot"][3]
        slots = sorted(tuple(s["slot"]) for s in states)
        expected = [(r, world, w, workers) for r in range(world) for w in range(workers)]
        if slots != expected:
            raise ValueError(f"merge_states needs the state of every stream of the saved "
                             f"run ({world} ranks x {workers} workers), each once; pass "
                             "every rank's loader state")
        epoch = epochs.pop()
        generation, left = generations.pop()
        started = [s for s in states if s["sources"] is not None]
        merged_sources = []
        for number, source in enumerate(self.sources):
            saved = [(tuple(s["slot"]), s["sources"][number]) for s in started]
            saved += [(tuple(s["slot"]), {"pass": 0, "taken": 0, "state": None, "bases": {}})
                      for s in states if s["sources"] is None]
            if _is_map_style(source):
                merged_sources.append(self._merge_map(number, source, epoch, saved,
                                                      world * workers))
            else:
                merged_sources.append(self._merge_iterable(source, saved))
        drawn = sum(int(s["drawn"]) for s in states)
        return {"format": MIXED_STATE_FORMAT, "merged": True, "epoch": epoch,
                "seed": self.seed, "generation": generation + 1,
                "left": left - drawn, "drawn": 0,
                "counts": [sum(s["counts"][n] for s in states)
                           for n in range(len(self.sources))],
                "sources": merged_sources}

    def _merge_map(self, number: int, source: Any, epoch: int,
                   saved: list[tuple[tuple, dict]], count: int) -> dict[str, Any]:
        length = len(source)
        cursor = _MapCursor(source, number, self.seed, self.shuffle, epoch, 0, count)
        bases = {}
        for _, state in saved:
            for p, runs in state["bases"].items():
                bases[int(p)] = runs
        passes = [int(state["pass"]) for _, state in saved] or [0]
        low, high = min(passes), max(passes)
        result: dict[int, list[list[int]]] = {}
        for p in range(low, high + 1):
            mask = _mask(bases.get(p), length)
            for slot, state in saved:
                stream = slot[0] * slot[3] + slot[2]
                share = cursor.share(p, stream, count, bases.get(p))
                if int(state["pass"]) > p:
                    mask[share] = True
                elif int(state["pass"]) == p:
                    mask[share[:int(state["taken"])]] = True
            result[p] = _runs(mask)
        return {"format": MAP_STATE_FORMAT, "pass": low, "taken": 0,
                "bases": {str(p): runs for p, runs in result.items()}}

    @staticmethod
    def _merge_iterable(source: Any, saved: list[tuple[tuple, dict]]) -> dict[str, Any]:
        passes = [int(state["pass"]) for _, state in saved]
        low, high = min(passes), max(passes)
        bases: dict[int, dict] = {}
        for p in range(low, high + 1):
            # a stream's state in pass p (one that has drawn from it), as the pattern of
            # the states of the streams done with pass p or not yet in it
            template = next((state["state"] for _, state in saved
                             if int(state["pass"]) == p and state["state"] is not None), None)
            if template is None:
                continue  # nothing of pass p drawn: it starts afresh
            per_stream = [state["state"] if int(state["pass"]) == p
                          and state["state"] is not None
                          else _stream_state_like(template, slot, int(state["pass"]) > p)
                          for slot, state in saved]
            bases[p] = source.merge_states(per_stream)
        return {"pass": low, "state": bases.get(low),
                "bases": {str(p): s for p, s in bases.items() if p != low}}

    # ----------------------------------------------------------------- stats
    def _write_stats(self, slot: tuple[int, int, int, int]) -> None:
        if get_worker_info() is None:
            return
        name = f"epoch{self.epoch:06d}-rank{slot[0]}-worker{slot[2]}.json"
        (self.stats_dir / name).write_text(json.dumps(
            {"counts": self._counts, "drawn": self._drawn}), encoding="utf-8")

    def stats(self) -> dict[str, Any]:
        """Samples drawn from each source in the latest iteration (all workers).

        Returns:
            dict: ``epoch``, ``samples`` and ``per_source``: per source its ``name``,
            ``weight`` and ``drawn`` count (DataLoader workers report when their
            iteration ends).
        """
        counts = [0] * len(self.sources)
        files = sorted(self.stats_dir.glob(f"epoch{self.epoch:06d}-rank*-worker*.json"))
        if files:
            for path in files:
                for n, c in enumerate(json.loads(path.read_text(encoding="utf-8"))["counts"]):
                    counts[n] += c
        else:
            counts = list(self._counts)
        return {"epoch": self.epoch, "samples": sum(counts),
                "per_source": [{"name": type(s).__name__, "weight": float(w), "drawn": c}
                               for s, w, c in zip(self.sources, self.weights, counts)]}

    def __repr__(self) -> str:
        weights = ", ".join(f"{w:.3g}" for w in self.weights)
        return (f"{type(self).__name__}({len(self.sources)} sources, weights=[{weights}], "
                f"samples_per_epoch={self.samples_per_epoch})")


def _stream_state_like(template: dict, slot: tuple[int, int, int, int], done: bool) -> dict:
    """A state of stream ``slot`` in ``template``'s pass: all of it or none handed out."""
    rank, world, worker, workers = slot
    return {**template, "rank": rank, "world_size": world, "worker": worker,
            "num_workers": workers, "shards_done": 0, "completed": [], "partial": {},
            "samples_emitted": 0, "finished": done}
