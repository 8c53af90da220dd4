"""Elastic resume: a state saved on R ranks with W workers resumes on R' ranks with W' workers.

Real launches: ``tests/elastic_worker.py`` runs under ``torchrun --standalone
--nproc_per_node=R`` (gloo, CPU) and stops every case after a few steps of epoch 0,
saving each rank's ``loader.state_dict()``; a second launch with ``R'`` ranks builds
the loaders with ``W'`` workers, loads the states and finishes the epoch, then runs
the next one. The union of the interrupted part (all old ranks) and the resumed part
(all new ranks) must be the epoch exactly: every sample id once, none lost, none
repeated; the next epoch is whole again on the new grid.

Cases: ranks 2 -> 1 and 1 -> 2, and DataLoader workers 2 -> 3, for
``AtompackLoader(shuffle=True)`` with ``batch_size`` and with ``max_atoms``, for
``StatefulLoader`` over ``ShardStreamDataset`` and over a ``MixedDataset`` of an
``AtompackDataset`` and a ``ShardStreamDataset``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from elastic_worker import parse
from test_resume import write_atp

from pyg_atompack import (
    AtompackDataset,
    AtompackLoader,
    ShardStreamDataset,
    SourceOptions,
    atp,
    convert,
)
from pyg_atompack.pyg.resume import ResumableSampler
from pyg_atompack.stream import LocalSource

WORKER = Path(__file__).resolve().parent / "elastic_worker.py"
N_MOLECULES = 40  # 40 = 3 steps x 4 x (1 or 2 ranks) + a rest that divides by 1 and 2
SHARD_SIZE = 5
LAUNCH_TIMEOUT_S = 300
CASES = [f"{kind}-{grids}" for kind in ("atp", "budget", "stream", "mix")
         for grids in ("r2w0-r1w0", "r1w0-r2w2", "r1w2-r1w3")]


def _launch(ranks: int, phase: str, cases: list[str], root: Path) -> None:
    if not cases:
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(WORKER), phase,
               "--atp", str(root / "train.atp"), "--shards", str(root / "shards"),
               "--out", str(root / "out"), "--cases", ",".join(cases)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env,
                                timeout=LAUNCH_TIMEOUT_S, cwd=root)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"torchrun {phase} on {ranks} ranks did not finish in "
                    f"{LAUNCH_TIMEOUT_S}s:\n{expired.stdout}\n{expired.stderr}")
    assert result.returncode == 0, (f"torchrun {phase} on {ranks} ranks failed:\n"
                                    f"{result.stdout}\n{result.stderr}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("elastic")
    write_atp(root / "train.atp", N_MOLECULES)
    convert.shard(root / "train.atp", root / "shards", SHARD_SIZE)
    (root / "out").mkdir()
    for phase, index in (("save", 1), ("load", 3)):
        for ranks in (1, 2):
            _launch(ranks, phase, [c for c in CASES if parse(c)[index] == ranks], root)
    reports = {}
    for case in CASES:
        _, before, _, after, _ = parse(case)
        reports[case] = {
            "heads": [json.loads((root / "out" / f"{case}.save.rank{r}.json").read_text())
                      ["head"] for r in range(before)],
            "tails": [json.loads((root / "out" / f"{case}.load.rank{r}.json").read_text())
                      for r in range(after)]}
    return reports


@pytest.mark.parametrize("case", CASES)
def test_interrupted_and_resumed_parts_are_one_epoch(runs: dict, case: str) -> None:
    run = runs[case]
    head = [i for part in run["heads"] for i in part]
    tail = [i for part in run["tails"] for i in part["tail"]]
    assert head and tail
    assert all(run["heads"]) and all(part["tail"] for part in run["tails"]), \
        "every rank took part before and after"
    steps = {tuple(part["steps"]) for part in run["tails"]}
    assert len(steps) == 1, f"the new ranks take equal numbers of steps: {steps}"
    following = [i for part in run["tails"] for i in part["next_epoch"]]
    if case.startswith("mix"):
        # 40 draws an epoch from two sources of 40 that never run out: the draws of
        # both parts together are 40, and no sample of either source is drawn twice
        assert len(head + tail) == len(set(head + tail)) == N_MOLECULES
        assert {i // 1000 for i in head + tail} == {0, 1}
        assert len(following) == len(set(following)) == N_MOLECULES
        return
    assert sorted(head + tail) == list(range(N_MOLECULES)), "every sample exactly once"
    assert sorted(following) == list(range(N_MOLECULES)), "the next epoch is whole"


def test_sampler_state_is_the_same_on_every_rank_and_resumes_anywhere() -> None:
    data = list(range(23))
    ranks = [ResumableSampler(data, seed=3, rank=r, world_size=2) for r in range(2)]
    taken = []
    for sampler in ranks:
        iterator = iter(sampler)
        taken += [next(iterator) for _ in range(4)]
    states = [sampler.state_dict() for sampler in ranks]
    assert states[0]["consumed"] == states[1]["consumed"] == 8
    for world in (1, 2, 3, 5):
        rest = []
        for rank in range(world):
            sampler = ResumableSampler(data, seed=3, rank=rank, world_size=world)
            sampler.load_state_dict(states[rank % 2])
            rest += list(sampler)
        left = sorted(set(data) - set(taken))
        assert len(rest) == -(-15 // world) * world
        assert sorted(i for i in rest if i in left) == left, f"{world} ranks"
        # the padding of the last round repeats from the epoch's beginning
        assert all(i in taken for i in rest if i not in left)


def test_another_worker_count_without_a_resumable_sampler_is_refused(tmp_path: Path) -> None:
    dataset = AtompackDataset(write_atp(tmp_path / "w.atp"))
    loader = AtompackLoader(dataset, batch_size=4, shuffle=False, num_workers=0)
    next(iter(loader))
    with pytest.raises(ValueError, match="num_workers=0.*num_workers=2.*ResumableSampler"):
        AtompackLoader(dataset, batch_size=4, num_workers=2).load_state_dict(
            loader.state_dict())


def _write_atp_shards(directory: Path, sizes: list[int]) -> None:
    rng = np.random.default_rng(1)
    directory.mkdir()
    first = 0
    for number, size in enumerate(sizes):
        with atp.Writer(directory / f"part-{number}.atp") as writer:
            for i in range(first, first + size):
                n = 3 + i % 5
                writer.add(rng.normal(size=(n, 3)).astype(np.float32),
                           rng.integers(1, 10, n).astype(np.uint8), energy=float(i),
                           properties={"sample_id": i})
        first += size


def _take(dataset: ShardStreamDataset, count: int) -> list[int]:
    iterator = iter(dataset)
    taken = [int(next(iterator).sample_id) for _ in range(count)]
    iterator.close()
    return taken


@pytest.mark.parametrize("mode", ["blocks", "shards"])
def test_stream_resumes_twice_on_other_grids_with_every_sample_once(tmp_path: Path,
                                                                    mode: str) -> None:
    # 2 ranks (unequal progress) -> 3 ranks (part of the rest) -> 1 rank (the end):
    # a merged state carries what earlier grids handed out into the next merge
    sizes = [23, 17, 31]
    _write_atp_shards(tmp_path / "atp", sizes)
    if mode == "shards":
        convert.shard(tmp_path / "atp", tmp_path / "pt", 6)
    total = sum(sizes)
    options = SourceOptions(cache_dir=tmp_path / "cache", interleave=2)
    if mode == "blocks":
        options = dataclasses.replace(options, blocks=True, block_bytes=2048)
    source = str(tmp_path / ("atp" if mode == "blocks" else "pt"))

    def make(rank: int, world: int) -> ShardStreamDataset:
        return ShardStreamDataset(LocalSource(source), options=options, shuffle=True, seed=5,
                                  rank=rank, world_size=world)

    if mode == "blocks":
        assert len(make(0, 1).blocks) > len(sizes), "several blocks per file"
    seen, states = [], []
    for rank, count in enumerate((9, 4)):
        dataset = make(rank, 2)
        seen += _take(dataset, count)
        states.append(dataset.state_dict())
    with pytest.raises(ValueError, match="rank 1 worker 0"):
        make(0, 1).merge_states(states[:1])
    merged = make(0, 1).merge_states(states)
    states = []
    for rank, count in enumerate((5, 11, 2)):
        dataset = make(rank, 3)
        dataset.load_state_dict(json.loads(json.dumps(merged)))  # JSON-serialisable
        seen += _take(dataset, count)
        states.append(dataset.state_dict())
    # on the grid it was taken on, a state after an elastic resume continues with
    # exactly the stream's rest (its order too, but for the interleave generator,
    # which restarts on any resume)
    uninterrupted = make(2, 3)
    uninterrupted.load_state_dict(merged)
    whole = [int(sample.sample_id) for sample in uninterrupted]
    going = make(2, 3)
    going.load_state_dict(states[2])
    rest = [int(sample.sample_id) for sample in going]
    assert sorted(whole[2:]) == sorted(rest) and whole[:2] == seen[-2:]
    merged = make(0, 1).merge_states(states)
    assert len(set(seen)) == len(seen) == 31, "nothing handed out twice so far"
    dataset = make(0, 1)
    dataset.load_state_dict(merged)
    rest = [int(sample.sample_id) for sample in dataset]
    assert sorted(seen + rest) == list(range(total)), "the epoch exactly, every sample once"
    dataset.set_epoch(1)
    assert sorted(int(s.sample_id) for s in dataset) == list(range(total))


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_atom_budget_sampler_resumes_on_another_world_size(before: int, after: int) -> None:
    from pyg_atompack.pyg.budget import AtomBudgetBatchSampler

    atoms = np.random.default_rng(0).integers(5, 60, 400)

    def sampler(rank: int, world: int) -> AtomBudgetBatchSampler:
        return AtomBudgetBatchSampler(atoms, 200, seed=3, rank=rank, world_size=world)

    taken, states = [], []
    for rank in range(before):
        saved = sampler(rank, before)
        iterator = iter(saved)
        for _ in range(4):
            taken += next(iterator)
        states.append(saved.state_dict())
    assert all(s["consumed"] == states[0]["consumed"] for s in states), "any rank's will do"
    # a part on a third grid in between: its state carries the first part's too
    middle = []
    for rank in range(3):
        resumed = sampler(rank, 3)
        resumed.load_state_dict(states[rank % before])
        iterator = iter(resumed)
        for _ in range(2):
            taken += next(iterator)
        middle.append(resumed.state_dict())
    rest, steps = [], set()
    for rank in range(after):
        resumed = sampler(rank, after)
        resumed.load_state_dict(middle[rank % 3])
        batches = list(resumed)
        steps.add(len(batches))
        rest += [i for batch in batches for i in batch]
        assert all(atoms[batch].sum() <= 200 for batch in batches)
    assert len(steps) == 1, "equal steps on the new ranks"
    assert sorted(taken + rest) == list(range(len(atoms))), "every structure once"
