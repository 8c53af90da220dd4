"""Interrupted and resumed epochs on another grid, run by ``test_elastic.py`` under torchrun.

``save`` builds each case's loader on this launch's ranks with the case's first worker
count, takes ``STOP_AFTER`` steps of epoch 0 and writes, per rank, the sample ids it
handed out, and rank 0 saves every rank's ``loader.state_dict()`` gathered with
``gather_loader_states``. ``load`` (a later launch, maybe with another
number of ranks) builds the loader with the case's second worker count, loads the saved
states (``AtompackLoader``: the last rank's alone, since any rank's carries the
position; ``ShardStreamDataset``: every rank's, as a list) and finishes epoch 0, then
runs epoch 1. Every rank writes ``<case>.<phase>.rank<r>.json``.

A case is ``<kind>-r<R>w<W>-r<R'>w<W'>``: ``atp`` (``AtompackLoader(shuffle=True)``
over an ``.atp`` file), ``budget`` (the same with ``max_atoms``), ``stream``
(``StatefulLoader`` over ``ShardStreamDataset``) or ``mix`` (``StatefulLoader`` over a
``MixedDataset`` of an ``AtompackDataset`` and a ``ShardStreamDataset``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyg_atompack import AtompackDataset, AtompackLoader, ShardStreamDataset  # noqa: E402
from pyg_atompack.pyg.resume import StatefulLoader, gather_loader_states  # noqa: E402
from pyg_atompack.stream import LocalSource  # noqa: E402

SEED = 11
STOP_AFTER = 3
BATCH_SIZE = 4


def parse(case: str) -> tuple[str, int, int, int, int]:
    """``(kind, ranks, workers, ranks after, workers after)`` of a case name."""
    match = re.fullmatch(r"(\w+)-r(\d)w(\d)-r(\d)w(\d)", case)
    assert match, case
    kind, *numbers = match.groups()
    return (kind, *map(int, numbers))


def build(kind: str, workers: int, atp_path: str, shards: str):
    """The loader of ``kind`` with ``workers`` DataLoader workers."""
    if kind == "atp":
        return AtompackLoader(AtompackDataset(atp_path), batch_size=BATCH_SIZE, shuffle=True,
                              seed=SEED, num_workers=workers)
    if kind == "budget":  # batches of at most 10 atoms (molecules of 2-4)
        return AtompackLoader(AtompackDataset(atp_path), max_atoms=10, shuffle=True,
                              seed=SEED, num_workers=workers)
    dataset = ShardStreamDataset(LocalSource(shards), shuffle=True, seed=SEED)
    if kind == "mix":
        from pyg_atompack.pyg.mixing import MixedDataset

        # one epoch of 40 draws reads about half of each source: no source cycles
        dataset = MixedDataset([AtompackDataset(atp_path), dataset], weights=[1, 1],
                               samples_per_epoch=40, seed=SEED, source_key="source")
    return StatefulLoader(dataset, batch_size=BATCH_SIZE, num_workers=workers)


def ids(batch) -> list[int]:
    """Sample ids; a mix's are ``1000 * source + id``."""
    offset = batch.source.view(-1) * 1000 if "source" in batch else 0
    return [int(i) for i in batch.sample_id.view(-1) + offset]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("save", "load"))
    parser.add_argument("--atp", required=True)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in args.cases.split(","):
        kind, ranks, workers, ranks_after, workers_after = parse(case)
        assert world == (ranks if args.phase == "save" else ranks_after), (case, world)
        if args.phase == "save":
            loader = build(kind, workers, args.atp, args.shards)
            loader.set_epoch(0)
            head = []
            for step, batch in enumerate(loader):
                head += ids(batch)
                if step + 1 == STOP_AFTER:
                    break
            # every rank's state, gathered at the same step; rank 0 saves them
            states = gather_loader_states(loader.state_dict())
            if rank == 0:
                (out / f"{case}.state").write_bytes(pickle.dumps(states))
            report = {"head": head}
        else:
            loader = build(kind, workers_after, args.atp, args.shards)
            states = pickle.loads((out / f"{case}.state").read_bytes())
            assert len(states) == ranks
            loader.load_state_dict(states[-1] if kind in ("atp", "budget") else states)
            epochs, steps = [], []
            for epoch in range(2):
                loader.set_epoch(epoch)
                batches = [ids(batch) for batch in loader]
                epochs.append([i for batch in batches for i in batch])
                steps.append(len(batches))
            report = {"tail": epochs[0], "next_epoch": epochs[1], "steps": steps}
        (out / f"{case}.{args.phase}.rank{rank}.json").write_text(json.dumps(report),
                                                                  encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
