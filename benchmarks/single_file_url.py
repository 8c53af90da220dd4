"""Benchmark: one big `.atp` file behind a single http URL (issue #30, item 8).

The file (written once under ``benchmarks/_work/single_file_url/``, git-ignored;
``tests/big_atp.py``: ~18.7 kB molecules, record ``i`` has energy ``i``) is served by
the loopback ``ShardServer`` (``tests/servers/http_server.py``) in its own process,
with a per-connection bandwidth limit chosen so that one plain GET of the file takes
about ``--download-s`` seconds. Every measurement runs in a fresh child process (its
peak RSS is its own; DataLoader workers are sampled as its children) with a fresh,
cold metadata cache.

(a) ``ShardStreamDataset(url, options=SourceOptions(block_bytes=16 MiB), prefetch=2)``,
    one process and two DataLoader workers: peak RSS growth over the child's baseline
    after its imports (target ``3 * block_bytes * 1.2 + 64 MiB``), time from
    construction to the first sample against the time of one plain GET of the whole
    file over the same server,
    measured in the same run (target <= 25%), and every record exactly once (the count
    and the sorted energies equal ``range(n)``); the record-block plan is reported
    (``dataset.blocks``, ``dataset.stats()``).
(b) ``AtompackDataset(url, cache_dir=tmp, cache_bytes=64 MiB)``: uniformly random
    records in batches of 64 through ``AtompackLoader``: peak bytes of the page cache
    on disk (target <= ``cache_bytes`` + one page) and of the whole cache directory
    (pages + metadata), peak RSS growth, and the batches equal (sha256 of every
    tensor) to the same batches read from the local file.

Run: ``.venv/bin/python benchmarks/single_file_url.py [--quick]``; writes
``benchmarks/results/single_file_url.md`` (``single_file_url_quick.md`` with
``--quick``: a 65 MB file, 4 MiB blocks, a 16 MiB page cache, the same code paths)
and prints the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from harness import PeakSampler, ServerProcess, dir_bytes, serve_http  # noqa: E402

WORK = HERE / "_work" / "single_file_url"
MiB = 1 << 20

#: Full and quick settings: records written (multiples of 64), block size, seconds a
#: plain GET of the file should take, random records read in (b) and the page cache's
#: bound there (quick: a quarter of the file, so that pages are evicted as in the full run).
MODES = {
    "full": {"records": 64 * 520, "block": 16 * MiB, "download_s": 30.0, "random": 3200,
             "cache_bytes": 64 * MiB},
    "quick": {"records": 64 * 56, "block": 4 * MiB, "download_s": 3.0, "random": 512,
              "cache_bytes": 16 * MiB},
}


# ------------------------------------------------------------------ memory of a process tree
def _memory(pid: int | str) -> tuple[int, int] | None:
    """``(resident, resident not file-backed)`` bytes of a process (``None`` once gone).

    The second is ``RssAnon + RssShmem``: heap and buffers (block buffers are shared
    anonymous maps, counted as shmem), without the pages of libraries and files.
    """
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if line.startswith(
                ("VmRSS", "RssFile")))
        resident, files = (int(fields[k].split()[0]) << 10 for k in ("VmRSS", "RssFile"))
        return resident, resident - files
    except (OSError, KeyError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found.extend(int(c) for c in handle.read().split())
    except OSError:
        pass
    return found


class TreeSampler(PeakSampler):
    """Peak RSS growth of this process plus the children it starts; peak bytes of folders.

    At every sample the growth of the tree is this process's RSS minus its RSS at
    construction plus, for each child, its RSS minus its RSS when first seen (a forked
    DataLoader worker starts with its parent's resident pages mapped); the peak of that
    sum is reported, for the whole resident set and for its part that is not
    file-backed (heap and buffers, not the pages of libraries that a child maps in as
    it first runs their code). Folders are walked at every
    sample (cheap for a page cache of a few hundred files).

    Args:
        folders (dict[str, str], optional): Name -> folder whose size is tracked.
        interval (float, optional): Seconds between samples.
    """

    def __init__(self, folders: dict[str, str] | None = None, interval: float = 0.005):
        self.folders = folders or {}
        self.interval = interval
        self.baseline = _memory("self")
        self.peak = self.peak_anon = self.peak_main = 0
        self.first: dict[int, tuple[int, int]] = {}  # child pid -> its first sample
        self.peak_disk = dict.fromkeys(self.folders, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)  # PeakSampler's loop

    def _sample(self) -> None:
        own = _memory("self")
        growth = [own[0] - self.baseline[0], own[1] - self.baseline[1]]
        self.peak_main = max(self.peak_main, growth[0])
        for pid in _children(os.getpid()):
            now = _memory(pid)
            if now is None:
                continue
            first = self.first.setdefault(pid, now)
            growth[0] += now[0] - first[0]
            growth[1] += now[1] - first[1]
        self.peak = max(self.peak, growth[0])
        self.peak_anon = max(self.peak_anon, growth[1])
        for name, folder in self.folders.items():
            self.peak_disk[name] = max(self.peak_disk[name], dir_bytes(folder))

    def __enter__(self) -> TreeSampler:
        self._sample()  # the children's first samples are their baselines
        return super().__enter__()


# ------------------------------------------------------------------ data and server
def build_file(records: int, name: str, work: Path) -> tuple[Path, int]:
    """Write ``name`` with about ``records`` records once; returns its path and count."""
    from big_atp import write_big_atp

    work.mkdir(parents=True, exist_ok=True)
    path = work / name
    if not path.exists():
        print(f"writing {path} ...", flush=True)
        temp = path.with_suffix(".tmp")
        temp.unlink(missing_ok=True)
        write_big_atp(temp, records, seed=30)
        temp.rename(path)
    return path, records


def plain_download(url: str) -> float:
    """Seconds of one plain GET of ``url``, its body read in 1 MiB chunks and dropped."""
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=120) as response:
        while response.read(MiB):
            pass
    return time.perf_counter() - started


# ------------------------------------------------------------------ child measurements
def _warm_imports() -> None:
    # what iteration imports lazily is imported before the baseline
    import torch  # noqa: F401
    import torch_geometric.data  # noqa: F401
    from torch.utils.data import DataLoader  # noqa: F401

    import pyg_atompack.stream  # noqa: F401
    from pyg_atompack import AtompackDataset, AtompackLoader  # noqa: F401
    from pyg_atompack.remote import record_reader  # noqa: F401


def child_stream(spec: dict) -> dict:
    """(a): stream the whole file once; RSS growth, first sample, records seen."""
    _warm_imports()
    import numpy as np
    from torch.utils.data import DataLoader

    from pyg_atompack.stream import ShardStreamDataset, SourceOptions

    workers = spec["workers"]
    energies = []
    with TreeSampler() as memory:
        started = time.perf_counter()
        dataset = ShardStreamDataset(spec["url"],
                                     options=SourceOptions(block_bytes=spec["block"],
                                                           cache_dir=spec["cache"]), prefetch=2)
        opened = time.perf_counter()
        first = None
        if workers:
            items = DataLoader(dataset, batch_size=None, num_workers=workers)
        else:
            items = dataset
        for sample in items:
            if first is None:
                first = time.perf_counter()
            energies.append(float(sample.energy))
        ended = time.perf_counter()
    energies = np.sort(np.asarray(energies))
    stats = dataset.stats()
    blocks = dataset.blocks or []
    return {
        "workers": workers, "open_s": opened - started, "first_s": first - started,
        "total_s": ended - started, "count": len(energies),
        "exactly_once": bool(len(energies) == spec["records"] and np.array_equal(
            energies, np.arange(spec["records"], dtype=np.float64))),
        "rss_growth": memory.peak, "anon_growth": memory.peak_anon,
        "main_growth": memory.peak_main, "processes": 1 + len(memory.first),
        "blocks": len(blocks),
        "block_records": [int(min(b.records for b in blocks)),
                          int(max(b.records for b in blocks))] if blocks else None,
        "shard_size": dataset.shards[0].size,
        "stats": {k: stats.get(k) for k in ("shards", "bytes", "structures", "wait_s",
                                            "peak_live_shards", "io_s", "total_s")},
    }


def _digest(batch) -> str:
    digest = hashlib.sha256()
    for key in ("pos", "z", "energy", "forces", "batch"):
        digest.update(batch[key].numpy().tobytes())
    return digest.hexdigest()


def child_random(spec: dict) -> dict:
    """(b): random records through the page cache; disk, RSS, equality to local reads."""
    _warm_imports()
    import numpy as np

    from pyg_atompack import AtompackDataset, AtompackLoader

    cache = Path(spec["cache"])
    order = np.random.default_rng(spec["seed"]).integers(0, spec["records"], spec["samples"])
    order = order.tolist()
    with TreeSampler({"pages": str(cache / "pages"), "cache": str(cache)},
                     interval=0.01) as memory:
        started = time.perf_counter()
        dataset = AtompackDataset(spec["url"], cache_dir=str(cache),
                                  cache_bytes=spec["cache_bytes"])
        remote = [_digest(b) for b in AtompackLoader(dataset, batch_size=64, sampler=order)]
        elapsed = time.perf_counter() - started
    reader = dataset.reader  # a RemoteAtpReader: records through its page cache
    stats = dict(reader.cache.stats)
    # the reference, after the measurement: the same batches from the local file
    local = AtompackDataset(spec["path"])
    same = remote == [_digest(b) for b in AtompackLoader(local, batch_size=64, sampler=order)]
    return {"samples": len(order), "elapsed_s": elapsed, "rate": len(order) / elapsed,
            "equal_to_local": same, "batches": len(remote),
            "peak_pages": memory.peak_disk["pages"], "peak_cache": memory.peak_disk["cache"],
            "page_bytes": reader.page_bytes,
            "rss_growth": memory.peak, "anon_growth": memory.peak_anon,
            "reader": type(reader).__name__,
            "fetched_bytes": stats.get("fetched_bytes"), "requests": stats.get("requests"),
            "hits": stats.get("hits"), "misses": stats.get("misses"),
            "evicted": stats.get("evicted")}


def run_child(kind: str, spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec)],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{kind} {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ main
def _versions() -> dict:
    from importlib.metadata import version  # no torch import in this process

    head = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %cI"],
                          capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                            "pyg_atompack"], capture_output=True, text=True,
                           check=False).stdout.strip()
    return {"python": platform.python_version(), "numpy": version("numpy"),
            "torch": version("torch"), "torch_geometric": version("torch_geometric"),
            "pyg_atompack": head + (" (+ uncommitted changes)" if dirty else "")}


def measure(mode: str, reps: int, workers: bool, work: Path = WORK) -> dict:
    settings = MODES[mode]
    path, records = build_file(settings["records"],
                               "big.atp" if mode == "full" else "quick.atp", work)
    size = path.stat().st_size
    bandwidth = size / settings["download_s"]
    block = settings["block"]
    results = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "uname": " ".join(platform.uname()), "nproc": os.cpu_count(),
               "versions": _versions(), "file_bytes": size, "records": records,
               "bandwidth": bandwidth, "block_bytes": block,
               "cache_bytes": settings["cache_bytes"],
               "rss_target": 3 * block * 1.2 + 64 * MiB, "stream": [], "random": []}
    server = ServerProcess(serve_http, str(work), bandwidth)
    url = f"{server.base_url}/{path.name}"
    try:
        results["uptime_start"] = os.popen("uptime").read().strip()
        results["download_s"] = plain_download(url)
        print(f"plain GET of {size / 1e6:.0f} MB: {results['download_s']:.1f} s", flush=True)
        arms = [0, 2] if workers else [0]
        for rep in range(reps):
            for count in arms if rep % 2 == 0 else arms[::-1]:
                with tempfile.TemporaryDirectory(prefix="single-file-a-") as cache:
                    got = run_child("stream", {"url": url, "block": block, "cache": cache,
                                               "records": records, "workers": count})
                results["stream"].append(got)
                print("a", json.dumps(got), flush=True)
        for rep in range(reps):
            with tempfile.TemporaryDirectory(prefix="single-file-b-", dir=work) as cache:
                got = run_child("random", {"url": url, "path": str(path), "cache": cache,
                                           "records": records, "seed": rep,
                                           "samples": settings["random"],
                                           "cache_bytes": settings["cache_bytes"]})
            results["random"].append(got)
            print("b", json.dumps(got), flush=True)
        results["uptime_end"] = os.popen("uptime").read().strip()
    finally:
        server.stop()
    return results


def verdicts(results: dict) -> dict:
    """Whether each target of the Done-when line is met, over every run."""
    download = results["download_s"]
    stream, random = results["stream"], results["random"]
    return {
        # the Done-when line's configuration: one process
        "rss": all(r["rss_growth"] <= results["rss_target"]
                   for r in stream if not r["workers"]),
        "rss_workers": all(r["rss_growth"] <= results["rss_target"]
                           for r in stream if r["workers"]),
        "first_sample": all(r["first_s"] <= 0.25 * download for r in stream),
        "exactly_once": all(r["exactly_once"] for r in stream),
        "blocks": all(r["blocks"] > 1 for r in stream),
        "disk": all(r["peak_pages"] <= results["cache_bytes"] + (r["page_bytes"] or 0)
                    for r in random),
        "equal": all(r["equal_to_local"] for r in random),
    }


def _ok(flag: bool) -> str:
    return "**met**" if flag else "**missed**"


def render(results: dict) -> str:
    v = verdicts(results)
    size, block = results["file_bytes"], results["block_bytes"]
    download = results["download_s"]
    versions = results["versions"]
    lines = [
        f"# One big `.atp` file behind a single http URL ({results['date']})", "",
        "`python benchmarks/single_file_url.py" + (" --quick`" if results["mode"] == "quick"
                                                   else "`") + " (issue #30, item 8).", "",
        f"- Machine: `{results['uname']}`, {results['nproc']} CPUs; load "
        f"`{results['uptime_start'].split('load average:')[-1].strip()}` at the start, "
        f"`{results['uptime_end'].split('load average:')[-1].strip()}` at the end.",
        f"- Versions: Python {versions['python']}, numpy {versions['numpy']}, torch "
        f"{versions['torch']}, torch_geometric {versions['torch_geometric']}, pyg_atompack "
        f"`{versions['pyg_atompack']}`.",
        f"- File: {size / 1e6:.0f} MB ({size / MiB:.0f} MiB), {results['records']} records "
        f"of {size / results['records'] / 1e3:.1f} kB, served by the loopback `ShardServer` "
        f"in its own process at {results['bandwidth'] / 1e6:.1f} MB/s per connection; one "
        f"plain GET of the whole file: **{download:.1f} s**.",
        "- Each row is a fresh child process with a cold metadata cache; times count from "
        "the dataset's construction (the size probe and the metadata fetch included). "
        f"One block's transfer at this bandwidth takes {block / results['bandwidth']:.2f} s: "
        "the first sample comes after construction plus about one block.",
        "- Peak RSS growth: of the child's process tree over its baseline after its imports "
        "(each DataLoader worker from when it is first seen), sampled every 5 ms; \"not "
        "file-backed\" leaves out the library pages a worker maps in as it first runs "
        "their code.",
        "", "## (a) `ShardStreamDataset(url, options=SourceOptions("
        f"block_bytes={block // MiB} MiB), prefetch=2)`", "",
        "| workers | blocks (records each) | construct s | first sample s | first / "
        "full GET | peak RSS growth MiB | of which not file-backed MiB | records seen | "
        "exactly once | epoch s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results["stream"]:
        lo, hi = r["block_records"] or (0, 0)
        split = (f" (main alone {r['main_growth'] / MiB:.0f})" if r["workers"] else "")
        lines.append(
            f"| {r['workers']} | {r['blocks']} ({lo}–{hi}) | {r['open_s']:.2f} | "
            f"{r['first_s']:.2f} | {r['first_s'] / download:.1%} | "
            f"{r['rss_growth'] / MiB:.0f}{split} | {r['anon_growth'] / MiB:.0f} | "
            f"{r['count']} | {r['exactly_once']} | {r['total_s']:.1f} |")
    single = [r for r in results["stream"] if not r["workers"]]
    pooled = [r for r in results["stream"] if r["workers"]]
    lines += [
        "", "| target | figure | verdict |", "|---|---|---|",
        f"| peak RSS growth ≤ 3 × {block // MiB} MiB × 1.2 + 64 MiB = "
        f"{results['rss_target'] / MiB:.1f} MiB, one process | max "
        f"{max(r['rss_growth'] for r in single) / MiB:.0f} MiB | {_ok(v['rss'])} |",
    ]
    if pooled:
        lines.append(
            f"| the same bound for the process tree with {pooled[0]['workers']} DataLoader "
            f"workers (each worker prefetches 1 block) | max "
            f"{max(r['rss_growth'] for r in pooled) / MiB:.0f} MiB (not file-backed "
            f"{max(r['anon_growth'] for r in pooled) / MiB:.0f}) | {_ok(v['rss_workers'])} |")
    lines += [
        f"| first sample ≤ 25% of a full download ({0.25 * download:.1f} s) | max "
        f"{max(r['first_s'] for r in results['stream']):.2f} s | {_ok(v['first_sample'])} |",
        f"| every record exactly once | {', '.join(str(r['count']) for r in results['stream'])}"
        f" of {results['records']} | {_ok(v['exactly_once'])} |",
        f"| record blocks chosen for the single-file URL | "
        f"{', '.join(str(r['blocks']) for r in results['stream'])} blocks | "
        f"{_ok(v['blocks'])} |",
        "", f"## (b) `AtompackDataset(url, cache_dir=tmp, cache_bytes="
        f"{results['cache_bytes'] // MiB} MiB)`, random records", "",
        "Uniformly random records (with repeats) in batches of 64 through "
        "`AtompackLoader(sampler=...)`; each batch's `pos`, `z`, `energy`, `forces`, "
        "`batch` hashed and compared with the same batches read from the local file.", "",
        "| samples | samples/s | peak page cache on disk MiB | peak cache dir (pages + "
        "metadata) MiB | page | range requests | downloaded MB | pages hit / missed / "
        "evicted | peak RSS growth MiB | equal to local |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in results["random"]:
        lines.append(
            f"| {r['samples']} | {r['rate']:.0f} | {r['peak_pages'] / MiB:.1f} | "
            f"{r['peak_cache'] / MiB:.1f} | {(r['page_bytes'] or 0) >> 10} KiB | "
            f"{r['requests']} | {(r['fetched_bytes'] or 0) / 1e6:.0f} | "
            f"{r['hits']} / {r['misses']} / {r['evicted']} | {r['rss_growth'] / MiB:.0f} | "
            f"{r['equal_to_local']} |")
    page = max((r["page_bytes"] or 0) for r in results["random"])
    lines += [
        "", "| target | figure | verdict |", "|---|---|---|",
        f"| page cache on disk ≤ cache_bytes + a page = "
        f"{(results['cache_bytes'] + page) / MiB:.2f} MiB | max "
        f"{max(r['peak_pages'] for r in results['random']) / MiB:.2f} MiB | {_ok(v['disk'])} |",
        f"| values equal to a local read | "
        f"{', '.join(str(r['equal_to_local']) for r in results['random'])} | {_ok(v['equal'])} |",
        f"| peak RSS growth (no target; reported) | max "
        f"{max(r['rss_growth'] for r in results['random']) / MiB:.0f} MiB | – |",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a 65 MB file, 4 MiB blocks, 3 s downloads, a 16 MiB page cache "
                             "(the same code paths)")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of every arm")
    parser.add_argument("--no-workers", action="store_true",
                        help="skip the two-DataLoader-worker arm of (a)")
    parser.add_argument("--work", type=Path, default=WORK,
                        help="where the file is written once (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default: benchmarks/results/single_file_url"
                             "[_quick].md)")
    parser.add_argument("--reprint", action="store_true",
                        help="rewrite the results file from its .json, measuring nothing")
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    out = args.out or HERE / "results" / ("single_file_url.md" if mode == "full"
                                          else "single_file_url_quick.md")
    if args.reprint:
        results = json.loads(out.with_suffix(".json").read_text())
    else:
        results = measure(mode, args.reps, not args.no_workers, args.work)
    text = render(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)
    print(json.dumps({"verdicts": verdicts(results)}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kinds = {"stream": child_stream, "random": child_random}
        print(json.dumps(kinds[sys.argv[2]](json.loads(sys.argv[3]))))
    else:
        main()
