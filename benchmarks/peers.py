"""Side by side with what users would pick instead: LitData, MosaicML streaming,
WebDataset, FoldPipe, the Hugging Face ``datasets`` library and PyG's ``OnDiskDataset``.

Part 1, streaming from remote storage. The same 64-atom structures are stored in each
tool's own format and read the way its documentation recommends, all shards behind the
same per-connection bandwidth limit, by a consumer sleeping a fixed compute time per
batch of 32 (D/C = 0.5, 1, 3, where D is the download time of one ``.pt`` shard at the
limit and C the compute time of its batches):

* ours: ``ShardStreamDataset(RemoteSource(manifest), shuffle=True, batch_size=32)`` over
  the ``.pt`` shards (``ours_pt``, the reference of every ratio) and over ``.atp`` shards
  of the same structures (``ours_atp``), with the library's defaults (prefetch 1, the
  connections chosen by measurement), as every peer runs with its own; ``--tuned`` gives
  ours the per-regime prefetch / concurrency of ``stream_overlap.py`` instead (earlier
  records); from the throttled HTTP server (``tests/servers/http_server.py``);
* LitData: ``litdata.optimize`` chunks on an S3 bucket of a ``moto`` server behind the
  paced TCP relay ``tests/servers/tcp_proxy.py`` (``AWS_ENDPOINT_URL``),
  read with ``StreamingDataset(shuffle=True)`` + ``StreamingDataLoader``;
* MosaicML streaming: ``MDSWriter`` shards on the same bucket,
  ``StreamingDataset(remote=s3://..., local=<fresh dir>, shuffle=True)`` + ``DataLoader``,
  run in its own virtual environment (``peer_mosaic.py``, see there why);
* WebDataset: tar shards on the throttled HTTP server, ``wds.WebDataset(urls,
  shardshuffle=...).shuffle(1000).decode()`` + ``DataLoader``;
* FoldPipe: ``AsyncFoldPipeLoader`` over the ``.pt`` shards, as in ``stream_overlap.py``;
* Hugging Face ``datasets``: Parquet shards on the same HTTP server,
  ``load_dataset("parquet", data_files=[urls], streaming=True).shuffle(seed=0)
  .with_format("torch")`` + ``DataLoader``, in-process and behind 2 workers
  (``peer_hf_datasets.py``, see there what it does on its own).

Every pass of every arm is checked to yield the structures written: its count, and
its energies (float32, sorted) against those of the structures (a digest), MosaicML's
inside its child.

Every pair runs each arm once, the order rotated from pair to pair; ratios are
``theirs / ours`` wall time (> 1: ours faster), summarised by the geometric mean and a
percentile-bootstrap 95% interval (``paired_stats.py``). Also recorded: time to first
batch, peak RSS growth, peak local disk, and the conversion each tool needs.

Part 2, random access for a PyG training loop: ``AtompackDataset`` + ``AtompackLoader``
(and + PyG ``DataLoader``) against ``torch_geometric.data.OnDiskDataset`` (SQLite) holding
the same structures, batches of 32, shuffled, 0 and 2 workers; plus store build time and
bytes.

Part 3 (the issue's finding): ours against WebDataset with ``DataLoader(num_workers=2)``.

Run: ``.venv/bin/python benchmarks/peers.py [--pairs 5] [--quick]``. The last line
printed is a JSON object of ours ÷ theirs at D/C = 1 and for the shuffled loop. Writes
``benchmarks/results/peers.md`` (+ ``peers.json``) and ``benchmarks/figures/peers.png``.
The MosaicML venv is built on first use under ``benchmarks/_work/`` (git-ignored), and
so are the stores of part 1 (every format of each structure set, with the conversion
figures measured when they were written): later runs with the same sizes and versions
reuse them (``--rebuild`` writes them again). One MosaicML child serves the whole run.

Why one file of ~1,300 lines: it is one protocol (the stores, the pairing, the sample
check and the report share one result layout that ``--first-shard``, ``--workers-only``
and ``--random-access`` print parts of); what one peer needs on its own lives beside it,
``peer_mosaic.py`` (its venv child) and ``peer_hf_datasets.py`` (the datasets arm).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

from harness import PeakSampler, ServerProcess, dir_bytes, serve_http, serve_s3_relay  # noqa: E402
from paired_stats import summarize_pairs  # noqa: E402
from peer_hf_datasets import available as hf_datasets_version  # noqa: E402
from peer_hf_datasets import hf_datasets_arm, write_parquet  # noqa: E402
from servers.http_server import write_manifest  # noqa: E402
from stream_overlap import _FoldPipeHTTPSource  # noqa: E402
from torch_geometric.data import Batch, Data  # noqa: E402

from pyg_atompack import AtompackDataset, AtompackLoader, atp  # noqa: E402
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions  # noqa: E402

WORK = HERE / "_work"
#: Stores of part 1 (every format of a structure set), kept between runs.
STORES = WORK / "peers-stores"
BATCH = 32
BUCKET = "peers"
#: The peers' versions this benchmark was written against (also in pyproject's ``bench``).
PINS = {"litdata": "0.2.76", "webdataset": "1.0.2", "moto": "5.2.5", "foldpipe": "0.3.2",
        "mosaicml-streaming": "0.13.0", "datasets": "5.2.0", "pyarrow": "26.0.1"}
#: The MosaicML venv: streaming without its dependency pins, plus what it imports.
MOSAIC_REQUIREMENTS = [
    "mosaicml-streaming==0.13.0", "numpy==2.1.3", "brotli==1.1.0", "python-snappy==0.7.3",
    "cramjam==2.14.0", "zstd==1.5.6.1", "xxhash==3.5.0", "catalogue==2.0.10",
    "transformers==4.57.1", "huggingface_hub==0.36.0", "tokenizers==0.22.1",
    "safetensors==0.8.0", "regex", "pyyaml", "packaging", "tqdm", "filelock",
]
#: (D/C, prefetch, concurrency): ours with ``--tuned`` (and ``--first-shard``); a run
#: without it gives ours the library's defaults.
REGIMES = [(0.5, 2, 2), (1.0, 2, 2), (3.0, 4, 3)]
#: Atom counts of the mixed-size set, drawn uniformly per structure (mean 64, as the other).
MIXED_ATOMS = (8, 120)
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


# ------------------------------------------------------------------ data in every format
#: Bump when ``write_formats`` changes what it writes, so that kept stores are rebuilt.
STORES_VERSION = 2  # 2: Parquet shards for the datasets arm


def stores_key() -> str:
    """What kept stores must match: this file's format version and the writers' versions."""
    found = []
    for name in ("torch", "torch_geometric", "litdata", "webdataset", "datasets", "pyarrow"):
        try:
            found.append(metadata.version(name))
        except metadata.PackageNotFoundError:
            found.append("none")
    digest = hashlib.sha256(" ".join(found).encode()).hexdigest()[:10]
    return f"v{STORES_VERSION}-{digest}"


def make_structures(shard: int, count: int, atoms: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(shard)
    return {"z": rng.integers(1, 10, (count, atoms)).astype(np.int64),
            "pos": rng.normal(size=(count, atoms, 3)).astype(np.float32),
            "forces": rng.normal(size=(count, atoms, 3)).astype(np.float32),
            "energy": rng.normal(size=count).astype(np.float32)}


def as_data(arrays: dict[str, np.ndarray], i: int) -> Data:
    return Data(z=torch.from_numpy(arrays["z"][i]), pos=torch.from_numpy(arrays["pos"][i]),
                forces=torch.from_numpy(arrays["forces"][i]),
                energy=torch.tensor([float(arrays["energy"][i])], dtype=torch.float64))


def timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def _litdata_item(item):  # module level: litdata.optimize pickles it into workers
    return item


def make_items(shard: int, count: int, atoms: int | tuple[int, int]) -> list[dict]:
    """``count`` structures as dicts of arrays: ``atoms`` each, or drawn from ``(low, high)``."""
    if isinstance(atoms, int):
        arrays = make_structures(shard, count, atoms)
        return [{k: v[i] for k, v in arrays.items()} for i in range(count)]
    rng = np.random.default_rng([shard, 7])
    items = []
    for n in rng.integers(atoms[0], atoms[1] + 1, count):
        items.append({"z": rng.integers(1, 10, n).astype(np.int64),
                      "pos": rng.normal(size=(n, 3)).astype(np.float32),
                      "forces": rng.normal(size=(n, 3)).astype(np.float32),
                      "energy": np.float32(rng.normal())})
    return items


def energy_digest(energies) -> str:
    """What every pass is checked against: the energies as float32, sorted, hashed."""
    values = np.sort(np.asarray(energies, dtype=np.float32).reshape(-1))
    return hashlib.sha256(values.tobytes()).hexdigest()[:16]


def expected_digest(shards: int, per_shard: int, atoms: int | tuple[int, int]) -> str:
    """The digest of the structures :func:`write_formats` writes (drawn again: seeded)."""
    return energy_digest([item["energy"] for s in range(shards)
                          for item in make_items(s, per_shard, atoms)])


def item_data(item: dict) -> Data:
    return Data(z=torch.from_numpy(item["z"]), pos=torch.from_numpy(item["pos"]),
                forces=torch.from_numpy(item["forces"]),
                energy=torch.tensor([float(item["energy"])], dtype=torch.float64))


def write_formats(www: Path, lit_dir: Path, mds_source: Path, shards: int, per_shard: int,
                  atoms: int | tuple[int, int]) -> tuple[dict, dict]:
    """Write .pt, .atp, tar, Parquet and LitData stores and the MDS source (structures as flat
    arrays + offsets, for ``peer_mosaic.py``); returns (names, conversion figures).

    ``atoms`` is the atom count of every structure, or a ``(low, high)`` range each
    structure's count is drawn from (the mixed-size set).
    """
    import litdata
    import webdataset as wds

    parts = [make_items(s, per_shard, atoms) for s in range(shards)]
    names = {"pt": [], "atp": [], "tar": [], "parquet": []}
    convert = {}
    started = time.perf_counter()
    for s, items in enumerate(parts):  # the reference: a training set already in .pt
        name = f"shard-{s:04d}.pt"
        torch.save([item_data(item) for item in items], www / "pt" / name)
        names["pt"].append(name)
    convert["pt (source)"] = {"seconds": time.perf_counter() - started,
                              "bytes": dir_bytes(www / "pt")}
    write_manifest(www / "pt", names["pt"], [per_shard] * shards)

    started = time.perf_counter()
    for s, items in enumerate(parts):
        name = f"shard-{s:04d}.atp"
        with atp.Writer(www / "atp" / name, overwrite=True) as writer:
            if isinstance(atoms, int):  # equal sizes: one call per shard
                stacked = {k: np.stack([item[k] for item in items]) for k in items[0]}
                writer.add_batch(stacked["pos"], stacked["z"].astype(np.uint8),
                                 energy=stacked["energy"].astype(np.float64),
                                 forces=stacked["forces"])
            else:
                for item in items:
                    writer.add(item["pos"], item["z"].astype(np.uint8),
                               energy=float(item["energy"]), forces=item["forces"])
        names["atp"].append(name)
    convert["ours .atp"] = {"seconds": time.perf_counter() - started,
                            "bytes": dir_bytes(www / "atp")}
    write_manifest(www / "atp", names["atp"], [per_shard] * shards)

    started = time.perf_counter()
    for s, items in enumerate(parts):
        name = f"shard-{s:04d}.tar"
        with wds.TarWriter(str(www / "tar" / name)) as sink:
            for i, item in enumerate(items):  # one pickled member per sample, as in the issue
                sink.write({"__key__": f"{s:04d}{i:06d}",
                            "pyd": {**item, "energy": np.array([item["energy"]])}})
        names["tar"].append(name)
    convert["webdataset"] = {"seconds": time.perf_counter() - started,
                             "bytes": dir_bytes(www / "tar")}

    if hf_datasets_version() is not None:  # else the datasets arms say "did not run"
        started = time.perf_counter()
        names["parquet"] = write_parquet(www / "parquet", parts)
        convert["hf datasets (Parquet)"] = {"seconds": time.perf_counter() - started,
                                            "bytes": dir_bytes(www / "parquet")}

    flat = [item for items in parts for item in items]
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        litdata.optimize(fn=_litdata_item, inputs=flat, output_dir=str(lit_dir),
                         chunk_size=per_shard, num_workers=1, mode="overwrite",
                         start_method="fork")  # spawn would re-import this script
    convert["litdata"] = {"seconds": time.perf_counter() - started, "bytes": dir_bytes(lit_dir)}
    offsets = np.cumsum([0] + [len(item["z"]) for item in flat])
    np.savez(mds_source, offsets=offsets,
             energy=np.array([item["energy"] for item in flat], dtype=np.float32),
             **{k: np.concatenate([item[k] for item in flat]) for k in ("z", "pos", "forces")})
    return names, convert


def concat_collate(samples: list[dict]) -> dict:
    """Batch structures of different sizes the way a graph loader does: atoms concatenated,
    one energy per structure, and the atom counts (default collate cannot stack them)."""
    return {"z": torch.from_numpy(np.concatenate([s["z"] for s in samples])),
            "pos": torch.from_numpy(np.concatenate([s["pos"] for s in samples])),
            "forces": torch.from_numpy(np.concatenate([s["forces"] for s in samples])),
            "energy": torch.tensor([float(np.asarray(s["energy"]).reshape(-1)[0])
                                    for s in samples]),
            "n_atoms": torch.tensor([len(s["z"]) for s in samples])}


# ------------------------------------------------------------------ S3 bucket
def upload(moto_url: str, directory: Path, prefix: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_url, **_boto_keys())
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=BUCKET)
    for path in sorted(directory.iterdir()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")


def _boto_keys() -> dict:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
            "region_name": "us-east-1"}


# ------------------------------------------------------------------ peer environments
def ensure_litdata() -> str:
    """Install the pinned LitData into this venv without its torchvision requirement."""
    try:
        installed = metadata.version("litdata")
    except metadata.PackageNotFoundError:
        installed = None
    if installed != PINS["litdata"]:
        # litdata's wheel requires torchvision, which the index only has as CUDA builds
        # that fail next to the CPU torch; litdata imports fine without it, and its other
        # requirements are in the project's ``bench`` extra
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        f"litdata=={PINS['litdata']}"], check=True)
    return PINS["litdata"]


def mosaic_python() -> Path:
    """The MosaicML venv's interpreter, built on first use (streaming's pins, no torch)."""
    venv = WORK / "mosaic-venv"
    python = venv / "bin" / "python"
    marker = venv / ".peers-ready"
    if marker.exists():
        return python
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps",
                    *MOSAIC_REQUIREMENTS], check=True)
    # torch (CPU) and boto3 come from the project's venv: appended to sys.path after the
    # venv's own site-packages, so the venv's numpy 2.1 shadows the project's
    site = next((venv / "lib").glob("python3*/site-packages"))
    project_site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    (site / "zz_project_site.pth").write_text(f"{project_site}\n", encoding="utf-8")
    marker.write_text("ok\n", encoding="utf-8")
    return python


class MosaicArm:
    """``peer_mosaic.py`` in the MosaicML venv, answering one JSON command per line."""

    def __init__(self, endpoint: str | None = None):
        env = {**os.environ, **S3_ENV}
        if endpoint:
            env["S3_ENDPOINT_URL"] = endpoint
        self.process = subprocess.Popen([str(mosaic_python()), str(HERE / "peer_mosaic.py")],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True, env=env)
        self.version = self._answer()["version"]

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise RuntimeError("the MosaicML child exited")

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise RuntimeError(f"MosaicML arm: {answer['error']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.write('{"op": "quit"}\n')
            self.process.stdin.close()
        self.process.wait(30)


# ------------------------------------------------------------------ measurement
def consume(make_batches, compute: float, directory: Path | None = None,
            arrivals: bool = False) -> dict:
    """One pass: ``make_batches()`` builds the loader (timed), the consumer sleeps per batch.

    The result holds the pass's wall time, when its first and last batches arrived, its
    sample count and the digest of its energies (:func:`energy_digest`, to check that
    every arm yields the same structures). With ``arrivals``, it also lists when each
    batch reached the consumer.
    """
    times, energies = [], []
    with PeakSampler(directory) as sampler:
        started = time.perf_counter()
        first, last, samples = None, None, 0
        for batch in make_batches():
            last = time.perf_counter() - started
            if first is None:
                first = last
            times.append(last)
            samples += _batch_len(batch)
            energies.append(_batch_energy(batch))
            time.sleep(compute)  # stands in for a training step
        elapsed = time.perf_counter() - started
    result = {"seconds": elapsed, "first_batch_s": first, "last_batch_s": last,
              "samples": samples, "energy_digest": energy_digest(np.concatenate(energies))
              if energies else energy_digest([]),
              "rss_growth": sampler.peak_rss - sampler.baseline,
              "disk_peak": sampler.peak_disk}
    if arrivals:
        result["arrivals"] = times
    return result


def _batch_energy(batch) -> np.ndarray:
    """The batch's energies as float32 (a PyG ``Batch`` or a collated dict)."""
    energy = batch.energy if isinstance(batch, Batch) else batch["energy"]
    if isinstance(energy, torch.Tensor):
        energy = energy.detach().numpy()
    return np.asarray(energy, dtype=np.float32).reshape(-1)


