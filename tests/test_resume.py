"""Exact mid-epoch resume with DataLoader workers, across processes.

``tests/resume_worker.py`` runs in two fresh processes: the first trains
uninterrupted for two epochs and, separately, stops after a few batches and
pickles the loader's ``state_dict()``; the second loads it into a newly built
loader and finishes. For ``AtompackLoader(shuffle=True)``, ``StatefulLoader`` over
``ShardStreamDataset`` and a plain torchdata ``StatefulDataLoader`` over
``ShardStreamDataset``, each with 0 and 2 workers, the interrupted run's head plus
the resumed tail must be the uninterrupted epoch, sample for sample, every sample
exactly once, and the next epoch must match too. The same is checked per rank
under ``torchrun`` in ``test_distributed.py``.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from resume_worker import CASES

from pyg_atompack import AtompackDataset, AtompackLoader, atp, convert
from pyg_atompack.pyg.resume import ResumableSampler, StatefulLoader

WORKER = Path(__file__).resolve().parent / "resume_worker.py"
N_MOLECULES = 40  # not a multiple of the batch size (3): the last batch is short
SHARD_SIZE = 5  # 8 equal shards: they split evenly over 2 ranks x 2 workers


def write_atp(path: Path, count: int = N_MOLECULES) -> Path:
    rng = np.random.default_rng(0)
    with atp.Writer(path) as writer:
        for i in range(count):
            n = 2 + i % 3
            writer.add(rng.normal(size=(n, 3)).astype(np.float32),
                       rng.integers(1, 10, n).astype(np.uint8), energy=float(i),
                       properties={"sample_id": i})
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("resume")
    atp_path = write_atp(root / "train.atp")
    convert.shard(atp_path, root / "shards", SHARD_SIZE)
    out = root / "out"
    out.mkdir()
    for phase in ("save", "load"):
        command = [sys.executable, str(WORKER), phase, "--atp", str(atp_path),
                   "--shards", str(root / "shards"), "--out", str(out)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=240,
                                env={"OMP_NUM_THREADS": "1", "PATH": ""})
        assert result.returncode == 0, f"{phase} failed:\n{result.stdout}\n{result.stderr}"
    return {case: {**json.loads((out / f"{case}.save.json").read_text()),
                   **json.loads((out / f"{case}.load.json").read_text())} for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_resumed_run_continues_the_epoch_exactly(runs: dict, case: str) -> None:
    run = runs[case]
    epoch0, epoch1 = run["full"]
    assert sorted(epoch0) == list(range(N_MOLECULES)), "every sample exactly once"
    assert epoch0 != sorted(epoch0), "the epoch is shuffled"
    assert len(run["head"]) > 0 and len(run["tail"]) > 0
    assert run["head"] + run["tail"] == epoch0
    assert run["next_epoch"] == epoch1
    assert epoch1 != epoch0


def test_resume_checks_the_state(tmp_path: Path) -> None:
    # another worker count: tests/test_elastic.py
    dataset = AtompackDataset(write_atp(tmp_path / "w.atp"))
    loader = AtompackLoader(dataset, batch_size=4, shuffle=True, seed=1, num_workers=0)
    next(iter(loader))
    with pytest.raises(ValueError, match="not a pyg_atompack loader state_dict"):
        loader.load_state_dict({"anything": 1})


def test_sampler_matches_distributed_sampler_and_checks_its_state() -> None:
    from torch.utils.data import DistributedSampler

    data = list(range(23))
    for rank in range(3):
        ours = ResumableSampler(data, seed=4, rank=rank, world_size=3)
        theirs = DistributedSampler(data, num_replicas=3, rank=rank, seed=4)
        for epoch in range(2):
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)  # ours advances its epoch by itself
    sampler = ResumableSampler(data, seed=4)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="seed=4, this sampler 5"):
        ResumableSampler(data, seed=5).load_state_dict(state)
    # a state taken at the end of a pass resumes with the next epoch
    first = list(sampler)
    restored = ResumableSampler(data, seed=4)
    restored.load_state_dict(pickle.loads(pickle.dumps(sampler.state_dict())))
    assert list(restored) == list(sampler) != first


def test_stateful_loader_collates_like_pyg() -> None:
    from torch_geometric.data import Data
    from torch_geometric.loader import DataLoader

    data = [Data(pos=torch.randn(i + 1, 3), energy=torch.tensor([float(i)])) for i in range(9)]
    ours = list(StatefulLoader(data, batch_size=4, follow_batch=["pos"]))
    theirs = list(DataLoader(data, batch_size=4, follow_batch=["pos"]))
    assert len(ours) == len(theirs) == 3
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine.pos, reference.pos)
        assert torch.equal(mine.pos_batch, reference.pos_batch)
        assert torch.equal(mine.ptr, reference.ptr)
