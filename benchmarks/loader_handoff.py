"""Loader only: what handing batches out of DataLoader workers costs (issue 31, point 3).

``AtompackLoader`` over one uncompressed ``.atp`` file in the page cache (64-atom
molecules with positions, forces and energy), batches of ``--batch-size``, nothing done
with a batch but counting its structures. Arms, interleaved in slices of whole passes
(at least ``--seconds`` each), several rounds in rotating order (the machine is shared:
report ratios to the in-process arm of the same round):

* ``inprocess``: ``num_workers=0`` (the loader's own fast path);
* ``workers2``: ``num_workers=2, pin_memory=True, persistent_workers=True``, the
  defaults otherwise: several consecutive batches per DataLoader item
  (``batches_per_item``, ~4 MiB: 21 batches here; ``pyg_atompack/pyg/bundle.py``), their
  tensors copied into one slab of a shared-memory arena per worker
  (``pyg_atompack/pyg/arena.py``) and handed out as views of it;
* ``workers2-kN`` (with ``--arms``): the same with ``batches_per_item=N``; ``workers2-k1``
  is one batch per item, the hand-off before bundles;
* ``workers2-pipe`` (with ``--arms``): one batch per item, packed, sent through the
  queue's pipe instead of an arena (the hand-off before the arenas);
* ``workers2-torch`` (with ``--arms``): one batch per item with PyG's default pickling
  (one torch shared-memory segment and descriptor per tensor): before packing.

Besides the rate, every slice records the CPU time per batch of the main process
(``time.process_time``) and of the worker processes (``/proc/<pid>/stat`` of the main
process's children): what the hand-off costs whatever the machine's load. On a machine
whose cores are busy with other work, the three processes of a 2-worker loader compete
for the same share of CPU as the in-process loader's one (Linux groups a session's
processes, ``sched_autogroup``), so there the rate ratio tends to the ratio of CPU per
batch; on idle cores the workers run beside the main process.

``pin_memory=True`` pins nothing on a machine without an accelerator (torch warns and
skips the pinning thread), but keeps the loader on DataLoader's worker path: the figure
leaves out the one copy per item into page-locked memory that a CUDA machine makes
(``BatchBundle.pin_memory``: one copy of the item's slab, ~3.5 MB here, in the pinning
thread; without bundles, one per tensor of every batch).

Run: ``.venv/bin/python benchmarks/loader_handoff.py [--rounds 5] [--seconds 2]
[--arms inprocess,workers2,workers2-k1,workers2-k4,workers2-pipe,workers2-torch]
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
    per_item = None  # the loader's choice
    if arm.startswith("workers2-k"):
        per_item = int(arm.removeprefix("workers2-k"))
    elif arm in ("workers2-pipe", "workers2-torch"):
        per_item = 1
    return AtompackLoader(dataset, batch_size=batch_size, num_workers=2, pin_memory=True,
                          persistent_workers=True, batches_per_item=per_item)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children_cpu() -> float:
    """CPU seconds of this process's child processes (the workers), from ``/proc``."""
    total = 0.0
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


def rate(loader: AtompackLoader, seconds: float) -> tuple[float, float, float]:
    """Structures per second over whole passes, at least ``seconds`` of them, and the
    CPU seconds per batch of the main process and of the workers.

    Whole passes, each timed from ``iter()`` to its end (the workers' start-up of the pass
    and the wait for its first item included): a pass cut short would leave items the
    workers had read ahead uncounted, and a clock started at the first batch would leave
    out the CPU the workers spent on the items in flight then.
    """
    structures, batches, elapsed, main, workers = 0, 0, 0.0, 0.0, 0.0
    while elapsed < seconds:
        started, main_cpu, workers_cpu = time.perf_counter(), time.process_time(), \
            children_cpu()
        for batch in loader:
            structures += batch.num_graphs
            batches += 1
        elapsed += time.perf_counter() - started
        main += time.process_time() - main_cpu
        workers += children_cpu() - workers_cpu
    return structures / elapsed, main / max(batches, 1), workers / max(batches, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--molecules", type=int, default=20000)
    parser.add_argument("--atoms", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--arms", default="inprocess,workers2,workers2-k1")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 0.5 s, 4,000 molecules")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.seconds, args.molecules = 2, 0.5, 4000
    arms = args.arms.split(",")
    if arms[0] != "inprocess":
        raise SystemExit("--arms must start with inprocess (the reference)")
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    load_before = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
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
        cpu: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            turn = round_ % len(arms)
            for arm in arms[turn:] + arms[:turn]:
                measured, main_cpu, workers_cpu = rate(loaders[arm], args.seconds)
                rates[arm].append(measured)
                cpu[arm].append((main_cpu, workers_cpu))
            print(f"round {round_}: " + ", ".join(f"{a} {rates[a][-1]:,.0f}/s" for a in arms),
                  flush=True)
        del loaders
    ratios = {arm: [r / ref for r, ref in zip(rates[arm], rates["inprocess"])] for arm in arms}
    # CPU per batch (µs): median over rounds of main, workers, both
    per_batch = {arm: [statistics.median(c[i] for c in cpu[arm]) * 1e6 for i in (0, 1)]
                 for arm in arms}
    reference_cpu = sum(per_batch["inprocess"])
    lines = [
        "# Loader-only hand-off (`benchmarks/loader_handoff.py`)",
        "",
        f"`AtompackLoader` over {args.molecules:,} molecules of {args.atoms} atoms (positions, "
        f"forces, energy; uncompressed `.atp` in the page cache), batches of {args.batch_size}; "
        f"{args.rounds} rounds of whole passes (at least {args.seconds:g} s) per arm in "
        "rotating order, each pass timed from `iter()` to its end; "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and "
        f"{os.getloadavg()[0]:.1f} after (shared machine: absolute rates drift, ratios to the "
        f"in-process arm of the same round less). {started}, Python "
        f"{platform.python_version()}, torch {torch.__version__}. `pin_memory=True` pins "
        "nothing without an accelerator (see the script's docstring).",
        "",
        "| arm | median structures/s | ratio to in-process (median [min, max] of rounds) "
        "| CPU µs a batch: main + workers = total | in-process CPU ÷ total |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        values = ratios[arm]
        main_us, workers_us = per_batch[arm]
        lines.append(f"| {arm} | {statistics.median(rates[arm]):,.0f} | "
                     f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}] "
                     f"| {main_us:.0f} + {workers_us:.0f} = {main_us + workers_us:.0f} "
                     f"| {reference_cpu / (main_us + workers_us):.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(
        {"setup": {k: str(v) for k, v in vars(args).items()}, "rates": rates,
         "ratios": ratios, "cpu_per_batch_s": cpu}, indent=1), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