def _batch_len(batch) -> int:
    if isinstance(batch, Batch):
        return batch.num_graphs
    if isinstance(batch, dict):
        return len(batch["energy"])
    return len(batch[-1])  # a tuple / list of collated columns


def ours(base_url: str, kind: str, prefetch: int | None, concurrency: int | None,
         workers: int = 0, dataset_batches: bool = False, **options):
    """``ShardStreamDataset`` batching itself (no workers), or behind ``num_workers``
    DataLoader workers: PyG's ``DataLoader`` collating samples, or with
    ``dataset_batches`` the dataset's own batches through ``DataLoader(batch_size=None)``.
    ``prefetch`` / ``concurrency`` :obj:`None`: the library's defaults (not passed).
    ``options`` are :class:`SourceOptions` fields (e.g. ``verify_before_use=False``), given
    to the source."""
    tuned = {k: v for k, v in (("prefetch", prefetch), ("concurrency", concurrency))
             if v is not None}
    source_options = SourceOptions(**options) if options else None

    def build():
        source = RemoteSource(f"{base_url}/{kind}/manifest.json", options=source_options)
        if workers == 0:
            return ShardStreamDataset(source, shuffle=True, batch_size=BATCH, **tuned)
        from torch_geometric.loader import DataLoader

        if dataset_batches:
            dataset = ShardStreamDataset(source, shuffle=True, batch_size=BATCH, **tuned)
            return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
        dataset = ShardStreamDataset(source, shuffle=True, **tuned)
        return DataLoader(dataset, batch_size=BATCH, num_workers=workers)
    return build


