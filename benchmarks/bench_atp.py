"""Benchmark the `.atp` format layer against the reference atompack-db, in one process.

Usage::

    python benchmarks/bench_atp.py [--molecules 20000] [--atoms 64] [--seconds 2]

Builds files of ``--molecules`` molecules x ``--atoms`` atoms (positions float32,
atomic numbers, energy, forces, cell, pbc; random values) with codec none and
zstd, written by atompack-db and by us, then measures in alternating time slices
(warm page cache):

* per-record reads of the full record as numpy arrays: our ``f[i]`` (mmap and
  pread) versus atompack-db ``db[i]``, touching positions, atomic_numbers,
  energy, forces, cell and pbc;
* ``read_batch`` of 32 random indices versus ``get_molecules_flat``;
* write throughput of our ``Writer.add_batch`` versus ``add_arrays_batch``.

Reads run on the file atompack-db wrote (the data users download). The machine
is shared, so only the ratios ours / atompack-db are meaningful; the arms are
interleaved so that both see the same background load. A markdown table goes to
``benchmarks/results/atp.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import atompack
import numpy as np

from pyg_atompack import atp

FIELDS = ("positions", "atomic_numbers", "energy", "forces", "cell", "pbc")
# operation -> minimum ratio ours / atompack-db
TARGETS = {"per-record": 0.8, "read_batch(32)": 1.0, "add_batch": 0.8}


def make_columns(molecules: int, atoms: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random stacked columns for ``molecules`` molecules of ``atoms`` atoms each."""
    rng = np.random.default_rng(seed)
    return {
        "positions": rng.standard_normal((molecules, atoms, 3)).astype(np.float32),
        "atomic_numbers": rng.integers(1, 90, size=(molecules, atoms), dtype=np.uint8),
        "energy": rng.standard_normal(molecules),
        "forces": rng.standard_normal((molecules, atoms, 3)).astype(np.float32),
        "cell": rng.standard_normal((molecules, 3, 3)),
        "pbc": rng.random((molecules, 3)) < 0.5,
    }


def _batches(columns: dict[str, np.ndarray], batch: int):
    total = len(columns["positions"])
    for start in range(0, total, batch):
        yield {key: value[start:start + batch] for key, value in columns.items()}


def write_atompack(path: Path, columns: dict[str, np.ndarray], codec: str, batch: int) -> None:
    db = atompack.Database(str(path), compression=codec, overwrite=True)
    for part in _batches(columns, batch):
        db.add_arrays_batch(part.pop("positions"), part.pop("atomic_numbers"), **part)
    db.flush()
    del db


def write_ours(path: Path, columns: dict[str, np.ndarray], codec: str, batch: int) -> None:
    with atp.Writer(path, compression=codec, overwrite=True) as writer:
        for part in _batches(columns, batch):
            writer.add_batch(part.pop("positions"), part.pop("atomic_numbers"), **part)


def interleave(arms: dict[str, Callable[[], int]], seconds: float,
               slices: int = 6) -> dict[str, float]:
    """Run each arm for ``seconds`` in total, in alternating slices; return items per second.

    Args:
        arms: name -> callable doing one unit of work and returning the items it processed.
        seconds: total time per arm.
        slices: number of slices per arm; the arm order reverses every slice.

    Returns:
        Items per second for every arm.
    """
    for run in arms.values():  # warm-up: page cache, lazy imports, allocator
        run()
    counts = dict.fromkeys(arms, 0)
    elapsed = dict.fromkeys(arms, 0.0)
    names = list(arms)
    for number in range(slices):
        for name in names if number % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            deadline = start + seconds / slices
            while True:
                counts[name] += arms[name]()
                if time.perf_counter() >= deadline:
                    break
            elapsed[name] += time.perf_counter() - start
    return {name: counts[name] / elapsed[name] for name in names}


def per_record_arms(path: Path, indices: list[int]) -> dict[str, Callable[[], int]]:
    """Full-record reads as numpy arrays, one molecule at a time."""
    readers = {access: atp.open(path, access=access) for access in ("mmap", "pread")}
    db = atompack.Database.open(str(path))

    def ours(reader) -> Callable[[], int]:
        def run() -> int:
            for i in indices:
                molecule = reader[i]
                for key in FIELDS:
                    getattr(molecule, key)
            return len(indices)
        return run

    def reference() -> int:
        for i in indices:
            molecule = db[i]
            for key in FIELDS:
                getattr(molecule, key)
        return len(indices)

    return {"ours mmap": ours(readers["mmap"]), "ours pread": ours(readers["pread"]),
            "atompack-db": reference}


