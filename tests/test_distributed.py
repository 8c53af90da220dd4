"""Multi-rank training with torchrun (2 ranks, gloo, CPU) from both datasets.

One ``torchrun --standalone --nproc_per_node=2`` launch of ``tests/ddp_worker.py``
trains a tiny DDP model from (a) ``AtompackDataset`` + ``DistributedSampler``
through ``AtompackLoader`` and (b) ``ShardStreamDataset`` over the loopback HTTP
server with 2 DataLoader workers per rank; each scenario is run twice with fresh
objects and the same seed, two epochs each. The ranks report every sample id
they consumed; the tests below check the reports:

* every sample is seen exactly once per epoch across ranks and workers (40
  molecules over 2 ranks; 8 equal shards over 2 x 2 streams);
* with shards of mixed sizes, ranks are equalised by dropping surplus samples,
  exactly as :meth:`ShardStreamDataset.plan` documents, and nothing is repeated;
* ranks take the same number of steps (DDP would hang otherwise: the launch has
  a timeout);
* epoch 1 is ordered differently from epoch 0, and a rerun with the same seed
  reproduces both orders exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servers.http_server import ShardServer, write_pt_shards

from pyg_atompack import ShardStreamDataset, atp
from pyg_atompack.stream import RemoteSource
from pyg_atompack.stream.splitting import StreamSlot

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
N_MOLECULES = 40
EVEN_SHARDS = [10] * 8
UNEVEN_SHARDS = [7, 10, 3, 12, 5, 9, 4, 8, 6]
SEED = 1234
LAUNCH_TIMEOUT_S = 240
WORLD_SIZE = 2


def _write_atp(path: Path) -> None:
    rng = np.random.default_rng(0)
    with atp.Writer(path) as writer:
        for i in range(N_MOLECULES):
            n = 2 + i % 4
            writer.add(rng.normal(size=(n, 3)).astype(np.float32),
                       rng.integers(1, 10, n).astype(np.uint8),
                       energy=float(rng.normal()), properties={"sample_id": i})


def _shard_ids(sizes: list[int]) -> list[int]:
    return [shard * 1000 + i for shard, count in enumerate(sizes) for i in range(count)]


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("ddp")
    atp_path = root / "train.atp"
    _write_atp(atp_path)
    www = root / "www"
    for name, sizes in (("even", EVEN_SHARDS), ("uneven", UNEVEN_SHARDS)):
        (www / name).mkdir(parents=True)
        write_pt_shards(www / name, sizes)
    out = root / "out"
    out.mkdir()
    server = ShardServer(www).start()
    try:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={WORLD_SIZE}", str(WORKER),
            "--atp", str(atp_path), "--manifest", server.url("even/manifest.json"),
            "--uneven-manifest", server.url("uneven/manifest.json"),
            "--out", str(out), "--seed", str(SEED),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        try:
            result = subprocess.run(command, capture_output=True, text=True, env=env,
                                    timeout=LAUNCH_TIMEOUT_S, cwd=root)
        except subprocess.TimeoutExpired as expired:
            pytest.fail(f"torchrun did not finish in {LAUNCH_TIMEOUT_S}s (a rank hung?):\n"
                        f"{expired.stdout}\n{expired.stderr}")
        assert result.returncode == 0, f"torchrun failed:\n{result.stdout}\n{result.stderr}"
        reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
        manifests = {name: server.url(f"{name}/manifest.json") for name in ("even", "uneven")}
        yield {"reports": reports, "manifests": manifests}
    finally:
        server.stop()


def _epochs(launch: dict, scenario: str) -> dict[tuple[int, int], list[dict]]:
    """(run, epoch) -> the records of that epoch, in rank order."""
    grouped: dict[tuple[int, int], list[dict]] = {}
    for report in launch["reports"]:
        for record in report[scenario]:
            grouped.setdefault((record["run"], record["epoch"]), []).append(record)
    assert all(len(v) == WORLD_SIZE for v in grouped.values())
    assert sorted(grouped) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    return grouped


def test_ranks_are_distinct_processes(launch: dict) -> None:
    assert sorted(r["rank"] for r in launch["reports"]) == [0, 1]
    assert all(r["world_size"] == WORLD_SIZE for r in launch["reports"])


@pytest.mark.parametrize("scenario,expected", [
    ("atp", list(range(N_MOLECULES))),
    ("stream", _shard_ids(EVEN_SHARDS)),
])
def test_every_sample_seen_exactly_once_per_epoch(launch: dict, scenario: str,
                                                  expected: list[int]) -> None:
    for key, ranks in _epochs(launch, scenario).items():
        seen = [i for record in ranks for i in record["ids"]]
        assert sorted(seen) == expected, f"{scenario} run/epoch {key}"


@pytest.mark.parametrize("scenario", ["atp", "stream", "stream_uneven"])
def test_ranks_take_equal_numbers_of_steps(launch: dict, scenario: str) -> None:
    for key, ranks in _epochs(launch, scenario).items():
        batches = {record["batches"] for record in ranks}
        assert len(batches) == 1 and batches.pop() > 0, f"{scenario} {key}: {ranks}"


def test_stream_shards_are_split_between_workers(launch: dict) -> None:
    for key, ranks in _epochs(launch, "stream").items():
        owner: dict[int, tuple[int, int]] = {}
        for rank, record in enumerate(ranks):
            assert set(record["workers"]) == {0, 1}, f"{key}: rank {rank} used one worker"
            for sample, worker in zip(record["ids"], record["workers"]):
                stream = (rank, worker)
                # a shard is read by exactly one (rank, worker) stream
                assert owner.setdefault(sample // 1000, stream) == stream, key


def test_uneven_shards_drop_exactly_the_documented_surplus(launch: dict) -> None:
    dataset = ShardStreamDataset(RemoteSource(launch["manifests"]["uneven"]), shuffle=True,
                                 seed=SEED, batch_size=4)
    all_ids = set(_shard_ids(UNEVEN_SHARDS))
    for (run, epoch), ranks in _epochs(launch, "stream_uneven").items():
        dataset.set_epoch(epoch)
        seen = [i for record in ranks for i in record["ids"]]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was repeated"
        assert set(seen) <= all_ids
        for rank, record in enumerate(ranks):
            for worker in (0, 1):
                plan = dataset.plan(StreamSlot(rank, WORLD_SIZE, worker, 2))
                mine = [i for i, w in zip(record["ids"], record["workers"]) if w == worker]
                assert len(mine) == plan.sample_quota, (run, epoch, rank, worker)
                assert {i // 1000 for i in mine} <= set(plan.shards)
        assert len(seen) < len(all_ids)  # these sizes cannot be split evenly: some dropped


@pytest.mark.parametrize("scenario", ["atp", "stream", "stream_uneven"])
def test_epochs_reshuffle_deterministically(launch: dict, scenario: str) -> None:
    epochs = _epochs(launch, scenario)
    for rank in range(WORLD_SIZE):
        first = [epochs[(0, e)][rank]["ids"] for e in (0, 1)]
        rerun = [epochs[(1, e)][rank]["ids"] for e in (0, 1)]
        assert first == rerun, f"{scenario}: rank {rank} order differs on rerun with the seed"
        assert first[0] != first[1], f"{scenario}: rank {rank} epoch 1 repeats epoch 0"


# ----------------------------------------------------------------------------- resume

RESUME_WORKER = Path(__file__).resolve().parent / "resume_worker.py"
RESUME_CASES = ("atp-w2", "stream-w2")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two torchrun launches of ``resume_worker.py``: save mid-epoch, then resume."""
    from test_resume import N_MOLECULES as count
    from test_resume import SHARD_SIZE, write_atp

    from pyg_atompack import convert

    root = tmp_path_factory.mktemp("ddp-resume")
    atp_path = write_atp(root / "train.atp")
    convert.shard(atp_path, root / "shards", SHARD_SIZE)
    out = root / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for phase in ("save", "load"):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={WORLD_SIZE}", str(RESUME_WORKER), phase,
                   "--atp", str(atp_path), "--shards", str(root / "shards"), "--out", str(out),
                   "--cases", ",".join(RESUME_CASES), "--distributed"]
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=LAUNCH_TIMEOUT_S, cwd=root)
        assert result.returncode == 0, f"torchrun {phase} failed:\n{result.stderr}"
    reports = {}
    for case in RESUME_CASES:
        reports[case] = [
            {**json.loads((out / f"{case}.save.rank{r}.json").read_text()),
             **json.loads((out / f"{case}.load.rank{r}.json").read_text())}
            for r in range(WORLD_SIZE)]
    return {"reports": reports, "count": count}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_each_rank_resumes_exactly_in_a_new_launch(resumed: dict, case: str) -> None:
    ranks = resumed["reports"][case]
    for rank, run in enumerate(ranks):
        epoch0, epoch1 = run["full"]
        assert run["head"] and run["tail"], rank
        assert run["head"] + run["tail"] == epoch0, f"rank {rank}"
        assert run["next_epoch"] == epoch1, f"rank {rank}"
    for epoch in (0, 1):  # the ranks split every epoch: each sample exactly once
        seen = [i for run in ranks for i in run["full"][epoch]]
        assert sorted(seen) == list(range(resumed["count"]))
