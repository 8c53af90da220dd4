"""Cold, first-touch and hot reads of a 1 GB `.atp` file: ours against atompack-db.

Issue 35 reported an independent protocol that did not reproduce the README's cold
figures (5.9× / 7.0× / 13.2× atompack-db). This script runs that protocol and the
variants that explain the difference:

* a 600,000 × 64-atom file (≈ 1 GB), written by atompack-db once under
  ``benchmarks/_work/`` (``regimes.build_file``);
* per round, both readers read the same random indices, the order of the readers
  alternating from round to round; figures are medians over rounds (records per
  wall-clock second) and ratios are ours ÷ atompack-db of those medians;
* operations: ``f[i]`` touching positions, atomic numbers, energy, forces, cell and
  pbc against ``db[i]`` and the same fields; ``read_batch(32)`` / ``read_batch(256)``
  against ``get_molecules_flat``.

Regimes (``--regimes``):

* ``cold``: every reader closed, the file dropped from the page cache with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each reader's run, a fresh reader;
  run for each length of ``--cold-records``. The length decides the figure: a
  plain memory map (atompack-db's) reads a whole read-around window per page fault
  (``read_ahead_kb`` of the disk, 8 MiB on this VM), so a few hundred faults bring
  in the whole file and the rest of a long run is served from memory.
* ``first``: the file in the page cache, a fresh reader per run.
* ``hot``: one reader per arm, every record read through it before the rounds.
* ``epoch``: the file in the page cache, a fresh reader per run that reads every
  record once, shuffled: the first epoch of a data set already in memory.
* ``cold-epoch``: as ``cold``, but a run reads every record once, shuffled: the first
  epoch of a data set that fits in memory and was not in the page cache.
* ``budget``: a data set larger than memory, emulated: a run of ``--budget-records``
  records during which, every 16 records, the file is dropped from the page cache
  (reader closed and reopened, clock paused) once more than ``--budget-share`` of it
  is resident. A read-around window is then rarely read again before it is dropped.

Run::

    python benchmarks/cold_read.py            # every regime, ~15 min on the shared 2-core VM
    python benchmarks/cold_read.py --quick    # for make bench-quick, ~4 min

Writes ``benchmarks/results/cold_read.md`` and ``.json`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import atompack
import numpy as np
import regimes
from bench_atp import _batches_of, _per_record, _touch_each, machine_description

from pyg_atompack import atp

HERE = Path(__file__).resolve().parent
ATOMS = 64
OPERATIONS: dict[str, tuple[Callable, Callable]] = {
    "f[i]": (_per_record, _touch_each),
    "read_batch(32)": _batches_of(32),
    "read_batch(256)": _batches_of(256),
}
BATCH = {"read_batch(32)": 32, "read_batch(256)": 256}
ALL_REGIMES = ("cold", "first", "hot", "epoch", "cold-epoch", "budget")
EPOCHS = ("epoch", "cold-epoch")  # a run reads every record once, shuffled
CHUNK = 16  # records between two residency checks of the budget regime (16 read-around
# windows of 8 MiB at most: the budget of 1/8 of a 1 GB file holds 16)


def read_ahead_kb(path: Path) -> str:
    """The read-ahead window of the block device holding ``path`` (``"?"`` if unknown)."""
    device = os.stat(path).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    for candidate in (sysfs / "queue" / "read_ahead_kb", sysfs / ".." / "queue" / "read_ahead_kb",
                      Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")):
        try:
            return candidate.read_text().strip()
        except OSError:
            continue
    return "?"


def arms(path: Path, operation: str) -> dict[str, regimes.Arm]:
    """Our reader (default access) and atompack-db's, for one operation."""
    run, touch = OPERATIONS[operation]
    return {"ours": regimes.Arm(lambda: atp.open(path), run, touch),
            "atompack-db": regimes.Arm(lambda: atompack.Database.open(str(path)), run, touch,
                                       close=lambda handle: None)}


def budget_paired(path: Path, operation: str, works: list[list[int]],
                  share: float) -> dict[str, float]:
    """Median rate of each arm over rounds, the file kept under ``share`` resident.

    Every ``CHUNK`` records (every batch, for batches) the clock stops, the resident
    share is measured (``mincore``) and, above ``share``, the reader is closed, the file
    dropped and a fresh reader opened. Each run starts from an evicted file.
    """
    contenders = arms(path, operation)
    run = OPERATIONS[operation][0]
    # a batch is one call: its reads cannot be interrupted by a check
    chunk = max(CHUNK, BATCH.get(operation, 1))
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    for number, work in enumerate(works):
        names = list(contenders) if number % 2 == 0 else list(contenders)[::-1]
        for name in names:
            arm = contenders[name]
            regimes.evict(path)
            handle = arm.open()
            elapsed = 0.0
            for start in range(0, len(work), chunk):
                begin = time.perf_counter()
                run(handle, work[start:start + chunk])
                elapsed += time.perf_counter() - begin
                if regimes.resident_fraction(path) > share:
                    arm.close(handle)
                    handle = None
                    gc.collect()  # a live mapping pins its pages against the eviction
                    regimes.evict(path)
                    handle = arm.open()
            arm.close(handle)
            handle = None
            gc.collect()
            rates[name].append(len(work) / elapsed)
    return {name: statistics.median(values) for name, values in rates.items()}


