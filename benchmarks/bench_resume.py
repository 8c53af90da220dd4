"""What exact resume costs: ``state_dict()`` and restarting from it, in milliseconds.

Usage::

    python benchmarks/bench_resume.py [--molecules 100000] [--repeats 7]

For ``AtompackLoader(shuffle=True)`` over an ``.atp`` file and for
``StatefulLoader`` over a ``ShardStreamDataset`` of the same records (``.atp``
shards of 1,000), each with 0 and 2 DataLoader workers, after 50 batches of 32:

* ``state_dict()``: the median time of one call, and the pickled size;
* resume: building a new loader, ``load_state_dict`` and taking the first batch,
  minus the same without a state (a fresh loader's first batch), paired and
  interleaved over ``--repeats``; the difference is what resuming adds (a
  shuffled ``AtompackLoader`` rebuilds one permutation; a stream skips the
  records its shard had already handed out).

A markdown table goes to ``benchmarks/results/resume.md`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pyg_atompack import AtompackDataset, AtompackLoader, ShardStreamDataset, atp
from pyg_atompack.pyg.resume import StatefulLoader
from pyg_atompack.stream import LocalSource

STEPS = 50
BATCH = 32


def write_atp(path: Path, count: int, atoms: int = 21) -> None:
    rng = np.random.default_rng(0)
    with atp.Writer(path) as writer:
        for start in range(0, count, 10_000):
            b = min(10_000, count - start)
            writer.add_batch(rng.normal(size=(b, atoms, 3)).astype(np.float32),
                             np.full((b, atoms), 6, np.uint8), energy=rng.normal(size=b),
                             forces=rng.normal(size=(b, atoms, 3)).astype(np.float32))


def builders(atp_path: Path, shards: Path, workers: int) -> dict:
    def atp_loader():
        return AtompackLoader(AtompackDataset(atp_path), batch_size=BATCH, shuffle=True,
                              seed=0, num_workers=workers)

    def stream_loader():
        dataset = ShardStreamDataset(LocalSource(shards), shuffle=True, seed=0)
        return StatefulLoader(dataset, batch_size=BATCH, num_workers=workers)

    return {f"AtompackLoader, {workers} workers": atp_loader,
            f"StatefulLoader(ShardStreamDataset), {workers} workers": stream_loader}


def measure(build, repeats: int) -> dict:
    loader = build()
    iterator = iter(loader)
    for _ in range(STEPS):
        next(iterator)
    calls = []
    for _ in range(20):
        start = time.perf_counter()
        state = loader.state_dict()
        calls.append(time.perf_counter() - start)
    size = len(pickle.dumps(state))
    del iterator, loader
    resumed, fresh = [], []
    for repeat in range(repeats):
        for arm in (("resume", "fresh") if repeat % 2 == 0 else ("fresh", "resume")):
            start = time.perf_counter()
            loader = build()
            if arm == "resume":
                loader.load_state_dict(state)
            next(iter(loader))
            (resumed if arm == "resume" else fresh).append(time.perf_counter() - start)
            del loader
    extra = sorted(r - f for r, f in zip(resumed, fresh))
    return {"state_ms": statistics.median(calls) * 1e3, "bytes": size,
            "fresh_ms": statistics.median(fresh) * 1e3,
            "extra_ms": statistics.median(extra) * 1e3,
            "extra_range": (extra[0] * 1e3, extra[-1] * 1e3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--molecules", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path,
                        default=Path(__file__).parent / "results" / "resume.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        atp_path = root / "train.atp"
        write_atp(atp_path, args.molecules)
        from pyg_atompack import convert

        convert.convert(atp_path, root / "shards", dst_format="atp-shards",
                        write_options=convert.WriteOptions(shard_size=1000))
        for workers in (0, 2):
            for name, build in builders(atp_path, root / "shards", workers).items():
                result = measure(build, args.repeats)
                low, high = result["extra_range"]
                rows.append(f"| {name} | {result['state_ms']:.3f} | {result['bytes']:,} | "
                            f"{result['fresh_ms']:.1f} | {result['extra_ms']:+.1f} "
                            f"[{low:+.1f}, {high:+.1f}] |")
                print(rows[-1], flush=True)
    load_after = os.getloadavg()
    lines = [
        "# Resume overhead",
        "",
        f"Run {datetime.datetime.now().isoformat(timespec='minutes')} on "
        f"{platform.machine()} / Python {platform.python_version()} / torch "
        f"{torch.__version__}; `python benchmarks/bench_resume.py --molecules "
        f"{args.molecules} --repeats {args.repeats}`. {args.molecules:,} molecules of 21 "
        f"atoms, batches of {BATCH}, state taken after {STEPS} batches; load average "
        f"before / after: {load_before[0]:.2f} / {load_after[0]:.2f} on {os.cpu_count()} "
        "cores (shared machine: absolute times are indicative).",
        "",
        "| loader | `state_dict()` ms | state (pickled bytes) | fresh first batch ms "
        "| resume adds ms (median [range]) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "`state_dict()` copies the latest snapshot (torchdata takes one per step: the",
        "sampler position in the main process, each worker's dataset state as it sends",
        "its batch), so its cost does not grow with the epoch. Resuming costs one",
        "permutation of the dataset (shuffled `AtompackLoader`) or the skipped records'",
        "indices in the shard being read (stream); with workers the first batch waits",
        "for the workers to start either way, and the difference is read against the",
        "spread of that start-up (the range column).",
        "",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