def litdata_arm(cache: Path, ragged: bool = False):
    def build():
        import litdata

        shutil.rmtree(cache, ignore_errors=True)  # every pass downloads afresh
        dataset = litdata.StreamingDataset(f"s3://{BUCKET}/litdata", cache_dir=str(cache),
                                           shuffle=True)
        return litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=0,
                                           collate_fn=concat_collate if ragged else None)
    return build


def webdataset_arm(base_url: str, names: list[str], workers: int = 0, ragged: bool = False):
    def build():
        import webdataset as wds

        urls = [f"{base_url}/tar/{n}" for n in names]
        dataset = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
                   .shuffle(1000).decode().map(_sample_dict))
        return torch.utils.data.DataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                           collate_fn=concat_collate if ragged else None)
    return build


def _sample_dict(sample: dict) -> dict:
    return sample["pyd"]


def foldpipe_arm(base_url: str, names: list[str]):
    def build():
        from foldpipe import AsyncFoldPipeLoader

        def batches(chunk):
            order = np.random.permutation(len(chunk))
            for start in range(0, len(chunk), BATCH):
                yield Batch.from_data_list([chunk[i] for i in order[start:start + BATCH]])

        source = _FoldPipeHTTPSource(f"{base_url}/pt", names)
        return AsyncFoldPipeLoader(source, batch_fn=batches)
    return build


# ------------------------------------------------------------------ part 1
def run_pairs(arms: dict, pairs: int) -> dict[str, list]:
    """One warm-up call of every arm, then ``pairs`` rounds, the order rotated each round."""
    for arm in arms.values():  # imports, page cache, first connections
        arm()
    runs = {name: [] for name in arms}
    order = list(arms)
    for pair in range(pairs):
        turn = pair % len(order)
        for name in order[turn:] + order[:turn]:
            runs[name].append(arms[name]())
    return runs


def streaming_arms(base: str, names: dict, cache: Path, mosaic: MosaicArm | None,
                   s3_endpoint: str, prefetch: int, concurrency: int, compute: float,
                   ragged: bool = False) -> dict:
    """Every streaming arm; ``ragged``: structures of different sizes, so the peers read
    through :func:`concat_collate` (their default collate cannot stack them)."""
    tar = names["tar"]
    arms = {
        "ours_pt": lambda: consume(ours(base, "pt", prefetch, concurrency), compute),
        "ours_atp": lambda: consume(ours(base, "atp", prefetch, concurrency), compute),
        "litdata": lambda: consume(litdata_arm(cache, ragged), compute, cache),
        "webdataset": lambda: consume(webdataset_arm(base, tar, ragged=ragged), compute),
        "webdataset_w2": lambda: consume(webdataset_arm(base, tar, 2, ragged), compute),
        "foldpipe": lambda: consume(foldpipe_arm(base, names["pt"]), compute),
    }
    if names.get("parquet"):  # stores written without ``datasets`` installed have none
        collate = concat_collate if ragged else None
        arms["hf_datasets"] = lambda: consume(
            hf_datasets_arm(base, names["parquet"], BATCH, collate_fn=collate), compute)
        arms["hf_datasets_w2"] = lambda: consume(
            hf_datasets_arm(base, names["parquet"], BATCH, 2, collate), compute)
        # what the 5 s sleep at the end of the source costs (peer_hf_datasets.py)
        arms["hf_datasets_nosleep"] = lambda: consume(
            hf_datasets_arm(base, names["parquet"], BATCH, collate_fn=collate,
                            shutdown_sleep=0.0), compute)
    if mosaic is not None:
        def mosaic_pass() -> dict:
            answer = mosaic.ask(op="read", remote=f"s3://{BUCKET}/mds", compute=compute,
                                batch_size=BATCH, ragged=ragged, endpoint=s3_endpoint)
            answer["energy_digest"] = energy_digest(answer.pop("energies"))
            return answer
        arms["mosaic"] = mosaic_pass
    return arms


def streaming_part(args, www: Path, names: dict, lit_dir: Path, mosaic_dir: Path,
                   shard_bytes: int, compute_batch: float, regimes, log,
                   mosaic: MosaicArm | None, ragged: bool = False,
                   digest: str | None = None) -> dict:
    """Part 1 over one structure set: every streaming arm in each regime, paired.

    ``mosaic`` is the one MosaicML child of the run (:obj:`None` when its venv failed,
    which is logged); each regime points it at that regime's relay. ``regimes`` holds
    (D/C, prefetch, concurrency), ours' two :obj:`None` for the library's defaults.
    Every pass is checked against the structures written: its count, and ``digest``
    (:func:`expected_digest`) against its energies'; a mismatch is logged and recorded
    under ``"mismatches"`` (the report prints it), never dropped.
    """
    compute_shard = compute_batch * args.per_shard / BATCH
    results = {}
    for ratio, prefetch, concurrency in regimes:
        bandwidth = shard_bytes / (ratio * compute_shard)
        http = ServerProcess(serve_http, str(www), bandwidth)
        s3 = ServerProcess(serve_s3_relay, bandwidth)
        base = http.base_url
        moto_url, proxy_url = (f"http://127.0.0.1:{p}" for p in s3.answer)
        try:
            upload(moto_url, lit_dir, "litdata")
            upload(moto_url, mosaic_dir, "mds")
            os.environ.update(S3_ENV, AWS_ENDPOINT_URL=proxy_url)
            cache = Path(tempfile.mkdtemp(prefix="litdata-cache-"))
            arms = streaming_arms(base, names, cache, mosaic, proxy_url, prefetch, concurrency,
                                  compute_batch, ragged)
            runs = run_pairs(arms, args.pairs)
            shutil.rmtree(cache, ignore_errors=True)
        finally:
            http.stop()
            s3.stop()
        mismatches = check_samples(runs, args.shards * args.per_shard, digest)
        for line in mismatches:
            log(f"D/C={ratio} {line}")
        summary = {
            name: summarize_pairs([p["seconds"] for p in passes],
                                  [p["seconds"] for p in runs["ours_pt"]]).to_dict()
            for name, passes in runs.items() if name != "ours_pt"
        }
        results[f"{ratio}"] = {"prefetch": prefetch, "concurrency": concurrency,
                               "compute": compute_batch, "bandwidth_Bps": bandwidth,
                               "runs": runs, "ours_pt_vs": summary, "mismatches": mismatches}
        log(f"D/C={ratio}: " + ", ".join(f"{n} {fmt(s)}" for n, s in summary.items()))
    return results


