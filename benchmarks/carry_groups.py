"""What carrying groups through a sharding conversion costs (``convert --shard-size``).

A framed file of ``--records`` small structures (2 atoms) carries one grouping of
``--records / 2`` groups (two neighbouring records each, a float column), written by
one ``add_groups`` call: one chunk that every output shard takes a slice of. The same
records are also written without groups. Both are converted into `.atp` shards of
``--shard-size`` records, arms interleaved in alternating repetitions; it prints the
median and minimum wall time of each arm and of the metadata planning alone
(``CarriedMetadata.of_source`` + ``check_outputs`` + ``frames_for`` for every shard).

Usage::

    python benchmarks/carry_groups.py [--records 200000] [--shard-size 1000] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from pyg_atompack import atp
from pyg_atompack.convert import ConversionNote, WriteOptions, convert
from pyg_atompack.convert.atp_io import CarriedMetadata


def _write(path: Path, n: int, groups: bool) -> None:
    rng = np.random.default_rng(0)
    db = atp.Writer(path, framed=True)
    db.add_batch(rng.normal(size=(n, 2, 3)), np.ones((n, 2), np.uint8),
                 energy=rng.normal(size=n))
    if groups:
        pairs = np.arange(n - n % 2).reshape(-1, 2)
        db.add_groups("pairs", pairs.tolist(), {"y": rng.normal(size=len(pairs)).tolist()})
    db.flush()
    db.close()


def _plan(src: Path, n: int, shard_size: int) -> None:
    metadata = CarriedMetadata.of_source(src)
    bounds = list(range(0, n, shard_size)) + [n]
    metadata.check_outputs(bounds, "out")
    for a, b in zip(bounds[:-1], bounds[1:]):
        metadata.frames_for(a, b, last=b == n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"no groups": [], "groups": [], "planning alone": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        sources = {"no groups": tmp_path / "plain.atp", "groups": tmp_path / "groups.atp"}
        for arm, path in sources.items():
            _write(path, args.records, arm == "groups")
        for rep in range(args.reps):
            arms = list(sources) if rep % 2 == 0 else list(sources)[::-1]
            for arm in arms:
                out = tmp_path / f"out-{rep}-{arm.replace(' ', '_')}"
                start = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConversionNote)
                    convert(sources[arm], out, write_options=WriteOptions(
                        shard_size=args.shard_size))
                times[arm].append(time.perf_counter() - start)
            start = time.perf_counter()
            _plan(sources["groups"], args.records, args.shard_size)
            times["planning alone"].append(time.perf_counter() - start)
    print(f"{args.records} records, {args.records // 2} groups, shards of {args.shard_size} "
          f"({-(-args.records // args.shard_size)} shards), {args.reps} reps")
    for arm, values in times.items():
        print(f"{arm:>15}: median {statistics.median(values):.3f} s, "
              f"min {min(values):.3f} s")


if __name__ == "__main__":
    main()
