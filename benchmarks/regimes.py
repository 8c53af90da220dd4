"""Real-size read benchmarks: cached test files, page-cache regimes, paired rounds.

Shared by ``bench_atp.py`` and ``bench_dataset.py``.

Files are written once by atompack-db into ``benchmarks/_work/`` (git-ignored) and
reused while their build parameters (kept in a ``.json`` beside them) match.

Three cache regimes, applied before every timed run of every arm:

* ``hot``: one reader per arm, opened once; every page of the file was touched
  through it before the first round (the steady state of a small data set).
* ``first``: the file is in the page cache (read through once with ``pread``
  before the regime), but each run opens a fresh reader, so each record is the
  first touch of its page through that reader's mapping (page faults, page-table
  set-up, per-reader memos): the first epoch of a data set that fits in RAM.
* ``epoch``: as ``first`` (file in the page cache, a fresh reader per run), but a
  run reads *every* record once, in a shuffled order: a whole first epoch. A short
  ``first`` run touches under 1% of a 1 GB file, so nearly every record it reads
  pays a whole page fault (the kernel maps 16 pages around it; the run uses one or
  two of them) and a fresh reader's per-size set-up is shared by a few records
  only; over an epoch both are spread over every record. ``bench_atp.py`` runs it
  for the default access mode only (a run takes seconds).
* ``cold``: every reader is closed (a mapped page cannot be dropped) and the file
  is evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each run, so reads
  go to the disk: a data set larger than RAM. :func:`resident_fraction` (``mincore``
  through ctypes) checks that the eviction worked; the benchmark prints it.

Within a round every arm runs once on the same indices, the arm order reverses
every round, and the reported figures are the medians over rounds of each arm's
rate (items per wall-clock second and per CPU second of the process). Ratios are
of those medians. On this shared machine (2 cores, several other users) the
wall-clock rate of an arm depends on how much of a core it got; CPU time counts
only the work (including page faults), so the CPU ratio is the steadier one for
the hot and first-touch regimes. Cold reads wait for the disk: wall-clock only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

WORK = Path(__file__).resolve().parent / "_work"
REGIMES = ("hot", "first", "cold")
EPOCH = "epoch"  # a whole shuffled pass of a fresh reader (bench_atp.py)
READ_REGIMES = ("hot", "first", EPOCH, "cold")  # bench_atp.py's order, tables and figure
SIZES = {  # name -> (file stem, molecules, atoms per molecule or None for 10-300)
    "20k": ("ref64_20k", 20_000, 64),
    "640k": ("ref64_640k", 640_000, 64),
    "mixed": ("refmix_260k", 260_000, None),
}
FIELDS = ("positions", "atomic_numbers", "energy", "forces", "cell", "pbc")
CHUNK = 10_000  # molecules generated and written per step (keeps memory flat)


def build_file(name: str, molecules: int, atoms: int | None, seed: int = 0,
               codec: str = "none") -> Path:
    """The atompack-db-written file ``name`` under ``_work/``, built on first use.

    Args:
        name: file stem.
        molecules: molecule count.
        atoms: atoms per molecule, or None for sizes drawn uniformly from 10-300.
        seed: random seed of the values.
        codec: atompack-db compression.

    Returns:
        The path.
    """
    import atompack

    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"{name}.atp"
    meta = WORK / f"{name}.json"
    params = {"molecules": molecules, "atoms": atoms, "seed": seed, "codec": codec,
              "version": 1}
    if path.exists() and meta.exists() and json.loads(meta.read_text()) == params:
        return path
    print(f"building {path} ({molecules:,} molecules)", flush=True)
    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression=codec, overwrite=True)
    for start in range(0, molecules, CHUNK):
        count = min(CHUNK, molecules - start)
        if atoms is None:
            # equal sizes in runs of 100 keep add_arrays_batch stacked; runs are mixed
            sizes = np.repeat(rng.integers(10, 301, size=(count + 99) // 100), 100)[:count]
        else:
            sizes = np.full(count, atoms)
        for n in np.unique(sizes).tolist():
            k = int((sizes == n).sum())
            db.add_arrays_batch(
                rng.standard_normal((k, n, 3)).astype(np.float32),
                rng.integers(1, 90, size=(k, n), dtype=np.uint8),
                energy=rng.standard_normal(k),
                forces=rng.standard_normal((k, n, 3)).astype(np.float32),
                cell=rng.standard_normal((k, 3, 3)),
                pbc=rng.random((k, 3)) < 0.5,
            )
    db.flush()
    del db
    meta.write_text(json.dumps(params))
    return path


# ------------------------------------------------------------------ page cache control
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def evict(path: Path) -> None:
    """Drop the file's clean pages from the page cache (no mapping may hold them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    """Read the whole file once so that it sits in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, 1 << 22):
            pass
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float:
    """Share of the file's pages in the page cache (``mincore`` of a fresh mapping)."""
    size = path.stat().st_size
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        address = _mapping_address(mm)
        if _libc.mincore(ctypes.c_void_p(address), size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        resident = np.frombuffer(vec.raw, np.uint8) & 1
    return float(resident.mean())


def _mapping_address(mm: mmap.mmap) -> int:
    # a read-only mmap exports a read-only buffer; numpy gives its address without copying
    return np.frombuffer(mm, np.uint8).ctypes.data


# ------------------------------------------------------------------ paired rounds
class Arm:
    """One contender: how to open it, touch it, run it on a set of indices, close it.

    Args:
        open: makes a fresh handle (a reader).
        run: ``run(handle, work) -> items`` does the timed work.
        touch: ``touch(handle)`` reads every record once (the hot regime's set-up).
        close: releases the handle (default: ``handle.close()`` if it has one).
    """

    def __init__(self, open: Callable[[], object], run: Callable[[object, object], int],
                 touch: Callable[[object], None] | None = None,
                 close: Callable[[object], None] | None = None) -> None:
        self.open, self.run = open, run
        self.touch = touch or (lambda h: None)
        self.close = close or (lambda h: getattr(h, "close", lambda: None)())


def paired(arms: dict[str, Arm], regime: str, path: Path,
           works: Sequence[object]) -> dict[str, tuple[float, float]]:
    """Median rates of every arm over ``len(works)`` rounds in ``regime``.

    Args:
        arms: name -> arm.
        regime: ``"hot"``, ``"first"``, ``"epoch"`` or ``"cold"``.
        path: the file (evicted before each cold run).
        works: one work item per round (e.g. an index list), the same for every arm.

    Returns:
        ``(items per wall-clock second, items per CPU second)`` per arm, each the
        median over rounds. CPU time is the process's (user + system, all threads:
        page faults included, waiting for the disk or for a core not); on a
        machine shared with other work it is the steadier measure of the work an
        arm does, wall-clock the one a user sees.
    """
    names = list(arms)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu_rates: dict[str, list[float]] = {name: [] for name in names}
    handles: dict[str, object] = {}
    if regime == "hot":
        for name in names:
            handles[name] = arms[name].open()
            arms[name].touch(handles[name])
    elif regime in ("first", EPOCH):
        warm(path)
    for number, work in enumerate(works):
        order = names if number % 2 == 0 else names[::-1]
        for name in order:
            arm = arms[name]
            if regime == "cold":
                evict(path)
            handle = handles[name] if regime == "hot" else arm.open()
            cpu = time.process_time()
            start = time.perf_counter()
            items = arm.run(handle, work)
            rates[name].append(items / (time.perf_counter() - start))
            cpu_rates[name].append(items / max(time.process_time() - cpu, 1e-9))
            if regime != "hot":
                arm.close(handle)
            handle = None  # a live mapping would pin its pages against the next eviction
            gc.collect()
    for name, handle in handles.items():
        arms[name].close(handle)
    return {name: (statistics.median(rates[name]), statistics.median(cpu_rates[name]))
            for name in names}