def check_samples(runs: dict[str, list], expected: int, digest: str | None) -> list[str]:
    """Every pass against the structures written: ``expected`` samples, energies whose
    :func:`energy_digest` is ``digest`` (:obj:`None`: counts only). Returns the
    mismatches as lines, empty when every pass of every arm yielded the same structures."""
    lines = []
    for name, passes in runs.items():
        counts = sorted({p["samples"] for p in passes})
        if counts != [expected]:
            lines.append(f"{name}: samples per pass {counts}, expected {expected}")
        found = {p.get("energy_digest") for p in passes}
        if digest is not None and found != {digest}:
            lines.append(f"{name}: energy digests {sorted(map(str, found))}, expected {digest}")
    return lines


# ------------------------------------------------------------------ part 2
def ondisk_class():
    from torch_geometric.data import OnDiskDataset

    class StructureStore(OnDiskDataset):
        """Structures in PyG's SQLite-backed ``OnDiskDataset``, typed columns as PCQM4Mv2."""

        def __init__(self, root: str):
            schema = {"z": {"dtype": torch.int64, "size": (-1,)},
                      "pos": {"dtype": torch.float32, "size": (-1, 3)},
                      "forces": {"dtype": torch.float32, "size": (-1, 3)},
                      "energy": float}
            super().__init__(root, schema=schema)

        def serialize(self, data: Data) -> dict:
            return {"z": data.z, "pos": data.pos, "forces": data.forces,
                    "energy": float(data.energy)}

        def deserialize(self, row: dict) -> Data:
            return Data(z=row["z"], pos=row["pos"], forces=row["forces"],
                        energy=torch.tensor([row["energy"]], dtype=torch.float64))

    return StructureStore


def random_access_part(args, scratch: Path, log) -> dict:
    from torch_geometric.loader import DataLoader

    count = args.ra_structures

    def epoch(loader) -> float:
        started = time.perf_counter()
        seen = sum(batch.num_graphs for batch in loader)
        if seen != count:
            raise RuntimeError(f"an epoch yielded {seen} structures, expected {count}")
        return time.perf_counter() - started

    arrays = make_structures(99, count, args.atoms)
    path = scratch / "all.atp"

    def build_atp():
        with atp.Writer(path, overwrite=True) as writer:
            writer.add_batch(arrays["pos"], arrays["z"].astype(np.uint8),
                             energy=arrays["energy"].astype(np.float64), forces=arrays["forces"])

    def build_ondisk():
        store = ondisk_class()(str(scratch / "ondisk"))
        store.extend([as_data(arrays, i) for i in range(count)], batch_size=1000)
        return store

    build = {"atp": {"seconds": timed(build_atp), "bytes": path.stat().st_size}}
    started = time.perf_counter()
    store = build_ondisk()
    build["ondisk"] = {"seconds": time.perf_counter() - started,
                       "bytes": dir_bytes(scratch / "ondisk" / "processed")}
    dataset = AtompackDataset(path, fields=["pos", "z", "energy", "forces"], log=False)
    store = ondisk_class()(str(scratch / "ondisk"))
    assert len(store) == len(dataset) == count
    results = {"build": build}
    for workers in (0, 2):
        kwargs = {"batch_size": BATCH, "shuffle": True, "num_workers": workers}

        arms = {"atompack_loader": lambda kw=kwargs: epoch(AtompackLoader(dataset, **kw)),
                "atompack_pyg_loader": lambda kw=kwargs: epoch(DataLoader(dataset, **kw)),
                "ondisk": lambda kw=kwargs: epoch(DataLoader(store, **kw))}
        times = run_pairs(arms, args.pairs)
        summary = {name: summarize_pairs(times[name], times["atompack_loader"]).to_dict()
                   for name in ("atompack_pyg_loader", "ondisk")}
        summary["pyg_loader_vs_ondisk"] = summarize_pairs(
            times["ondisk"], times["atompack_pyg_loader"]).to_dict()
        results[f"workers={workers}"] = {"times": times, "ours_vs": summary}
        log(f"random access, {workers} workers: AtompackLoader vs OnDisk "
            f"{fmt(summary['ondisk'])}, vs PyG DataLoader(AtompackDataset) "
            f"{fmt(summary['atompack_pyg_loader'])}; DataLoader(AtompackDataset) vs OnDisk "
            f"{fmt(summary['pyg_loader_vs_ondisk'])}")
    return results


def recorded(meta: dict) -> str:
    """Close ``meta`` (load at the end, versions) and say when and where a run was made."""
    meta["load_end"] = os.getloadavg()[0].__round__(1)
    meta["versions"] = versions(None)
    return (f"Recorded {meta['date']} on {meta['machine']}; load average at start / end "
            f"{meta['load_start']} / {meta['load_end']}; autogroup {meta['autogroup']}. ")


def random_access_lines(random_access: dict) -> list[str]:
    """The random-access table and the store build figures, as Markdown lines."""
    lines = ["| workers | AtompackLoader vs OnDiskDataset | AtompackLoader vs "
             "DataLoader(AtompackDataset) | DataLoader(AtompackDataset) vs OnDiskDataset |",
             "|---|---|---|---|"]
    for key in ("workers=0", "workers=2"):
        row = random_access[key]["ours_vs"]
        lines.append(f"| {key[-1]} | {fmt(row['ondisk'])} | {fmt(row['atompack_pyg_loader'])} "
                     f"| {fmt(row['pyg_loader_vs_ondisk'])} |")
    build = random_access["build"]
    return lines + ["", f"Store build from the same arrays: `.atp` "
                        f"{build['atp']['seconds']:.2f} s, {build['atp']['bytes']:,} bytes; "
                        f"OnDiskDataset (SQLite) {build['ondisk']['seconds']:.2f} s, "
                        f"{build['ondisk']['bytes']:,} bytes.", ""]


def random_access_only(args, meta: dict, log) -> None:
    """``--random-access``: part 2 alone, into ``results/peers_random_access.md``."""
    scratch = Path(tempfile.mkdtemp(prefix="peers-ra-"))
    try:
        results = random_access_part(args, scratch, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = HERE / "results" / "peers_random_access.md"
    lines = ["# Peers, random access (`benchmarks/peers.py --random-access`)", "",
             recorded(meta) + f"{args.ra_structures} structures of {args.atoms} atoms, "
             f"batches of {BATCH}, "
             f"shuffled, full epochs (worker start-up included), {args.pairs} pairs, order "
             "rotated. Ratios: the named arm's time / the first's, > 1 means the first is "
             "faster. Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()
                                               if k in ("torch", "torch_geometric")) + ".",
             ""] + random_access_lines(results)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results},
                                                   indent=1, default=str), encoding="utf-8")
    print("\n".join(lines), flush=True)


# ------------------------------------------------------------------ part 3
def worker_arms(base: str, names: dict, compute: float, traces: dict) -> dict:
    def ours_workers(prefetch: int, concurrency: int, key: str, dataset_batches: bool = False):
        def run():
            build = ours(base, "pt", prefetch, concurrency, workers=2,
                         dataset_batches=dataset_batches)
            holder = {}

            def make():
                holder["loader"] = build()
                return holder["loader"]
            result = consume(make, compute, arrivals=True)
            dataset = holder["loader"].dataset
            traces[key] = {"stats": dataset.stats(), "records": dataset.trace}
            return result
        return run

    return {"ours_w2_k2c2": ours_workers(2, 2, "ours_w2_k2c2"),
            "ours_w2_dsbatch": ours_workers(2, 2, "ours_w2_dsbatch", dataset_batches=True),
            "webdataset_w2": lambda: consume(webdataset_arm(base, names["tar"], 2), compute,
                                             arrivals=True),
            "ours_w0_k2c2": lambda: consume(ours(base, "pt", 2, 2), compute, arrivals=True),
            "webdataset_w0": lambda: consume(webdataset_arm(base, names["tar"]), compute,
                                             arrivals=True)}


