"""Benchmark: the remote layer's streaming and random-access paths, for paired old/new runs.

Uses only what every version of the library takes, a URL (and the record-block size,
as each version takes it): ``ShardStreamDataset(url)`` over 16 ``.pt`` shards (a
``manifest.json``, whole shards fetched in parts over three connections, the first one
handed out as it arrives) and over one 60 MB ``.atp`` file (record blocks of 4 MiB),
and ``AtompackDataset(url)`` reading 1,500 uniformly random
records by range through a cold page cache. The files are written once under
``benchmarks/_work/remote_paired/`` (git-ignored) and served by the loopback
``ShardServer`` (``tests/servers/http_server.py``) in this process, without a bandwidth
cap: what is timed is the library's own work per byte and per request.

Run the same script against two checkouts and pair the runs (A B A B ...)::

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/remote_paired.py --out a.jsonl

Each run appends one JSON line: seconds of each pass (in-process, after imports and
the server's start) and the samples seen. ``--summary a.jsonl b.jsonl`` prints the
median ratio A/B of each pass over the pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

WORK = HERE / "_work" / "remote_paired"


def _prepare() -> None:
    from big_atp import write_big_atp
    from servers.http_server import write_pt_shards

    pt, atp = WORK / "pt", WORK / "atp"
    if not (pt / "manifest.json").is_file():
        pt.mkdir(parents=True, exist_ok=True)
        write_pt_shards(pt, [400] * 16, atoms=8)
    if not (atp / "big.atp").is_file():
        atp.mkdir(parents=True, exist_ok=True)
        write_big_atp(atp / "big.atp", 64 * 55)


def _run() -> dict:
    from servers.http_server import ShardServer

    from pyg_atompack import AtompackDataset
    from pyg_atompack.stream import ShardStreamDataset

    try:  # the record-block size is a SourceOptions field since session 16; older
        # checkouts (paired against) take it as a keyword
        from pyg_atompack.stream import SourceOptions
        block_options = {"options": SourceOptions(block_bytes=4 << 20)}
    except ImportError:
        block_options = {"block_bytes": 4 << 20}

    server = ShardServer(WORK).start()
    result = {}
    try:
        with tempfile.TemporaryDirectory() as cache:
            started = time.perf_counter()
            stream = ShardStreamDataset(server.url("pt/manifest.json"), prefetch=2,
                                        concurrency=3, shuffle=True, seed=0)
            samples = sum(1 for _ in stream)
            result["stream_pt_s"] = time.perf_counter() - started
            result["stream_pt_samples"] = samples

            started = time.perf_counter()
            blocks = ShardStreamDataset(server.url("atp/big.atp"), prefetch=2, concurrency=3,
                                        **block_options)
            records = sum(1 for _ in blocks)
            result["stream_blocks_s"] = time.perf_counter() - started
            result["stream_blocks_records"] = records

            started = time.perf_counter()
            dataset = AtompackDataset(server.url("atp/big.atp"), cache_dir=cache,
                                      cache_bytes=16 << 20)
            order = random.Random(0).sample(range(len(dataset)), 1500)
            energies = [float(dataset[i].energy) for i in order]
            result["random_access_s"] = time.perf_counter() - started
            result["random_access_ok"] = energies == [float(i) for i in order]
    finally:
        server.stop()
    return result


def _summary(a: Path, b: Path) -> None:
    runs_a = [json.loads(line) for line in a.read_text().splitlines()]
    runs_b = [json.loads(line) for line in b.read_text().splitlines()]
    for key in ("stream_pt_s", "stream_blocks_s", "random_access_s"):
        ratios = [x[key] / y[key] for x, y in zip(runs_a, runs_b)]
        print(f"{key}: A median {statistics.median(r[key] for r in runs_a):.3f} s, "
              f"B median {statistics.median(r[key] for r in runs_b):.3f} s, "
              f"A/B median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} pairs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="append this run's figures (JSON line)")
    parser.add_argument("--summary", type=Path, nargs=2, metavar=("A", "B"))
    args = parser.parse_args()
    if args.summary:
        _summary(*args.summary)
        return
    _prepare()
    result = _run()
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    main()
