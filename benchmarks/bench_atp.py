"""Benchmark the `.atp` format layer against the reference atompack-db, in one process.

Usage::

    python benchmarks/bench_atp.py            # every size, ~15 min on the shared 2-core VM
    python benchmarks/bench_atp.py --quick    # 3 rounds, half the records (make bench)
    python benchmarks/bench_atp.py --sizes 640k --access mmap auto

**Reads by size and cache regime** (codec none): files of 20,000 x 64 atoms
(35 MB), 640,000 x 64 atoms (1.1 GB) and 260,000 x 10-300 atoms (1.05 GB), written
by atompack-db once and cached under ``benchmarks/_work/`` (``regimes.build_file``).
In each of three page-cache regimes (hot, first touch, cold; defined and verified
in ``benchmarks/regimes.py``) every ``--access`` mode of ours and atompack-db read
the same random indices per round, in alternating order, and the medians of the
rounds are compared; a fourth, *epoch* (a fresh reader reads every record once,
shuffled, file in the page cache), compares the default access mode only:

* per-record: our ``f[i]`` versus atompack-db ``db[i]``, touching positions,
  atomic_numbers, energy, forces, cell and pbc;
* ``read_batch`` of 32 and of 256 random indices versus ``get_molecules_flat``.

The same rounds measure this machine's random-read limit: plain ``os.pread`` of the
same records, one thread, file evicted, as one more arm of the cold per-record rows.

**Small file, hot** (``--codecs``, default zstd; codec none is in the size table):
per-record and ``read_batch(32)`` in alternating time slices, and write throughput
of our ``Writer.add_batch`` versus ``add_arrays_batch``.

The machine is shared, so only the ratios ours / atompack-db are meaningful; the
load average before and after is recorded. A markdown table goes to
``benchmarks/results/atp.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import atompack
import numpy as np
import regimes

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


SIZES = regimes.SIZES
BATCH_SIZES = (32, 256)
# (operation, regime) -> minimum ratio ours / atompack-db on the >= 1 GB files
REAL_TARGETS = {("per-record", "hot"): 1.0, ("per-record", "first"): 1.0,
                **{(f"read_batch({b})", r): 1.2 for b in BATCH_SIZES for r in ("hot", "first")},
                **{(f"read_batch({b})", "cold"): 1.7 for b in BATCH_SIZES}}
LIMIT_TARGET = 0.8  # cold per-record reads as a share of the machine's random-read limit
EPOCH_ACCESS = "auto"  # the epoch regime (a whole pass: seconds a run) runs the default only


def _per_record(handle, indices: list[int]) -> int:
    for i in indices:
        molecule = handle[i]
        for key in FIELDS:
            getattr(molecule, key)
    return len(indices)


def _batches_of(size: int):
    def run(handle, indices: list[int]) -> int:
        batch = getattr(handle, "read_batch", None) or handle.get_molecules_flat
        for start in range(0, len(indices) - size + 1, size):
            batch(indices[start:start + size])
        _drain(handle)
        return len(indices) // size * size

    return run, _touch_all


def _drain(handle) -> None:
    """Wait for our reader's first-touch helper (atp/prefault.py): its time is the run's."""
    state = getattr(handle, "_state", None)
    helper = state().cache.helper if state is not None else None
    if helper is not None:
        helper.result()


def _touch_all(handle) -> None:
    """Read every record once through ``handle`` with batches (the batch rows' set-up)."""
    count = len(handle)
    batch = getattr(handle, "read_batch", None) or handle.get_molecules_flat
    for start in range(0, count, 4096):
        batch(list(range(start, min(start + 4096, count))))


def _touch_each(handle) -> None:
    """Read every record once through ``handle[i]`` (the per-record rows' set-up).

    Batches of mixed-size records are verified against a shared structure, which
    leaves ``f[i]``'s per-record memo empty; a per-record workload's hot state is
    what ``f[i]`` itself leaves.
    """
    for i in range(len(handle)):
        handle[i]


class _PlainReads:
    """The machine's random-read limit as an arm: plain ``os.pread`` of each record.

    One thread, the descriptor advised ``POSIX_FADV_RANDOM``, the exact bytes of the
    records the other arms read (offsets and sizes from the index, read at open).
    """

    def __init__(self, path: Path) -> None:
        with atp.open(path, access="pread") as reader:
            self.offsets = reader.index["offset"].tolist()
            self.sizes = reader.index["raw"].tolist()
        self.fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def __len__(self) -> int:
        return len(self.offsets)

    def run(self, indices: list[int]) -> int:
        offsets, sizes, fd = self.offsets, self.sizes, self.fd
        for i in indices:
            os.pread(fd, sizes[i], offsets[i])
        return len(indices)

    def close(self) -> None:
        os.close(self.fd)


def real_size_rows(label: str, path: Path, accesses: list[str], rounds: int,
                   records: dict[str, int],
                   rng: np.random.Generator) -> tuple[list[tuple], float]:
    """Every (regime, operation, arm) of one file: ours / atompack-db, medians of rounds.

    Returns:
        ``(rows, limit)``: the rows, and the median rate of plain ``os.pread`` of the
        same records, an arm of the cold per-record rounds (the random-read limit).
    """
    count = len(atp.open(path))
    rows = []
    limit = float("nan")
    operations = {"per-record": (_per_record, _touch_each)}
    operations.update({f"read_batch({b})": _batches_of(b) for b in BATCH_SIZES})
    for regime in regimes.READ_REGIMES:
        if regime == regimes.EPOCH and EPOCH_ACCESS not in accesses:
            continue
        if regime == "cold":
            regimes.evict(path)
            print(f"[{label}] resident after eviction: {regimes.resident_fraction(path):.3f}",
                  flush=True)
        for operation, (run, touch) in operations.items():
            arms = {f"ours {access}": regimes.Arm(
                        lambda access=access: atp.open(path, access=access), run, touch)
                    for access in (accesses if regime != regimes.EPOCH else [EPOCH_ACCESS])}
            arms["atompack-db"] = regimes.Arm(lambda: atompack.Database.open(str(path)), run,
                                              touch, close=lambda h: None)
            if regime == "cold" and operation == "per-record":
                arms["plain os.pread"] = regimes.Arm(lambda: _PlainReads(path),
                                                     lambda h, work: h.run(work))
            works = [rng.permutation(count).tolist() if regime == regimes.EPOCH else
                     rng.integers(0, count, records[regime]).tolist() for _ in range(rounds)]
            rates = regimes.paired(arms, regime, path, works)
            reference, reference_cpu = rates.pop("atompack-db")
            if "plain os.pread" in rates:
                limit = rates.pop("plain os.pread")[0]
            for arm, (rate, cpu) in rates.items():
                rows.append((label, regime, operation, arm, rate, reference,
                             cpu / reference_cpu))
                print(f"[{label}] {regime:5s} {operation:15s} {arm:10s} {rate:11,.0f}/s  "
                      f"atompack-db {reference:11,.0f}/s  {rate / reference:.2f}x  "
                      f"(CPU {cpu / reference_cpu:.2f}x)", flush=True)
    return rows, limit


def latency_rows(path: Path, latency: float, rounds: int,
                 rng: np.random.Generator) -> list[tuple]:
    """``read_batch`` over an emulated latency-bound store: concurrent against serial.

    This machine's disk serves about as many random reads per second at any queue
    depth, so what concurrency buys is measured on an emulated store instead: the
    reader's positional read (``FileState.pread``) sleeps ``latency`` seconds per
    call before reading, like a network filesystem or object store round trip.
    The *parallel store* serves calls concurrently; the *serial store* holds a lock
    around each call (one request at a time, as the reads were issued before).
    """
    import statistics
    import threading

    lock = threading.Lock()

    def parallel(fd: int, length: int, offset: int) -> bytes:
        time.sleep(latency)
        return os.pread(fd, length, offset)

    def serial(fd: int, length: int, offset: int) -> bytes:
        with lock:
            return parallel(fd, length, offset)

    rows = []
    count = len(atp.open(path))
    for size in BATCH_SIZES:
        for access in ("pread", "auto"):
            rates = {}
            for store, pread in (("serial", serial), ("parallel", parallel)):
                samples = []
                for _ in range(rounds):
                    with atp.open(path, access=access) as reader:
                        st = reader._state()
                        st.pread = pread
                        if access == "auto":  # take the batch for not in the page cache
                            st.resident = lambda offset, length: False
                        batch = rng.integers(0, count, size).tolist()
                        start = time.perf_counter()
                        reader.read_batch(batch)
                        samples.append(size / (time.perf_counter() - start))
                rates[store] = statistics.median(samples)
            rows.append((size, access, rates["serial"], rates["parallel"]))
            print(f"[latency {latency * 1e3:g} ms] read_batch({size}) {access}: serial store "
                  f"{rates['serial']:,.0f}/s, parallel store {rates['parallel']:,.0f}/s "
                  f"({rates['parallel'] / rates['serial']:.1f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=20000,
                        help="molecules of the zstd / write measures")
    parser.add_argument("--atoms", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=2.0, help="time per arm and measure")
    parser.add_argument("--batch", type=int, default=2000, help="molecules per write batch")
    parser.add_argument("--write-molecules", type=int, default=10000,
                        help="molecules per timed write (a prefix of the data set)")
    parser.add_argument("--codecs", nargs="*", default=["zstd"],
                        help="codecs of the small hot table (codec none is in the size table)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--access", nargs="+", default=["mmap", "pread", "auto"])
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds per measure")
    parser.add_argument("--latency-ms", type=float, default=1.0,
                        help="round trip of the emulated latency-bound store (0: skip)")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds and fewer records per run (about a third of the time)")
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "atp.md")
    parser.add_argument("--figure", type=Path,
                        default=Path(__file__).resolve().parent / "figures" / "atp_regimes.png",
                        help="bar chart of the default access mode by regime")
    args = parser.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    scale = 2 if args.quick else 1
    # cold runs of 512 records (~50 ms at the disk's rate) moved by up to 2x between
    # runs; 2,048 keep a run's share of the random-read limit within ~10%
    records = {"hot": 10240 // scale, "first": 10240 // scale, "cold": 4096 // scale}
    load_before = os.getloadavg()
    rng = np.random.default_rng(1)

    real_rows = []
    limits = {}
    for label in args.sizes:
        stem, molecules, atoms = SIZES[label]
        path = regimes.build_file(stem, molecules, atoms)
        check_same(path, rng.integers(0, molecules, 32).tolist())
        print(f"[{label}] {path.stat().st_size / 1e6:,.0f} MB", flush=True)
        rows, limits[label] = real_size_rows(label, path, args.access, rounds, records, rng)
        real_rows += rows
        print(f"[{label}] machine random-read limit (cold os.pread): {limits[label]:,.0f}/s",
              flush=True)

    latency = latency_rows(regimes.build_file(*SIZES["20k"]), args.latency_ms / 1e3, rounds,
                           rng) if args.latency_ms > 0 else []

    columns = make_columns(args.molecules, args.atoms)
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
            ]
            if codec == args.codecs[0]:
                measures.append(("add_batch", write_arms(folder, write_columns, codec,
                                                         args.batch)))
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
    load_after = os.getloadavg()
    lines = ["# `.atp` format layer vs atompack-db", "",
             f"`python benchmarks/bench_atp.py {' '.join(argv or sys.argv[1:])}`".replace(
                 " `", "`"), "",
             *machine_description(),
             f"- load average (1/5/15 min) before: {load_before[0]:.2f} / {load_before[1]:.2f}"
             f" / {load_before[2]:.2f}; after: {load_after[0]:.2f} / {load_after[1]:.2f} / "
             f"{load_after[2]:.2f}", "",
             "## Reads by file size and page-cache regime (codec none)", "",
             "Files written by atompack-db (positions f32, Z, energy, forces f32, cell, pbc; "
             "random values) and cached under `benchmarks/_work/`. Regimes (see "
             "`benchmarks/regimes.py`): **hot** = one reader per arm, every record read "
             "through it first; **first** = file in the page cache, a fresh reader per run "
             "(first touch of every page through that reader); **epoch** = the same, but a "
             "run reads every record of the file once in a shuffled order (a whole first "
             "epoch; default access only); **cold** = readers closed and "
             "the file evicted with `posix_fadvise(DONTNEED)` before each run (checked with "
             "`mincore`). Per round every arm reads the same random indices "
             f"({records['hot']:,} records hot / first, all of them epoch, "
             f"{records['cold']:,} cold), the arm "
             f"order reverses every round; figures are medians of {rounds} rounds, "
             "records per wall-clock second; *ratio* is ours ÷ atompack-db by wall clock, "
             "*CPU ratio* the same by the process's CPU time (hot and first touch; the "
             "steadier figure on this shared machine, see `regimes.py`); targets are "
             "checked on the wall-clock ratio. per-record = `f[i]` + the 6 fields against "
             "`db[i]` + the same fields; read_batch(B) against `get_molecules_flat`.", "",
             "| file | regime | operation | arm | ours (rec/s) | atompack-db (rec/s) | ratio "
             "| CPU ratio | target | met |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for label, regime, operation, arm, rate, reference, cpu_ratio in real_rows:
        ratio = rate / reference
        target = REAL_TARGETS.get((operation, regime)) if label != "20k" else None
        met = "" if target is None else ("yes" if ratio >= target else "no")
        cpu = "" if regime == "cold" else f"{cpu_ratio:.2f}"
        lines.append(f"| {label} | {regime} | {operation} | {arm} | {rate:,.0f} | "
                     f"{reference:,.0f} | {ratio:.2f} | {cpu} | {target or ''} | {met} |")
    lines += ["", "### Cold per-record reads against this machine's random-read limit", "",
              "Limit: plain `os.pread` of the same records (offsets and sizes from the "
              "index), one thread, `POSIX_FADV_RANDOM`: an arm of the cold per-record "
              "rounds, so it reads the same indices in the same rounds, file evicted "
              "before each run, arm order alternating (median of rounds).", "",
              "| file | limit (reads/s) | arm | cold per-record (rec/s) | share of limit | "
              "target |", "|---|---:|---|---:|---:|---:|"]
    for label, regime, operation, arm, rate, *_ in real_rows:
        if regime == "cold" and operation == "per-record":
            lines.append(f"| {label} | {limits[label]:,.0f} | {arm} | {rate:,.0f} | "
                         f"{rate / limits[label]:.2f} | ≥ {LIMIT_TARGET} |")
    for label in limits:
        lines.append(f"| {label} | {limits[label]:,.0f} | atompack-db | "
                     f"{_reference_rate(real_rows, label):,.0f} | "
                     f"{_reference_rate(real_rows, label) / limits[label]:.2f} | |")
    if latency:
        lines += ["", f"### Concurrent batch reads on an emulated {args.latency_ms:g} ms store",
                  "", "The disk here serves about as many random reads per second at any "
                  "queue depth, so it cannot show what issuing a batch's reads together "
                  "buys. Emulated instead (`latency_rows`): every positional read first "
                  f"sleeps {args.latency_ms:g} ms; the *serial* store serves one call at a "
                  "time (what one-read-at-a-time costs), the *parallel* store serves calls "
                  "concurrently (NVMe queues, network filesystems, object stores). "
                  "`auto` is forced onto its not-in-memory path. Records per second, "
                  f"median of {rounds} batches.", "",
                  "| batch | access | serial store | parallel store | speed-up |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| {size} | {access} | {ser:,.0f} | {par:,.0f} | {par / ser:.1f}× |"
                  for size, access, ser, par in latency]
    lines += ["", f"## Small file, hot ({args.molecules:,} molecules × {args.atoms} atoms)", "",
              f"{max(args.molecules // 32, 1)} random batches of 32; "
              f"{args.write_molecules} molecules per timed write, batches of {args.batch}; "
              f"arms interleaved in alternating slices of {args.seconds} s in total.", "",
              "| codec | operation | arm | ours (mol/s) | atompack-db (mol/s) | ratio | target "
              "| met |",
              "|---|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {c} | {op} | {arm} | {r:,.0f} | {ref:,.0f} | {ratio:.2f} | {t} | {met} |"
              for c, op, arm, r, ref, ratio, t, met in rows]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")
    if real_rows and f"ours {EPOCH_ACCESS}" in {row[3] for row in real_rows}:
        draw(real_rows, f"ours {EPOCH_ACCESS}", args.figure)
        print(f"wrote {args.figure}")
    return 0


def draw(rows: list[tuple], arm: str, path: Path) -> None:
    """Ours ÷ atompack-db of one access mode, by file, regime and operation (log scale).

    Args:
        rows (list[tuple]): The rows of :func:`real_size_rows`.
        arm (str): The arm to draw (e.g. ``"ours auto"``).
        path (Path): The PNG to write.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: skipping the figure")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label in SIZES if any(row[0] == label for row in rows)]
    regimes_drawn = [r for r in regimes.READ_REGIMES
                     if any(row[1] == r for row in rows)]
    operations = ["per-record", *(f"read_batch({b})" for b in BATCH_SIZES)]
    ratio = {(row[0], row[1], row[2]): row[4] / row[5] for row in rows if row[3] == arm}
    figure, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 3.4),
                                sharey=True, squeeze=False)
    width = 0.8 / len(operations)
    for axis, label in zip(axes[0], labels):
        for k, operation in enumerate(operations):
            values = [ratio.get((label, r, operation), np.nan) for r in regimes_drawn]
            axis.bar(np.arange(len(regimes_drawn)) + k * width, values, width,
                     label=operation)
        axis.axhline(1.0, color="k", lw=0.8)
        axis.set_yscale("log")
        axis.set_xticks(np.arange(len(regimes_drawn)) + width * (len(operations) - 1) / 2)
        axis.set_xticklabels(regimes_drawn)
        axis.set_title(f"{label} file", fontsize=9)
    axes[0][0].set_ylabel(f"{arm} ÷ atompack-db (> 1: ours faster)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle("Reads by page-cache regime, wall clock", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _reference_rate(rows: list[tuple], label: str) -> float:
    """atompack-db's cold per-record rate on file ``label``."""
    for row_label, regime, operation, _, _, reference, _ in rows:
        if (row_label, regime, operation) == (label, "cold", "per-record"):
            return reference
    return float("nan")


if __name__ == "__main__":
    sys.exit(main())
