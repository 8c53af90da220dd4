"""Paired benchmark: decoding one ``.pt`` shard, in place against ``torch.load``.

For each layout users write (a list of ``Data``; list slices of a collated
``InMemoryDataset``, i.e. FoldPipe's shards, views of one storage; a collated
``(data, slices)`` tuple; the ``InMemoryDataset.save`` triple), three decoders run on the
same bytes, interleaved in rotating order in one process:

* ``lazy``: :func:`pyg_atompack.pyg.decode_pt` on a ``bytearray`` (the default path of
  ``ShardStreamDataset``): indexed in place, samples built when taken;
* ``safe``: the same on ``bytes``: ``torch.load(weights_only=True)`` with the PyG
  allow-list, then the layout classifier (what every other layout gets, and
  ``lazy_decode=False``);
* ``unsafe``: ``torch.load(weights_only=False)``, FoldPipe's loader, which runs CPython's
  C unpickler; the retired restricted C unpickler (``stream/safe_pickle.py``) ran at
  this speed, so ``safe / unsafe`` is what it bought.

Per arm: the decode time (what the prefetch thread spends), the time to decode and then
take every sample and touch its tensors (what the consumer also spends), and the memory
the decoded shard holds (Python objects counted by ``tracemalloc``, plus tensor storages
outside the shard buffer, plus the buffer itself where the samples view it), as a
multiple of the file size. Ratios are medians of per-round ratios.

Run: ``.venv/bin/python benchmarks/pt_decode.py [--rounds 15] [--samples 1000]``
"""

from __future__ import annotations

import argparse
import ctypes
import io
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import torch
from torch_geometric.data import Data, InMemoryDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from servers.http_server import make_samples  # noqa: E402

from pyg_atompack.pyg import decode_pt  # noqa: E402
from pyg_atompack.pyg.pt import as_samples  # noqa: E402


class _Collated(InMemoryDataset):
    def __init__(self, samples: list[Data]) -> None:
        super().__init__(None)
        self.data, self.slices = self.collate(samples)


def _saved(obj: object) -> bytes:
    stream = io.BytesIO()
    torch.save(obj, stream)
    return stream.getvalue()


def layouts(samples: int, atoms: int) -> dict[str, bytes]:
    data = make_samples(3, samples, atoms=atoms)
    dataset = _Collated(data)
    return {
        "list of Data": _saved(data),
        "list slices of a collated dataset (FoldPipe)": _saved([d for d in dataset]),
        "collated (data, slices)": _saved((dataset._data, dataset.slices)),
        "InMemoryDataset.save triple": _saved((dataset._data.to_dict(), dataset.slices,
                                               Data)),
    }


def decode(arm: str, raw: bytes):
    if arm == "lazy":
        return decode_pt(bytearray(raw))
    if arm == "safe":
        return decode_pt(raw)
    return as_samples(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False))


def consume(samples) -> None:
    for sample in samples:
        for _, value in sample:
            if isinstance(value, torch.Tensor):
                value.sum()


def held_bytes(arm: str, raw: bytes) -> int:
    """Memory the decoded shard holds: Python objects, storages, and its buffer."""
    buffer = bytearray(raw) if arm == "lazy" else raw
    tracemalloc.start()
    try:
        samples = decode_pt(buffer) if arm != "unsafe" else decode("unsafe", raw)
        objects, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if arm == "lazy" else -1
    storages = {}
    for index in range(len(samples)):
        for _, value in samples[index]:
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if start <= storage.data_ptr() < start + len(buffer):
                    continue  # a view of the shard buffer, counted once below
                storages[storage.data_ptr()] = storage.nbytes()
    return objects + sum(storages.values()) + (len(buffer) if arm == "lazy" else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--atoms", type=int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "pt_decode.md")
    args = parser.parse_args()
    arms = ["lazy", "safe", "unsafe"]
    rows = []
    for name, raw in layouts(args.samples, args.atoms).items():
        for arm in arms:  # warm-up: imports, first-call caches
            consume(decode(arm, raw))
        times = {arm: [] for arm in arms}
        totals = {arm: [] for arm in arms}
        for round_ in range(args.rounds):
            order = arms[round_ % 3:] + arms[:round_ % 3]
            for arm in order:
                started = time.perf_counter()
                samples = decode(arm, raw)
                decoded = time.perf_counter()
                consume(samples)
                times[arm].append(decoded - started)
                totals[arm].append(time.perf_counter() - started)
                del samples
        memory = {arm: held_bytes(arm, raw) / len(raw) for arm in arms}

        def ratio(values, a, b):
            return statistics.median(x / y for x, y in zip(values[a], values[b]))

        rows.append((name, len(raw), {a: statistics.median(v) * 1e3 for a, v in times.items()},
                     {a: statistics.median(v) * 1e3 for a, v in totals.items()},
                     ratio(times, "lazy", "unsafe"), ratio(times, "safe", "unsafe"),
                     ratio(totals, "lazy", "unsafe"), ratio(totals, "safe", "unsafe"), memory))
        print(rows[-1], flush=True)
    load = os.getloadavg()
    lines = [
        "# `.pt` decoding: in place against `torch.load` (`benchmarks/pt_decode.py`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, "
        f"Python {sys.version.split()[0]}; shared 2-core VM, load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) at the end. "
        f"{args.samples} molecules of {args.atoms} atoms per shard, {args.rounds} "
        f"interleaved rounds; times are medians, ratios medians of per-round ratios "
        f"against `unsafe` = `torch.load(weights_only=False)` (FoldPipe's loader; < 1 is "
        f"faster). Memory: what the decoded shard holds, as a multiple of its file.",
        "",
        "| layout | file KiB | decode ms (lazy / safe / unsafe) | decode vs unsafe "
        "(lazy / safe) | decode + take all ms (lazy / safe / unsafe) | decode + take all "
        "vs unsafe (lazy / safe) | memory x file (lazy / safe / unsafe) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, size, decode_ms, total_ms, lazy_d, safe_d, lazy_t, safe_t, memory in rows:
        lines.append(
            f"| {name} | {size / 1024:.0f} | {decode_ms['lazy']:.1f} / {decode_ms['safe']:.1f}"
            f" / {decode_ms['unsafe']:.1f} | {lazy_d:.2f}x / {safe_d:.2f}x | "
            f"{total_ms['lazy']:.1f} / {total_ms['safe']:.1f} / {total_ms['unsafe']:.1f} | "
            f"{lazy_t:.2f}x / {safe_t:.2f}x | {memory['lazy']:.2f} / {memory['safe']:.2f} / "
            f"{memory['unsafe']:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
