"""Which samples of an epoch one stream has handed out, for ``state_dict`` / resume."""

from __future__ import annotations

from dataclasses import dataclass, field

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
