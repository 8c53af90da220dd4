"""What a framed file's CRC-32 check costs per record (``docs/atp-format.md`` §15).

A framed file's record is checked (CRC-32 of its frame header and stored bytes)
on its first read through a reader; later reads skip the check. This measures,
in one process, the same records written twice (``atp.Writer`` with
``framed=False`` and ``framed=True``), arms interleaved in alternating repetitions:

* ``first f[i]``: a fresh reader reads every record once, shuffled (each read is a
  first read: the check runs);
* ``first read_batch(32)``: a fresh reader reads every record once in shuffled
  batches of 32;
* ``again f[i]``: the same reader reads every record a second time (no check);
* ``zlib.crc32`` alone over each record's frame header and stored bytes, and the
  package's check alone on pages already mapped (median and minimum: the minimum is
  the figure least disturbed by other processes on a shared machine).

Times are the process's CPU time (``time.process_time``: every operation runs on one
thread), which other processes on a shared machine disturb less than wall time. Per
operation it prints the median and the minimum per record of each arm, the ratio
framed / 0.4.1 and the difference in µs per record (what the check costs).

Usage::

    python benchmarks/framed_crc.py [--records 20000] [--atoms 64 8] [--codecs none zstd]
        [--reps 7] [--out benchmarks/results/framed_crc.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from pyg_atompack import atp

# CPU time of this process: what the check costs, less disturbed than wall time by the
# other processes of a shared machine (every operation here runs on one thread)
_clock = time.process_time


def _write(path: Path, codec: str, count: int, atoms: int, framed: bool) -> None:
    rng = np.random.default_rng(0)
    with atp.Writer(path, compression=codec, framed=framed, overwrite=True) as w:
        for start in range(0, count, 1000):
            b = min(1000, count - start)
            w.add_batch(rng.random((b, atoms, 3), dtype=np.float32),
                        rng.integers(1, 90, (b, atoms)), energy=rng.random(b),
                        forces=rng.random((b, atoms, 3), dtype=np.float32))


def _first_items(path: Path, order: np.ndarray) -> float:
    reader = atp.Reader(path, access="mmap")
    start = _clock()
    for i in order.tolist():
        reader[i]
    took = _clock() - start
    reader.close()
    return took


def _first_batches(path: Path, order: np.ndarray) -> float:
    reader = atp.Reader(path, access="mmap")
    start = _clock()
    for at in range(0, len(order), 32):
        reader.read_batch(order[at:at + 32])
    took = _clock() - start
    reader.close()
    return took


def _again_items(path: Path, order: np.ndarray) -> float:
    reader = atp.Reader(path, access="mmap")
    for i in order.tolist():
        reader[i]
    start = _clock()
    for i in order.tolist():
        reader[i]
    took = _clock() - start
    reader.close()
    return took


def _crc_only(path: Path, order: np.ndarray) -> float:
    data = memoryview(path.read_bytes())
    index = atp.Reader(path).index
    spans = [(int(index["offset"][i]) - 20, int(index["stored"][i])) for i in order.tolist()]
    start = _clock()
    for at, stored in spans:
        zlib.crc32(data[at + 20:at + 20 + stored], zlib.crc32(data[at:at + 16]))
    return _clock() - start


def _check_only(path: Path, order: np.ndarray) -> float:
    """The package's check alone (``FrameCheck.check`` through the index entry), on
    pages already mapped: what a first read adds besides moving its page faults."""
    from pyg_atompack.atp import cache

    reader = atp.Reader(path, access="mmap")
    st = reader._state()
    listed = order.tolist()
    for i in listed:
        cache.entry(st, i)  # maps the pages
    st.frames.ok[:] = bytes(len(st.frames.ok))
    start = _clock()
    for i in listed:
        cache.entry(st, i)
    took = _clock() - start
    reader.close()
    return took


OPERATIONS = {"first f[i]": _first_items, "first read_batch(32)": _first_batches,
              "again f[i]": _again_items}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20000)
    parser.add_argument("--atoms", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--codecs", nargs="+", default=["none", "zstd"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = ["| codec | atoms | stored B/record | operation | 0.4.1 µs/rec (median; min) | "
             "framed µs/rec | ratio | CRC cost µs/rec |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs:
            for atoms in args.atoms:
                plain, framed = Path(tmp) / "plain.atp", Path(tmp) / "framed.atp"
                _write(plain, codec, args.records, atoms, False)
                _write(framed, codec, args.records, atoms, True)
                stored = float(atp.Reader(framed).index["stored"].mean())
                order = np.random.default_rng(1).permutation(args.records)
                for name, run in OPERATIONS.items():
                    times = {False: [], True: []}
                    for rep in range(args.reps):  # alternate which arm goes first
                        for arm in ((False, True) if rep % 2 == 0 else (True, False)):
                            times[arm].append(run(framed if arm else plain, order))
                    a = statistics.median(times[False]) / args.records * 1e6
                    b = statistics.median(times[True]) / args.records * 1e6
                    a0 = min(times[False]) / args.records * 1e6
                    b0 = min(times[True]) / args.records * 1e6
                    lines.append(f"| {codec} | {atoms} | {stored:.0f} | {name} | {a:.2f}; "
                                 f"{a0:.2f} | {b:.2f}; {b0:.2f} | {b / a:.2f}; {b0 / a0:.2f} "
                                 f"| {b - a:+.2f}; {b0 - a0:+.2f} |")
                    print(lines[-1], flush=True)
                for name, run in (("zlib.crc32 alone", _crc_only),
                                  ("package check alone", _check_only)):
                    took = [run(framed, order) for _ in range(args.reps)]
                    lines.append(f"| {codec} | {atoms} | {stored:.0f} | {name} (median; min) "
                                 f"| | {statistics.median(took) / args.records * 1e6:.2f}; "
                                 f"{min(took) / args.records * 1e6:.2f} | | |")
                    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