def workers_part(args, www: Path, names: dict, shard_bytes: int, compute_batch: float,
                 ratios, log) -> dict:
    """Ours vs WebDataset through ``DataLoader(num_workers=2)`` (the issue's finding)."""
    compute_shard = compute_batch * args.per_shard / BATCH
    results = {}
    for ratio in ratios:
        bandwidth = shard_bytes / (ratio * compute_shard)
        http = ServerProcess(serve_http, str(www), bandwidth)
        base = http.base_url
        traces: dict = {}
        try:
            runs = run_pairs(worker_arms(base, names, compute_batch, traces), args.pairs)
        finally:
            http.stop()
        summary = {
            "w2_k2c2_vs_wds_w2": summarize_pairs([r["seconds"] for r in runs["webdataset_w2"]],
                                                 [r["seconds"] for r in runs["ours_w2_k2c2"]]),
            "w2_dsbatch_vs_wds_w2": summarize_pairs(
                [r["seconds"] for r in runs["webdataset_w2"]],
                [r["seconds"] for r in runs["ours_w2_dsbatch"]]),
            "w0_vs_wds_w0": summarize_pairs([r["seconds"] for r in runs["webdataset_w0"]],
                                            [r["seconds"] for r in runs["ours_w0_k2c2"]]),
        }
        results[f"{ratio}"] = {"runs": runs, "traces": traces,
                               "summary": {k: v.to_dict() for k, v in summary.items()}}
        log(f"workers=2, D/C={ratio}: " + ", ".join(f"{k} {fmt(v.to_dict())}"
                                                   for k, v in summary.items()))
    return results


# ------------------------------------------------------------------ reporting
def fmt(summary: dict) -> str:
    low, high = summary["speedup_ci"]
    return f"{summary['speedup_geomean']:.2f}x [{low:.2f}, {high:.2f}]"


def median(values) -> float:
    return float(np.median([v for v in values if v is not None])) if values else float("nan")


def versions(mosaic_version: str | None) -> dict:
    found = {}
    for name in ("torch", "torch_geometric", "numpy", "litdata", "webdataset", "moto",
                 "foldpipe", "boto3", "obstore", "datasets", "pyarrow", "fsspec", "aiohttp"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["mosaicml-streaming"] = mosaic_version or "not run"
    return found


def draw(streaming: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ratios = list(streaming)
    peers = [p for p in PEER_ARMS if p in streaming[ratios[0]]["ours_pt_vs"]]
    figure, axis = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / len(peers)
    for k, peer in enumerate(peers):
        means = [streaming[r]["ours_pt_vs"][peer]["speedup_geomean"] for r in ratios]
        lows = [m - streaming[r]["ours_pt_vs"][peer]["speedup_ci"][0]
                for m, r in zip(means, ratios)]
        highs = [streaming[r]["ours_pt_vs"][peer]["speedup_ci"][1] - m
                 for m, r in zip(means, ratios)]
        axis.bar(np.arange(len(ratios)) + k * width, means, width, yerr=[lows, highs],
                 capsize=2, label=peer)
    axis.axhline(1.0, color="k", lw=0.8)
    axis.set_yscale("log")  # the datasets arms sit an order of magnitude above the rest
    axis.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axis.set_xticks(np.arange(len(ratios)) + width * (len(peers) - 1) / 2)
    axis.set_xticklabels([f"D/C={r}" for r in ratios])
    axis.set_ylabel("their time / ours (.pt), log scale")
    axis.set_title("ShardStreamDataset (.pt) vs peers: > 1 means ours is faster", fontsize=9)
    axis.legend(fontsize=7, ncol=3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


#: The arms compared with ``ours_pt``, in the tables' column order.
PEER_ARMS = ("ours_atp", "litdata", "mosaic", "webdataset", "webdataset_w2", "foldpipe",
             "hf_datasets", "hf_datasets_w2", "hf_datasets_nosleep")
PEER_TITLES = ("ours .atp (its time / .pt's)", "LitData", "MosaicML", "WebDataset",
               "WebDataset, 2 workers", "FoldPipe", "HF datasets", "HF datasets, 2 workers",
               "HF datasets, no 5 s sleep")


def knobs(row: dict) -> str:
    """Ours' prefetch / concurrency in a regime: figures with ``--tuned``, else defaults."""
    if row["prefetch"] is None:
        return "defaults"
    return f"{row['prefetch']} / {row['concurrency']}"


def sample_lines(streaming: dict, mixed: dict | None) -> list[str]:
    """What the sample check found (:func:`check_samples`), as Markdown lines."""
    found = [f"D/C = {ratio}{' (mixed sizes)' if label else ''}: {line}"
             for label, part in (("", streaming), ("mixed", mixed or {}))
             for ratio, row in part.items() if isinstance(row, dict) and "mismatches" in row
             for line in row["mismatches"]]
    if not found:
        return ["Same samples: every pass of every arm yielded the structures written (its "
                "count, and its energies as float32, sorted, against theirs; MosaicML's "
                "checked on what its child returned).", ""]
    return ["**Sample check failed** (these passes did not yield the structures written):",
            "", *[f"* {line}" for line in found], ""]


def report(args, streaming, random_access, workers, convert, shard_sizes, meta, out,
           mixed=None) -> None:
    lines = [
        "# Peers: LitData, MosaicML streaming, WebDataset, FoldPipe, Hugging Face datasets, "
        "OnDiskDataset (`benchmarks/peers.py`)",
        "",
        f"Recorded {meta['date']} on {meta['machine']}; load average at start / end "
        f"{meta['load_start']} / {meta['load_end']}, autogroup nice "
        f"{meta.get('autogroup', 'unknown')} ("
        + ("a loaded machine: **rerun on a quiet one** before quoting absolute figures; "
           if max(meta["load_start"], meta["load_end"]) > 2 else "")
        + "ratios are paired, arms interleaved). Versions: "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
        "",
        f"{args.shards} shards x {args.per_shard} structures of {args.atoms} atoms (z, pos, "
        f"forces, energy); consumer: {args.compute * 1e3:.0f} ms sleep per batch of {BATCH}; "
        f"per-connection bandwidth set so that one `.pt` shard ({shard_sizes['pt'] / 1024:.0f} "
        f"KiB) takes D = ratio x C. {args.pairs} pairs per regime, order rotated. Ratios: "
        "their wall time / ours (`ShardStreamDataset` over `.pt`), geometric mean "
        "[bootstrap 95% CI]; **> 1 means ours is faster**. Shard bytes: "
        + ", ".join(f"{k} {v / 1024:.0f} KiB" for k, v in shard_sizes.items()) + ".",
        "",
        "## Streaming from remote storage",
        "",
        "Ours (k / conc.: prefetch / concurrency) runs with "
        + ("the per-regime figures of `stream_overlap.py` (`--tuned`)" if args.tuned else
           "the library's defaults (prefetch 1, connections chosen by measurement)")
        + "; every peer with its documented defaults (see the notes at the end).",
        "",
        "| D/C | k / conc. | " + " | ".join(PEER_TITLES) + " |",
        "|---|---|" + "---|" * len(PEER_TITLES),
    ]
    peers = PEER_ARMS
    for ratio, row in streaming.items():
        cells = [fmt(row["ours_pt_vs"][p]) if p in row["ours_pt_vs"] else "did not run"
                 for p in peers]
        lines.append(f"| {ratio} | {knobs(row)} | " + " | ".join(cells) + " |")
    lines += ["", *sample_lines(streaming, mixed)]
    lines += [
        "Median time to first batch (s) / peak RSS growth (MiB) / peak local disk (MiB):",
        "",
        "| D/C | ours .pt | " + " | ".join(PEER_TITLES) + " |",
        "|---|---|" + "---|" * len(PEER_TITLES),
    ]
    for ratio, row in streaming.items():
        cells = []
        for arm in ("ours_pt", *peers):
            passes = row["runs"].get(arm)
            if not passes:
                cells.append("–")
                continue
            cells.append(f"{median([p['first_batch_s'] for p in passes]):.2f} / "
                         f"{median([p['rss_growth'] for p in passes]) / 2**20:.0f} / "
                         f"{median([p['disk_peak'] for p in passes]) / 2**20:.1f}")
        lines.append(f"| {ratio} | " + " | ".join(cells) + " |")
    if mixed:
        row = mixed["1.0"]
        lines += [
            "",
            f"## Mixed sizes: {MIXED_ATOMS[0]}-{MIXED_ATOMS[1]} atoms per structure, "
            f"D/C = 1 (ours: {knobs(row)})",
            "",
            "The same pipeline over structures whose atom counts are drawn uniformly from "
            f"{MIXED_ATOMS[0]}-{MIXED_ATOMS[1]} (mean 64; mean `.pt` shard "
            f"{mixed['shard_bytes']['pt'] / 1024:.0f} KiB, {mixed['shards']} shards). The "
            "peers' default collate cannot "
            "stack arrays of different shapes, so they batch with `concat_collate` (atoms "
            "concatenated, as a graph loader does; HF datasets too, on its torch format); "
            "ours and FoldPipe batch PyG `Batch`es.",
            "",
            "| arm | their time / ours (.pt) | first batch s / RSS MiB / disk MiB |",
            "|---|---|---|",
        ]
        for arm in ("ours_pt", *peers):
            passes = row["runs"].get(arm)
            if not passes:
                lines.append(f"| {arm} | did not run | – |")
                continue
            ratio_cell = "reference" if arm == "ours_pt" else fmt(row["ours_pt_vs"][arm])
            lines.append(f"| {arm} | {ratio_cell} | "
                         f"{median([p['first_batch_s'] for p in passes]):.2f} / "
                         f"{median([p['rss_growth'] for p in passes]) / 2**20:.0f} / "
                         f"{median([p['disk_peak'] for p in passes]) / 2**20:.1f} |")
    lines += [
        "",
        "Conversion before training (from the structures in memory; ours reads existing "
        "`.pt` / `.atp` shards as they are; measured when the stores were written, "
        f"{', '.join(meta.get('stores_built', [])) or 'this run'}, and kept under "
        "`benchmarks/_work/peers-stores/` for later runs, `--rebuild` to write them again):",
        "",
        "| format | seconds | bytes |",
        "|---|---:|---:|",
    ]
    for name, figures in convert.items():
        lines.append(f"| {name} | {figures['seconds']:.2f} | {figures['bytes']:,} |")
    lines += ["", "## Random access (PyG training loop, batches of 32, shuffled)", ""]
    lines += random_access_lines(random_access)
    lines += workers_lines(workers)
    lines += meta.get("notes", [])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)


def workers_lines(workers: dict) -> list[str]:
    """The table of part 3 (ours vs WebDataset behind ``DataLoader(num_workers=2)``)."""
    if not workers:
        return []
    lines = ["## DataLoader workers (the issue's finding)", "",
             "| D/C | ours w=2 (PyG DataLoader) vs WDS w=2 | ours w=2, dataset batches "
             "vs WDS w=2 | ours w=0 vs WDS w=0 | first batch s (ours w2 / WDS w2 / "
             "ours w0 / WDS w0) |",
             "|---|---|---|---|---|"]
    for ratio, row in workers.items():
        s = row["summary"]
        firsts = " / ".join(
            f"{median([p['first_batch_s'] for p in row['runs'][a]]):.2f}"
            for a in ("ours_w2_k2c2", "webdataset_w2", "ours_w0_k2c2", "webdataset_w0"))
        lines.append(f"| {ratio} | {fmt(s['w2_k2c2_vs_wds_w2'])} | "
                     f"{fmt(s['w2_dsbatch_vs_wds_w2'])} | {fmt(s['w0_vs_wds_w0'])} | "
                     f"{firsts} |")
    return [*lines, ""]


def workers_only(args, meta: dict, log) -> None:
    """``--workers-only``: part 3 alone, into ``results/peers_workers.md`` (+ ``.json``)."""
    scratch = Path(tempfile.mkdtemp(prefix="peers-workers-"))
    try:
        www = scratch / "www"
        for sub in ("pt", "atp", "tar", "parquet"):
            (www / sub).mkdir(parents=True)
        names, _ = write_formats(www, scratch / "litdata", scratch / "mds.npz", args.shards,
                                 args.per_shard, args.atoms)
        shard_bytes = (www / "pt" / names["pt"][0]).stat().st_size
        workers = workers_part(args, www, names, shard_bytes, args.compute, [1.0, 3.0], log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta["load_end"] = os.getloadavg()[0].__round__(1)
    out = HERE / "results" / "peers_workers.md"
    lines = ["# Peers, part 3 only: DataLoader workers (`benchmarks/peers.py --workers-only`)",
             "", f"Recorded {meta['date']} on {meta['machine']}; load average at start / end "
             f"{meta['load_start']} / {meta['load_end']}. {args.shards} shards x "
             f"{args.per_shard} structures of {args.atoms} atoms, {args.pairs} pairs, "
             f"consumer {args.compute * 1e3:.0f} ms per batch of {BATCH}; ours at prefetch 2, "
             "concurrency 2 per rank (each of the 2 workers: 1 and 1). Ratios: WebDataset's "
             "time / ours, > 1 means ours is faster.", "", *workers_lines(workers)]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    for row in workers.values():
        row.pop("traces", None)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "workers": workers},
                                                   indent=1, default=str), encoding="utf-8")
    print("\n".join(lines), flush=True)
    print(json.dumps({ratio: round(row["summary"]["w2_k2c2_vs_wds_w2"]["speedup_geomean"], 3)
                      for ratio, row in workers.items()}), flush=True)


