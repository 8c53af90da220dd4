"""Benchmark: the tuned stream (``memory_budget=``) against a grid of fixed settings.

A loopback HTTP server in its own process (``tests/servers/http_server.py`` through
``harness.serve_http``) limits every connection's bandwidth so that one connection takes
``D/C`` (default 8) times the consumer's compute time ``C`` per shard. The consumer sleeps
(``--consumer sleep``, GIL free) or holds the GIL (``--consumer gil``, a pure-Python
loop, like a loop launching GPU kernels) for ``C / samples`` per sample. Arms, in
rotating order each round:

* ``fixed p,c``: ``ShardStreamDataset(prefetch=p, concurrency=c)`` for every ``p`` in
  ``--prefetch`` and ``c`` in ``--concurrency`` (default 1,2,4 x 1,2,4,8);
* ``tuned``: ``ShardStreamDataset(memory_budget=...)`` (default 1 GiB), its settings
  chosen by ``pyg_atompack.stream.autotune`` while it runs.

Each arm's pass time is the median over ``--rounds``; the figure is *best fixed pass ÷
tuned pass* (≥ 0.8 is the target of issue #31, point 6), with the tuned stream's final
choice and its decisions from ``stats()["autotune"]``.

Run: ``.venv/bin/python benchmarks/autotune.py [--ratio 8] [--rounds 3] [--quick]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import ServerProcess, hold_gil, serve_http

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from servers.http_server import write_pt_shards  # noqa: E402

from pyg_atompack.stream import RemoteSource, ShardStreamDataset  # noqa: E402

CONSUMERS = {"sleep": time.sleep, "gil": hold_gil}


def run_pass(base_url: str, compute_per_sample: float, consumer: str,
             **settings: object) -> tuple[float, dict]:
    source = RemoteSource(f"{base_url}/manifest.json")  # listed before the clock starts
    dataset = ShardStreamDataset(source, **settings)
    step = CONSUMERS[consumer]
    started = time.perf_counter()
    count = 0
    for _ in dataset:
        step(compute_per_sample)
        count += 1
    elapsed = time.perf_counter() - started
    return elapsed, {"samples": count, **{key: value for key, value in dataset.stats().items()
                                          if key in ("wait_s", "autotune")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=8.0, help="D/C of one connection")
    parser.add_argument("--compute", type=float, default=0.1, help="C, seconds per shard")
    parser.add_argument("--shards", type=int, default=12)
    parser.add_argument("--samples", type=int, default=20, help="samples per shard")
    parser.add_argument("--atoms", type=int, default=300)
    parser.add_argument("--prefetch", default="1,2,4")
    parser.add_argument("--concurrency", default="1,2,4,8")
    parser.add_argument("--memory-budget", type=int, default=1 << 30)
    parser.add_argument("--consumer", choices=sorted(CONSUMERS), default="sleep")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a 2 x 2 grid, one round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.prefetch, args.concurrency, args.rounds = "1,2", "2,8", 1
    grid = [(p, c) for p in map(int, args.prefetch.split(","))
            for c in map(int, args.concurrency.split(","))]
    root = Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    names = write_pt_shards(root, [args.samples] * args.shards, atoms=args.atoms)
    shard_bytes = max((root / name).stat().st_size for name in names)
    bandwidth = shard_bytes / (args.ratio * args.compute)
    compute_per_sample = args.compute / args.samples
    server = ServerProcess(serve_http, str(root), bandwidth)
    arms = [f"fixed {p},{c}" for p, c in grid] + ["tuned"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    details: dict[str, dict] = {}
    print(f"{args.shards} shards of {shard_bytes / 1e3:.0f} kB, {bandwidth / 1e3:.0f} kB/s per "
          f"connection (D/C = {args.ratio} at C = {args.compute} s), consumer "
          f"{args.consumer}, {args.rounds} round(s)", flush=True)
    try:
        for round_number in range(args.rounds):
            shift = round_number % len(arms)
            for arm in arms[shift:] + arms[:shift]:  # rotating order: drift hits all arms
                if arm == "tuned":
                    settings = {"memory_budget": args.memory_budget}
                else:
                    p, c = map(int, arm.removeprefix("fixed ").split(","))
                    settings = {"prefetch": p, "concurrency": c}
                elapsed, detail = run_pass(server.base_url, compute_per_sample,
                                           args.consumer, **settings)
                assert detail["samples"] == args.shards * args.samples, detail
                times[arm].append(elapsed)
                details[arm] = detail
                print(f"  round {round_number} {arm:<12s} {elapsed:6.2f} s", flush=True)
    finally:
        server.stop()
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    best = min((arm for arm in arms if arm != "tuned"), key=medians.get)
    ratio = medians[best] / medians["tuned"]
    tuned = details["tuned"]["autotune"]
    ceiling = args.shards * args.compute
    print(f"\nconsumer alone (the ceiling): {ceiling:.2f} s")
    for arm in sorted(arms, key=medians.get):
        print(f"  {arm:<12s} {medians[arm]:6.2f} s  ({ceiling / medians[arm]:.2f} of ceiling)")
    print(f"best fixed: {best} ({medians[best]:.2f} s); tuned {medians['tuned']:.2f} s; "
          f"best fixed / tuned = {ratio:.2f}")
    print(f"tuned chose prefetch {tuned['prefetch']}, concurrency {tuned['concurrency']}:")
    for decision in tuned["decisions"]:
        print(f"  {decision['at_s']:7.3f} s {decision['event']:<8s} -> prefetch "
              f"{decision['prefetch']}, concurrency {decision['concurrency']}: "
              f"{decision['reason']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"medians": medians, "best": best, "ratio": ratio,
                                         "times": times, "tuned": tuned}, indent=1))


if __name__ == "__main__":
    main()
