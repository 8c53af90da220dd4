"""Fixed-size batches against atom-budget batches on a file of 10-300-atom structures.

Usage::

    python benchmarks/atom_budget.py                   # ~3 min: results/atom_budget.md + figure
    python benchmarks/atom_budget.py --quick --out DIR # smoke run (the test suite's)

The file holds ``--molecules`` structures of 10 to 300 atoms drawn uniformly (positions
in a cube at 0.05 atoms per cubic Angstrom, with energies and forces), written with
``atp.Writer``. Two loaders over it, both shuffled with the same seed:

* *fixed*: ``AtompackLoader(batch_size=B)``, ``B`` the budget divided by the mean
  atom count (12 for a budget of 2,000);
* *budget*: ``AtompackLoader(max_atoms=M)`` (``M`` = 2,000).

Measured:

* the spread of atoms per batch over one epoch (min / 5% / median / 95% / max);
* loader throughput, structures per second, in alternating whole-epoch passes
  (``--rounds``, the arm that goes first alternating), median ratio budget / fixed;
* the peak resident memory of a SchNet energy+force training step (CPU, the project's
  ``graph.InteractionGraph``, cutoff 5 A, at most 32 neighbours), in a fresh process per
  arm: the process iterates one epoch, keeps the ``--peak-batches`` batches with most
  atoms and trains on them; its peak RSS (``ru_maxrss``) before and after the steps is
  reported. The largest batch of an epoch is what sets the memory a GPU must hold;
* the steps ``rank_batches`` adds to split an epoch evenly over 2, 4 and 8 ranks.

Absolute rates on a shared machine drift; the ratio is measured side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import training  # noqa: E402

import pyg_atompack  # noqa: E402
from pyg_atompack import AtompackDataset, AtompackLoader, atp, graph  # noqa: E402
from pyg_atompack.pyg import balance_batches, plan_atom_batches  # noqa: E402

WORK = ROOT / "benchmarks" / "_work"
DENSITY = 0.05  # atoms per cubic Angstrom
CUTOFF = 5.0


def build_file(path: Path, molecules: int, seed: int = 0) -> Path:
    """Structures of 10-300 atoms (written once per size and seed, then reused)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    partial = path.with_suffix(".partial")
    with atp.Writer(partial, overwrite=True) as writer:
        for _ in range(molecules):
            n = int(rng.integers(10, 301))
            side = (n / DENSITY) ** (1 / 3)
            writer.add((rng.random((n, 3)) * side).astype(np.float32),
                       rng.integers(1, 10, n).astype(np.uint8),
                       energy=float(rng.normal()),
                       forces=rng.normal(size=(n, 3)).astype(np.float32))
    partial.rename(path)
    return path


def _loaders(path: Path, batch_size: int, max_atoms: int, seed: int) -> dict:
    dataset = AtompackDataset(path)
    return {"fixed": AtompackLoader(dataset, batch_size=batch_size, shuffle=True, seed=seed),
            "budget": AtompackLoader(dataset, max_atoms=max_atoms, shuffle=True, seed=seed)}


def atoms_per_batch(loader: AtompackLoader) -> list[int]:
    """Atoms of every batch of one epoch."""
    return [int(batch.num_nodes) for batch in loader]


def spread(values: list[int]) -> dict:
    """min / 5% / median / 95% / max, mean and count of ``values``."""
    array = np.asarray(values)
    q = np.percentile(array, [0, 5, 50, 95, 100])
    return {"batches": len(values), "min": int(q[0]), "p5": float(q[1]),
            "median": float(q[2]), "p95": float(q[3]), "max": int(q[4]),
            "mean": float(array.mean()), "std": float(array.std())}


def loader_rates(loaders: dict, rounds: int) -> dict:
    """Structures per second of alternating whole-epoch passes."""
    rates: dict[str, list[float]] = {arm: [] for arm in loaders}
    for arm in loaders:  # one untimed pass each: page cache, lazy setup
        for _ in loaders[arm]:
            pass
    for index in range(rounds):
        order = list(loaders) if index % 2 == 0 else list(reversed(loaders))
        for arm in order:
            started = time.perf_counter()
            structures = sum(batch.num_graphs for batch in loaders[arm])
            rates[arm].append(structures / (time.perf_counter() - started))
    ratios = [b / f for b, f in zip(rates["budget"], rates["fixed"])]
    return {"rates": rates, "ratio_median": statistics.median(ratios), "ratios": ratios}


