"""The training script ``test_distributed.py`` launches with ``torchrun --nproc_per_node=2``.

Each rank joins a gloo process group, trains a tiny model with
``DistributedDataParallel`` from two data paths and writes every sample id it
consumed, per scenario, run and epoch, to ``OUT/rank{r}.json``:

* ``atp``: ``AtompackDataset`` + ``DistributedSampler`` through ``AtompackLoader``
  (2 workers);
* ``stream`` (and ``stream_uneven``): ``ShardStreamDataset`` over HTTP with 2
  DataLoader workers per rank; a transform tags every sample with the worker
  that produced it.

Every scenario runs twice ("runs" 0 and 1) with freshly built datasets,
samplers and loaders and the same seed, so the test can check that the order
is reproducible, and each run has two epochs, so it can check the reshuffle.
DDP's gradient all-reduce in every step makes unequal batch counts hang, which
the parent turns into a failure with its timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyg_atompack import AtompackDataset, AtompackLoader, ShardStreamDataset  # noqa: E402
from pyg_atompack.stream import RemoteSource  # noqa: E402
from pyg_atompack.transport import RetryPolicy  # noqa: E402

EPOCHS = 2
RUNS = 2


class TinyModel(torch.nn.Module):
    """Per-atom linear energy, summed per graph."""

    def __init__(self) -> None:
        super().__init__()
        self.atom = torch.nn.Linear(3, 1)

    def forward(self, pos: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        per_atom = self.atom(pos.float()).squeeze(-1)
        return torch.zeros(num_graphs).index_add(0, batch, per_atom)


def tag_worker(data):
    """Stream transform: remember which DataLoader worker produced the sample."""
    info = get_worker_info()
    data.worker = torch.tensor([info.id if info is not None else -1])
    return data


def train_epoch(model: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                loader) -> dict:
    ids: list[int] = []
    workers: list[int] = []
    batches = 0
    for batch in loader:
        optimizer.zero_grad()
        prediction = model(batch.pos, batch.batch, batch.num_graphs)
        loss = torch.nn.functional.mse_loss(prediction, batch.energy.float().view(-1))
        loss.backward()  # all-reduce: every rank must take the same number of steps
        optimizer.step()
        ids += [int(i) for i in batch.sample_id.view(-1)]
        if "worker" in batch:
            workers += [int(w) for w in batch.worker.view(-1)]
        batches += 1
    return {"ids": ids, "workers": workers, "batches": batches}


def run_atp(path: str, seed: int) -> list[dict]:
    results = []
    for run in range(RUNS):
        dataset = AtompackDataset(path)
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
        loader = AtompackLoader(dataset, batch_size=4, sampler=sampler, num_workers=2)
        model = DistributedDataParallel(TinyModel())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            results.append({"run": run, "epoch": epoch,
                            **train_epoch(model, optimizer, loader)})
    return results


def run_stream(manifest_url: str, seed: int) -> list[dict]:
    results = []
    for run in range(RUNS):
        source = RemoteSource(manifest_url, retry=RetryPolicy(backoff=0.05, timeout=20))
        dataset = ShardStreamDataset(source, shuffle=True, seed=seed, batch_size=4,
                                     prefetch=2, concurrency=2, transform=tag_worker)
        model = DistributedDataParallel(TinyModel())
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for epoch in range(EPOCHS):
            dataset.set_epoch(epoch)
            loader = DataLoader(dataset, batch_size=None, num_workers=2)
            results.append({"run": run, "epoch": epoch,
                            **train_epoch(model, optimizer, loader)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--atp", required=True, help=".atp file with a sample_id property")
    parser.add_argument("--manifest", required=True, help="manifest URL, equal shards")
    parser.add_argument("--uneven-manifest", required=True, help="manifest URL, mixed shards")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # identical initial weights on every rank
    report = {
        "rank": rank,
        "world_size": world_size,
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "atp": run_atp(args.atp, args.seed),
        "stream": run_stream(args.manifest, args.seed),
        "stream_uneven": run_stream(args.uneven_manifest, args.seed),
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
