"""What elastic resume and mixing cost: merging states, planning the rest, drawing samples.

Usage::

    python benchmarks/bench_elastic.py [--shards 10000] [--records 1000] [--repeats 5]

* Streams: a listing of ``--shards`` shards of ``--records`` samples (no data: planning
  needs only the listing), read by 8 ranks x 4 workers; every stream has finished its
  first shards and is half-way through the next one (~40% of the epoch). Timed:
  ``merge_states`` of the 32 states, the merged state's JSON size, and planning one
  stream of the new grid (16 ranks x 2 workers) from it, against planning the same
  stream of a whole epoch.
* Map-style: ``ResumableSampler.load_state_dict`` of a state from another world size and
  its first index, against a fresh sampler's first index (both build the epoch's
  permutation), for ``--shards * --records`` positions.
* Mixing: samples/s drawn by ``MixedDataset`` from three in-memory map-style sources
  (lists of ``Data``) against reading one such list in order: the per-sample cost of
  picking a source and its next sample.

Prints a markdown table (medians of ``--repeats``); ``--output`` writes it too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch_geometric.data import Data

from pyg_atompack import MixedDataset, ShardStreamDataset
from pyg_atompack.pyg.resume import ResumableSampler
from pyg_atompack.stream.progress import StreamProgress
from pyg_atompack.stream.sources import ShardInfo
from pyg_atompack.stream.splitting import StreamSlot


class ListingOnly:
    """A source that lists shards and serves none (planning reads only the listing)."""

    def __init__(self, shards: int, records: int) -> None:
        self.shards = [ShardInfo(f"shard-{i:06d}.pt", size=1 << 20, records=records)
                       for i in range(shards)]

    def list_shards(self) -> list[ShardInfo]:
        return self.shards

    def fetch(self, shard, cancel):  # pragma: no cover - never called
        raise RuntimeError("planning only")


def median_s(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stream_rows(shards: int, records: int, repeats: int) -> list[tuple[str, str]]:
    def dataset(rank: int, world: int) -> ShardStreamDataset:
        return ShardStreamDataset(ListingOnly(shards, records), shuffle=True, seed=0,
                                  rank=rank, world_size=world)

    states = []
    for rank in range(8):
        for worker in range(4):
            slot = StreamSlot(rank, 8, worker, 4)
            plan = dataset(rank, 8).plan(slot)
            done = int(len(plan.shards) * 0.4)
            progress = StreamProgress(0, slot, shards_done=done,
                                      partial={done: set(range(0, records, 2))},
                                      samples_emitted=done * records + records // 2)
            states.append({**progress.to_state(), "seed": 0, "shuffle": True,
                           "block_bytes": None, "base": None})
    merger = dataset(0, 1)
    merge_s = median_s(lambda: merger.merge_states(states), repeats)
    merged = merger.merge_states(states)
    size = len(json.dumps(merged))
    resumed = dataset(3, 16)
    resumed.load_state_dict(merged)
    slot = StreamSlot(3, 16, 1, 2)
    plan_s = median_s(lambda: resumed.plan(slot), repeats)
    whole = dataset(3, 16)
    whole_s = median_s(lambda: whole.plan(slot), repeats)
    return [
        (f"merge_states, 32 streams, {shards:,} shards x {records:,}", f"{merge_s * 1e3:.1f} ms"),
        ("merged state (JSON)", f"{size / 1024:.1f} KiB"),
        ("plan one stream of 16 x 2 from it", f"{plan_s * 1e3:.1f} ms"),
        ("plan one stream of a whole epoch (reference)", f"{whole_s * 1e3:.1f} ms"),
    ]


def sampler_rows(length: int, repeats: int) -> list[tuple[str, str]]:
    saved = ResumableSampler(length, seed=0, rank=0, world_size=8)
    iterator = iter(saved)
    for _ in range(1000):
        next(iterator)
    state = saved.state_dict()

    def resumed() -> None:
        sampler = ResumableSampler(length, seed=0, rank=5, world_size=12)
        sampler.load_state_dict(state)
        next(iter(sampler))

    def fresh() -> None:
        next(iter(ResumableSampler(length, seed=0, rank=5, world_size=12)))

    return [(f"ResumableSampler, {length:,} positions: load (8 -> 12 ranks) + first index",
             f"{median_s(resumed, repeats) * 1e3:.0f} ms"),
            ("fresh sampler's first index (reference)", f"{median_s(fresh, repeats) * 1e3:.0f} ms")]


def mixing_rows(samples: int, repeats: int) -> list[tuple[str, str]]:
    sources = [[Data(pos=torch.zeros(3, 3), z=torch.ones(3, dtype=torch.long))] * size
               for size in (5000, 3000, 2000)]

    def mixed() -> None:
        for _ in MixedDataset(sources, [0.5, 0.3, 0.2], samples_per_epoch=samples, seed=0):
            pass

    def plain() -> None:
        source = sources[0]
        for k in range(samples):
            source[k % len(source)]

    mixed_s, plain_s = median_s(mixed, repeats), median_s(plain, repeats)
    return [(f"MixedDataset, 3 in-memory sources, {samples:,} draws",
             f"{samples / mixed_s:,.0f} samples/s ({mixed_s / samples * 1e6:.1f} us each)"),
            ("one list read in order (reference)",
             f"{samples / plain_s:,.0f} samples/s ({plain_s / samples * 1e6:.2f} us each)")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--records", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = (stream_rows(args.shards, args.records, args.repeats)
            + sampler_rows(args.shards * args.records, args.repeats)
            + mixing_rows(100_000, args.repeats))
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = [f"Elastic resume and mixing ({now} UTC, {platform.machine()}, "
             f"{torch.get_num_threads()} torch thread, torch {torch.__version__}; "
             f"medians of {args.repeats})", "",
             "| what | cost |", "|---|---|"]
    lines += [f"| {what} | {cost} |" for what, cost in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        args.output.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