def read_batch_arms(path: Path, batches: list[list[int]]) -> dict[str, Callable[[], int]]:
    """Batched reads of 32 random indices."""
    reader = atp.open(path)
    db = atompack.Database.open(str(path))

    def ours() -> int:
        for batch in batches:
            reader.read_batch(batch)
        return sum(len(batch) for batch in batches)

    def reference() -> int:
        for batch in batches:
            db.get_molecules_flat(batch)
        return sum(len(batch) for batch in batches)

    return {"ours": ours, "atompack-db": reference}


def write_arms(folder: Path, columns: dict[str, np.ndarray], codec: str,
               batch: int) -> dict[str, Callable[[], int]]:
    """Whole-file writes with stacked batches (flush included)."""
    count = len(columns["positions"])

    def ours() -> int:
        write_ours(folder / "write_ours.atp", columns, codec, batch)
        return count

    def reference() -> int:
        write_atompack(folder / "write_ref.atp", columns, codec, batch)
        return count

    return {"ours": ours, "atompack-db": reference}


def check_same(path: Path, indices: list[int]) -> None:
    """Refuse to benchmark a reader that returns different values."""
    db = atompack.Database.open(str(path))
    with atp.open(path) as reader:
        for i in indices:
            ours, reference = reader[i], db[i]
            for key in FIELDS:
                assert np.array_equal(np.asarray(getattr(ours, key)),
                                      np.asarray(getattr(reference, key))), (path, i, key)


def machine_description() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    return [
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: `{uname}`",
        f"- CPU: {cpu}",
        f"- Python {platform.python_version()}, numpy {np.__version__}, "
        f"atompack-db {atompack.__version__}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=20000)
    parser.add_argument("--atoms", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per arm and measure")
    parser.add_argument("--batch", type=int, default=2000, help="molecules per write batch")
    parser.add_argument("--write-molecules", type=int, default=10000,
                        help="molecules per timed write (a prefix of the data set)")
    parser.add_argument("--codecs", nargs="+", default=["none", "zstd"])
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "atp.md")
    args = parser.parse_args(argv)

    columns = make_columns(args.molecules, args.atoms)
    rng = np.random.default_rng(1)
    # one shuffled pass over the whole file, and as many random batches: a short list
    # repeated would sit in the CPU caches and measure something no training loop sees
    indices = rng.permutation(args.molecules).tolist()
    batches = [rng.integers(0, args.molecules, size=32).tolist()
               for _ in range(max(args.molecules // 32, 1))]
    write_columns = {key: value[:args.write_molecules] for key, value in columns.items()}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_atp_") as tmp:
        folder = Path(tmp)
        for codec in args.codecs:
            reference_path = folder / f"reference_{codec}.atp"
            write_atompack(reference_path, columns, codec, args.batch)
            write_ours(folder / f"ours_{codec}.atp", columns, codec, args.batch)
            check_same(reference_path, indices[:32])
            check_same(folder / f"ours_{codec}.atp", indices[:32])
            print(f"[{codec}] {reference_path.stat().st_size / 1e6:.1f} MB", flush=True)
            measures = [
                ("per-record", per_record_arms(reference_path, indices)),
                ("read_batch(32)", read_batch_arms(reference_path, batches)),
                ("add_batch", write_arms(folder, write_columns, codec, args.batch)),
            ]
            for operation, arms in measures:
                rates = interleave(arms, args.seconds)
                reference = rates.pop("atompack-db")
                for arm, rate in rates.items():
                    ratio = rate / reference
                    met = "yes" if ratio >= TARGETS[operation] else "no"
                    rows.append((codec, operation, arm, rate, reference, ratio,
                                 TARGETS[operation], met))
                    print(f"[{codec}] {operation:15s} {arm:10s} {rate:12,.0f} mol/s  "
                          f"atompack-db {reference:12,.0f} mol/s  ratio {ratio:.2f} "
                          f"(target {TARGETS[operation]}: {met})", flush=True)
    lines = ["# `.atp` format layer vs atompack-db", "",
             f"`python benchmarks/bench_atp.py --molecules {args.molecules} --atoms {args.atoms}"
             f" --seconds {args.seconds}` (reads: one shuffled pass over every molecule, "
             f"{max(args.molecules // 32, 1)} random batches of 32; "
             f"{args.write_molecules} molecules per timed write, "
             f"batches of {args.batch}; arms interleaved, warm page cache).", "",
             *machine_description(), "",
             "| codec | operation | arm | ours (mol/s) | atompack-db (mol/s) | ratio | target "
             "| met |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {c} | {op} | {arm} | {r:,.0f} | {ref:,.0f} | {ratio:.2f} | {t} | {met} |"
              for c, op, arm, r, ref, ratio, t, met in rows]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
