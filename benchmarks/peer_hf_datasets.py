"""The Hugging Face ``datasets`` arm of ``benchmarks/peers.py``: Parquet shards in
streaming mode, from the same loopback HTTP server the other arms read.

Written and read the way the library's documentation shows a user:

* writing: one ``Dataset.from_list(structures).to_parquet(path)`` per shard (the
  structures as dicts of numpy arrays; ``datasets`` infers ``z: List(int64)``,
  ``pos`` / ``forces: List(List(float32))``, ``energy: float32``);
* reading: ``load_dataset("parquet", data_files=[http URLs], split="train",
  streaming=True)``, ``.shuffle(seed=0)`` (its defaults: a buffer of 1,000 samples fed
  from up to 10 shards at a time, each shard read on its own thread and connection),
  ``.with_format("torch")`` and a torch ``DataLoader(batch_size=32)``, in-process or
  behind worker processes. ``datasets`` reads plain ``http://`` URLs through fsspec's
  HTTP filesystem (aiohttp): a ``HEAD`` (the test server answers 501) then a ``GET``
  for the size, then ranged reads of the footer and the row group. Nothing is tuned.

What a user meets and the benchmark keeps in the time: ``datasets`` 5.x sleeps
``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`` (5 s) when the shards feeding a
shuffle run dry (its reader threads' shutdown, apache/arrow#45214): with a buffer of
1,000 samples each epoch stalls 5 s before its last 1,000 samples, or before its first
batch when the data is smaller than the buffer. ``shutdown_sleep=0`` sets that value
to 0 for one arm, to show what the sleep costs.

Run alone (``python benchmarks/peer_hf_datasets.py``) it times the same pipeline over
local Parquet files, no network and no consumer, to show where the arm's time goes
(:func:`main`). Imports nothing outside the standard library at module level, so
``peers.py`` imports it even when ``datasets`` is not installed (that run then writes
no Parquet shards and its tables say the arms did not run).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The shuffle buffer ``IterableDataset.shuffle`` uses when none is given.
BUFFER = 1000


def available() -> str | None:
    """The installed ``datasets`` version, or :obj:`None` when it is not installed."""
    try:
        import datasets
    except ImportError:
        return None
    return datasets.__version__


def write_parquet(directory: Path, parts: list[list[dict]]) -> list[str]:
    """Write one Parquet shard per list of structures, as a ``datasets`` user would.

    Args:
        directory (Path): Folder the shards go to (``shard-NNNN.parquet``).
        parts (list[list[dict]]): Per shard, the structures as dicts of numpy arrays
            (``z``, ``pos``, ``forces``, ``energy``).

    Returns:
        The shard names, in order.
    """
    import datasets

    datasets.disable_progress_bars()  # one bar per shard would flood the benchmark's log
    names = []
    for s, items in enumerate(parts):
        name = f"shard-{s:04d}.parquet"
        datasets.Dataset.from_list(items).to_parquet(str(directory / name))
        names.append(name)
    return names


#: ``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`` as the library set it.
_LIBRARY_SLEEP: list[float] = []


def hf_datasets_arm(base_url: str, names: list[str], batch_size: int, workers: int = 0,
                    collate_fn: Callable[[list], Any] | None = None,
                    shutdown_sleep: float | None = None) -> Callable[[], Any]:
    """A builder of one pass: the streamed, shuffled Parquet shards behind a ``DataLoader``.

    Args:
        base_url (str): The loopback server's root (shards under ``/parquet/``).
        names (list[str]): The shard names.
        batch_size (int): Structures per batch.
        workers (int, optional): ``DataLoader`` worker processes (``datasets`` gives each
            a share of the shards). (default: :obj:`0`)
        collate_fn (Callable, optional): For structures of different sizes, which the
            default collate cannot stack. (default: :obj:`None`)
        shutdown_sleep (float, optional): Seconds ``datasets`` sleeps when the shards
            feeding the shuffle run dry; :obj:`None` keeps the library's value.
            (default: :obj:`None`)

    Returns:
        A function building the loader; ``peers.consume`` times it and the pass.
    """
    def build():
        import datasets
        import torch

        datasets.disable_progress_bars()
        if not _LIBRARY_SLEEP:
            _LIBRARY_SLEEP.append(datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN)
        # read when the sleep happens, and inherited by forked DataLoader workers
        datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = (
            _LIBRARY_SLEEP[0] if shutdown_sleep is None else shutdown_sleep)
        urls = [f"{base_url}/parquet/{n}" for n in names]
        stream = datasets.load_dataset("parquet", data_files=urls, split="train",
                                       streaming=True)
        stream = stream.shuffle(seed=0, buffer_size=BUFFER).with_format("torch")
        return torch.utils.data.DataLoader(stream, batch_size=batch_size,
                                           num_workers=workers, collate_fn=collate_fn)
    return build


def main() -> None:
    """``python benchmarks/peer_hf_datasets.py``: where the arm's time goes, without any
    network: one pass of the same pipeline over Parquet files on the local disk, no
    consumer, the features ``datasets`` infers against ``Array2D`` ones, and the sleep
    at the library's value against 0. Prints one JSON line of seconds per pass."""
    import argparse
    import json
    import tempfile
    import time

    import datasets
    import torch
    from peers import make_items  # this file's folder is sys.path[0]

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=12)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--atoms", type=int, default=64)
    args = parser.parse_args()
    datasets.disable_progress_bars()
    library_sleep = datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN
    arrays = datasets.Features({
        "z": datasets.List(datasets.Value("int64")),
        "pos": datasets.Array2D(shape=(None, 3), dtype="float32"),
        "forces": datasets.Array2D(shape=(None, 3), dtype="float32"),
        "energy": datasets.Value("float32")})
    parts = [make_items(s, args.per_shard, args.atoms) for s in range(args.shards)]
    results = {"datasets": datasets.__version__, "structures": args.shards * args.per_shard}
    with tempfile.TemporaryDirectory(prefix="peer-hf-") as scratch:
        for label, features in (("inferred", None), ("Array2D", arrays)):
            files = []
            for s, items in enumerate(parts):
                files.append(f"{scratch}/{label}-{s:04d}.parquet")
                datasets.Dataset.from_list(items, features=features).to_parquet(files[-1])
            for sleep in (library_sleep, 0):
                datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = sleep
                started = time.perf_counter()
                stream = datasets.load_dataset("parquet", data_files=files, split="train",
                                               streaming=True)
                stream = stream.shuffle(seed=0, buffer_size=BUFFER).with_format("torch")
                seen = sum(len(b["energy"])
                           for b in torch.utils.data.DataLoader(stream, batch_size=32))
                assert seen == results["structures"], seen
                results[f"{label}, sleep {sleep} s"] = round(time.perf_counter() - started, 2)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