# ------------------------------------------------------------------ --first-shard
#: ``--first-shard`` arms: ours with the defaults (``verify_before_use="records"``: the
#: first shard handed out as it arrives, each record checked against its CRC-32, the
#: listed sha256 at its end), ours with ``verify_before_use=True`` (the benchmark's
#: manifests carry sha256, so the first shard is then hashed whole before any sample),
#: ours with nothing checked before use (``verify_before_use=False``), every shard so
#: (``stream_shards="all"``), and WebDataset (which verifies nothing), in-process and
#: behind 2 DataLoader workers.
FIRST_SHARD_ARMS = ("ours_pt_early", "ours_pt_all", "ours_pt", "ours_pt_strict", "webdataset",
                    "webdataset_w2", "ours_w2_early", "ours_w2_all", "ours_w2",
                    "ours_w2_strict")


def first_shard_arms(base: str, names: dict, prefetch: int, concurrency: int,
                     compute: float) -> dict:
    early = {"verify_before_use": False}
    every = {"verify_before_use": False, "stream_shards": "all"}
    strict = {"verify_before_use": True}
    return {
        "ours_pt_strict": lambda: consume(ours(base, "pt", prefetch, concurrency, **strict),
                                          compute),
        "ours_w2_strict": lambda: consume(ours(base, "pt", 2, 2, workers=2, **strict),
                                          compute),
        "ours_pt_early": lambda: consume(ours(base, "pt", prefetch, concurrency, **early),
                                         compute),
        "ours_pt_all": lambda: consume(ours(base, "pt", prefetch, concurrency, **every),
                                       compute),
        "ours_pt": lambda: consume(ours(base, "pt", prefetch, concurrency), compute),
        "webdataset": lambda: consume(webdataset_arm(base, names["tar"]), compute),
        "webdataset_w2": lambda: consume(webdataset_arm(base, names["tar"], 2), compute),
        # the workers part's setting: prefetch 2 / concurrency 2 per rank
        "ours_w2_early": lambda: consume(ours(base, "pt", 2, 2, workers=2, **early), compute),
        "ours_w2_all": lambda: consume(ours(base, "pt", 2, 2, workers=2, **every), compute),
        "ours_w2": lambda: consume(ours(base, "pt", 2, 2, workers=2), compute),
    }


