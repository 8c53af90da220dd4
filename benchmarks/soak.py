"""Soak run: many epochs of shard streaming through a fault-injecting loopback server.

``make soak`` runs this script (it is not part of ``make test``). A
``ShardStreamDataset`` with prefetch and concurrent downloads reads a modest set
of small ``.pt`` shards over HTTP for as many epochs as it takes to issue at
least ``--requests`` shard downloads, while the server fails about
``--fault-rate`` of them (HTTP 500, HTTP 429, connection resets, truncated
bodies). After every epoch the script checks that every sample arrived exactly
once and samples the process's resident memory, thread count and open file
descriptors. It writes the figures to ``benchmarks/results/reliability.md`` and
exits non-zero when a sample was lost or duplicated, or when threads or file
descriptors grew.

Example::

    python benchmarks/soak.py --requests 10000
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

# the fault-injecting server is a test helper that lives next to the tests
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from servers.http_server import ShardServer, write_pt_shards  # noqa: E402

from pyg_atompack.stream import RemoteSource, ShardStreamDataset  # noqa: E402
from pyg_atompack.transport import RetryPolicy  # noqa: E402

FAULTS = ("500", "429", "reset", "truncate")
RESULTS = REPO / "benchmarks" / "results" / "reliability.md"


def rss_mib() -> float:
    """Resident set size of this process in MiB (from /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def inject_faults(server: ShardServer, names: list[str], rate: float,
                  rng: random.Random) -> Counter:
    """Queue a fault for about ``rate`` of the shards' next requests."""
    injected: Counter = Counter()
    for name in names:
        if rng.random() < rate:
            kind = rng.choice(FAULTS)
            server.add_fault(name, kind, retry_after=0 if kind == "429" else None,
                             at_fraction=rng.uniform(0.1, 0.9))
            injected[kind] += 1
    return injected


def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="pyg_atompack-soak-"))
    names = write_pt_shards(root, [args.samples] * args.shards, atoms=args.atoms)
    expected = sorted(shard * 1000 + i for shard in range(args.shards)
                      for i in range(args.samples))
    server = ShardServer(root).start()
    policy = RetryPolicy(retries=8, backoff=0.01, max_backoff=0.1, timeout=10)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=policy),
                                 prefetch=args.prefetch, concurrency=args.concurrency,
                                 shuffle=True, seed=args.seed)
    epochs = -(-args.requests // args.shards)
    samples, injected, statuses = [], Counter(), Counter()
    lost = duplicated = requests = delivered = 0
    started = time.perf_counter()
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        injected += inject_faults(server, names, args.fault_rate, rng)
        seen = Counter(int(data.sample_id) for data in dataset)
        lost += sum(1 for i in expected if seen[i] == 0)
        duplicated += sum(count - 1 for count in seen.values() if count > 1)
        delivered += sum(seen.values())
        with server._lock:  # noqa: SLF001 - keep the server's own log from growing
            shard_requests = [r for r in server.requests if r.path != "/manifest.json"]
            requests += len(shard_requests)
            statuses.update(r.fault or str(r.status) for r in shard_requests)
            server.requests.clear()
        samples.append({"epoch": epoch, "rss_mib": rss_mib(), "threads": os_threads(),
                        "py_threads": threading.active_count(), "fds": open_fds(),
                        "elapsed_s": time.perf_counter() - started})
        if args.verbose and epoch % 25 == 0:
            print(f"epoch {epoch}: {samples[-1]}", flush=True)
    elapsed = time.perf_counter() - started
    server.stop()
    return {"args": vars(args), "epochs": epochs, "samples": samples, "lost": lost,
            "duplicated": duplicated, "requests": requests, "injected": injected,
            "statuses": statuses, "elapsed_s": elapsed,
            "delivered": delivered}


def verdict(result: dict) -> list[str]:
    """Problems found by the soak (empty when it passed)."""
    problems = []
    if result["lost"] or result["duplicated"]:
        problems.append(f"{result['lost']} samples lost, {result['duplicated']} duplicated")
    # skip the first epochs: thread pools, the server's sockets and caches warm up there
    warm = result["samples"][min(5, len(result["samples"]) - 1)]
    end = result["samples"][-1]
    if end["threads"] > warm["threads"] + 2:
        problems.append(f"threads grew from {warm['threads']} to {end['threads']}")
    if end["fds"] > warm["fds"] + 2:
        problems.append(f"open file descriptors grew from {warm['fds']} to {end['fds']}")
    if end["rss_mib"] > warm["rss_mib"] * 1.25 + 32:
        problems.append(f"RSS grew from {warm['rss_mib']:.0f} to {end['rss_mib']:.0f} MiB")
    return problems


def render(result: dict, problems: list[str]) -> str:
    s = result["samples"]
    warm = s[min(5, len(s) - 1)]
    rss = [x["rss_mib"] for x in s]
    a = result["args"]
    faults = sum(result["injected"].values())
    lines = [
        "# Reliability figures",
        "",
        "Produced by `benchmarks/soak.py` (`make soak`); rerun it to refresh this file.",
        "Crash, fuzz and multi-rank results are tests, not figures: see docs/guarantees.md.",
        "",
        "## Soak: streaming through a fault-injecting loopback server",
        "",
        f"Setup: {a['shards']} `.pt` shards x {a['samples']} samples ({a['atoms']} atoms each), "
        f"`ShardStreamDataset(prefetch={a['prefetch']}, concurrency={a['concurrency']}, "
        f"shuffle=True)`, {result['epochs']} epochs, fault rate {a['fault_rate']:.0%} of shard "
        f"requests (HTTP 500, HTTP 429, connection reset, truncated body), seed {a['seed']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| shard requests served | {result['requests']} |",
        f"| injected faults | {faults} ({faults / max(result['requests'], 1):.1%}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(result["injected"].items())) + ") |",
        "| faults the server answered | "
        + ", ".join(f"{k} {v}" for k, v in sorted(result["statuses"].items())
                    if k in FAULTS) + " |",
        f"| samples delivered | {result['delivered']} |",
        f"| samples lost / duplicated | {result['lost']} / {result['duplicated']} |",
        f"| wall time | {result['elapsed_s']:.1f} s "
        f"({result['requests'] / result['elapsed_s']:.0f} requests/s) |",
        f"| RSS start (epoch 0) / after warm-up (epoch {warm['epoch']}) / peak / end | "
        f"{rss[0]:.1f} / {warm['rss_mib']:.1f} / {max(rss):.1f} / {rss[-1]:.1f} MiB |",
        f"| OS threads after warm-up / max / end | {warm['threads']} / "
        f"{max(x['threads'] for x in s)} / {s[-1]['threads']} |",
        f"| open fds after warm-up / max / end | {warm['fds']} / "
        f"{max(x['fds'] for x in s)} / {s[-1]['fds']} |",
        f"| verdict | {'PASS' if not problems else 'FAIL: ' + '; '.join(problems)} |",
        "",
        "RSS per tenth of the run (MiB): "
        + ", ".join(f"{s[i]['rss_mib']:.1f}" for i in range(0, len(s), max(len(s) // 10, 1))),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000,
                        help="minimum shard downloads (epochs = requests / shards)")
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--samples", type=int, default=8, help="samples per shard")
    parser.add_argument("--atoms", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--fault-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # retries log warnings; keep the output short

    result = soak(args)
    problems = verdict(result)
    text = render(result, problems)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
