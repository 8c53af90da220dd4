"""The headline figures: run the scripts behind them and print the table the README shows.

Usage::

    python benchmarks/headline.py --quick      # make bench-quick (<= 15 min on 2 cores)
    python benchmarks/headline.py              # the full runs of the same scripts
    python benchmarks/headline.py --reprint    # the table of the last run, nothing run
    python benchmarks/headline.py --reprint --readme README.md docs/benchmarks.md

Every row names the script that measures it; this script runs those scripts (their
quick variants with ``--quick``), collects their figures into
``benchmarks/results/headline.json`` and prints the table with the date, the machine
and the versions. ``--readme`` writes the same table between the README's
``<!-- headline:start -->`` and ``<!-- headline:end -->`` markers. ``--skip`` leaves
sources out (their rows say so); ``--tiny`` is the smoke test's run (small files,
short runs: the figures mean nothing, the plumbing is what it checks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "headline.json"
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
OPS = ("f[i]", "read_batch(32)", "read_batch(256)")
# the SchNet figure's setting (RESULTS.md, "SchNet on streamed MD shards"): D/C ~ 1
SCHNET = ["--shard-size", "128", "--max-shards", "4", "--bandwidth", "190000",
          "--concurrency", "2"]


@dataclass(frozen=True)
class Row:
    """One line of the headline table.

    Args:
        source (str): The key of the run that measures it (:data:`SOURCES`).
        script (str): The script that reprints it (relative to the repository).
        what (str): What is compared, as the table says it.
        cells (Callable): ``cells(figures) -> str``: the ratio column from the source's
            figures.
    """

    source: str
    script: str
    what: str
    cells: Callable[[dict], str]


def _ratios(regime: str) -> Callable[[dict], str]:
    def cells(figures: dict) -> str:
        found = {row["operation"]: row["ratio"] for row in figures["rows"]
                 if row["regime"] == regime}
        return " / ".join(f"{found[op]:.2f}×" if op in found else "–" for op in OPS)
    return cells


def _loader(figures: dict) -> str:
    return f"{figures['ratio']:.1f}×"


def _schnet(figures: dict) -> str:
    low, high = figures["ci"]
    return f"{figures['speedup']:.2f}× [{low:.2f}, {high:.2f}] (D/C = {figures['d_over_c']:.2f})"


def _peers(figures: dict) -> str:
    names = ("litdata", "mosaic", "webdataset", "foldpipe", "datasets")
    return " / ".join(f"{figures[name]:.2f}×" if figures.get(name) else "–"
                      for name in names if name in figures)


ROWS = (
    Row("reads", "benchmarks/cold_read.py", "`.atp` reads vs atompack-db, 1 GB file in the page "
        "cache, a fresh reader's first shuffled epoch: `f[i]` / `read_batch(32)` / "
        "`read_batch(256)`", _ratios("epoch")),
    Row("reads", "benchmarks/cold_read.py", "same, later epochs (records read before through "
        "the same reader)", _ratios("hot")),
    Row("reads", "benchmarks/cold_read.py", "same file, larger than memory (page cache held to "
        "1/8 of the file), random reads", _ratios("budget")),
    Row("reads", "benchmarks/cold_read.py", "same file not in the page cache, a whole first "
        "epoch read from the disk (the file fits in memory)", _ratios("cold-epoch")),
    Row("loader", "benchmarks/bench_dataset.py", "`AtompackLoader` vs PyG "
        "`DataLoader(AtompackDataset)`, shuffled batches of 32, 20,000 × 64 atoms in the page "
        "cache", _loader),
    Row("schnet", "benchmarks/paired_schnet.py", "SchNet trained on `.pt` shards streamed from "
        "a throttled loopback server, `ShardStreamDataset` prefetch vs sequential", _schnet),
    Row("peers", "benchmarks/peers.py", "`ShardStreamDataset` vs LitData / MosaicML streaming / "
        "WebDataset (2 workers) / FoldPipe (/ HF `datasets` where run), remote shards, "
        "D/C = 1, wall time", _peers),
)
SOURCES = ("reads", "loader", "schnet", "peers")


def _run(command: list[str], log: Callable[[str], None]) -> str:
    """Run a benchmark script; its output goes to our stderr, its stdout is returned."""
    log("$ " + " ".join(command))
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    return done.stdout


def measure_reads(mode: str, folder: Path, log: Callable[[str], None]) -> dict:
    """``cold_read.py`` in the regimes of the table."""
    out = folder / "cold_read.md"
    command = [sys.executable, str(HERE / "cold_read.py"), "--regimes", "epoch", "hot",
               "budget", "cold-epoch", "--output", str(out)]
    if mode == "quick":
        command += ["--quick"]
    elif mode == "tiny":
        command += ["--molecules", "3000", "--rounds", "1", "--epoch-rounds", "1",
                    "--cold-epoch-rounds", "1", "--records", "256", "--budget-records", "512",
                    "--epoch-operations", "read_batch(256)"]
    sys.stderr.write(_run(command, log))
    return json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))


def measure_loader(mode: str, folder: Path, log: Callable[[str], None]) -> dict:
    """``AtompackLoader`` against PyG's ``DataLoader`` over the same dataset, interleaved."""
    import bench_dataset
    import numpy as np
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(2024)
    molecules, seconds = {"tiny": (640, 0.3), "quick": (20_000, 2.0)}.get(mode, (20_000, 4.0))
    path = folder / "loader.atp"
    bench_dataset.write_atompack_file(path, bench_dataset.molecule_sizes(molecules, 64, rng))
    log(f"loader: {molecules:,} molecules, {seconds:g} s per arm")
    rates = bench_dataset.batches(path, seconds, rng)
    ours, pyg = rates["ours: AtompackLoader"], rates["PyG DataLoader(AtompackDataset)"]
    return {"molecules": molecules, "seconds": seconds, "rates": rates, "ratio": ours / pyg}


