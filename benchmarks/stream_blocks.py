"""Benchmark: record blocks and the block cache on multi-GB remote `.atp` files.

Files (written once under ``benchmarks/_work/stream_blocks/``, git-ignored): ``big4g.atp``
(>= 4 GB), ``big1g.atp`` (~1 GB) and four ~128 MB shards, all of ~17 KB molecules
(``tests/big_atp.py``). They are served by the loopback ``ShardServer``
(``tests/servers/http_server.py``), in its own process, once unthrottled and once with a
per-connection bandwidth limit. Every measurement runs in a fresh child process (so
that its peak RSS is its own).

(a) peak RSS growth while streaming blocks, vs ``block_bytes`` and prefetch ``k``, on
    the 1 GB and the 4 GB file (target ``<= (k + 1) * block_bytes + 20%``), and of
    whole-shard streaming of the 1 GB file for comparison;
(b) time to first sample on the throttled server, including the (cold) metadata fetch,
    blocks vs whole-shard (``split_shards`` over 4 connections);
(c) steady-state samples/s at D/C = 1 (one record's download over one connection takes
    as long as the consumer's compute for it, a sleep per sample) on the 4.69 GB file
    (part ``C``: the first ``--samples-c`` samples; blocks vs the whole shard vs local
    mmap reads of the same file) and, from an earlier run, on the four 143 MB shards
    (part ``c``);
(d) random access through the page cache at cache sizes of 5/25/100% of the file: on
    the 4.69 GB file over the throttled server (part ``D``: the cache warmed to that
    share, then ``--samples-d`` uniformly random records in batches of 64) and, from
    an earlier run, two epochs over one 143 MB shard (part ``d``): samples/s and bytes
    downloaded per sample;
(e) shuffle quality: the distances in stored order between consecutive samples of one
    epoch of the 4 GB file (the real planning and ordering functions, without decoding),
    against a global permutation.

Run: ``.venv/bin/python benchmarks/stream_blocks.py [--parts abCD]``; writes
``benchmarks/results/stream_blocks.md`` (+ ``.json``) and
``benchmarks/figures/stream_blocks.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from harness import PeakSampler, ServerProcess, serve_http  # noqa: E402

WORK = HERE / "_work" / "stream_blocks"
MiB = 1 << 20
SLEEP_PER_SAMPLE = 0.0005  # the consumer's "training step" in (c)


# ------------------------------------------------------------------ data and server
def build_files() -> dict[str, int]:
    from big_atp import write_big_atp, write_manifest

    WORK.mkdir(parents=True, exist_ok=True)
    plan = {"big4g.atp": 64 * 3900, "big1g.atp": 64 * 960}
    plan.update({f"part{k}.atp": 64 * 120 for k in range(4)})
    counts = {}
    for seed, (name, records) in enumerate(plan.items()):
        path = WORK / name
        if not path.exists():
            print(f"writing {name} ...", flush=True)
            temp = path.with_suffix(".tmp")
            temp.unlink(missing_ok=True)
            counts[name] = write_big_atp(temp, records, seed=seed)
            temp.rename(path)
        else:
            counts[name] = records
    if not _manifest_is_current(WORK, list(plan)):  # hashing 6 GB takes a while: once
        write_manifest(WORK, list(plan), [counts[n] for n in plan])
    # manifests of the four small shards alone and of the 4 GB file alone (hard links,
    # entries copied from the main manifest: nothing is hashed again)
    entries = {e["name"]: e for e in json.loads((WORK / "manifest.json").read_text())["shards"]}
    for folder, names in (("parts", [f"part{k}.atp" for k in range(4)]), ("big", ["big4g.atp"])):
        (WORK / folder).mkdir(exist_ok=True)
        for name in names:
            if not (WORK / folder / name).exists():
                os.link(WORK / name, WORK / folder / name)
        (WORK / folder / "manifest.json").write_text(
            json.dumps({"shards": [entries[n] for n in names]}))
    return counts


def _manifest_is_current(root: Path, names: list[str]) -> bool:
    path = root / "manifest.json"
    if not path.exists():
        return False
    listed = {e["name"]: e for e in json.loads(path.read_text())["shards"]}
    return all(n in listed and listed[n]["bytes"] == (root / n).stat().st_size
               and path.stat().st_mtime >= (root / n).stat().st_mtime for n in names)


# ------------------------------------------------------------------ child measurements
def child_stream(spec: dict) -> dict:
    """Stream ``spec["limit"]`` samples; RSS growth, time to first sample, samples/s."""
    from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions

    started = time.perf_counter()
    source = RemoteSource(spec["url"])
    if spec.get("only"):
        source._shards = tuple(s for s in source.list_shards() if s.name == spec["only"])
    # threads: the blocks' memory in this process, whose resident set is sampled
    dataset = ShardStreamDataset(source,
                                 options=SourceOptions(blocks=spec["blocks"],
                                                       block_bytes=spec.get("block", 64 * MiB),
                                                       cache_dir=spec["cache"],
                                                       retrieval="threads"), prefetch=spec["k"],
                                 concurrency=spec.get("c", 1))
    opened = time.perf_counter()
    count, first = 0, None
    with PeakSampler(interval=0.005) as rss:
        for _ in dataset:
            if first is None:
                first = time.perf_counter()
            count += 1
            if spec.get("sleep"):
                time.sleep(spec["sleep"])
            if count >= spec["limit"]:
                break
        ended = time.perf_counter()
    return {"open_s": opened - started, "first_s": first - started, "count": count,
            "rate": (count - 1) / max(ended - first, 1e-9), "total_s": ended - started,
            "rss_growth": rss.growth}


def child_local(spec: dict) -> dict:
    """Local mmap reads of the same files, with the same per-sample consumer."""
    from pyg_atompack import atp
    from pyg_atompack.pyg import record_to_data

    started = time.perf_counter()
    count, limit = 0, spec.get("limit")
    for path in spec["paths"]:
        with atp.open(path) as reader:
            for i in range(len(reader)):
                record_to_data(reader[i])
                count += 1
                time.sleep(spec["sleep"])
                if count == limit:
                    break
        if count == limit:
            break
    return {"count": count, "rate": count / (time.perf_counter() - started)}


def child_random(spec: dict) -> dict:
    """Two shuffled epochs through the page cache; rate of the second, bytes per sample."""
    import torch

    from pyg_atompack import AtompackDataset, AtompackLoader

    dataset = AtompackDataset(spec["url"], cache_dir=spec["cache"],
                              cache_bytes=spec["cache_bytes"])
    reader = dataset.reader
    rates = []
    for epoch in range(2):
        loader = AtompackLoader(dataset, batch_size=64, shuffle=True,
                                generator=torch.Generator().manual_seed(epoch))
        started = time.perf_counter()
        count = sum(batch.num_graphs for batch in loader)
        rates.append(count / (time.perf_counter() - started))
    stats = reader.cache.stats
    return {"rate_epoch2": rates[1], "rate_epoch1": rates[0],
            "bytes_per_sample": stats["fetched_bytes"] / (2 * len(dataset)),
            "requests": stats["requests"], "disk_bytes": reader.cache.disk_bytes(),
            "record_bytes": float(reader.index["stored"].mean())}


def child_random_big(spec: dict) -> dict:
    """Random batches through a page cache warmed to ``fraction`` of the file.

    The cache is warmed through the unthrottled server (the first ``fraction`` of the
    file's bytes, in 64 MiB reads, without decoding); the measurement then reads
    ``samples`` uniformly random records, in batches of 64 through ``AtompackLoader``,
    from the throttled server. Both URLs name the same content (the manifest's
    sha256), so they share the cache. Once warm, LRU over uniform random reads keeps
    about ``fraction`` of the pages, so the hit ratio is that of steady training.
    """
    from pyg_atompack import AtompackDataset, AtompackLoader
    from pyg_atompack.remote.record_reader import open_remote_atp, range_readers

    options = {"cache_dir": spec["cache"], "cache_bytes": spec["cache_bytes"]}
    if spec.get("page_bytes"):
        options["page_bytes"] = spec["page_bytes"]

    def remote(url: str) -> AtompackDataset:  # AtompackDataset(url, cache_...) + page size
        return AtompackDataset(open_remote_atp(range_readers(url), **options))

    warm = remote(spec["warm_url"]).reader
    started = time.perf_counter()
    end = int(spec["fraction"] * warm.range_reader.size)
    for start in range(0, end, 64 * MiB):
        warm.cache.pages(warm.range_reader, [(start, min(start + 64 * MiB, end))])
    warm_s = time.perf_counter() - started
    dataset = remote(spec["url"])
    reader = dataset.reader
    assert reader.range_reader.identity == warm.range_reader.identity
    order = np.random.default_rng(spec.get("seed", 0)).integers(0, len(dataset),
                                                                spec["samples"])
    before = dict(reader.cache.stats)
    started = time.perf_counter()
    count = sum(batch.num_graphs for batch in AtompackLoader(dataset, batch_size=64,
                                                             sampler=order.tolist()))
    elapsed = time.perf_counter() - started
    delta = {k: reader.cache.stats[k] - before[k] for k in before}
    # the reference: the same records, same batches, from the local file (memory map)
    local = AtompackDataset(spec["local_path"])
    started = time.perf_counter()
    local_count = sum(batch.num_graphs for batch in AtompackLoader(local, batch_size=64,
                                                                   sampler=order.tolist()))
    local_rate = local_count / (time.perf_counter() - started)
    return {"rate": count / elapsed, "local_rate": local_rate, "count": count,
            "warm_s": warm_s,
            "warm_bytes": end, "bytes_per_sample": delta["fetched_bytes"] / count,
            "requests_per_sample": delta["requests"] / count,
            "hit_ratio": delta["hits"] / max(1, delta["hits"] + delta["misses"]),
            "evicted": delta["evicted"], "disk_bytes": reader.cache.disk_bytes(),
            "record_bytes": float(reader.index["stored"].mean())}


def run_child(kind: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{kind} {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ (e) shuffle quality
def shuffle_distances(path: Path, block: int, interleave: int, buffer: int) -> np.ndarray:
    from types import SimpleNamespace

    from pyg_atompack.atp.images import plan_blocks
    from pyg_atompack.remote.atp_meta import load_meta
    from pyg_atompack.remote.ranges import FileRangeReader
    from pyg_atompack.stream.blocks import Block, plan_block_stream
    from pyg_atompack.stream.ordering import interleave_shards, mix_across_shards
    from pyg_atompack.stream.progress import StreamProgress
    from pyg_atompack.stream.splitting import StreamSlot

    meta = load_meta(FileRangeReader(path), WORK / "cache-e")
    bounds = plan_blocks(meta, block).tolist()
    blocks = [Block(0, a, b, a) for a, b in zip(bounds[:-1], bounds[1:])]
    slot = StreamSlot()
    plan = plan_block_stream(blocks, slot, shuffle=True, seed=0, epoch=0)
    shards = (SimpleNamespace(position=p, index=b.global_first,
                              samples=range(b.first, b.stop))
              for p, b in enumerate(plan.blocks))
    rng = np.random.default_rng([0, 0, 0, 0, 11])
    items = interleave_shards(shards, interleave, rng, StreamProgress(0, slot), {},
                              shuffle=True, seed=0, epoch=0, transform=None)
    order = np.fromiter((sample for _, _, sample in mix_across_shards(items, buffer, rng)),
                        dtype=np.int64)
    return np.abs(np.diff(order))


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", default="abCD",
                        help="measurements to (re)run (c, d: on the four 143 MB shards; "
                             "C, D: on the 4.69 GB file); the others are taken from the "
                             "last run's benchmarks/_work/stream_blocks/partial.json")
    parser.add_argument("--reps", type=int, default=2,
                        help="interleaved repetitions of (C)")
    parser.add_argument("--samples-c", type=int, default=30_000,
                        help="samples streamed per arm in (C)")
    parser.add_argument("--samples-d", type=int, default=3_200,
                        help="random samples read per cache size in (D)")
    parser.add_argument("--steady-only", type=int, default=0, metavar="REPS",
                        help="rerun only (c), with REPS interleaved repetitions, into "
                             "results/stream_blocks_steady.json")
    args = parser.parse_args()
    if args.steady_only:
        steady_only(args.steady_only)
        return
    counts = build_files()
    sizes = {name: (WORK / name).stat().st_size for name in counts}
    bandwidth = 17e6  # bytes/s per connection; ~ one 128 MB shard per 7.5 s
    record_bytes = sizes["part0.atp"] / counts["part0.atp"]
    sleep = SLEEP_PER_SAMPLE
    # D/C = 1: one shard over one connection takes as long as its samples' sleeps
    dc_bandwidth = record_bytes / sleep
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "uptime": os.popen("uptime").read().strip(), "sizes": sizes,
                     "record_bytes": record_bytes, "quick": args.quick}
    partial_path = WORK / "partial.json"
    partial = json.loads(partial_path.read_text()) if partial_path.exists() else {}
    results.update({k: v for k, v in partial.items() if k in (
        "rss", "rss_whole_1g_mib", "ttfs", "steady", "dc_bandwidth", "random",
        "steady_big", "random_big")})
    free = ServerProcess(serve_http, str(WORK), None)
    slow = ServerProcess(serve_http, str(WORK), bandwidth)
    dc = ServerProcess(serve_http, str(WORK / "parts"), dc_bandwidth)
    dc_big = (ServerProcess(serve_http, str(WORK / "big"), dc_bandwidth)
              if "C" in args.parts else None)
    try:
        if "C" in args.parts:  # (c) on the 4 GB file
            results["steady_big"] = steady_big(dc_big.base_url, counts["big4g.atp"], sleep,
                                               dc_bandwidth, reps=args.reps,
                                               limit=args.samples_c)
            _save(partial_path, results)
        if "D" in args.parts:  # (d) on the 4 GB file
            results["random_big"] = random_big(free.base_url, slow.base_url, sizes,
                                               samples=args.samples_d)
            results["random_big_bandwidth"] = bandwidth
            _save(partial_path, results)
        cache = tempfile.mkdtemp(prefix="stream-blocks-")
        # (a) RSS growth
        rss = []
        if "a" not in args.parts:
            rss = None
        for name in ("big1g.atp", "big4g.atp") if rss is not None else ():
            for block in (16 * MiB, 64 * MiB):
                for k in (1, 3):
                    limit = int((k + 4) * block / record_bytes)
                    spec = {"url": f"{free.base_url}/manifest.json", "only": name, "k": k,
                            "blocks": True, "block": block, "cache": cache, "limit": limit}
                    got = run_child("stream", spec)
                    rss.append({"file": name, "block_mib": block // MiB, "k": k,
                                "growth_mib": got["rss_growth"] / MiB,
                                "target_mib": 1.2 * (k + 1) * block / MiB})
                    print("a", rss[-1], flush=True)
        if rss is not None:
            whole = run_child("stream", {"url": f"{free.base_url}/manifest.json",
                                         "only": "big1g.atp", "k": 1, "blocks": False,
                                         "cache": cache, "limit": counts["big1g.atp"]})
            results["rss"] = rss
            results["rss_whole_1g_mib"] = whole["rss_growth"] / MiB
            print("a whole", whole, flush=True)
            _save(partial_path, results)
        # (b) time to first sample (cold metadata cache each time)
        ttfs = {}
        for name in ("big1g.atp", "big4g.atp") if "b" in args.parts else ():
            got = run_child("stream", {"url": f"{slow.base_url}/manifest.json", "only": name,
                                       "k": 1, "blocks": True, "cache": tempfile.mkdtemp(),
                                       "limit": 1})
            index_bytes = 8 + 20 * counts[name]
            ttfs[name] = {"blocks_s": got["first_s"], "metadata_s": got["open_s"],
                          "one_block_plus_meta_s": (64 * MiB + index_bytes + 8192) / bandwidth}
            print("b", name, ttfs[name], flush=True)
        if "b" in args.parts:
            got = run_child("stream", {"url": f"{slow.base_url}/manifest.json",
                                       "only": "big1g.atp", "k": 1, "c": 4, "blocks": False,
                                       "cache": cache, "limit": 1})
            ttfs["big1g.atp"]["whole_shard_s"] = got["first_s"]
            ttfs["big4g.atp"]["whole_shard_estimate_s"] = sizes["big4g.atp"] / (4 * bandwidth)
            results["ttfs"] = ttfs
            print("b whole", got, flush=True)
            _save(partial_path, results)
        # (c) steady state at D/C = 1, arms interleaved
        total = 4 * counts["part0.atp"]
        steady = {"blocks": [], "whole": [], "local": []}
        for _ in range(0 if "c" not in args.parts else 1 if args.quick else 2):
            base = {"url": f"{dc.base_url}/manifest.json", "k": 1, "cache": cache,
                    "limit": total, "sleep": sleep}
            steady["blocks"].append(run_child("stream", {**base, "blocks": True,
                                                         "block": 32 * MiB})["total_s"])
            steady["whole"].append(run_child("stream", {**base, "blocks": False})["total_s"])
            steady["local"].append(total / run_child("local", {
                "paths": [str(WORK / f"part{k}.atp") for k in range(4)],
                "sleep": sleep})["rate"])
            print("c", {k: v[-1] for k, v in steady.items()}, flush=True)
        if "c" in args.parts:
            results["steady"] = {k: {"total_s": float(np.median(v)),
                                     "samples_per_s": total / float(np.median(v)),
                                     "runs_s": v} for k, v in steady.items()}
            results["dc_bandwidth"] = dc_bandwidth
            _save(partial_path, results)
        # (d) random access through the cache
        random_access = []
        for fraction in (0.05, 0.25, 1.0) if "d" in args.parts else ():
            got = run_child("random", {"url": f"{free.base_url}/part0.atp",
                                       "cache": tempfile.mkdtemp(),
                                       "cache_bytes": int(fraction * sizes["part0.atp"]) + MiB})
            random_access.append({"fraction": fraction, **got})
            print("d", random_access[-1], flush=True)
        if "d" in args.parts:
            results["random"] = random_access
            _save(partial_path, results)
    finally:
        free.stop()
        slow.stop()
        dc.stop()
        if dc_big is not None:
            dc_big.stop()
    # (e) shuffle quality
    quality = {}
    n = counts["big4g.atp"]
    glob = np.abs(np.diff(np.random.default_rng(0).permutation(n)))
    quality["global permutation"] = glob
    for interleave, buffer in ((1, 0), (1, 10000), (4, 10000)):
        label = f"blocks 64 MiB, interleave={interleave}, shuffle_buffer={buffer}"
        quality[label] = shuffle_distances(WORK / "big4g.atp", 64 * MiB, interleave, buffer)
    results["shuffle"] = {label: {"median": float(np.median(d)),
                                  "below_1000": float((d < 1000).mean()),
                                  "below_records_per_block": float(
                                      (d < 64 * MiB / record_bytes).mean())}
                          for label, d in quality.items()}
    write_outputs(results, quality)


def steady_big(base_url: str, records: int, sleep: float, bandwidth: float, *, reps: int,
               limit: int) -> dict:
    """(c) on the 4.69 GB file at D/C = 1: the first ``limit`` samples of one epoch.

    Arms, interleaved and rotated per repetition: blocks (64 MiB, k = 1 and k = 2,
    one connection), the whole shard (k = 1, one connection: its first sample waits
    for all 4.69 GB) and local mmap reads of the same file. Steady state = samples/s
    after the first sample; the time to ``limit`` samples includes the wait.
    """
    cache = tempfile.mkdtemp(prefix="stream-blocks-C-")
    base = {"url": f"{base_url}/manifest.json", "cache": cache, "limit": limit,
            "sleep": sleep}
    arms = {
        "blocks k=1": lambda: run_child("stream", {**base, "k": 1, "blocks": True}),
        "blocks k=2": lambda: run_child("stream", {**base, "k": 2, "blocks": True}),
        "whole shard k=1": lambda: run_child("stream", {**base, "k": 1, "blocks": False}),
        "local mmap": lambda: _local_arm(limit, sleep),
    }
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    names = list(arms)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(arms[name]())
            print("C", rep, name, runs[name][-1], flush=True)
    whole = [r["rate"] for r in runs["whole shard k=1"]]
    out = {"records": records, "limit": limit, "bandwidth": bandwidth, "sleep": sleep,
           "uptime": os.popen("uptime").read().strip(), "arms": {}}
    for name, got in runs.items():
        rates = [r["rate"] for r in got]
        out["arms"][name] = {
            "rate_runs": rates, "first_s_runs": [r.get("first_s") for r in got],
            "total_s_runs": [r["total_s"] for r in got],
            "rss_mib_runs": [r.get("rss_growth", 0) / MiB for r in got],
            "ratio_to_whole": float(np.median(np.asarray(rates) / np.asarray(whole))),
        }
    return out


def _local_arm(limit: int, sleep: float) -> dict:
    started = time.perf_counter()
    got = run_child("local", {"paths": [str(WORK / "big4g.atp")], "sleep": sleep,
                              "limit": limit})
    return {"rate": got["rate"], "first_s": 0.0, "total_s": time.perf_counter() - started}


def random_big(free_url: str, slow_url: str, sizes: dict, *, samples: int) -> list[dict]:
    """(d) on the 4.69 GB file: page cache of 5 / 25 / 100% of it, warmed, then random."""
    out = []
    for fraction, page in ((0.05, None), (0.05, 64 << 10), (0.25, None), (1.0, None)):
        cache = Path(tempfile.mkdtemp(prefix="stream-blocks-D-", dir=WORK))
        try:
            got = run_child("random_big", {"page_bytes": page,
                "warm_url": f"{free_url}/big/manifest.json",
                "url": f"{slow_url}/big/manifest.json", "cache": str(cache),
                "local_path": str(WORK / "big4g.atp"),
                "cache_bytes": int(fraction * sizes["big4g.atp"]) + MiB,
                "fraction": fraction, "samples": samples})
        finally:
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
        out.append({"fraction": fraction, "page_kib": (page or 256 << 10) >> 10, **got,
                    "uptime": os.popen("uptime").read().strip()})
        print("D", out[-1], flush=True)
    return out


def _save(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=1))


def steady_only(reps: int) -> None:
    """(c) alone: blocks (k=1 and k=4, the lookahead bytes of one whole shard) vs whole
    shards (k=1) vs local mmap, ``reps`` interleaved repetitions, rotating the order."""
    counts = build_files()
    record_bytes = (WORK / "part0.atp").stat().st_size / counts["part0.atp"]
    dc = ServerProcess(serve_http, str(WORK / "parts"), record_bytes / SLEEP_PER_SAMPLE)
    total = 4 * counts["part0.atp"]
    cache = tempfile.mkdtemp(prefix="stream-blocks-")
    base = {"url": f"{dc.base_url}/manifest.json", "cache": cache, "limit": total,
            "sleep": SLEEP_PER_SAMPLE}
    arms = {
        "blocks k=1": lambda: run_child("stream", {**base, "k": 1, "blocks": True,
                                                   "block": 32 * MiB})["total_s"],
        "blocks k=4": lambda: run_child("stream", {**base, "k": 4, "blocks": True,
                                                   "block": 32 * MiB})["total_s"],
        "whole k=1": lambda: run_child("stream", {**base, "k": 1, "blocks": False})["total_s"],
        "local mmap": lambda: total / run_child("local", {
            "paths": [str(WORK / f"part{k}.atp") for k in range(4)],
            "sleep": SLEEP_PER_SAMPLE})["rate"],
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    try:
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                times[name].append(arms[name]())
            print("c", rep, {k: v[-1] for k, v in times.items()}, flush=True)
    finally:
        dc.stop()
    ratios = {name: float(np.median(np.asarray(times["whole k=1"]) / np.asarray(v)))
              for name, v in times.items()}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "uptime": os.popen("uptime").read().strip(), "times_s": times,
           "median_ratio_to_whole": ratios, "samples": total}
    (HERE / "results" / "stream_blocks_steady.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out["median_ratio_to_whole"]))


def write_outputs(results: dict, quality: dict) -> None:
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "stream_blocks.json").write_text(json.dumps(results, indent=1))
    lines = [f"# Record blocks and the block cache ({results['date']})", "",
             f"Machine load: `{results['uptime']}`. Files: " + ", ".join(
                 f"{k} {v / 1e9:.2f} GB" for k, v in results["sizes"].items()
                 if not k.startswith("part")) + f", four shards of "
             f"{results['sizes']['part0.atp'] / 1e6:.0f} MB; records "
             f"{results['record_bytes'] / 1e3:.1f} kB." +
             (" **Reduced run (--quick).**" if results["quick"] else ""), "",
             "## (a) Peak RSS growth, blocks", "",
             "| file | block_bytes | k | growth MiB | target (k+1)·block+20% |",
             "|---|---:|---:|---:|---:|"]
    for r in results["rss"]:
        lines.append(f"| {r['file']} | {r['block_mib']} MiB | {r['k']} | "
                     f"{r['growth_mib']:.0f} | {r['target_mib']:.0f} |")
    lines += ["", f"Whole-shard streaming of big1g.atp (prefetch 1): "
              f"{results['rss_whole_1g_mib']:.0f} MiB.", "",
              "## (b) Time to first sample (17 MB/s per connection, cold metadata)", "",
              "| file | blocks s | of which metadata s | target 2×(block+metadata) s | "
              "whole shard s |", "|---|---:|---:|---:|---:|"]
    for name, t in results["ttfs"].items():
        whole = t.get("whole_shard_s")
        whole = f"{whole:.1f}" if whole is not None else \
            f"≈{t['whole_shard_estimate_s']:.0f} (size / 4 connections, not run)"
        lines.append(f"| {name} | {t['blocks_s']:.2f} | {t['metadata_s']:.2f} | "
                     f"{2 * t['one_block_plus_meta_s']:.2f} | {whole} |")
    big = results.get("steady_big")
    if big:
        reps = len(big["arms"]["local mmap"]["rate_runs"])
        lines += ["", "## (c) Steady state at D/C = 1, the 4.69 GB file", "",
                  f"One connection at {big['bandwidth'] / 1e6:.1f} MB/s (one record's "
                  f"download = the consumer's {big['sleep'] * 1e3:.1f} ms sleep per sample), "
                  f"the first {big['limit']} samples of an epoch, {reps} "
                  f"interleaved repetitions (order rotated); load `{big['uptime']}`. "
                  "Steady state = samples/s after the first sample; ratio = median of the "
                  "per-repetition ratios to the whole-shard arm.", "",
                  "| arm | samples/s (runs) | ratio to whole shard | first sample s | "
                  f"time to {big['limit']} samples s | peak RSS growth MiB |",
                  "|---|---|---:|---|---|---|"]
        for arm, r in big["arms"].items():
            lines.append(
                f"| {arm} | {', '.join(f'{x:.0f}' for x in r['rate_runs'])} | "
                f"{r['ratio_to_whole']:.2f} | "
                f"{', '.join(f'{x:.1f}' for x in r['first_s_runs'])} | "
                f"{', '.join(f'{x:.0f}' for x in r['total_s_runs'])} | "
                + (", ".join(f"{x:.0f}" for x in r["rss_mib_runs"]) if arm != "local mmap"
                   else "(file mapping)") + " |")
    steady = results["steady"]
    lines += ["", "## (c') Steady state at D/C = 1, four 143 MB shards (earlier run)", "",
              "| arm | samples/s | ratio to whole shards |", "|---|---:|---:|"]
    for arm in ("blocks", "whole", "local"):
        lines.append(f"| {arm} | {steady[arm]['samples_per_s']:.0f} | "
                     f"{steady[arm]['samples_per_s'] / steady['whole']['samples_per_s']:.2f} |")
    steady_file = HERE / "results" / "stream_blocks_steady.json"
    if steady_file.exists():  # the interleaved rerun of (c) (--steady-only)
        rerun = json.loads(steady_file.read_text())
        lines += ["", f"Rerun of (c) alone, interleaved repetitions ({rerun['date']}, "
                  f"`{rerun['uptime']}`), median of per-repetition ratios to whole shards:",
                  "", "| arm | runs (s) | ratio |", "|---|---|---:|"]
        for arm, runs in rerun["times_s"].items():
            lines.append(f"| {arm} | {', '.join(f'{t:.1f}' for t in runs)} | "
                         f"{rerun['median_ratio_to_whole'][arm]:.2f} |")
    rand = results.get("random_big")
    if rand:
        lines += ["", "## (d) Random access through the page cache, the 4.69 GB file", "",
                  f"Server throttled to {results['random_big_bandwidth'] / 1e6:.0f} MB/s per "
                  "connection (8 range requests in flight); the cache is "
                  "first warmed with the first 5 / 25 / 100% of the file's bytes through an "
                  "unthrottled server (same content identity), then "
                  f"{rand[0]['count']} uniformly random records are read in shuffled "
                  "batches of 64 (`AtompackLoader`); records "
                  f"{rand[0]['record_bytes'] / 1e3:.1f} kB.", "",
                  "| cache | page | samples/s | local mmap samples/s (same records) | ratio | "
                  "downloaded bytes/sample | requests/sample | page hit ratio | "
                  "cache on disk | warm-up s | load |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rand:
            lines.append(
                f"| {r['fraction']:.0%} | {r['page_kib']} KiB | {r['rate']:.0f} | "
                f"{r['local_rate']:.0f} | "
                f"{r['rate'] / r['local_rate']:.2f} | "
                f"{r['bytes_per_sample'] / 1e3:.1f} kB | {r['requests_per_sample']:.2f} | "
                f"{r['hit_ratio']:.2f} | {r['disk_bytes'] / 1e9:.2f} GB | "
                f"{r['warm_s']:.0f} | {r['uptime'].split('load average:')[-1].strip()} |")
    lines += ["", "## (d') Random access through the page cache, one 143 MB shard "
              "(earlier run, two epochs)", "",
              "| cache | samples/s epoch 1 | samples/s epoch 2 | downloaded bytes/sample "
              "| requests |", "|---:|---:|---:|---:|---:|"]
    for r in results["random"]:
        lines.append(f"| {r['fraction']:.0%} | {r['rate_epoch1']:.0f} | "
                     f"{r['rate_epoch2']:.0f} | {r['bytes_per_sample'] / 1e3:.0f} kB | "
                     f"{r['requests']} |")
    lines += ["", "## (e) Shuffle quality (distance in stored order between consecutive "
              "samples, 4 GB file)", "", "| order | median | < 1000 | within one block's "
              "record count |", "|---|---:|---:|---:|"]
    for label, q in results["shuffle"].items():
        lines.append(f"| {label} | {q['median']:.0f} | {q['below_1000']:.1%} | "
                     f"{q['below_records_per_block']:.1%} |")
    lines.append("")
    lines.append("![shuffle and memory](../figures/stream_blocks.png)")
    (HERE / "results" / "stream_blocks.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rand = results.get("random_big")
    fig, axes = plt.subplots(1, 3 if rand else 2, figsize=(16.5 if rand else 11, 4))
    left, right = axes[0], axes[1]
    for label, distances in quality.items():
        ordered = np.sort(distances) + 1
        left.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)
    left.set_xscale("log")
    left.set_xlabel("|index difference| + 1 between consecutive samples")
    left.set_ylabel("fraction of consecutive pairs (CDF)")
    left.set_title("(e) shuffle quality, one epoch of the 4 GB file")
    left.legend(fontsize=7)
    for name in ("big1g.atp", "big4g.atp"):
        rows = [r for r in results["rss"] if r["file"] == name]
        right.plot([f"{r['block_mib']}M k{r['k']}" for r in rows],
                   [r["growth_mib"] for r in rows], "o-", label=f"{name} growth")
    right.plot([f"{r['block_mib']}M k{r['k']}" for r in rows], [r["target_mib"] for r in rows],
               "k--", label="target")
    right.set_ylabel("peak RSS growth (MiB)")
    right.set_title("(a) memory vs block_bytes and k")
    right.legend(fontsize=7)
    if rand:
        third = axes[2]
        labels = [f"{r['fraction']:.0%}, {r['page_kib']} KiB" for r in rand]
        third.bar(labels, [r["rate"] for r in rand], color="tab:blue", width=0.5)
        third.set_xlabel("page cache size (share of the 4.69 GB file), page size")
        third.set_ylabel("random samples/s", color="tab:blue")
        twin = third.twinx()
        twin.plot(labels, [r["bytes_per_sample"] / 1e3 for r in rand], "o-", color="tab:red")
        twin.set_ylabel("downloaded kB per sample", color="tab:red")
        third.set_title("(d) random access through the page cache")
    fig.tight_layout()
    (HERE / "figures").mkdir(exist_ok=True)
    fig.savefig(HERE / "figures" / "stream_blocks.png", dpi=120)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kinds = {"stream": child_stream, "local": child_local, "random": child_random,
                 "random_big": child_random_big}
        print(json.dumps(kinds[sys.argv[2]](json.loads(sys.argv[3]))))
    else:
        main()
