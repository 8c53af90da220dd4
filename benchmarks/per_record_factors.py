"""Why per-record ``f[i]`` ratios against atompack-db differ between harnesses.

Usage::

    python benchmarks/per_record_factors.py            # the 20k file of bench_atp.py
    python benchmarks/per_record_factors.py --sizes 640k --rounds 7

Issue 19 measured ``f[i]`` + six fields at 0.67-0.83x of atompack-db's ``db[i]`` +
the same fields on the 20,000 x 64-atom file, where ``RESULTS.md`` had recorded
0.97x. The harnesses differed in several ways at once; this script varies one
factor at a time from the same baseline, ours and atompack-db reading the same
indices in the same process, arm order alternating every round:

* ``warm-up``: every record read once through the reader before the rounds (its
  layout check memoised, its pages mapped) -- or a fresh reader per round, so
  each record is a first touch;
* ``indices``: a shuffled pass over every record (a permutation) or 2,000 uniform
  random indices per round;
* ``fields``: the six of ``bench_atp.py`` (positions, atomic_numbers, energy,
  forces, cell, pbc) or four (no cell, pbc);
* ``order``: attributes read in that order or reversed.

The figure is the median over rounds of the ratio ours / atompack-db, by process
CPU time (the steadier measure on a shared machine) and by wall clock. The load
average is printed; above 3 on this 2-core machine the figures need a quiet rerun.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import atompack
import numpy as np
import regimes

from pyg_atompack import atp

SIX = ("positions", "atomic_numbers", "energy", "forces", "cell", "pbc")
FOUR = ("positions", "atomic_numbers", "energy", "forces")
# name -> (warm-up, indices, fields); the baseline is the harness of bench_atp.py's
# small-file table (one warm-up pass, a permutation, six fields)
CONFIGS = {
    "baseline: warm, permutation, 6 fields": (True, "permutation", SIX),
    "no warm-up (fresh reader per round)": (False, "permutation", SIX),
    "2,000 uniform random indices": (True, "uniform", SIX),
    "2,000 uniform, no warm-up": (False, "uniform", SIX),
    "4 fields": (True, "permutation", FOUR),
    "6 fields, reversed order": (True, "permutation", SIX[::-1]),
}


def _read(handle, indices: list[int], fields: tuple[str, ...]) -> None:
    for i in indices:
        molecule = handle[i]
        for key in fields:
            getattr(molecule, key)


def measure(atp_module, path: Path, warm: bool, kind: str, fields: tuple[str, ...],
            rounds: int, rng: np.random.Generator) -> tuple[float, float]:
    """Median ratios (CPU time, wall clock) ours / atompack-db over ``rounds`` rounds.

    Args:
        atp_module: the ``atp`` package under test (another version may be passed).
        path: the file.
        warm: read every record through each reader before the rounds.
        kind: ``"permutation"`` (every record once) or ``"uniform"`` (2,000 random).
        fields: the attributes read from each molecule, in order.
        rounds: paired rounds.
        rng: the random generator.

    Returns:
        ``(cpu ratio, wall ratio)``; above 1 means ours is faster.
    """
    count = len(atompack.Database.open(str(path)))
    opens = {"ours": lambda: atp_module.open(path),
             "atompack-db": lambda: atompack.Database.open(str(path))}
    handles = {}
    if warm:
        for name, make in opens.items():
            handles[name] = make()
            _read(handles[name], list(range(count)), fields)
    cpu: dict[str, list[float]] = {name: [] for name in opens}
    wall: dict[str, list[float]] = {name: [] for name in opens}
    for number in range(rounds):
        indices = (rng.permutation(count) if kind == "permutation"
                   else rng.integers(0, count, 2000)).tolist()
        for name in (list(opens) if number % 2 == 0 else list(opens)[::-1]):
            handle = handles[name] if warm else opens[name]()
            start_cpu, start = time.process_time(), time.perf_counter()
            _read(handle, indices, fields)
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
            if not warm and hasattr(handle, "close"):
                handle.close()
    ratio = [b / a for a, b in zip(cpu["ours"], cpu["atompack-db"])]
    wall_ratio = [b / a for a, b in zip(wall["ours"], wall["atompack-db"])]
    return statistics.median(ratio), statistics.median(wall_ratio)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["20k"], choices=list(regimes.SIZES))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(3)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for label in args.sizes:
        path = regimes.build_file(*regimes.SIZES[label])
        for config, (warm, kind, fields) in CONFIGS.items():
            cpu, wall = measure(atp, path, warm, kind, fields, args.rounds, rng)
            print(f"[{label}] {config:40s} CPU {cpu:.2f}x  wall {wall:.2f}x", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
