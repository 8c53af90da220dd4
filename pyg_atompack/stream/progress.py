"""Which samples of an epoch one stream has handed out, for ``state_dict`` / resume.

:class:`StreamProgress` is one stream's position, by position in its own plan (exact
resume on the same grid of ranks and DataLoader workers). :class:`EpochConsumed` is
what every stream together handed out, by shard and sample, free of the grid:
:func:`merge_stream_states` builds it from the states of every stream of a run, and a
run on any other grid deals what is left (elastic resume).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyg_atompack.stream.splitting import StreamSlot

STATE_VERSION = 1


@dataclass
class StreamProgress:
    """Emitted samples of one stream in one epoch.

    Positions are indices into the stream's shard list for the epoch (its
    :class:`~pyg_atompack.stream.splitting.StreamPlan`), sample indices are positions in
    the decoded shard. A shard is *complete* once all its samples were handed out (or it
    was skipped); ``shards_done`` counts the complete prefix, so the state stays small.

    Attributes:
        epoch: The epoch.
        slot: The stream.
        shards_done: Leading positions that are complete.
        completed: Complete positions beyond the prefix (shuffle buffers finish out of order).
        partial: Emitted sample indices of started, incomplete positions.
        samples_emitted: Samples handed out this epoch.
        finished: The epoch's iteration ran to its end.
    """

    epoch: int
    slot: StreamSlot
    shards_done: int = 0
    completed: set[int] = field(default_factory=set)
    partial: dict[int, set[int]] = field(default_factory=dict)
    samples_emitted: int = 0
    finished: bool = False

    def is_complete(self, position: int) -> bool:
        """Whether every sample of ``position`` was handed out."""
        return position < self.shards_done or position in self.completed

    def emitted_in(self, position: int) -> set[int]:
        """Sample indices of ``position`` already handed out."""
        return self.partial.get(position, set())

    def mark_sample(self, position: int, sample: int) -> None:
        """Record that sample ``sample`` of ``position`` was handed out."""
        self.partial.setdefault(position, set()).add(sample)
        self.samples_emitted += 1

    def mark_complete(self, position: int) -> None:
        """Record that ``position`` has no samples left."""
        self.partial.pop(position, None)
        self.completed.add(position)
        while self.shards_done in self.completed:
            self.completed.discard(self.shards_done)
            self.shards_done += 1

    def to_state(self) -> dict:
        """JSON-serialisable state."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "rank": self.slot.rank,
            "world_size": self.slot.world_size,
            "worker": self.slot.worker,
            "num_workers": self.slot.num_workers,
            "shards_done": self.shards_done,
            "completed": sorted(self.completed),
            "partial": {str(p): sorted(s) for p, s in sorted(self.partial.items())},
            "samples_emitted": self.samples_emitted,
            "finished": self.finished,
        }

    @classmethod
    def from_state(cls, state: dict) -> StreamProgress:
        """Rebuild from :meth:`to_state` output, validating it."""
        try:
            if state["version"] != STATE_VERSION:
                raise ValueError(f"unsupported state version {state['version']!r}")
            slot = StreamSlot(int(state["rank"]), int(state["world_size"]),
                              int(state["worker"]), int(state["num_workers"]))
            return cls(
                epoch=int(state["epoch"]),
                slot=slot,
                shards_done=int(state["shards_done"]),
                completed={int(p) for p in state["completed"]},
                partial={int(p): {int(i) for i in s} for p, s in state["partial"].items()},
                samples_emitted=int(state["samples_emitted"]),
                finished=bool(state["finished"]),
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a ShardStreamDataset state_dict: {error!r}") from error


def _merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(runs):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        elif b > a:
            merged.append((a, b))
    return merged


def _runs_of(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1]:
            runs[-1] = (runs[-1][0], i + 1)
        elif not runs or i > runs[-1][1]:
            runs.append((i, i + 1))
    return runs


#: A stream's plan as :meth:`EpochConsumed.add_progress` takes it.
PlanUnits = tuple[list[tuple[int, int, "int | None"]], bool, Mapping[int, frozenset[int]]]


@dataclass
class EpochConsumed:
    """What every stream of an epoch together handed out, in a form free of the grid.

    Streams number their shards by position in their own plan; this names samples by
    shard (its index in the source listing) and sample (its index in the shard, a
    record number for record blocks), so the rest of the epoch can be dealt over any
    number of ranks and DataLoader workers (elastic resume).

    Attributes:
        epoch: The epoch.
        done: Shards with nothing left (whole-shard mode; sizes may be unknown).
        runs: Per shard, the sorted, disjoint ``[a, b)`` runs of samples handed out.
    """

    epoch: int
    done: set[int] = field(default_factory=set)
    runs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    def add(self, shard: int, runs: list[tuple[int, int]]) -> None:
        """Record that the samples in ``runs`` of ``shard`` were handed out."""
        if runs:
            self.runs[shard] = _merge_runs(self.runs.get(shard, []) + runs)

    def count(self, shard: int, first: int = 0, stop: int | None = None) -> int:
        """Samples of ``shard`` in ``[first, stop)`` handed out."""
        end = float("inf") if stop is None else stop
        return sum(max(0, min(b, end) - max(a, first)) for a, b in self.runs.get(shard, []))

    def taken(self, shard: int, first: int = 0, stop: int | None = None) -> set[int]:
        """Samples of ``shard`` in ``[first, stop)`` handed out."""
        end = float("inf") if stop is None else stop
        return {i for a, b in self.runs.get(shard, [])
                for i in range(max(a, first), int(min(b, end)))}

    def add_progress(self, progress: StreamProgress, units: PlanUnits) -> None:
        """Add what one stream handed out itself.

        Args:
            progress (StreamProgress): The stream's progress.
            units (PlanUnits): The stream's plan: per position ``(shard, first, samples)``
                (``first``: the shard's sample number of the unit's index 0, a record
                block's first record, 0 for a whole shard; ``samples``: :obj:`None` for
                a shard of unknown size), whether units are whole shards, and the samples
                of each position the stream was to skip (``handed``).
        """
        positions, whole, handed = units
        # a stream whose iteration ran to its end has nothing left (its surplus, cut by
        # rank equalisation, was dropped for the epoch)
        complete = (range(len(positions)) if progress.finished
                    else set(range(progress.shards_done)) | progress.completed)
        for position in complete:
            shard, first, samples = positions[position]
            skip = handed.get(position, frozenset())
            if whole and not skip:
                self.done.add(shard)
            elif not skip:
                self.add(shard, [(first, first + samples)])
            else:  # a shard shared with other streams, or partly handed out before
                self.add(shard, _runs_of([first + i for i in range(samples) if i not in skip]))
        for position, indices in progress.partial.items():
            shard, first, _ = positions[position]
            skip = handed.get(position, frozenset())
            self.add(shard, _runs_of([first + i for i in indices if i not in skip]))

    def to_state(self) -> dict:
        """JSON-serialisable state."""
        return {"epoch": self.epoch, "done": sorted(self.done),
                "runs": {str(s): [list(r) for r in runs] for s, runs in sorted(self.runs.items())}}

    @classmethod
    def from_state(cls, state: dict) -> EpochConsumed:
        """Rebuild from :meth:`to_state` output."""
        try:
            return cls(int(state["epoch"]), {int(s) for s in state["done"]},
                       {int(s): [(int(a), int(b)) for a, b in runs]
                        for s, runs in state["runs"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"not a ShardStreamDataset state_dict: {error!r}") from error




def plan_units(plan: Any, shards: Sequence[Any]) -> PlanUnits:
    """A stream's plan (``StreamPlan`` or ``BlockPlan``) as :meth:`EpochConsumed.add_progress`
    takes it; ``shards`` is the source's listing (their ``records``)."""
    blocks = getattr(plan, "blocks", None)
    if blocks is not None:
        return [(b.shard, b.first, b.records) for b in blocks], False, plan.handed
    return [(s, 0, shards[s].records) for s in plan.shards], True, plan.handed


def merge_stream_states(states: list[dict],
                        plan_units: Callable[[StreamSlot, EpochConsumed | None], PlanUnits]
                        ) -> dict:
    """One grid-free state from the states of every stream of a run (elastic resume).

    Args:
        states (list[dict]): ``state_dict()`` of every (rank, worker) stream, each once.
        plan_units (Callable[[StreamSlot, EpochConsumed | None], PlanUnits]): The units of
            a stream's plan for the states' epoch, given what was handed out before it.

    Returns:
        dict: A state every stream of any grid can load: the epoch and
        :class:`EpochConsumed`.

    Raises:
        ValueError: If the states are of different epochs or runs, or a stream's is
            missing or given twice.
    """
    progresses = [StreamProgress.from_state(state) for state in states]
    if not progresses:
        raise ValueError("merge_states needs the state of every stream, got none")
    first = progresses[0]
    grid = (first.slot.world_size, first.slot.num_workers)
    bases = {repr(state.get("base")) for state in states}
    if any(p.epoch != first.epoch for p in progresses) or len(bases) > 1:
        raise ValueError("merge_states: the states belong to different epochs or runs")
    if any((p.slot.world_size, p.slot.num_workers) != grid for p in progresses):
        raise ValueError("merge_states: the states were saved on different grids of ranks "
                         "and workers")
    slots = [p.slot for p in progresses]
    expected = {StreamSlot(r, grid[0], w, grid[1]) for r in range(grid[0]) for w in range(grid[1])}
    missing = sorted(expected - set(slots), key=lambda s: s.index)
    if missing or len(set(slots)) != len(slots):
        which = ", ".join(f"rank {s.rank} worker {s.worker}" for s in missing) or "duplicates"
        raise ValueError(f"merge_states needs the state of every stream of the saved run "
                         f"({grid[0]} ranks x {grid[1]} workers), each once: {which}; pass "
                         "every rank's loader state")
    base = states[0].get("base")
    before = None if base is None else EpochConsumed.from_state(base)
    consumed = EpochConsumed(first.epoch) if before is None else EpochConsumed.from_state(base)
    for progress in progresses:
        consumed.add_progress(progress, plan_units(progress.slot, before))
    return {"version": STATE_VERSION, "merged": True, "epoch": first.epoch,
            "consumed": consumed.to_state(),
            "finished": all(p.finished for p in progresses)}
