"""Benchmark AtompackDataset / AtompackLoader against atompack-db, PyG's loader and
the usual storage baselines (HDF5, LMDB, ASE SQLite), side by side in one run.

Every comparison interleaves its arms (alternating order, several slices each) in
the same process and minute, and reports ratios: absolute rates drift up to 2x on
a shared machine, ratios much less. Results go to ``benchmarks/results/dataset.md``.

Usage::

    python benchmarks/bench_dataset.py                 # default: ~10 minutes
    python benchmarks/bench_dataset.py --molecules 50000 --seconds 4
    python benchmarks/bench_dataset.py --skip-small --sizes 640k mixed  # real sizes only

Real sizes: ``--sizes`` names files of ``regimes.py`` (1.1 GB of 64-atom molecules,
1.05 GB of 10-300 atoms; built once under ``benchmarks/_work/``), measured in the
hot, first-touch and cold page-cache regimes defined there: ``AtompackLoader`` and
``read_batch`` + the same ``Batch`` assembly against atompack-db's
``get_molecules_flat`` + that assembly, and ``dataset[i]`` against ``db[i]`` ->
``Data``.

Memory: a child process iterates datasets of 1x and 4x the size with
``AtompackLoader`` and samples ``/proc/self/status``. No cgroup can be created
here (no systemd, read-only cgroupfs), so a page-cache budget is emulated: each
time the file-backed resident set has grown by more than the budget, the child
closes the reader (which unmaps the file; it reopens lazily) and evicts the file
from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``. Anonymous memory
(``RssAnon``, what the process itself allocates) is reported separately from
file-backed resident pages (``RssFile``, clean and reclaimable).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import regimes
import torch
from torch_geometric.data import Batch, Data
from torch_geometric.loader import DataLoader

from pyg_atompack import AtompackDataset, AtompackLoader, atp
from pyg_atompack.pyg import flat_to_batch

RESULTS = Path(__file__).resolve().parent / "results" / "dataset.md"
PAPER_RATIOS = {"HDF5 (h5py, chunked SoA)": 24.0, "LMDB (pickled dicts)": 3.8,
                "ASE SQLite (ase.db)": 247.0}
Arm = Callable[[], int]

# ------------------------------------------------------------------------ data


def molecule_sizes(count: int, atoms: int | None, rng: np.random.Generator) -> np.ndarray:
    if atoms is not None:
        return np.full(count, atoms, dtype=np.int64)
    return rng.integers(10, 301, size=count)


def write_atompack_file(path: Path, sizes: np.ndarray, seed: int = 0) -> None:
    """Write with the reference library (atompack-db), grouped by atom count."""
    import atompack

    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression="none", overwrite=True)
    order = np.argsort(sizes, kind="stable")
    grouped = np.split(order, np.flatnonzero(np.diff(sizes[order])) + 1)
    rng.shuffle(grouped)  # sizes interleaved across the file, not sorted
    for group in grouped:
        for start in range(0, len(group), 2000):
            count, n = len(group[start:start + 2000]), int(sizes[group[0]])
            db.add_arrays_batch(
                rng.normal(size=(count, n, 3)).astype(np.float32),
                rng.integers(1, 90, size=(count, n)).astype(np.uint8),
                energy=rng.normal(size=count),
                forces=rng.normal(size=(count, n, 3)).astype(np.float32),
                cell=rng.normal(size=(count, 3, 3)),
                stress=rng.normal(size=(count, 3, 3)),
                pbc=np.ones((count, 3), dtype=bool),
            )
    db.flush()


def record_arrays(reader, i: int) -> dict[str, np.ndarray]:
    m = reader[i]
    return {"positions": np.array(m.positions), "atomic_numbers": np.array(m.atomic_numbers),
            "energy": np.float64(m.energy), "forces": np.array(m.forces),
            "cell": np.array(m.cell), "stress": np.array(m.stress), "pbc": np.array(m.pbc)}


def write_hdf5(path: Path, reader, step: int = 20_000) -> None:
    """Structure of arrays: one chunked dataset per field plus an offsets array.

    Written ``step`` molecules at a time, so a file of millions of molecules never
    sits in memory at once.
    """
    import h5py

    n_atoms = reader.n_atoms
    offsets = np.concatenate([[0], np.cumsum(n_atoms)])
    fields = [key for key in ("positions", "atomic_numbers", "forces", "energy", "cell",
                              "stress", "pbc") if key in reader.fields or key in
              ("positions", "atomic_numbers")]
    with h5py.File(path, "w") as out:
        out["offsets"] = offsets
        for start in range(0, len(reader), step):
            stop = min(start + step, len(reader))
            flat = reader.read_batch(np.arange(start, stop), fields=fields)
            for key in fields:
                values = flat[key]
                per_atom = key in ("positions", "atomic_numbers", "forces")
                first, last = (offsets[start], offsets[stop]) if per_atom else (start, stop)
                if key not in out:
                    rows = int(offsets[-1]) if per_atom else len(reader)
                    out.create_dataset(key, shape=(rows, *values.shape[1:]), dtype=values.dtype,
                                       chunks=(4096 if per_atom else 1024, *values.shape[1:]))
                out[key][first:last] = values


def write_lmdb(path: Path, reader) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=8 * os.path.getsize(reader.path) + (64 << 20),
                    subdir=True, lock=False)
    with env.begin(write=True) as txn:
        for i in range(len(reader)):
            txn.put(b"%09d" % i, pickle.dumps(record_arrays(reader, i), protocol=5))
    env.close()


def write_ase_db(path: Path, reader, count: int) -> None:
    import ase.db
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    with ase.db.connect(str(path), append=False) as db:
        for i in range(count):
            r = record_arrays(reader, i)
            atoms = Atoms(numbers=r["atomic_numbers"], positions=r["positions"],
                          cell=r["cell"], pbc=r["pbc"])
            atoms.calc = SinglePointCalculator(atoms, energy=float(r["energy"]),
                                               forces=r["forces"], stress=r["stress"])
            db.write(atoms)


def disk_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


# ------------------------------------------------------------------------ harness


def interleave(arms: dict[str, Arm], seconds: float, slices: int = 6) -> dict[str, float]:
    """Items per second of each arm, timed in alternating slices after one warm-up call."""
    for arm in arms.values():
        arm()
    done = dict.fromkeys(arms, 0)
    spent = dict.fromkeys(arms, 0.0)
    names = list(arms)
    for slice_number in range(slices):
        for name in names if slice_number % 2 == 0 else reversed(names):
            start = time.perf_counter()
            stop = start + seconds / slices
            while True:
                done[name] += arms[name]()
                now = time.perf_counter()
                if now >= stop:
                    break
            spent[name] += now - start
    return {name: done[name] / spent[name] for name in names}


def cycling(factory: Callable[[], Iterator], per_call: int) -> Arm:
    """An arm pulling ``per_call`` items from an iterator, restarting it when exhausted."""
    state = {"it": factory()}

    def run() -> int:
        count = 0
        for _ in range(per_call):
            try:
                item = next(state["it"])
            except StopIteration:
                state["it"] = factory()
                item = next(state["it"])
            count += item.num_graphs if isinstance(item, Batch) else 1
        return count

    return run


def atompack_data(molecule) -> Data:
    """What a user would write to turn an atompack-db molecule into a PyG Data."""
    n = len(molecule)
    return Data(
        z=torch.from_numpy(molecule.atomic_numbers.astype(np.int64)),
        pos=torch.from_numpy(np.array(molecule.positions)),
        natoms=torch.tensor([n]),
        energy=torch.tensor([molecule.energy], dtype=torch.float64),
        forces=torch.from_numpy(np.array(molecule.forces)),
        cell=torch.from_numpy(np.array(molecule.cell)).unsqueeze(0),
        stress=torch.from_numpy(np.array(molecule.stress)).unsqueeze(0),
        pbc=torch.tensor([molecule.pbc], dtype=torch.bool),
    )


def assert_same_data(left: Data, right: Data) -> None:
    assert set(left.keys()) == set(right.keys()), (left, right)
    for key in left.keys():  # noqa: SIM118 - iterating a Data yields pairs
        assert left[key].dtype == right[key].dtype and torch.equal(left[key], right[key]), key


# ------------------------------------------------------------------------ comparisons


def per_sample(path: Path, seconds: float, rng: np.random.Generator) -> dict[str, float]:
    import atompack

    dataset = AtompackDataset(path)
    db = atompack.Database.open(str(path))
    order = rng.permutation(len(dataset)).tolist()
    for i in order[:50]:
        assert_same_data(dataset[i], atompack_data(db[i]))

    def arm(get: Callable[[int], Data]) -> Arm:
        position = {"at": 0}

        def run() -> int:
            start = position["at"]
            for i in order[start:start + 256]:
                get(i)
            position["at"] = (start + 256) % (len(order) - 256)
            return 256

        return run

    return interleave({"ours: dataset[i]": arm(dataset.__getitem__),
                       "atompack-db: db[i] -> Data": arm(lambda i: atompack_data(db[i]))},
                      seconds)


def batches(path: Path, seconds: float, rng: np.random.Generator) -> dict[str, float]:
    import atompack

    dataset = AtompackDataset(path)
    db = atompack.Database.open(str(path))
    index_batches = rng.permutation(len(dataset))[: len(dataset) // 32 * 32].reshape(-1, 32)

    def shuffled_index_batches() -> Iterator[list[int]]:
        # the sampling machinery AtompackLoader uses, so both arms pay for shuffling
        sampler = torch.utils.data.RandomSampler(range(len(dataset)))
        return iter(torch.utils.data.BatchSampler(sampler, 32, drop_last=False))

    def atompack_batches() -> Iterator[Batch]:
        for indices in shuffled_index_batches():
            flat = db.get_molecules_flat(indices)
            flat["n_atoms"] = flat["n_atoms"].astype(np.int64)
            yield flat_to_batch(flat)

    reader = dataset.reader

    def our_batches() -> Iterator[Batch]:
        for indices in shuffled_index_batches():
            yield flat_to_batch(reader.read_batch(indices))

    first = flat_to_batch({**db.get_molecules_flat(index_batches[0].tolist()),
                           "n_atoms": dataset.reader.n_atoms[index_batches[0]]})
    ours = next(iter(AtompackLoader(dataset, batch_size=32, sampler=index_batches[0].tolist())))
    pyg = next(iter(DataLoader(dataset, batch_size=32, sampler=index_batches[0].tolist())))
    for key in pyg.keys():  # noqa: SIM118
        assert torch.equal(ours[key], pyg[key]) and torch.equal(first[key], pyg[key]), key

    return interleave({
        "ours: AtompackLoader": cycling(
            lambda: iter(AtompackLoader(dataset, batch_size=32, shuffle=True)), 8),
        "PyG DataLoader(AtompackDataset)": cycling(
            lambda: iter(DataLoader(dataset, batch_size=32, shuffle=True)), 8),
        "ours: read_batch + same assembly": cycling(our_batches, 8),
        "atompack-db get_molecules_flat + same assembly": cycling(atompack_batches, 8),
    }, seconds)


def _reference_data(molecule) -> Data:
    """``atompack_data`` for the real-size files of ``regimes.py`` (they carry no stress)."""
    n = len(molecule)
    return Data(
        z=torch.from_numpy(molecule.atomic_numbers.astype(np.int64)),
        pos=torch.from_numpy(np.array(molecule.positions)),
        natoms=torch.tensor([n]),
        energy=torch.tensor([molecule.energy], dtype=torch.float64),
        forces=torch.from_numpy(np.array(molecule.forces)),
        cell=torch.from_numpy(np.array(molecule.cell)).unsqueeze(0),
        pbc=torch.tensor([molecule.pbc], dtype=torch.bool),
    )


def real_size(label: str, path: Path, accesses: list[str], rounds: int,
              records: dict[str, int], rng: np.random.Generator) -> list[tuple]:
    """Loader batches and per-sample reads of one real-size file in every cache regime.

    Rows ``(file, regime, comparison, arm, ours, reference, CPU ratio)``; regimes
    and rounds as in ``regimes.py`` (the same random indices for both arms of a
    round, alternating order, medians).
    """
    import atompack

    count = len(atp.open(path))

    def our_loader(dataset, indices: list[int]) -> int:
        loader = AtompackLoader(dataset, batch_size=32, sampler=indices)
        return sum(batch.num_graphs for batch in loader)

    def reference_loader(db, indices: list[int]) -> int:
        done = 0
        for start in range(0, len(indices), 32):
            flat = db.get_molecules_flat(indices[start:start + 32])
            flat["n_atoms"] = flat["n_atoms"].astype(np.int64)
            done += flat_to_batch(flat).num_graphs
        return done

    def our_read_batch(dataset, indices: list[int]) -> int:
        done = 0
        for start in range(0, len(indices), 32):
            done += flat_to_batch(dataset.reader.read_batch(indices[start:start + 32])).num_graphs
        return done

    def touch_ours(dataset) -> None:
        for start in range(0, count, 4096):
            dataset.reader.read_batch(np.arange(start, min(start + 4096, count)))

    def touch_reference(db) -> None:
        for start in range(0, count, 4096):
            db.get_molecules_flat(list(range(start, min(start + 4096, count))))

    def per_sample_ours(dataset, indices: list[int]) -> int:
        for i in indices:
            dataset[i]
        return len(indices)

    def per_sample_reference(db, indices: list[int]) -> int:
        for i in indices:
            _reference_data(db[i])
        return len(indices)

    def close_dataset(dataset) -> None:
        dataset.reader.close()

    def open_reference():
        return atompack.Database.open(str(path))

    comparisons = {
        "AtompackLoader (batches of 32) vs get_molecules_flat + same assembly": (
            {f"ours {access}": regimes.Arm(
                lambda access=access: AtompackDataset(path, access=access, log=False),
                our_loader, touch_ours, close_dataset) for access in accesses},
            regimes.Arm(open_reference, reference_loader, touch_reference, lambda h: None)),
        "read_batch + same assembly vs get_molecules_flat + same assembly": (
            {"ours auto": regimes.Arm(lambda: AtompackDataset(path, log=False),
                                      our_read_batch, touch_ours, close_dataset)},
            regimes.Arm(open_reference, reference_loader, touch_reference, lambda h: None)),
        "dataset[i] -> Data vs db[i] -> Data": (
            {"ours auto": regimes.Arm(lambda: AtompackDataset(path, log=False),
                                      per_sample_ours, touch_ours, close_dataset)},
            regimes.Arm(open_reference, per_sample_reference, touch_reference,
                        lambda h: None)),
    }
    rows = []
    for regime in regimes.REGIMES:
        for comparison, (ours, reference) in comparisons.items():
            arms = {**ours, "atompack-db": reference}
            works = [rng.integers(0, count, records[regime]).tolist() for _ in range(rounds)]
            rates = regimes.paired(arms, regime, path, works)
            ref_wall, ref_cpu = rates.pop("atompack-db")
            for arm, (wall, cpu) in rates.items():
                rows.append((label, regime, comparison, arm, wall, ref_wall, cpu / ref_cpu))
                print(f"[{label}] {regime:5s} {comparison[:28]:28s} {arm:10s} {wall:9,.0f}/s "
                      f"atompack-db {ref_wall:9,.0f}/s {wall / ref_wall:.2f}x "
                      f"(CPU {cpu / ref_cpu:.2f}x)", flush=True)
    return rows


def record_reads(path: Path, workdir: Path, seconds: float, ase_count: int,
                 rng: np.random.Generator,
                 keep: bool = False) -> tuple[dict[str, float], dict[str, int]]:
    """Shuffled record reads of ours against HDF5, LMDB and ASE SQLite copies of ``path``.

    Args:
        path: the `.atp` file (the baselines are written from it).
        workdir: where the baseline copies go.
        seconds: timed seconds per arm.
        ase_count: molecules in the ASE SQLite copy (the first ones).
        rng: the random generator.
        keep: reuse copies already in ``workdir`` (written by an earlier run of the
            same file; a ``done`` marker says the writes finished).

    Returns:
        ``(records per second of each arm, bytes on disk of each store)``.
    """
    import ase.db
    import h5py
    import lmdb

    reader = atp.open(path)
    h5_path, lmdb_path, ase_path = (workdir / "soa.h5", workdir / "pickles.lmdb",
                                    workdir / "small.db")
    marker = workdir / "done"
    if not (keep and marker.exists()):
        marker.unlink(missing_ok=True)
        started = time.perf_counter()
        write_hdf5(h5_path, reader)
        write_lmdb(lmdb_path, reader)
        write_ase_db(ase_path, reader, ase_count)
        marker.write_text(str(path))
        print(f"  baselines written in {time.perf_counter() - started:.0f} s", flush=True)

    order = rng.permutation(len(reader)).tolist()
    ase_order = rng.permutation(ase_count).tolist()
    h5 = h5py.File(h5_path, "r")
    offsets = h5["offsets"][:]
    columns = {key: h5[key] for key in ("positions", "atomic_numbers", "forces", "energy",
                                        "cell", "stress", "pbc")}
    env = lmdb.open(str(lmdb_path), readonly=True, lock=False)
    txn = env.begin()
    sqlite = ase.db.connect(str(ase_path))

    def ours(i: int) -> tuple:
        m = reader[i]
        return m.positions, m.atomic_numbers, m.energy, m.forces, m.cell, m.stress, m.pbc

    def hdf5(i: int) -> tuple:
        start, stop = offsets[i], offsets[i + 1]
        return (columns["positions"][start:stop], columns["atomic_numbers"][start:stop],
                columns["forces"][start:stop], columns["energy"][i], columns["cell"][i],
                columns["stress"][i], columns["pbc"][i])

    def pickled(i: int) -> dict:
        return pickle.loads(txn.get(b"%09d" % i))

    def sqlite_row(i: int) -> tuple:
        row = sqlite.get(id=i + 1)
        return row.positions, row.numbers, row.energy, row.forces, row.cell, row.stress, row.pbc

    check = order[0] % ase_count
    assert np.array_equal(ours(check)[0], hdf5(check)[0])
    assert np.array_equal(ours(check)[3], pickled(check)["forces"])
    assert np.allclose(ours(check)[0], sqlite_row(check)[0])

    def arm(read: Callable[[int], object], indices: list[int], per_call: int) -> Arm:
        position = {"at": 0}

        def run() -> int:
            start = position["at"]
            for i in indices[start:start + per_call]:
                read(i)
            position["at"] = (start + per_call) % (len(indices) - per_call)
            return per_call

        return run

    rates = interleave({
        "ours: atp reader[i]": arm(ours, order, 256),
        "HDF5 (h5py, chunked SoA)": arm(hdf5, order, 16),
        "LMDB (pickled dicts)": arm(pickled, order, 64),
        "ASE SQLite (ase.db)": arm(sqlite_row, ase_order, 4),
    }, seconds)
    sizes = {"atp (codec none)": disk_bytes(path), "HDF5 (h5py, chunked SoA)": disk_bytes(h5_path),
             "LMDB (pickled dicts)": disk_bytes(lmdb_path),
             f"ASE SQLite ({ase_count} molecules)": disk_bytes(ase_path)}
    h5.close()
    env.close()
    return rates, sizes


# ------------------------------------------------------------------------ memory


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) // 1024  # MiB
    return fields


def rss_child(path: str, budget_mb: int, passes: int) -> None:
    """Iterate ``path`` ``passes`` times; print memory figures (MiB) as JSON.

    With ``budget_mb``, whenever the file-backed resident set has grown by more
    than the budget since the start, the reader is closed (munmap; it reopens
    lazily) and the file evicted from the page cache, like a cache limit would.
    """
    torch.set_num_threads(1)
    dataset = AtompackDataset(path)
    loader = AtompackLoader(dataset, batch_size=128, shuffle=True)
    fd = os.open(path, os.O_RDONLY)
    start = _status()
    peak_anon, peak_file, drops = start["RssAnon"], start["RssFile"], 0
    for _ in range(passes):
        for _batch in loader:
            status = _status()
            peak_anon = max(peak_anon, status["RssAnon"])
            peak_file = max(peak_file, status["RssFile"])
            if budget_mb and status["RssFile"] - start["RssFile"] > budget_mb:
                dataset.reader.close()
                gc.collect()  # arrays that viewed the mapping may sit in cycles
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                drops += 1
    print(json.dumps({"file_mb": os.path.getsize(path) >> 20, "start_rss": start["VmRSS"],
                      "anon_growth": peak_anon - start["RssAnon"],
                      "file_growth": peak_file - start["RssFile"], "drops": drops}))


def memory(workdir: Path, base_count: int, budget_mb: int) -> list[dict]:
    rows = []
    for factor in (1, 4):
        path = workdir / f"rss_{factor}x.atp"
        write_atompack_file(path, np.full(base_count * factor, 64), seed=factor)
        for budget in (budget_mb, 0):
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", str(path), str(budget), "2"],
                capture_output=True, text=True, check=True)
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"molecules": base_count * factor, "budget": budget, **figures})
        path.unlink()
    return rows


# ------------------------------------------------------------------------ report


def machine() -> list[str]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    import atompack
    import torch_geometric

    return [f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} cores "
            f"visible, {cpu}); shared with other jobs",
            f"- Python {platform.python_version()}, torch {torch.__version__} "
            f"(torch.set_num_threads(1)), torch_geometric {torch_geometric.__version__}, "
            f"atompack-db {atompack.__version__}, numpy {np.__version__}"]


def baselines_at(molecules: int, seconds: float, ase_count: int) -> int:
    """The shuffled record-read table at a large size (``--baselines-at``).

    The `.atp` file (written by atompack-db) and its HDF5 / LMDB / ASE copies are
    cached under ``benchmarks/_work/``; the table goes to ``results/dataset_baselines.md``.
    At this size the stores together exceed what the page cache of a shared machine
    holds, so reads are partly served from disk (the load and free memory are noted).
    """
    rng = np.random.default_rng(2025)
    load_before = os.getloadavg()
    workdir = regimes.WORK / f"baselines_{molecules}"
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "data.atp"  # the small table's fields (stress included)
    if not (workdir / "data.done").exists():
        print(f"building {path} ({molecules:,} molecules)", flush=True)
        write_atompack_file(path, molecule_sizes(molecules, 64, rng))
        (workdir / "data.done").write_text("")
    rates, sizes = record_reads(path, workdir, seconds, ase_count, rng, keep=True)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    report = ["# Shuffled record reads against HDF5 / LMDB / ASE SQLite at scale", "",
              f"`python benchmarks/bench_dataset.py --baselines-at {molecules}`", "",
              *machine(),
              f"- load average before: {load_before[0]:.2f}; after: {os.getloadavg()[0]:.2f}; "
              f"free memory after: {free:.1f} GiB", "",
              *rate_table(f"Shuffled record reads (all fields as numpy), {molecules:,} "
                          f"molecules × 64 atoms; ASE SQLite holds only the first "
                          f"{ase_count:,} molecules (writing it is slow)", rates,
                          "ours: atp reader[i]", PAPER_RATIOS),
              "The target column holds the paper's ratios for atompack. Each arm reads its "
              "own copy of the data in a shuffled order, interleaved in alternating slices; "
              "the copies together are larger than the page cache can keep on this shared "
              "machine, so part of every arm's reads come from disk.", "",
              "| store | bytes | bytes / molecule |", "|---|---:|---:|"]
    for name, size in sizes.items():
        count = ase_count if name.startswith("ASE") else molecules
        report.append(f"| {name} | {size:,} | {size / count:,.0f} |")
    out = RESULTS.parent / "dataset_baselines.md"
    out.write_text("\n".join(report) + "\n", encoding="utf-8")
    print("\n".join(report))
    return 0


def rate_table(title: str, rates: dict[str, float], reference: str,
               targets: dict[str, float] | None = None) -> list[str]:
    lines = [f"### {title}", "", "| arm | molecules/s | ours / arm | target |",
             "|---|---:|---:|---:|"]
    for name, rate in rates.items():
        ratio = "—" if name == reference else f"{rates[reference] / rate:.2f}×"
        target = (targets or {}).get(name)
        lines.append(f"| {name} | {rate:,.0f} | {ratio} | "
                     f"{'' if target is None else f'≥ {target}×'} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=20_000, help="64-atom molecules")
    parser.add_argument("--mixed", type=int, default=20_000, help="10-300-atom molecules")
    parser.add_argument("--ase-molecules", type=int, default=2_000,
                        help="molecules in the (slow to write) ASE SQLite baseline")
    parser.add_argument("--seconds", type=float, default=2.0, help="timed seconds per arm")
    parser.add_argument("--rss-molecules", type=int, default=20_000,
                        help="1x size of the memory test (also run at 4x)")
    parser.add_argument("--budget-mb", type=int, default=32, help="emulated page-cache budget")
    parser.add_argument("--sizes", nargs="*", default=["640k"],
                        choices=list(regimes.SIZES),
                        help="real-size files (regimes.py) measured in every cache regime")
    parser.add_argument("--access", nargs="+", default=["auto", "pread"],
                        help="AtompackDataset access modes of the real-size loader rows")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (real sizes)")
    parser.add_argument("--skip-small", action="store_true",
                        help="only the real-size rows (no 20k tables, baselines or memory)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--baselines-at", type=int, default=0, metavar="N",
                        help="only the HDF5 / LMDB / ASE record-read table, on a cached "
                             "file of N molecules x 64 atoms (copies kept in _work/)")
    parser.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]), int(args.rss_child[2]))
        return 0
    if args.baselines_at:
        return baselines_at(args.baselines_at, args.seconds, args.ase_molecules)

    torch.set_num_threads(1)
    rng = np.random.default_rng(2024)
    load_before = os.getloadavg()
    records = {"hot": 8192, "first": 8192, "cold": 1024}
    real_rows = []
    for label in args.sizes:
        stem, molecules, atoms = regimes.SIZES[label]
        real_rows += real_size(label, regimes.build_file(stem, molecules, atoms), args.access,
                               args.rounds, records, rng)
    real_report = [
        "## Real sizes, by page-cache regime", "",
        "Files of `benchmarks/regimes.py` (written by atompack-db, cached under "
        "`benchmarks/_work/`): 640k = 640,000 molecules × 64 atoms (1.1 GB), mixed = "
        "260,000 molecules × 10–300 atoms (1.05 GB). Regimes: hot (every record read "
        "through the reader first), first (page cache warm, fresh dataset / database per "
        "run), cold (file evicted with `posix_fadvise(DONTNEED)` before each run). "
        f"{records['hot']:,} random records per run hot / first, {records['cold']:,} cold; "
        f"medians of {args.rounds} paired rounds, arm order alternating. Ratio = ours ÷ "
        "atompack-db by wall clock; CPU ratio by process CPU time (hot / first only).", "",
        f"Load average before: {load_before[0]:.2f} / {load_before[1]:.2f} / "
        f"{load_before[2]:.2f}; after: " + " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "", "| file | regime | comparison | arm | ours (mol/s) | atompack-db (mol/s) | ratio "
        "| CPU ratio |", "|---|---|---|---|---:|---:|---:|---:|"]
    for label, regime, comparison, arm, wall, ref_wall, cpu_ratio in real_rows:
        cpu = "" if regime == "cold" else f"{cpu_ratio:.2f}"
        real_report.append(f"| {label} | {regime} | {comparison} | {arm} | {wall:,.0f} | "
                           f"{ref_wall:,.0f} | {wall / ref_wall:.2f} | {cpu} |")
    real_report.append("")
    if args.skip_small:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(["# AtompackDataset / AtompackLoader benchmarks", "",
                                        *machine(), "", *real_report]) + "\n",
                            encoding="utf-8")
        print("\n".join(real_report))
        return 0
    report = ["# AtompackDataset / AtompackLoader benchmarks", "", *machine(), "",
              "Arms of one table run interleaved (6 alternating slices each, "
              f"{args.seconds:g} s per arm, after a warm-up call), shuffled indices, warm "
              "page cache, files written by atompack-db 0.4.1 with codec none (positions f32, "
              "Z, energy, forces f32, cell, stress, pbc). Ratios are ours ÷ arm.", ""]
    with tempfile.TemporaryDirectory(prefix="bench_dataset_") as tmp:
        workdir = Path(tmp)
        sets = {f"{args.molecules:,} molecules × 64 atoms": molecule_sizes(args.molecules, 64, rng),
                f"{args.mixed:,} molecules × 10–300 atoms": molecule_sizes(args.mixed, None, rng)}
        paths = {}
        for number, (label, sizes) in enumerate(sets.items()):
            paths[label] = workdir / f"set{number}.atp"
            write_atompack_file(paths[label], sizes, seed=number)
        for label, path in paths.items():
            print(f"{label}: per-sample and batches", flush=True)
            rates = per_sample(path, args.seconds, rng)
            report += rate_table(f"Per-sample `dataset[i]` → `Data`, {label}", rates,
                                 "ours: dataset[i]", {"atompack-db: db[i] -> Data": 1.3})
            rates = batches(path, args.seconds, rng)
            report += rate_table(f"Shuffled batches of 32, {label}", rates,
                                 "ours: AtompackLoader",
                                 {"PyG DataLoader(AtompackDataset)": 5.0,
                                  "atompack-db get_molecules_flat + same assembly": 1.0})
            same_path = (rates["ours: read_batch + same assembly"]
                         / rates["atompack-db get_molecules_flat + same assembly"])
            report += [f"Same loop, only the read differs: `read_batch` + assembly ÷ "
                       f"`get_molecules_flat` + assembly = **{same_path:.2f}×** (target ≥ 1.0×). "
                       "The AtompackLoader row adds the loader's own per-batch work "
                       "(fetcher, dataset index mapping, field selection).", ""]
        first = next(iter(paths.values()))
        print("record reads vs HDF5 / LMDB / ASE", flush=True)
        rates, sizes = record_reads(first, workdir, args.seconds, args.ase_molecules, rng)
        report += rate_table(f"Shuffled record reads (all fields as numpy), {next(iter(sets))}; "
                             f"ASE SQLite holds only the first {args.ase_molecules:,} molecules "
                             "(writing it is slow)", rates, "ours: atp reader[i]", PAPER_RATIOS)
        report += ["The target column holds the paper's ratios for atompack.", "",
                   "### Bytes on disk (same data)", "", "| store | bytes | bytes / molecule |",
                   "|---|---:|---:|"]
        for name, size in sizes.items():
            count = args.ase_molecules if name.startswith("ASE") else args.molecules
            report.append(f"| {name} | {size:,} | {size / count:,.0f} |")
        print("memory", flush=True)
        rows = memory(workdir, args.rss_molecules, args.budget_mb)
    report += ["", "### Memory while iterating (AtompackLoader, batch 128, 2 shuffled passes)", "",
               "Child process per row; MiB from `/proc/self/status`, growth over the value "
               "after opening the dataset (the start RSS is mostly torch). With a budget, "
               "once file-backed pages grew by more than the budget the reader is closed "
               "(munmap) and the file evicted with `posix_fadvise(DONTNEED)`; RssFile may "
               "overshoot by one batch's page faults (random reads fault in 64 KiB "
               "around each record). Without a budget, mapped pages of a file read at "
               "random stay resident up to the file size: they are clean page cache that "
               "the kernel reclaims under pressure, not memory the loader holds.", "",
               "| molecules | file MiB | budget MiB | RSS at start | peak RssAnon growth | "
               "peak RssFile growth | budget drops |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        report.append(f"| {row['molecules']:,} | {row['file_mb']} | "
                      f"{row['budget'] or 'none'} | {row['start_rss']} | "
                      f"{row['anon_growth']} | {row['file_growth']} | {row['drops']} |")
    report.append("")
    if real_rows:
        report += ["", *real_report]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(report) + "\n", encoding="utf-8")
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
