"""Benchmark: neighbour-list backends against the project's padded pure-torch search.

Run: ``python benchmarks/neighbours.py [--device cuda] [--repeats 7] [--quick]``. For each
case it prints the median time of every backend and its ratio to the pure-torch search
(``radius_graph(..., backend="torch")``) measured in the same process, interleaved. On the
CPU the time is the process's CPU time (every arm runs on one thread): on a loaded machine
the wall clock of a long call is mostly time spent descheduled.

Backends: ``torch`` (the project's padded blockwise search), ``vesin`` (``vesin-torch``
cell lists, one call per structure, through ``radius_graph(backend="vesin")``) and
``torch_cluster`` where it imports (molecules only; it has no periodic search). Each
builds the full :class:`~pyg_atompack.graph.NeighbourGraph` (sorted edges, shifts,
differentiable vectors), the work a model's forward does.

Cases: molecules (random clouds at liquid density, 0.1 atoms/Å³) and periodic crystals
(random cubic cells at 0.08 atoms/Å³) of 20, 64 and 300 atoms, alone and in batches of
32, and of 1,000 atoms alone; cutoff 5 Å. The ``auto`` column is what ``backend="auto"``
chooses (``vesin`` for one structure alone, for batches of periodic cells of 128 atoms or
more and of molecules of 600 or more on average, when it is installed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pyg_atompack.graph import radius_graph, torch_cluster_available

CUTOFF = 5.0


def structures(kind: str, atoms: int, graphs: int, device: str,
               seed: int = 0) -> dict[str, torch.Tensor | None]:
    generator = np.random.default_rng(seed)
    batch = torch.arange(graphs, device=device).repeat_interleave(atoms)
    if kind == "molecule":
        radius = (atoms / 0.1 * 3 / (4 * np.pi)) ** (1 / 3)
        pos = generator.normal(scale=radius / 2, size=(graphs * atoms, 3))
        return {"pos": torch.tensor(pos, dtype=torch.float32, device=device), "batch": batch,
                "cell": None}
    side = (atoms / 0.08) ** (1 / 3)
    pos = generator.uniform(0, side, size=(graphs * atoms, 3))
    cell = torch.eye(3, device=device).repeat(graphs, 1, 1) * side
    return {"pos": torch.tensor(pos, dtype=torch.float32, device=device), "batch": batch,
            "cell": cell}


def timed(function: Callable[[], object], device: str) -> float:
    # On the CPU: the process's CPU time. Every arm is single-threaded, and on a shared
    # machine the wall clock mostly measures how often the scheduler lets us run.
    if device == "cuda":
        start = time.perf_counter()
        function()
        torch.cuda.synchronize()
        return time.perf_counter() - start
    start = time.process_time()
    function()
    return time.process_time() - start


def run_case(kind: str, atoms: int, graphs: int, device: str, repeats: int) -> dict[str, float]:
    data = structures(kind, atoms, graphs, device)
    backends = ["torch", "vesin"]
    if kind == "molecule" and torch_cluster_available():
        backends.append("torch_cluster")
    calls = {name: (lambda name=name: radius_graph(
        data["pos"], CUTOFF, data["batch"], cell=data["cell"], return_vectors=True,
        backend=name)) for name in backends}
    for call in calls.values():
        call()  # warm-up (caches, first kernel launches)
    samples: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(repeats):
        for name, call in calls.items():  # interleaved: the same minute for every arm
            samples[name].append(timed(call, device))
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one small case per kind")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the backends' own parallelism is off too (vesin n_threads=1)
    sizes = [(20, 1), (64, 32)] if args.quick else [
        (20, 1), (20, 32), (64, 1), (64, 32), (300, 1), (300, 32), (1000, 1)]
    print(f"torch {torch.__version__}, device {args.device}, cutoff {CUTOFF} A, "
          f"medians of {args.repeats} "
          f"({'wall' if args.device == 'cuda' else 'CPU'} time); "
          "ratio = backend time / pure-torch time")
    print(f"{'case':<28s} {'torch ms':>9s} {'vesin ms':>9s} {'vesin/torch':>11s}  auto")
    for kind in ("molecule", "crystal"):
        for atoms, graphs in sizes:
            times = run_case(kind, atoms, graphs, args.device, args.repeats)
            label = f"{kind} {atoms} atoms x {graphs}"
            line = (f"{label:<28s} {times['torch'] * 1e3:9.2f} {times['vesin'] * 1e3:9.2f} "
                    f"{times['vesin'] / times['torch']:11.2f}")
            if "torch_cluster" in times:
                line += f"  torch_cluster {times['torch_cluster'] / times['torch']:.2f}x"
            threshold = 128 if kind == "crystal" else 600
            line += "  " + ("vesin" if graphs == 1 or atoms >= threshold else "torch")
            print(line, flush=True)


if __name__ == "__main__":
    main()