def measure_schnet(mode: str, folder: Path, log: Callable[[str], None]) -> dict:
    """``paired_schnet.py`` at its recorded D/C ~ 1 setting (20 pairs; 4 quick)."""
    pairs = {"tiny": "1", "quick": "4"}.get(mode, "20")
    command = [sys.executable, str(HERE / "paired_schnet.py"), *SCHNET, "--pairs", pairs,
               "--out", str(folder), "--figure", str(folder / "schnet.png")]
    if mode == "tiny":
        command += ["--hidden-channels", "16", "--num-interactions", "1", "--max-shards", "2"]
    sys.stderr.write(_run(command, log))
    result = json.loads((folder / "schnet.json").read_text(encoding="utf-8"))
    summary = result["summary"]
    return {"pairs": len(result["pairs"]), "speedup": summary["speedup_geomean"],
            "ci": list(summary["speedup_ci"]), "d_over_c": result["d_over_c"]}


def measure_peers(mode: str, folder: Path, log: Callable[[str], None]) -> dict:
    """``peers.py``: its last line is ours ÷ each peer at D/C = 1."""
    command = [sys.executable, str(HERE / "peers.py")]
    if mode != "full":
        command += ["--quick", "--no-mixed", "--no-workers"]
    else:
        command += ["--out", str(folder / "peers.md")]
    return json.loads(_run(command, log).strip().splitlines()[-1])


MEASURES = {"reads": measure_reads, "loader": measure_loader, "schnet": measure_schnet,
            "peers": measure_peers}