def peak_step_memory(path: Path, arm: str, args: argparse.Namespace) -> dict:
    """Run :func:`_memory_child` for ``arm`` in a fresh process; its JSON report."""
    command = [sys.executable, __file__, "--memory-child", arm, "--file", str(path),
               "--batch-size", str(args.batch_size), "--max-atoms", str(args.max_atoms),
               "--seed", str(args.seed), "--peak-batches", str(args.peak_batches),
               "--hidden-channels", str(args.hidden_channels),
               "--num-interactions", str(args.num_interactions)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _memory_child(args: argparse.Namespace) -> None:
    loader = _loaders(Path(args.file), args.batch_size, args.max_atoms, args.seed)[
        args.memory_child]
    largest: list = []
    for batch in loader:  # keep the epoch's batches with most atoms
        largest.append(batch)
        largest.sort(key=lambda b: -b.num_nodes)
        del largest[args.peak_batches:]
    config = training.ModelConfig(hidden_channels=args.hidden_channels,
                                  num_filters=args.hidden_channels,
                                  num_interactions=args.num_interactions, cutoff=CUTOFF)
    model = training.build_model(config, graph.InteractionGraph(CUTOFF))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    before = _maxrss_mib()
    for batch in largest:
        batch.pos = batch.pos.float()
        batch.forces = batch.forces.float()
        batch.energy = batch.energy.float()
        training.train_step(model, optimizer, batch)
    print(json.dumps({"arm": args.memory_child, "before_steps_mib": before,
                      "peak_mib": _maxrss_mib(),
                      "step_atoms": [int(b.num_nodes) for b in largest]}))


def rank_split_cost(path: Path, max_atoms: int, seed: int) -> dict:
    """Batches an epoch gains when :func:`rank_batches` splits it over W ranks."""
    counts = atp.open(path).n_atoms
    batches = plan_atom_batches(counts, max_atoms, seed=seed)
    return {str(w): len(balance_batches(batches, w)) - len(batches) for w in (2, 4, 8)}


def run(args: argparse.Namespace) -> dict:
    path = build_file(Path(args.file) if args.file else
                      WORK / f"mixed10_300_{args.molecules}.atp", args.molecules)
    loaders = _loaders(path, args.batch_size, args.max_atoms, args.seed)
    load_before = os.getloadavg()
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "torch": torch.__version__, "pyg_atompack": pyg_atompack.__version__},
        "setup": {"molecules": args.molecules, "batch_size": args.batch_size,
                  "max_atoms": args.max_atoms, "seed": args.seed,
                  "model": f"SchNet hidden {args.hidden_channels}, "
                           f"{args.num_interactions} interactions, cutoff {CUTOFF}"},
        "atoms": {arm: atoms_per_batch(loader) for arm, loader in loaders.items()},
    }
    result["spread"] = {arm: spread(values) for arm, values in result["atoms"].items()}
    result["loader"] = loader_rates(loaders, args.rounds)
    runs: dict[str, list[dict]] = {arm: [] for arm in loaders}
    for index in range(args.memory_repeats):  # alternating; the median run per arm
        for arm in (list(loaders) if index % 2 == 0 else list(reversed(loaders))):
            runs[arm].append(peak_step_memory(path, arm, args))
    result["memory_runs"] = runs
    result["memory"] = {arm: sorted(r, key=lambda m: m["peak_mib"] - m["before_steps_mib"])[
        len(r) // 2] for arm, r in runs.items()}
    result["rank_split"] = rank_split_cost(path, args.max_atoms, args.seed)
    result["load_average"] = [load_before, os.getloadavg()]
    return result


def markdown(result: dict, command: str) -> str:
    setup, sp, mem = result["setup"], result["spread"], result["memory"]
    loader = result["loader"]
    lines = [
        "# Fixed-size vs atom-budget batches",
        "",
        f"`{command}`",
        "",
        f"- date: {result['date']}",
        f"- machine: {result['machine']}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}",
        f"- load average before / after: {result['load_average'][0][0]:.1f} / "
        f"{result['load_average'][1][0]:.1f}",
        f"- file: {setup['molecules']:,} structures of 10-300 atoms; fixed "
        f"`batch_size={setup['batch_size']}`, budget `max_atoms={setup['max_atoms']}`; "
        f"{setup['model']}",
        "",
        "## Atoms per batch (one epoch)",
        "",
        "| arm | batches | min | 5% | median | 95% | max | std |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, s in sp.items():
        lines.append(f"| {arm} | {s['batches']} | {s['min']:,} | {s['p5']:,.0f} | "
                     f"{s['median']:,.0f} | {s['p95']:,.0f} | {s['max']:,} | {s['std']:,.0f} |")
    lines += [
        "",
        "## Loader throughput (structures/s, alternating whole-epoch passes)",
        "",
        "| arm | median | passes |",
        "|---|---:|---:|",
    ]
    for arm, rates in loader["rates"].items():
        lines.append(f"| {arm} | {statistics.median(rates):,.0f} | {len(rates)} |")
    lines += [
        "",
        f"Budget / fixed, median of paired passes: **{loader['ratio_median']:.2f}x** "
        f"(pairs: {', '.join(f'{r:.2f}' for r in loader['ratios'])}).",
        "",
        "## Peak memory of a SchNet energy+force step (CPU, fresh process per arm)",
        "",
        "The run with the median growth of each arm; growth of every run in brackets.",
        "",
        "| arm | atoms of the steps | peak RSS before the steps (MiB) | peak RSS (MiB) "
        "| growth (MiB) |",
        "|---|---|---:|---:|---:|",
    ]
    for arm, m in mem.items():
        growths = ", ".join(f"{r['peak_mib'] - r['before_steps_mib']:,.0f}"
                            for r in result["memory_runs"][arm])
        lines.append(f"| {arm} | {', '.join(f'{a:,}' for a in m['step_atoms'])} | "
                     f"{m['before_steps_mib']:,.0f} | {m['peak_mib']:,.0f} | "
                     f"{m['peak_mib'] - m['before_steps_mib']:,.0f} [{growths}] |")
    split = result["rank_split"]
    lines += [
        "",
        "## Equal steps per rank",
        "",
        f"The epoch has {sp['budget']['batches']} budget batches; `rank_batches` splits "
        + ", ".join(f"{n} for {w} ranks" for w, n in split.items())
        + " of them in two (nothing dropped or repeated).",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    bins = np.linspace(0, max(max(v) for v in result["atoms"].values()) + 50, 40)
    for arm, values in result["atoms"].items():
        left.hist(values, bins=bins, alpha=0.6, label=f"{arm} ({len(values)} batches)")
    left.axvline(result["setup"]["max_atoms"], color="k", linestyle="--", linewidth=1)
    left.set_xlabel("atoms per batch")
    left.set_ylabel("batches")
    left.legend()
    arms = list(result["memory"])
    right.bar(arms, [result["memory"][a]["peak_mib"] for a in arms], color=["C0", "C1"])
    right.bar(arms, [result["memory"][a]["before_steps_mib"] for a in arms],
              color="lightgrey", label="before the steps")
    right.set_ylabel("peak RSS (MiB)")
    right.set_title("SchNet energy+force step, largest batches")
    right.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small file, few passes")
    parser.add_argument("--molecules", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--max-atoms", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--peak-batches", type=int, default=3)
    parser.add_argument("--memory-repeats", type=int, default=3,
                        help="fresh processes per arm (the median growth is reported)")
    parser.add_argument("--hidden-channels", type=int, default=64)
    parser.add_argument("--num-interactions", type=int, default=3)
    parser.add_argument("--file", help="the .atp file (built if missing)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                        help="folder of atom_budget.md / .json")
    parser.add_argument("--figure", type=Path,
                        default=ROOT / "benchmarks" / "figures" / "atom_budget.png")
    parser.add_argument("--memory-child", choices=("fixed", "budget"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child:
        _memory_child(args)
        return 0
    if args.quick:
        args.molecules, args.rounds, args.peak_batches, args.memory_repeats = 300, 2, 1, 1
        args.hidden_channels, args.num_interactions = 16, 1
        if args.file is None:
            args.file = str(args.out / "mixed10_300_quick.atp")
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/atom_budget.py " + " ".join(argv or sys.argv[1:])
    (args.out / "atom_budget.json").write_text(json.dumps(result, indent=1))
    (args.out / "atom_budget.md").write_text(markdown(result, command.strip()))
    figure = args.figure if not args.quick else args.out / "atom_budget.png"
    plot(result, figure)
    print(markdown(result, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