def first_shard_only(args, meta: dict, log) -> None:
    """``--first-shard``: the arms the first shard decides, at D/C = 0.5, 1 and 3, over
    the kept 64-atom stores, into ``results/peers_first_shard.md`` (+ ``.json``)."""
    root = STORES / f"{args.shards}x{args.per_shard}x{args.atoms}-{stores_key()}"
    marker = root / "stores.json"
    if not marker.exists():  # these arms need no MosaicML store: a full run adds it
        ensure_litdata()
        shutil.rmtree(root, ignore_errors=True)
        for sub in ("pt", "atp", "tar", "parquet"):
            (root / "www" / sub).mkdir(parents=True)
        names, convert = write_formats(root / "www", root / "litdata", root / "mds.npz",
                                       args.shards, args.per_shard, args.atoms)
        (root / "mds").mkdir()
        marker.write_text(json.dumps({"built": meta["date"], "names": names,
                                      "convert": convert, "mds": False}), encoding="utf-8")
        log(f"built the stores in {root} (no MosaicML store yet)")
    saved = json.loads(marker.read_text(encoding="utf-8"))
    names, www = saved["names"], root / "www"
    shard_bytes = int(np.mean([(www / "pt" / n).stat().st_size for n in names["pt"]]))
    compute_shard = args.compute * args.per_shard / BATCH
    results = {}
    for ratio, prefetch, concurrency in REGIMES:
        bandwidth = shard_bytes / (ratio * compute_shard)
        http = ServerProcess(serve_http, str(www), bandwidth)
        try:
            runs = run_pairs(first_shard_arms(http.base_url, names, prefetch, concurrency,
                                              args.compute), args.pairs)
        finally:
            http.stop()
        expected = args.shards * args.per_shard
        for name, passes in runs.items():
            if {p["samples"] for p in passes} != {expected}:
                log(f"D/C={ratio} {name}: samples per pass differ from {expected}")
        seconds = {name: [p["seconds"] for p in passes] for name, passes in runs.items()}
        pairs = {  # their time / ours: > 1 means the second arm is faster
            "webdataset / ours early": ("webdataset", "ours_pt_early"),
            "webdataset w2 / ours early": ("webdataset_w2", "ours_pt_early"),
            "webdataset / ours default": ("webdataset", "ours_pt"),
            "ours strict / ours default": ("ours_pt_strict", "ours_pt"),
            "webdataset w2 / ours w2 strict": ("webdataset_w2", "ours_w2_strict"),
            "ours w2 strict / ours w2 default": ("ours_w2_strict", "ours_w2"),
            "ours verified / ours early": ("ours_pt", "ours_pt_early"),
            "webdataset w2 / ours w2 early": ("webdataset_w2", "ours_w2_early"),
            "webdataset w2 / ours w2 verified": ("webdataset_w2", "ours_w2"),
            "ours w2 verified / ours w2 early": ("ours_w2", "ours_w2_early"),
            "webdataset / ours all": ("webdataset", "ours_pt_all"),
            "webdataset w2 / ours all": ("webdataset_w2", "ours_pt_all"),
            "webdataset w2 / ours w2 all": ("webdataset_w2", "ours_w2_all"),
            "ours early / ours all": ("ours_pt_early", "ours_pt_all"),
        }
        summary = {label: summarize_pairs(seconds[a], seconds[b]).to_dict()
                   for label, (a, b) in pairs.items()}
        firsts = {name: median([p["first_batch_s"] for p in passes])
                  for name, passes in runs.items()}
        results[f"{ratio}"] = {"prefetch": prefetch, "concurrency": concurrency,
                               "bandwidth_Bps": bandwidth, "runs": runs, "summary": summary,
                               "first_batch_s": firsts}
        log(f"D/C={ratio}: " + ", ".join(f"{k} {fmt(v)}" for k, v in summary.items())
            + "; first batch " + ", ".join(f"{k} {v:.3f}" for k, v in firsts.items()))
    out = HERE / "results" / "peers_first_shard.md"
    lines = ["# Peers, the first shard (`benchmarks/peers.py --first-shard`)", "",
             recorded(meta) + f"{args.shards} shards x {args.per_shard} structures of "
             f"{args.atoms} atoms "
             f"(the kept stores built {saved['built']}), {args.pairs} pairs, order "
             f"rotated, consumer {args.compute * 1e3:.0f} ms per batch of {BATCH}. The "
             "manifests list size and sha256 of every shard: `ours_pt` / `ours_w2` run "
             "with the defaults (`verify_before_use=\"records\"`: the first shard handed "
             "out as it arrives, each record checked against its CRC-32, the sha256 at "
             "its end; \"verified\" in the ratio names), `*_strict` with "
             "`verify_before_use=True` (the first shard hashed whole before its first "
             "sample), `*_early` with `verify_before_use=False` (the first shard handed "
             "out as it arrives, its hash checked at its end), `*_all` with "
             "`verify_before_use=False, stream_shards=\"all\"` (every shard so). "
             "In-process arms at the "
             "regime's prefetch / concurrency; 2-worker arms at 2 / 2 per rank. Ratios: "
             "first arm's time / second's, > 1 means the second is faster. Versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()
                         if k in ("torch", "torch_geometric", "webdataset")) + ".", "",
             "| D/C | " + " | ".join(next(iter(results.values()))["summary"]) + " |",
             "|---|" + "---|" * len(next(iter(results.values()))["summary"])]
    for ratio, row in results.items():
        lines.append(f"| {ratio} | " + " | ".join(fmt(v) for v in row["summary"].values())
                     + " |")
    lines += ["", "Time to first batch (median, s):", "",
              "| D/C | " + " | ".join(FIRST_SHARD_ARMS) + " |",
              "|---|" + "---|" * len(FIRST_SHARD_ARMS)]
    for ratio, row in results.items():
        lines.append(f"| {ratio} | " + " | ".join(
            f"{row['first_batch_s'][a]:.3f}" for a in FIRST_SHARD_ARMS) + " |")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "regimes": results},
                                                   indent=1, default=str), encoding="utf-8")
    print("\n".join(lines), flush=True)


NOTES = [
    "## How each peer was run, and what had to be worked around",
    "",
    "* **LitData** 0.2.76 fetches chunks with obstore when it is installed, and builds "
    "that `S3Store` with fixed client options that do not allow plain HTTP: against an "
    "`http://` S3 endpoint every chunk GET fails (`reqwest` `BadScheme`; `AWS_ALLOW_HTTP` "
    "is not consulted). The arm sets `litdata.streaming.downloader._OBSTORE_AVAILABLE = "
    "False`, so LitData uses its boto3 path (`index.json` already goes through boto3). "
    "`litdata.optimize` spawns its workers, which re-import the calling script.",
    "* **MosaicML streaming** 0.13.0 runs in `benchmarks/_work/mosaic-venv` "
    "(`peer_mosaic.py`): its pins (`numpy<2.2`, `transformers<5` -> "
    "`huggingface_hub<1.0`) conflict with the project, and `import streaming` imports "
    "`streaming.vision`, which needs `torchvision` (the index only has CUDA builds, "
    "which fail to load next to the CPU torch); empty modules stand in for "
    "`streaming.vision` / `streaming.multimodal`, which are not used. torch and boto3 "
    "come from the project venv via a `.pth` file. `S3_ENDPOINT_URL` points it at the "
    "proxy. Its times are measured inside the child (after imports), like the others'.",
    "* **WebDataset** 1.0.2 reads `http://` URLs through a `curl` subprocess per shard "
    "(its `gopen`), `shardshuffle` = number of shards, `.shuffle(1000)`, default "
    "`.decode()` of `.npy` members, torch `DataLoader` default collate.",
    "* **OnDiskDataset**: typed columns (`schema` with tensor dtypes and sizes, as "
    "PyG's `PCQM4Mv2` does) so rows are raw tensor bytes, not pickles; filled with "
    "`extend(..., batch_size=1000)`.",
    "* Every pass of LitData / MosaicML starts from an empty local cache (else the "
    "second pass would read from disk).",
    "* **Hugging Face datasets** (`peer_hf_datasets.py`): Parquet shards written with "
    "`Dataset.from_list(...).to_parquet()`, one per `.pt` shard, on the same HTTP server; "
    "read with `load_dataset(\"parquet\", data_files=[http URLs], split=\"train\", "
    "streaming=True).shuffle(seed=0).with_format(\"torch\")` and a torch `DataLoader` "
    "(in-process, and with `num_workers=2`), all at the library's defaults: plain http:// "
    "URLs work (fsspec's HTTP filesystem over aiohttp, ranged reads), and the shuffle "
    "buffer (1,000 samples) is fed from up to 10 shards at once, each on its own thread "
    "and connection. When a shuffled Parquet stream ends, datasets 5.x sleeps 5 s "
    "(`datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN`, a workaround for "
    "apache/arrow#45214) when the shuffle's source runs dry: with a buffer of 1,000 "
    "samples every epoch stalls 5 s before its last 1,000 samples (before its first "
    "batch where the data is smaller than the buffer). `hf_datasets` and "
    "`hf_datasets_w2` keep it (a user waits for it); `hf_datasets_nosleep` sets that "
    "config value to 0 to show what it costs. The rows are written with the features "
    "`datasets` infers (`pos`: `List(List(float32))`) and turned into tensors row "
    "by row by its torch formatter.",
    "* **Ours** runs with the library's defaults unless the run says `--tuned`; part 3 "
    "(DataLoader workers) keeps prefetch 2 / concurrency 2 per rank, one connection "
    "per worker as each WebDataset worker has.",
]


