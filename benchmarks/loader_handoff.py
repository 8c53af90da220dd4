"""Loader only: what handing batches out of DataLoader workers costs (issue 31, point 3).

``AtompackLoader`` over one uncompressed ``.atp`` file in the page cache (64-atom
molecules with positions, forces and energy), batches of ``--batch-size``, nothing done
with a batch but counting its structures. Arms, interleaved in slices of
``--seconds`` each, several rounds in rotating order (the machine is shared: report
ratios to the in-process arm of the same round):

* ``inprocess``: ``num_workers=0`` (the loader's own fast path);
* ``workers2``: ``num_workers=2, pin_memory=True, persistent_workers=True``, the
  defaults otherwise: batches packed into one buffer each and handed over through a
  shared-memory arena per worker (``pyg_atompack/pyg/arena.py``);
* ``workers2-pipe`` (with ``--arms``): the same, the packed buffers sent through the
  queue's pipe instead (the hand-off before the arenas);
* ``workers2-torch`` (with ``--arms``): the same with PyG's default pickling (one torch
  shared-memory segment and descriptor per tensor): the hand-off before packing.

``pin_memory=True`` pins nothing on a machine without an accelerator (torch warns and
skips the pinning thread), but keeps the loader on DataLoader's worker path.

Run: ``.venv/bin/python benchmarks/loader_handoff.py [--rounds 5] [--seconds 2]
[--arms inprocess,workers2,workers2-pipe,workers2-torch]
[--out benchmarks/results/loader_handoff.md]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from pyg_atompack import AtompackDataset, AtompackLoader, atp

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "loader_handoff.md"


def write_file(path: Path, molecules: int, atoms: int) -> None:
    rng = np.random.default_rng(0)
    with atp.Writer(path, compression="none") as writer:
        for start in range(0, molecules, 4096):
            count = min(4096, molecules - start)
            writer.add_batch(rng.normal(size=(count, atoms, 3)).astype(np.float32),
                             rng.integers(1, 10, (count, atoms)).astype(np.uint8),
                             energy=rng.normal(size=count),
                             forces=rng.normal(size=(count, atoms, 3)).astype(np.float32))


class _NoArenas:
    """Patch: workers get no arena (their packed buffers go through the pipe)."""

    def __enter__(self):
        from pyg_atompack.data import loader

        self.module, self.saved = loader, loader.arenas_for_children
        loader.arenas_for_children = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        self.module.arenas_for_children = self.saved


class _TorchPickling:
    """Patch: workers pickle batches the default way (no packing at all)."""

    def __enter__(self):
        from pyg_atompack.pyg import handoff

        self.module, self.saved = handoff, handoff.install_in_worker
        handoff.install_in_worker = lambda *args, **kwargs: None
        from pyg_atompack.data import loader

        self.loader, self.saved_loader = loader, loader.install_in_worker
        loader.install_in_worker = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        self.module.install_in_worker = self.saved
        self.loader.install_in_worker = self.saved_loader


def make_loader(arm: str, dataset: AtompackDataset, batch_size: int) -> AtompackLoader:
    if arm == "inprocess":
        return AtompackLoader(dataset, batch_size=batch_size)
    return AtompackLoader(dataset, batch_size=batch_size, num_workers=2, pin_memory=True,
                          persistent_workers=True)


def rate(loader: AtompackLoader, seconds: float) -> float:
    """Structures per second over about ``seconds`` (passes restarted as needed)."""
    structures, elapsed = 0, 0.0
    while elapsed < seconds:
        iterator = iter(loader)
        next(iterator)  # the first batch of a pass waits for the workers to start
        started = time.perf_counter()
        for batch in iterator:
            structures += batch.num_graphs
            if elapsed + time.perf_counter() - started >= seconds:
                break
        elapsed += time.perf_counter() - started
        del iterator
    return structures / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--molecules", type=int, default=20000)
    parser.add_argument("--atoms", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--arms", default="inprocess,workers2,workers2-pipe,workers2-torch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.5 s, 4,000 molecules")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.molecules = 2, 0.5, 4000
    arms = args.arms.split(",")
    if arms[0] != "inprocess":
        raise SystemExit("--arms must start with inprocess (the reference)")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    with tempfile.TemporaryDirectory(prefix="loader-handoff-") as work:
        path = Path(work) / "molecules.atp"
        write_file(path, args.molecules, args.atoms)
        dataset = AtompackDataset(path)
        loaders = {}
        for arm in arms:  # made (and their workers started) once, outside the clock
            patch = {"workers2-pipe": _NoArenas, "workers2-torch": _TorchPickling}.get(arm)
            if patch is None:
                loaders[arm] = make_loader(arm, dataset, args.batch_size)
                rate(loaders[arm], 0.2)  # warm-up: page cache, workers, decode plans
                continue
            with patch():  # the patch acts where workers start and first pickle
                loaders[arm] = make_loader(arm, dataset, args.batch_size)
                rate(loaders[arm], 0.2)
        rates: dict[str, list[float]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            turn = round_ % len(arms)
            for arm in arms[turn:] + arms[:turn]:
                rates[arm].append(rate(loaders[arm], args.seconds))
            print(f"round {round_}: " + ", ".join(f"{a} {rates[a][-1]:,.0f}/s" for a in arms),
                  flush=True)
        del loaders
    ratios = {arm: [r / ref for r, ref in zip(rates[arm], rates["inprocess"])] for arm in arms}
    lines = [
        "# Loader-only hand-off (`benchmarks/loader_handoff.py`)",
        "",
        f"`AtompackLoader` over {args.molecules:,} molecules of {args.atoms} atoms (positions, "
        f"forces, energy; uncompressed `.atp` in the page cache), batches of {args.batch_size}; "
        f"{args.rounds} rounds of {args.seconds:g} s per arm in rotating order; "
        f"{os.cpu_count()} CPUs (shared machine: absolute rates drift, ratios to the "
        "in-process arm of the same round less). Python "
        f"{platform.python_version()}, torch {torch.__version__}.",
        "",
        "| arm | median structures/s | ratio to in-process (median [min, max] of rounds) |",
        "|---|---|---|",
    ]
    for arm in arms:
        values = ratios[arm]
        lines.append(f"| {arm} | {statistics.median(rates[arm]):,.0f} | "
                     f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}] |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"setup": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
         "ratios": ratios}, indent=1), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
