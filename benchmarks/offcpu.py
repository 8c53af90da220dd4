"""Where the wall-clock time of first-touch reads goes: per thread, on and off the CPU.

Usage::

    python benchmarks/offcpu.py                       # 640k and mixed files, ~1 min
    python benchmarks/offcpu.py --sizes 640k --rounds 5

For the *first touch* regime of ``bench_atp.py`` (file in the page cache, a fresh
reader per run) every arm reads the same random indices per round, arm order
reversed every round, and each run is measured from the kernel's own counters:

* wall clock, and the process's CPU time split into the calling thread and every
  other thread of the process (``/proc/self/task/*/schedstat``: nanoseconds on
  the CPU, nanoseconds runnable but waiting for a core, time slices);
* minor / major page faults and voluntary / involuntary context switches
  (``getrusage``).

*cores* is CPU time ÷ wall clock: above 1 an arm runs on more than one core at a
time. Arms: our ``read_batch`` under ``access="auto"`` with the first-touch
helper of ``atp/prefault.py`` and without it (``prefault.MIN_RECORDS`` raised
out of reach), atompack-db's ``get_molecules_flat``, and per-record ``f[i]`` /
``db[i]``. Figures are medians over rounds; the machine's load is recorded.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import atompack
import numpy as np
import regimes

from pyg_atompack import atp
from pyg_atompack.atp import prefault

OUT = Path(__file__).resolve().parent / "results" / "offcpu.md"


def _tasks() -> dict[str, tuple[int, int, int]]:
    """``tid -> (ns on CPU, ns waiting for a CPU, time slices)`` of every thread."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as handle:
                run, wait, slices = (int(v) for v in handle.read().split())
        except OSError:  # a thread that ended
            continue
        out[tid] = (run, wait, slices)
    return out


def measure(run, work) -> dict[str, float]:
    """Run ``run(work)`` once; the counters of the run (see the module docstring)."""
    me = str(__import__("threading").get_native_id())
    usage0, tasks0 = resource.getrusage(resource.RUSAGE_SELF), _tasks()
    start = time.perf_counter()
    items = run(work)
    wall = time.perf_counter() - start
    usage1, tasks1 = resource.getrusage(resource.RUSAGE_SELF), _tasks()
    main = [b - a for a, b in zip(tasks0.get(me, (0, 0, 0)), tasks1[me])]
    other = [0, 0, 0]
    for tid, after in tasks1.items():
        if tid != me:
            before = tasks0.get(tid, (0, 0, 0))
            other = [o + b - a for o, a, b in zip(other, before, after)]
    per = 1e6 / items
    return {"wall": wall * per, "main cpu": main[0] / 1e3 / items,
            "other cpu": other[0] / 1e3 / items, "main wait": main[1] / 1e3 / items,
            "other wait": other[1] / 1e3 / items,
            "cores": (main[0] + other[0]) / 1e9 / wall,
            "faults": (usage1.ru_minflt - usage0.ru_minflt) / items,
            "major": (usage1.ru_majflt - usage0.ru_majflt) / items,
            "voluntary": (usage1.ru_nvcsw - usage0.ru_nvcsw) / items,
            "involuntary": (usage1.ru_nivcsw - usage0.ru_nivcsw) / items}


def arms(path: Path, batch: int):
    """name -> ``run(indices) -> items``, each opening a fresh reader (first touch)."""
    def ours(helper: bool):
        def run(indices):
            saved = prefault.MIN_RECORDS
            prefault.MIN_RECORDS = saved if helper else 1 << 62
            try:
                with atp.open(path, access="auto") as reader:
                    if batch == 1:
                        for i in indices:
                            molecule = reader[i]
                            for key in regimes.FIELDS:
                                getattr(molecule, key)
                    else:
                        for s in range(0, len(indices), batch):
                            reader.read_batch(indices[s:s + batch])
                    helper_task = reader._state().cache.helper
                    if helper_task is not None:
                        helper_task.result()  # its CPU time belongs to this run
            finally:
                prefault.MIN_RECORDS = saved
            return len(indices)
        return run

    def reference(indices):
        db = atompack.Database.open(str(path))
        if batch == 1:
            for i in indices:
                molecule = db[i]
                for key in regimes.FIELDS:
                    getattr(molecule, key)
        else:
            for s in range(0, len(indices), batch):
                db.get_molecules_flat(indices[s:s + batch])
        del db
        return len(indices)

    if batch == 1:
        return {"ours f[i]": ours(False), "atompack-db db[i]": reference}
    return {"ours": ours(True), "ours, no helper": ours(False), "atompack-db": reference}


COLUMNS = ("wall", "main cpu", "other cpu", "main wait", "other wait", "cores", "faults",
           "voluntary", "involuntary")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["640k", "mixed"],
                        choices=list(regimes.SIZES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32, 128, 256])
    parser.add_argument("--records", type=int, default=5120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=OUT)
    args = parser.parse_args(argv)
    load0 = os.getloadavg()
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    lines = ["# First-touch reads: on and off the CPU, per thread\n",
             f"`python benchmarks/offcpu.py {' '.join(argv or sys.argv[1:])}`\n",
             f"- date: {time.strftime('%Y-%m-%dT%H:%M:%S')}",
             f"- machine: `{uname}`, {os.cpu_count()} CPUs",
             f"- atompack-db {atompack.__version__}, numpy {np.__version__}",
             f"- load average before: {' / '.join(f'{v:.2f}' for v in load0)}", ""]
    table = ["| file | batch | arm | " + " | ".join(COLUMNS) + " |",
             "|---|---:|---|" + "---:|" * len(COLUMNS)]
    rng = np.random.default_rng(0)
    for size in args.sizes:
        stem, molecules, atoms = regimes.SIZES[size]
        path = regimes.build_file(stem, molecules, atoms)
        regimes.warm(path)
        count = len(atp.open(path))
        for batch in args.batches:
            contenders = arms(path, batch)
            samples: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            names = list(contenders)
            for number in range(args.rounds):
                work = rng.integers(0, count, args.records).tolist()
                for name in names if number % 2 == 0 else names[::-1]:
                    gc.collect()
                    samples[name].append(measure(contenders[name], work))
            for name, runs in samples.items():
                med = {key: statistics.median(r[key] for r in runs) for key in COLUMNS}
                cells = " | ".join(f"{med[key]:.2f}" for key in COLUMNS)
                table.append(f"| {size} | {batch} | {name} | {cells} |")
                print(table[-1], flush=True)
    load1 = os.getloadavg()
    lines[5] += f"; after: {' / '.join(f'{v:.2f}' for v in load1)}"
    lines += ["Per record: *wall* µs of wall clock; *main cpu* / *other cpu* µs on a CPU in the "
              "calling thread / in every other thread; *main wait* / *other wait* µs runnable "
              "but waiting for a core; *cores* CPU ÷ wall; *faults*, *voluntary*, "
              "*involuntary*: minor page faults and context switches per record. Medians of "
              f"{args.rounds} rounds of {args.records:,} random records, fresh reader per run "
              "(opened and closed inside the measured run, for both readers), file in the "
              "page cache.", "", *table, ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
