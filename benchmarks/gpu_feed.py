"""Benchmark: how close each loader configuration keeps a training step to the device limit.

Run: ``python benchmarks/gpu_feed.py`` on any CUDA machine (``--device cuda`` is the
default where CUDA is available), or ``python benchmarks/gpu_feed.py --smoke`` on a CPU
(the quick check ``tests/test_device_feed_bench.py`` runs in ``make test``).

SchNet energy + force training steps (MSE on both, Adam) on 64-atom structures read from
an ``.atp`` file in the page cache, for two models: 64 channels x 2 interactions with
batches of 128, and 128 channels x 6 interactions with batches of 64 (cutoff 5 Å, at most
32 neighbours, the graph searched by ``pyg_atompack.graph``). For each model it measures

* ``limit``: the same steps on batches already on the device (no loader can beat it),
  measured before and after the loader arms; the arms are divided by their mean;
* ``AtompackLoader`` with 0, 2, 4 and 8 workers, each without ``device=`` (the usual
  ``batch.to(device)``, pinned memory with workers) and with ``device=`` (copied one step
  ahead on a side stream: :class:`pyg_atompack.pyg.device.DeviceFeeder`);
* ``device=`` with ``device_transform=`` (the neighbour graph built on the side stream,
  not in the forward pass), and PyG's ``PrefetchLoader`` around the 0-worker loader.

Every arm reports structures per second and its ratio to the limit. The ratio is the
figure to compare between machines; absolute rates depend on the GPU. ``--json PATH``
writes the results.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch_geometric.loader import PrefetchLoader
from torch_geometric.nn.models import SchNet

from pyg_atompack import AtompackDataset, AtompackLoader, atp
from pyg_atompack.graph import InteractionGraph, SchNetWithGraph

ATOMS = 64
CUTOFF = 5.0
MODELS = {  # name: (hidden channels, interactions, batch size)
    "schnet-64x2-b128": (64, 2, 128),
    "schnet-128x6-b64": (128, 6, 64),
}


def write_structures(path: Path, count: int, seed: int = 0) -> Path:
    """``count`` random 64-atom structures at liquid density with energies and forces."""
    rng = np.random.default_rng(seed)
    side = (ATOMS / 0.1) ** (1 / 3)
    with atp.Writer(path) as writer:
        for start in range(0, count, 256):
            size = min(256, count - start)
            writer.add_batch(
                rng.uniform(0, side, size=(size, ATOMS, 3)).astype(np.float32),
                rng.choice(np.array([1, 6, 7, 8], np.uint8), size=(size, ATOMS)),
                energy=rng.normal(size=size),
                forces=rng.normal(size=(size, ATOMS, 3)).astype(np.float32))
    return path


def make_model(channels: int, interactions: int, device: torch.device) -> SchNetWithGraph:
    torch.manual_seed(0)
    model = SchNet(hidden_channels=channels, num_filters=channels,
                   num_interactions=interactions, num_gaussians=50, cutoff=CUTOFF,
                   interaction_graph=InteractionGraph(CUTOFF, 32))
    return SchNetWithGraph(model).to(device)


def make_step(model: SchNetWithGraph) -> Callable[[object], None]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(batch) -> None:
        # no .item() or other host sync: a real loop syncs only for logging, so the GPU
        # is still busy when the loader is asked for the next batch
        batch.pos.requires_grad_(True)
        energy = model(batch).view(-1)
        forces = -torch.autograd.grad(energy.sum(), batch.pos, create_graph=True)[0]
        loss = ((energy - batch.energy.to(energy.dtype)) ** 2).mean() \
            + ((forces - batch.forces) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(batches: Iterable, step: Callable, device: torch.device, warmup: int,
                steps: int, to_device: bool, batch_size: int) -> float:
    """Structures per second over ``steps`` steps after ``warmup`` steps."""
    iterator = iter(batches)
    for _ in range(warmup):
        batch = next(iterator)
        step(batch.to(device, non_blocking=True) if to_device else batch)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(iterator)
        step(batch.to(device, non_blocking=True) if to_device else batch)
    synchronize(device)
    return steps * batch_size / (time.perf_counter() - start)


def run_model(name: str, path: Path, device: torch.device, workers: list[int], warmup: int,
              steps: int, channels: int, interactions: int, batch_size: int) -> dict:
    model = make_model(channels, interactions, device)
    step = make_step(model)
    dataset = AtompackDataset(path)
    cuda = device.type == "cuda"

    def limit() -> float:
        resident = [batch.to(device) for batch in
                    AtompackLoader(dataset, batch_size=batch_size, drop_last=True)]
        resident = resident * (1 + (warmup + steps) // len(resident))
        return timed_steps(resident, step, device, warmup, steps, False, batch_size)

    arms: dict[str, float] = {}
    limits = [limit()]
    for count in workers:
        pin = cuda and count > 0
        plain = AtompackLoader(dataset, batch_size=batch_size, shuffle=True, seed=1,
                               drop_last=True, num_workers=count, pin_memory=pin)
        arms[f"{count} workers"] = timed_steps(plain, step, device, warmup, steps, True,
                                               batch_size)
        fed = AtompackLoader(dataset, batch_size=batch_size, shuffle=True, seed=1,
                             drop_last=True, num_workers=count, pin_memory=pin, device=device)
        arms[f"{count} workers, device="] = timed_steps(fed, step, device, warmup, steps, False,
                                                        batch_size)
    graph = model.model.interaction_graph.transform()
    fed_graph = AtompackLoader(dataset, batch_size=batch_size, shuffle=True, seed=1,
                               drop_last=True, device=device, device_transform=graph)
    arms["0 workers, device= + graph on side stream"] = timed_steps(
        fed_graph, step, device, warmup, steps, False, batch_size)
    prefetch = PrefetchLoader(AtompackLoader(dataset, batch_size=batch_size, shuffle=True,
                                             seed=1, drop_last=True), device=device)
    arms["0 workers, PyG PrefetchLoader"] = timed_steps(prefetch, step, device, warmup, steps,
                                                        False, batch_size)
    limits.append(limit())
    reference = sum(limits) / len(limits)
    return {"model": name, "batch_size": batch_size, "limit": reference,
            "limit_runs": limits,
            "arms": {arm: {"structures_per_s": rate, "ratio": rate / reference}
                     for arm, rate in arms.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of every arm in a few seconds (tiny models and runs)")
    parser.add_argument("--workers", default=None, help="comma-separated (default 0,2,4,8)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    models = dict(MODELS)
    workers = [0, 2, 4, 8]
    warmup, steps = args.warmup, args.steps
    if args.smoke:  # every arm once, tiny: the code path, not the figures
        models = {"smoke-8x1-b2": (8, 1, 2)}
        workers, warmup, steps = [0, 2], 1, 1
        torch.set_num_threads(1)
    if args.workers is not None:
        workers = [int(count) for count in args.workers.split(",")]
    torch.backends.cudnn.benchmark = True
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", "torch": torch.__version__, "atoms": ATOMS, "steps": steps,
               "models": []}
    print(f"device {results['device']}, torch {torch.__version__}, {ATOMS}-atom structures, "
          f"{steps} timed steps after {warmup}")
    with tempfile.TemporaryDirectory(prefix="gpu_feed-") as directory:
        largest = max(batch for _, _, batch in models.values())
        path = write_structures(Path(directory) / "structures.atp",
                                largest * (warmup + steps + 2))
        for name, (channels, interactions, batch_size) in models.items():
            result = run_model(name, path, device, workers, warmup, steps, channels,
                               interactions, batch_size)
            results["models"].append(result)
            print(f"{name}: limit {result['limit']:,.0f} structures/s "
                  f"(runs {', '.join(f'{r:,.0f}' for r in result['limit_runs'])})")
            for arm, figures in result["arms"].items():
                print(f"  {arm:<44s} {figures['structures_per_s']:>10,.0f}/s  "
                      f"{figures['ratio']:.2f}x limit")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
