"""Interrupted and resumed training loops, run by ``test_resume.py`` in fresh processes.

``save`` runs every case twice with freshly built loaders and the same seed: once
uninterrupted for two epochs, once stopped after ``STOP_AFTER`` batches of epoch 0,
pickling ``loader.state_dict()``. ``load`` (a new process) builds each loader again,
loads the state and finishes epoch 0, then runs epoch 1. Every sample id handed out
goes to ``OUT/<case>.<phase>.json``.

Cases: ``AtompackLoader(shuffle=True)`` over an ``.atp`` file, ``StatefulLoader`` over
``ShardStreamDataset`` (samples collated the PyG way) and a plain torchdata
``StatefulDataLoader`` over a ``ShardStreamDataset`` that batches itself, each with 0
and 2 DataLoader workers.

With ``--distributed`` the script runs under ``torchrun``: every rank joins a gloo
group (the sampler and the stream split themselves between ranks) and writes
``<case>.<phase>.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from pyg_atompack import AtompackDataset, AtompackLoader, ShardStreamDataset  # noqa: E402
from pyg_atompack.pyg.resume import StatefulLoader  # noqa: E402
from pyg_atompack.stream import LocalSource  # noqa: E402

SEED = 7
STOP_AFTER = 3
EPOCHS = 2
CASES = [f"{kind}-w{workers}" for kind in ("atp", "stream", "stream_plain")
         for workers in (0, 2)]


def build(case: str, atp_path: str, shards: str):
    """The loader of ``case``, and a function that sets its epoch."""
    kind, workers = case.rsplit("-w", 1)
    workers = int(workers)
    if kind == "atp":
        loader = AtompackLoader(AtompackDataset(atp_path), batch_size=3, shuffle=True,
                                seed=SEED, num_workers=workers)
        return loader, loader.set_epoch
    if kind == "stream":
        dataset = ShardStreamDataset(LocalSource(shards), shuffle=True, seed=SEED)
        loader = StatefulLoader(dataset, batch_size=3, num_workers=workers)
        return loader, loader.set_epoch
    dataset = ShardStreamDataset(LocalSource(shards), shuffle=True, seed=SEED, batch_size=3)
    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers), dataset.set_epoch


def ids(batch) -> list[int]:
    return [int(i) for i in batch.sample_id.view(-1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("save", "load"))
    parser.add_argument("--atp", required=True)
    parser.add_argument("--shards", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--distributed", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    suffix = ""
    if args.distributed:
        dist.init_process_group("gloo")
        suffix = f".rank{dist.get_rank()}"
    for case in args.cases.split(","):
        state_path = out / f"{case}{suffix}.state"
        if args.phase == "save":
            loader, set_epoch = build(case, args.atp, args.shards)
            full = []
            for epoch in range(EPOCHS):
                set_epoch(epoch)
                full.append([i for batch in loader for i in ids(batch)])
            loader, set_epoch = build(case, args.atp, args.shards)
            set_epoch(0)
            head = []
            for step, batch in enumerate(loader):
                head += ids(batch)
                if step + 1 == STOP_AFTER:
                    break
            state_path.write_bytes(pickle.dumps(loader.state_dict()))
            report = {"full": full, "head": head}
        else:
            loader, set_epoch = build(case, args.atp, args.shards)
            loader.load_state_dict(pickle.loads(state_path.read_bytes()))
            epochs = []
            for epoch in range(EPOCHS):
                set_epoch(epoch)
                epochs.append([i for batch in loader for i in ids(batch)])
            report = {"tail": epochs[0], "next_epoch": epochs[1]}
        (out / f"{case}.{args.phase}{suffix}.json").write_text(json.dumps(report),
                                                                 encoding="utf-8")
    if args.distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