def autogroup() -> str:
    """This process group's scheduler priority (``/proc/self/autogroup``), for the record."""
    try:
        return Path("/proc/self/autogroup").read_text(encoding="utf-8").split()[-1]
    except (OSError, IndexError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--shards", type=int, default=12)
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument("--atoms", type=int, default=64)
    parser.add_argument("--ra-structures", type=int, default=8192,
                        help="structures in the random-access stores")
    parser.add_argument("--compute", type=float, default=0.02, help="compute s per batch")
    parser.add_argument("--quick", action="store_true",
                        help="D/C = 1 only, 2 pairs, 6 shards (smoke run, < 5 min)")
    parser.add_argument("--no-workers", action="store_true", help="skip part 3")
    parser.add_argument("--no-mixed", action="store_true",
                        help=f"skip the mixed-size set ({MIXED_ATOMS[0]}-{MIXED_ATOMS[1]} atoms)")
    parser.add_argument("--workers-only", action="store_true",
                        help="run part 3 alone (into results/peers_workers.md)")
    parser.add_argument("--random-access", action="store_true",
                        help="only part 2 (random access against OnDiskDataset), into "
                             "results/peers_random_access.md")
    parser.add_argument("--first-shard", action="store_true",
                        help="only the arms the first shard decides (ours with and without "
                             "verify_before_use, WebDataset in-process and in 2 workers) at "
                             "D/C = 0.5, 1, 3 over the kept stores (results/peers_first_shard.md)")
    parser.add_argument("--tuned", action="store_true",
                        help="give ours the per-regime prefetch / concurrency of "
                             "stream_overlap.py (earlier records) instead of the defaults")
    parser.add_argument("--rebuild", action="store_true",
                        help="write the stores again even if benchmarks/_work/ has them")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "peers.md")
    args = parser.parse_args()
    # every peer runs with its own defaults, and so does ours unless --tuned
    regimes = REGIMES if args.tuned else [(ratio, None, None) for ratio, _, _ in REGIMES]
    worker_ratios = [1.0, 3.0]
    if args.quick:
        args.pairs, args.shards, args.per_shard, args.ra_structures = 2, 6, 128, 1024
        regimes, worker_ratios = [regimes[1]], [1.0]
        args.out = Path(tempfile.mkdtemp(prefix="peers-quick-")) / "peers.md"
    torch.set_num_threads(1)
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()} {os.cpu_count()} CPU, Linux {platform.release()}, "
                       f"Python {platform.python_version()}",
            "load_start": os.getloadavg()[0].__round__(1), "autogroup": autogroup()}
    if args.first_shard:
        first_shard_only(args, meta, log)
        return
    if args.random_access:
        random_access_only(args, meta, log)
        return
    ensure_litdata()
    if args.workers_only:
        workers_only(args, meta, log)
        return
    scratch = Path(tempfile.mkdtemp(prefix="peers-"))
    begun = time.perf_counter()
    mosaic = None
    try:
        try:  # one child for the whole run: conversions and every read
            mosaic = MosaicArm()
        except Exception as exc:  # recorded, never silently dropped
            log(f"MosaicML venv unavailable: {exc}")
        mosaic_version = mosaic.version if mosaic is not None else None
        stores_built = []

        def build_stores(atoms, shards: int) -> tuple:
            """Every format of one structure set: (www, names, convert, litdata dir, MDS
            dir, shard sizes), reused from ``benchmarks/_work/peers-stores/`` when an
            earlier run with the same set and versions left them there."""
            spec = atoms if isinstance(atoms, int) else f"{atoms[0]}-{atoms[1]}"
            root = STORES / f"{shards}x{args.per_shard}x{spec}-{stores_key()}"
            www, lit_dir, mds_dir = root / "www", root / "litdata", root / "mds"
            marker = root / "stores.json"
            if marker.exists() and not args.rebuild and json.loads(
                    marker.read_text(encoding="utf-8")).get("mds", True):
                saved = json.loads(marker.read_text(encoding="utf-8"))
                names, convert = saved["names"], saved["convert"]
                log(f"reusing the stores built {saved['built']} in {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
                for sub in ("pt", "atp", "tar", "parquet"):
                    (www / sub).mkdir(parents=True)
                names, convert = write_formats(www, lit_dir, root / "mds.npz", shards,
                                               args.per_shard, atoms)
                mds_dir.mkdir()
                saved = {"built": meta["date"], "names": names, "convert": convert}
                try:
                    pt_shard = (www / "pt" / names["pt"][0]).stat().st_size
                    convert["mosaicml (MDSWriter)"] = mosaic.ask(
                        op="convert", source=str(root / "mds.npz"), out=str(mds_dir),
                        size_limit=pt_shard)
                    marker.write_text(json.dumps(saved), encoding="utf-8")
                except Exception as exc:  # the stores are rebuilt next time
                    log(f"MosaicML conversion failed: {exc}")
            stores_built.append(saved["built"])
            sizes = {kind: int(np.mean([(www / kind / n).stat().st_size for n in names[kind]]))
                     for kind in ("pt", "atp", "tar", "parquet") if names.get(kind)}
            sizes["litdata"] = max(p.stat().st_size for p in lit_dir.glob("*.bin"))
            if any(mds_dir.glob("*.mds")):
                sizes["mds"] = max(p.stat().st_size for p in mds_dir.glob("*.mds"))
            return www, names, convert, lit_dir, mds_dir, sizes

        www, names, convert, lit_dir, mds_dir, shard_sizes = build_stores(
            args.atoms, args.shards)
        # the mixed-size set: fewer shards in a quick run, to stay within its 5 minutes
        mixed_args = argparse.Namespace(**{**vars(args),
                                           "shards": 4 if args.quick else args.shards})
        mixed_stores = None if args.no_mixed else build_stores(MIXED_ATOMS, mixed_args.shards)
        meta["stores_built"] = sorted(set(stores_built))
        import litdata.streaming.downloader as litdata_downloader

        litdata_downloader._OBSTORE_AVAILABLE = False  # see NOTES: obstore refuses http://
        log(f"[{time.perf_counter() - begun:.0f} s] formats written; streaming part")
        streaming = streaming_part(
            args, www, names, lit_dir, mds_dir, shard_sizes["pt"], args.compute, regimes, log,
            mosaic, digest=expected_digest(args.shards, args.per_shard, args.atoms))
        mixed = {}
        if mixed_stores is not None:
            log(f"[{time.perf_counter() - begun:.0f} s] mixed-size streaming part")
            m_www, m_names, _, m_lit, m_mds, m_sizes = mixed_stores
            mixed = streaming_part(
                mixed_args, m_www, m_names, m_lit, m_mds, m_sizes["pt"], args.compute,
                [next(r for r in regimes if r[0] == 1.0)], log, mosaic, ragged=True,
                digest=expected_digest(mixed_args.shards, args.per_shard, MIXED_ATOMS))
            mixed["shard_bytes"], mixed["shards"] = m_sizes, mixed_args.shards
        log(f"[{time.perf_counter() - begun:.0f} s] random-access part")
        random_access = random_access_part(args, scratch, log)
        log(f"[{time.perf_counter() - begun:.0f} s] workers part")
        workers = {} if args.no_workers else workers_part(
            args, www, names, shard_sizes["pt"], args.compute, worker_ratios, log)
        meta["load_end"] = os.getloadavg()[0].__round__(1)
        meta["versions"] = versions(mosaic_version)
        meta["notes"] = NOTES
        report(args, streaming, random_access, workers, convert, shard_sizes, meta, args.out,
               mixed)
        details = {"meta": meta, "convert": convert, "shard_bytes": shard_sizes,
                   "streaming": streaming, "mixed": mixed, "random_access": random_access,
                   "workers": workers}
        args.out.with_suffix(".json").write_text(json.dumps(details, indent=1, default=str),
                                                 encoding="utf-8")
        if not args.quick:
            draw(streaming, HERE / "figures" / "peers.png")
        one = streaming["1.0"]["ours_pt_vs"]
        last = {name: round(one[name]["speedup_geomean"], 3) if name in one else None
                for name in ("litdata", "mosaic", "foldpipe")}
        # WebDataset as its documentation recommends: behind DataLoader workers
        last["webdataset"] = round(one["webdataset_w2"]["speedup_geomean"], 3)
        # Hugging Face datasets as a user writes it (in-process, its defaults), then in
        # 2 workers and without its 5 s sleep; ``headline.py`` reads "datasets"
        for key, name in (("datasets", "hf_datasets"), ("datasets_w2", "hf_datasets_w2"),
                          ("datasets_nosleep", "hf_datasets_nosleep")):
            last[key] = round(one[name]["speedup_geomean"], 3) if name in one else None
        last = {k: last[k] for k in ("litdata", "mosaic", "webdataset", "foldpipe",
                                     "datasets", "datasets_w2", "datasets_nosleep")}
        last["ondisk"] = round(
            random_access["workers=0"]["ours_vs"]["ondisk"]["speedup_geomean"], 3)
        log(f"[{time.perf_counter() - begun:.0f} s] done")
        print(json.dumps(last), flush=True)
    finally:
        if mosaic is not None:
            mosaic.close()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
