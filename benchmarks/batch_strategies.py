"""Which ``read_batch`` strategy earns its place: the gathers against per-record decoding.

Usage::

    python benchmarks/batch_strategies.py             # ~1 min, files cached in _work/

``read_batch`` on a mapped uncompressed file has three ways to build a batch of
checked records (``pyg_atompack/atp/batch.py``): one gather per field when all
records share a layout (``gather.read_single``), a gather per group of equal
layout scattered into the output (``gather.read_mapped``: sparse fields, a few
sizes), and one gather per field for records of different sizes sharing one
structure (``structure.read_structured``). The fallback decodes record by record
(``batch._heterogeneous``), the path of compressed files and of records read with
``pread``. This script times each applicable strategy on the same random batches
of the two file kinds where the choice matters:

* ``sparse``: 20,000 x 64 atoms where every other record lacks forces (two
  layouts of one size: the grouped gather or per-record decoding);
* ``mixed``: 20,000 records of 10-300 atoms (runs of 100 of one size, as
  ``regimes.build_file`` writes them; a random batch has about as many layouts as
  records: the structure gather, the grouped gather or per-record decoding).

Records per CPU second, medians of alternating rounds; the load average is
printed (above 3 the figures need a quiet rerun).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import regimes

from pyg_atompack import atp
from pyg_atompack.atp import batch as atp_batch
from pyg_atompack.atp import gather

SPARSE = regimes.WORK / "sparse64_20k.atp"


def build_sparse(path: Path = SPARSE, molecules: int = 20_000, atoms: int = 64) -> Path:
    """Every other record without forces (written once, then reused)."""
    if path.exists():
        return path
    regimes.WORK.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with atp.Writer(path, overwrite=True) as writer:
        for i in range(molecules):
            extra = {"forces": rng.standard_normal((atoms, 3)).astype(np.float32)} \
                if i % 2 == 0 else {}
            writer.add(rng.standard_normal((atoms, 3)).astype(np.float32),
                       rng.integers(1, 90, atoms, dtype=np.uint8),
                       energy=float(rng.standard_normal()),
                       cell=rng.standard_normal((3, 3)), pbc=rng.random(3) < 0.5, **extra)
    return path


def arms_for(reader: atp.Reader, idx: np.ndarray) -> dict:
    """The strategies that apply to batch ``idx``, each a zero-argument callable."""
    st = reader._state()
    infos = atp_batch.resolve_fields(reader.fields, None, reader.name)
    entries = st.index[idx]
    n_atoms = entries["n_atoms"].astype(np.int64)
    lids = atp_batch._checked_layout_ids(st, idx, entries)
    layouts = [st.cache.memo_layouts[lid] for lid in lids.tolist()]
    arms = {
        "grouped gather": lambda: gather.read_mapped(st, idx, entries["offset"], lids,
                                                     n_atoms, infos),
        "per-record decode": lambda: atp_batch._heterogeneous(
            atp_batch._fetch(st, idx, entries, True), layouts, infos, n_atoms, idx,
            st.name, st.pos_dtype),
    }
    if atp_batch._read_structured(st, idx, entries, n_atoms, infos) is not None:
        arms["structure gather"] = lambda: atp_batch._read_structured(st, idx, entries,
                                                                      n_atoms, infos)
    return arms


def run(path: Path, batch: int, batches: int, rounds: int, rng: np.random.Generator) -> dict:
    """Median records per CPU second of each strategy on ``path``."""
    reader = atp.open(path, access="mmap")
    count = len(reader)
    reader.read_batch(np.arange(count))  # every record checked and mapped: hot
    rates: dict[str, list[float]] = {}
    for number in range(rounds):
        work = [np.sort(rng.integers(0, count, batch)) for _ in range(batches)]
        prepared = [arms_for(reader, idx) for idx in work]
        names = list(prepared[0])
        for name in names if number % 2 == 0 else names[::-1]:
            start = time.process_time()
            for arms in prepared:
                arms[name]()
            rates.setdefault(name, []).append(batch * batches / (time.process_time() - start))
    reader.close()
    return {name: statistics.median(values) for name, values in rates.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(5)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    files = {"sparse": build_sparse(), "mixed": regimes.build_file("refmix_20k", 20_000, None)}
    for label, path in files.items():
        for size in args.batch:
            rates = run(path, size, max(4096 // size, 8), args.rounds, rng)
            shown = "  ".join(f"{name} {rate:,.0f}/s" for name, rate in rates.items())
            print(f"[{label}] read_batch({size}): {shown}", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