def describe() -> dict:
    """Date, machine and versions of the run."""
    import atompack
    import numpy
    import torch
    import torch_geometric

    import pyg_atompack

    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{os.cpu_count()} cores ({cpu}), "
                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} "
                       f"GiB, Linux {platform.release()}",
            "load": round(os.getloadavg()[0], 1),
            "versions": {"python": platform.python_version(),
                         "pyg_atompack": getattr(pyg_atompack, "__version__", "?"),
                         "torch": torch.__version__, "torch_geometric": torch_geometric.__version__,
                         "numpy": numpy.__version__, "atompack-db": atompack.__version__}}


def build_table(results: dict) -> str:
    """The headline table (markdown) from ``results``: ``{"meta": ..., "figures": ...}``.

    A row whose source was not run, or failed, says so instead of a figure.
    """
    meta, figures = results["meta"], results["figures"]
    lines = ["| what | ours ÷ reference | reprinted by |", "|---|---:|---|"]
    for row in ROWS:
        found = figures.get(row.source)
        if found is None:
            cell = "not run"
        elif "error" in found:
            cell = f"failed: {found['error']}"
        else:
            cell = row.cells(found)
        lines.append(f"| {row.what} | {cell} | `{row.script}` |")
    versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items())
    lines += ["", f"`python benchmarks/headline.py {meta['mode_flag']}`".replace(" `", "`")
              + f" ({meta['mode']} runs), {meta['date']}, {meta['machine']}, load "
              f"{meta['load']} at the start, {meta['minutes']:.1f} min; {versions}. "
              "More than 1×: ours is faster. The machine is shared with other work: "
              "the figures are provisional and move by ±20% between runs."]
    return "\n".join(lines) + "\n"


README_INTRO = ("Ours ÷ the reference or the strongest peer, on a shared 2-core CPU machine; each "
                "row names the script that measures it; what each figure means, the protocols "
                "and every other figure are on the [benchmarks page](docs/benchmarks.md).\n\n")


def replace_between_markers(text: str, table: str, name: str) -> str:
    """``text`` with everything between the headline markers replaced by ``table``.

    Args:
        text (str): The page.
        table (str): The table of :func:`build_table`.
        name (str): The page's file name, for the error and the README's link line.
    """
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{name}: the markers {START} ... {END} were not found (in this "
                         "order)")
    intro = README_INTRO if name == "README.md" else ""
    return text[:start + len(START)] + "\n" + intro + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the quick variants (bench-quick)")
    mode.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    mode.add_argument("--reprint", action="store_true",
                      help="print the table of --results without running anything")
    parser.add_argument("--skip", nargs="*", default=[], choices=SOURCES,
                        help="sources not to run")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="JSON of the figures (written, or read with --reprint)")
    parser.add_argument("--readme", type=Path, nargs="*", default=[],
                        help="also write the table between the headline markers of these "
                             "files (README.md, docs/benchmarks.md)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))  # the benchmark modules import each other by name
    if args.reprint:
        results = json.loads(args.results.read_text(encoding="utf-8"))
    else:
        name = "quick" if args.quick else "tiny" if args.tiny else "full"
        log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
        began = time.perf_counter()
        meta = {**describe(), "mode": name, "mode_flag": "" if name == "full" else f"--{name}"}
        figures = {}
        with tempfile.TemporaryDirectory(prefix="headline-") as tmp:
            for source in SOURCES:
                if source in args.skip:
                    continue
                folder = Path(tmp) / source
                folder.mkdir()
                started = time.perf_counter()
                try:
                    figures[source] = MEASURES[source](name, folder, log)
                except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as exc:
                    # recorded in the table, never dropped: the other rows still stand
                    figures[source] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                log(f"[{source}: {time.perf_counter() - started:.0f} s]")
        meta["minutes"] = (time.perf_counter() - began) / 60
        results = {"meta": meta, "figures": figures}
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1), encoding="utf-8")
    table = build_table(results)
    print(table)
    for page in args.readme:
        try:
            text = replace_between_markers(page.read_text(encoding="utf-8"), table, page.name)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        page.write_text(text, encoding="utf-8")
        print(f"wrote the table into {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
