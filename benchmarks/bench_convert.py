"""Benchmark conversions: throughput into `.atp`, and bytes per structure by format.

Usage::

    python benchmarks/bench_convert.py [--structures 2000] [--atoms 21] [--repeats 3]
                                       [--workers 1,2] [--parallel-structures 20000]

Builds an MD-like dataset (one molecule of ``--atoms`` atoms jiggled around a
fixed geometry, float64 positions, energy, forces) as extxyz and as a metatrain
memmap directory, then measures:

* extxyz -> `.atp` structures/s, next to a plain ``ase.io.iread`` pass over the
  same file (the floor set by ASE's parser) as a ratio;
* memmap -> `.atp` structures/s;
* extxyz -> `.atp` with ``--workers`` processes (``convert(..., workers=N)``) on a
  larger file (``--parallel-structures``), as a ratio against one process, paired
  and interleaved (each repeat runs every arm once, in rotating order), next to the
  ceiling of ASE's parser: ``ase.io.iread`` alone, in one process and in N
  processes each parsing 1/N of the frames at the same time;
* bytes per structure of `.pt` shards (``list[Data]``, 1000 per shard), `.atp`
  (none and zstd-3), the memmap layout, and, for reference, what ``torch.save``
  writes for shards of views into a collated ``InMemoryDataset`` (the mistake
  the shard writer avoids).

The machine is shared; throughput is the median of ``--repeats`` runs and is
indicative, sizes are exact. A markdown table goes to
``benchmarks/results/convert.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pyg_atompack.convert import (
    ReadOptions,
    Structure,
    WriteOptions,
    convert,
    open_writer,
)


def make_structures(count: int, atoms: int, seed: int = 0) -> list[Structure]:
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(atoms, 3)) * 1.5
    numbers = rng.choice([1, 6, 7, 8], size=atoms)
    return [
        Structure(
            positions=base + rng.normal(size=(atoms, 3)) * 0.05,
            atomic_numbers=numbers,
            energy=float(-1000.0 + rng.normal()),
            forces=rng.normal(size=(atoms, 3)),
        )
        for _ in range(count)
    ]


def write_sources(structures: list[Structure], root: Path) -> tuple[Path, Path]:
    import ase.io

    from pyg_atompack.convert.ase_io import structure_to_atoms

    extxyz = root / "data.extxyz"
    ase.io.write(extxyz, [structure_to_atoms(s) for s in structures])
    memmap = root / "memmap"
    with open_writer(memmap, "memmap") as writer:
        for structure in structures:
            writer.add(structure)
    return extxyz, memmap


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _parse_frames(path: Path, start: int, stop: int) -> None:
    import ase.io

    for _ in ase.io.iread(path, index=slice(start, stop)):
        pass


def ase_parse_s(path: Path, processes: int, total: int) -> float:
    """Wall time of ``processes`` processes each parsing 1/processes of the frames."""
    bounds = [total * i // processes for i in range(processes + 1)]
    context = multiprocessing.get_context("fork")
    start = time.perf_counter()
    children = [context.Process(target=_parse_frames, args=(path, lo, hi))
                for lo, hi in zip(bounds, bounds[1:])]
    for child in children:
        child.start()
    for child in children:
        child.join()
    return time.perf_counter() - start


def paired_parallel(extxyz: Path, root: Path, workers: list[int],
                    repeats: int) -> dict[str, list[float]]:
    """Seconds per arm and repeat; arms rotate their order from one repeat to the next."""
    import ase.io

    total = sum(1 for _ in ase.io.iread(extxyz, index=":"))
    over = WriteOptions(overwrite=True)
    arms = {f"convert w{w}": (lambda w=w: convert(extxyz, root / f"p{w}.atp",
                                                  write_options=over, workers=w))
            for w in workers}
    arms.update({f"ase x{w}": (lambda w=w: ase_parse_s(extxyz, w, total)) for w in workers})
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            own, children = _cpu()
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
            own_after, children_after = _cpu()
            times.setdefault(f"{name} cpu", []).append(
                (own_after - own, children_after - children))
    times["total"] = [float(total)]
    return times


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its reaped children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def cpu_model_speedup(one: list[tuple[float, float]], many: list[tuple[float, float]],
                      cores: int) -> float:
    """Speed-up on ``cores`` idle cores predicted from CPU time (robust to load).

    One process needs its CPU time as wall time; the parallel arm needs at least
    the main process's CPU time and at least all CPU time spread over the cores.
    """
    serial = statistics.median(main + kids for main, kids in one)
    main = statistics.median(m for m, _ in many)
    total = statistics.median(m + k for m, k in many)
    return serial / max(main, total / cores)


def tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def collated_view_shard_bytes(structures: list[Structure], root: Path, shard: int) -> int:
    """Size of one shard made of views into a collated InMemoryDataset (the 18× mistake)."""
    import torch
    from torch_geometric.data import Data, InMemoryDataset

    data_list = [Data(z=torch.from_numpy(np.asarray(s.atomic_numbers, dtype=np.int64)),
                      pos=torch.from_numpy(s.positions), forces=torch.from_numpy(s.forces),
                      energy=torch.tensor([s.energy])) for s in structures]
    data, slices = InMemoryDataset.collate(data_list)
    dataset = InMemoryDataset()
    dataset.data, dataset.slices = data, slices
    views = [dataset[i] for i in range(shard)]
    path = root / "views.pt"
    torch.save(views, path)
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--structures", type=int, default=2000)
    parser.add_argument("--atoms", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default="1,2",
                        help="comma-separated worker counts of the parallel rows")
    parser.add_argument("--parallel-structures", type=int, default=20000,
                        help="structures of the file the parallel rows convert")
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "convert.md")
    args = parser.parse_args()
    n = args.structures
    structures = make_structures(n, args.atoms)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        extxyz, memmap = write_sources(structures, root)
        over = WriteOptions(overwrite=True)

        import ase.io

        ase_only = timed(lambda: sum(1 for _ in ase.io.iread(extxyz, index=":")), args.repeats)
        from_xyz = timed(lambda: convert(extxyz, root / "x.atp", write_options=over),
                         args.repeats)
        from_memmap = timed(lambda: convert(memmap, root / "m.atp", write_options=over,
                                            read_options=ReadOptions()), args.repeats)

        sizes = {}
        convert(extxyz, root / "none.atp")
        sizes[".atp, codec none"] = tree_bytes(root / "none.atp")
        convert(extxyz, root / "zstd.atp", write_options=WriteOptions(compression="zstd"))
        sizes[".atp, zstd level 3"] = tree_bytes(root / "zstd.atp")
        convert(extxyz, root / "pt", dst_format="pt-shards",
                write_options=WriteOptions(shard_size=1000))
        sizes[".pt shards (list[Data], owned tensors)"] = tree_bytes(root / "pt")
        sizes["memmap directory (float32)"] = tree_bytes(memmap)
        sizes["extxyz text"] = tree_bytes(extxyz)
        view_bytes = collated_view_shard_bytes(structures, root, min(1000, n))
        workers = [int(w) for w in args.workers.split(",")]
        big = root / "big"
        big.mkdir()
        big_xyz, _ = write_sources(make_structures(args.parallel_structures, args.atoms), big)
        parallel = paired_parallel(big_xyz, root, workers, args.repeats)
        load_after = os.getloadavg()

    raw = args.atoms * 3 * 8 * 2 + 8 + args.atoms  # f64 positions + forces, energy, Z
    big_n = parallel.pop("total")[0]
    one = parallel[f"convert w{workers[0]}"]
    one_cpu = parallel[f"convert w{workers[0]} cpu"]
    parallel_rows = []
    for w in workers:
        mine = parallel[f"convert w{w}"]
        ratios = sorted(a / b for a, b in zip(one, mine))
        ase_rate = big_n / statistics.median(parallel[f"ase x{w}"])
        parallel_rows.append(
            f"| {w} | {big_n / statistics.median(mine):,.0f} | "
            f"{statistics.median(ratios):.2f}× [{ratios[0]:.2f}, {ratios[-1]:.2f}] | "
            f"{ase_rate:,.0f} | {big_n / statistics.median(mine) / ase_rate:.2f} | "
            f"{cpu_model_speedup(one_cpu, parallel[f'convert w{w} cpu'], 2):.2f}× |")
    lines = [
        "# Conversion benchmark",
        "",
        f"Run {datetime.datetime.now().isoformat(timespec='minutes')} on "
        f"{platform.machine()} / Python {platform.python_version()}; "
        f"`python benchmarks/bench_convert.py --structures {n} --atoms {args.atoms} "
        f"--workers {args.workers} --parallel-structures {args.parallel_structures}`.",
        f"Data: {n} structures × {args.atoms} atoms (MD-like: one geometry jiggled, float64 "
        "positions, energy, forces; forces random so they barely compress).",
        "Throughput is the median of "
        f"{args.repeats} runs on a shared 2-core machine (indicative only).",
        "",
        "| conversion | structures/s | note |",
        "|---|---:|---|",
        f"| extxyz → .atp | {n / from_xyz:,.0f} | plain `ase.io.iread` pass alone: "
        f"{n / ase_only:,.0f}/s (conversion takes {from_xyz / ase_only:.2f}× the parse) |",
        f"| memmap → .atp | {n / from_memmap:,.0f} | |",
        "",
        f"extxyz → .atp with worker processes ({big_n:,.0f} structures; "
        f"{os.cpu_count()} cores; load average before / after: "
        f"{load_before[0]:.2f} / {load_after[0]:.2f}). Speed-up: median and range over "
        f"{args.repeats} paired repeats of the one-worker time over this row's. ASE "
        "ceiling: `ase.io.iread` alone in as many processes, each parsing its share. "
        "CPU model: the speed-up 2 idle cores would give, from the CPU seconds of the "
        "main process and of the workers (one-worker CPU time over max(main, all / 2)); "
        "unlike wall times it does not depend on the other load of a shared machine.",
        "",
        "| workers | structures/s | speed-up vs 1 | ASE parse ceiling /s | fraction of it "
        "| CPU model, 2 cores |",
        "|---:|---:|---:|---:|---:|---:|",
        *parallel_rows,
        "",
        f"| format | bytes / structure | vs raw payload ({raw} B) |",
        "|---|---:|---:|",
    ]
    for name, size in sizes.items():
        lines.append(f"| {name} | {size / n:,.0f} | {size / n / raw:.2f}× |")
    shard = min(1000, n)
    lines.append(f"| .pt shard of views into a collated InMemoryDataset (not written by us) "
                 f"| {view_bytes / shard:,.0f} | {view_bytes / shard / raw:.2f}× |")
    lines += [
        "",
        "The last row is one shard of `dataset[i]` views: `torch.save` writes the whole",
        "collated storage behind them, so every shard carries the full dataset (here",
        f"{n} structures in a shard of {shard}: the overhead is dataset size / shard size and",
        "grows with the dataset). Our shard writer clones every tensor, so a shard's size",
        "follows its content (tested in tests/test_convert_pt.py).",
        "",
    ]
    text = "\n".join(lines)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