def measure(path: Path, args: argparse.Namespace) -> list[dict]:
    """Every (regime, run length, operation): both arms' median rates and the ratio."""
    rng = np.random.default_rng(args.seed)
    rows = []
    plan: list[tuple[str, int, int]] = []  # (regime, records per run, rounds)
    for regime in args.regimes:
        if regime == "cold":
            plan += [("cold", records, args.rounds) for records in args.cold_records]
        elif regime in ("first", "hot"):
            plan.append((regime, args.records, args.rounds))
        elif regime in EPOCHS:
            plan.append((regime, args.molecules, args.epoch_rounds if regime == "epoch"
                         else args.cold_epoch_rounds))
        else:
            plan.append((regime, args.budget_records, args.rounds))
    molecules = args.molecules
    for regime, records, rounds in plan:
        for operation in args.operations:
            if regime == "cold-epoch" and operation not in args.epoch_operations:
                continue
            if regime in EPOCHS:
                works = [rng.permutation(molecules).tolist() for _ in range(rounds)]
            else:
                works = [rng.integers(0, molecules, records).tolist() for _ in range(rounds)]
            began = time.perf_counter()
            if regime == "budget":
                rates = budget_paired(path, operation, works, args.budget_share)
            else:
                kind = {"cold-epoch": "cold", "epoch": regimes.EPOCH}.get(regime, regime)
                paired = regimes.paired(arms(path, operation), kind, path, works)
                rates = {name: wall for name, (wall, _) in paired.items()}
            row = {"regime": regime, "records": records, "rounds": rounds,
                   "operation": operation, "ours": rates["ours"],
                   "atompack_db": rates["atompack-db"],
                   "ratio": rates["ours"] / rates["atompack-db"],
                   "seconds": time.perf_counter() - began}
            rows.append(row)
            print(f"{regime:10s} {records:7,d} records {operation:15s} ours {row['ours']:9,.0f}/s"
                  f"  atompack-db {row['atompack_db']:9,.0f}/s  {row['ratio']:.2f}x  "
                  f"({row['seconds']:.0f} s)", flush=True)
    return rows


MEANING = {
    "cold": "file not in the page cache, a fresh reader, a run of random reads",
    "first": "file in the page cache, a fresh reader (a new process or worker)",
    "hot": "file in the page cache, every record read before through the same reader",
    "epoch": "first epoch of a data set already in the page cache (a fresh reader)",
    "cold-epoch": "first epoch of a data set that fits in memory, read from the disk",
    "budget": "random reads of a data set larger than memory (page cache held to a share)",
}


def write(rows: list[dict], args: argparse.Namespace, path: Path, load: tuple) -> None:
    """The markdown table and the JSON rows (``args.output`` and its ``.json``)."""
    info = {"file": str(path.name), "bytes": path.stat().st_size,
            "read_ahead_kb": read_ahead_kb(path),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "atompack_db": atompack.__version__, "argv": sys.argv[1:], "load": load}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.with_suffix(".json").write_text(json.dumps({"info": info, "rows": rows},
                                                           indent=1))
    lines = ["# Cold, first-touch and hot reads of a 1 GB `.atp` file vs atompack-db", "",
             f"`python benchmarks/cold_read.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             "", *machine_description(),
             f"- file: {args.molecules:,} × {ATOMS} atoms, {info['bytes'] / 1e9:.2f} GB; disk "
             f"read-ahead {info['read_ahead_kb']} KiB; memory {info['memory_gib']:.0f} GiB",
             f"- load average before / after: {load[0]:.2f} / {load[1]:.2f}", "",
             "Records per wall-clock second, medians of rounds; both readers read the same "
             "indices in a round, order alternating; ratio = ours ÷ atompack-db.", "",
             "| regime | what it is for a user | records a run | operation | ours | "
             "atompack-db | ratio |", "|---|---|---:|---|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['regime']} | {MEANING[row['regime']]} | {row['records']:,} | "
                     f"`{row['operation']}` | {row['ours']:,.0f} | {row['atompack_db']:,.0f} | "
                     f"{row['ratio']:.2f}× |")
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", nargs="+", default=list(ALL_REGIMES), choices=ALL_REGIMES)
    parser.add_argument("--operations", nargs="+", default=list(OPERATIONS),
                        choices=list(OPERATIONS))
    parser.add_argument("--cold-records", nargs="+", type=int, default=[2048, 8192, 32768],
                        help="records per cold run (one row each)")
    parser.add_argument("--records", type=int, default=10240, help="records per hot/first run")
    parser.add_argument("--budget-records", type=int, default=2048)
    parser.add_argument("--budget-share", type=float, default=0.125,
                        help="largest resident share of the file in the budget regime")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epoch-rounds", type=int, default=3)
    parser.add_argument("--cold-epoch-rounds", type=int, default=3)
    parser.add_argument("--epoch-operations", nargs="+", default=list(OPERATIONS),
                        choices=list(OPERATIONS), help="operations of the cold epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--molecules", type=int, default=600_000,
                        help="molecules of 64 atoms in the file (tests use a small one)")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, cold runs of 2,048 and 32,768 records, budget runs of "
                             "256, one cold epoch of read_batch(256)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "cold_read.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.cold_epoch_rounds = 3, 1
        args.cold_records = [2048, 32768]
        args.records = 5120
        args.budget_records = 256
        args.epoch_operations = ["read_batch(256)"]  # a cold epoch of f[i]: a minute a run
    load_before = os.getloadavg()[0]
    stem = "ref64_600k" if args.molecules == 600_000 else f"ref64_{args.molecules}"
    path = regimes.build_file(stem, args.molecules, ATOMS)
    rows = measure(path, args)
    write(rows, args, path, (load_before, os.getloadavg()[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
