"""Batches by atom budget: the planner, AtompackLoader(max_atoms=), ShardStreamDataset(max_atoms=).

The file of these tests holds molecules of 10 to 300 atoms, each tagged with its
``sample_id``. Checked: no batch exceeds the budget; every record is handed out exactly
once per epoch; the batches repeat for a (seed, epoch) and change with the epoch; a
state taken mid-epoch resumes with exactly the batches left, in process and with
DataLoader workers; two ranks under a real ``torchrun --nproc_per_node 2`` launch (gloo,
DDP) take the same number of steps and together see every record once; a structure
larger than the budget is an error naming its file and record, or its own batch.
Also the end-of-epoch resume of a plain ``AtompackLoader(shuffle=True)`` with workers.

Run as a script, this file is the training script of the ``torchrun`` launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyg_atompack import (  # noqa: E402
    AtompackDataset,
    AtompackLoader,
    ShardStreamDataset,
    StatefulLoader,
    atp,
    convert,
)
from pyg_atompack.pyg.budget import (  # noqa: E402
    AtomBudgetBatchSampler,
    AtomBudgetError,
    EqualSteps,
    balance_batches,
    consumed_positions,
    group_by_atoms,
    plan_atom_batches,
    rank_batches,
)

N_MOLECULES = 120
MAX_ATOMS = 1000
SEED = 7


def write_atp(path: Path, count: int = N_MOLECULES, *, big: int | None = None) -> Path:
    """Molecules of 10-300 atoms (``big``: one of 2,000 atoms at that index)."""
    rng = np.random.default_rng(0)
    with atp.Writer(path) as writer:
        for i in range(count):
            n = 2000 if i == big else int(rng.integers(10, 301))
            writer.add(rng.normal(size=(n, 3)).astype(np.float32),
                       rng.integers(1, 10, n).astype(np.uint8), energy=float(i),
                       properties={"sample_id": i})
    return path


def ids(batch) -> list[int]:
    return batch.sample_id.view(-1).tolist()


def epoch_batches(loader) -> list[list[int]]:
    return [ids(batch) for batch in loader]


@pytest.fixture(scope="module")
def atp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_atp(tmp_path_factory.mktemp("budget") / "mixed.atp")


@pytest.fixture(scope="module")
def atoms(atp_path: Path) -> np.ndarray:
    return atp.open(atp_path).n_atoms


# ---------------------------------------------------------------- the planner
def test_plan_keeps_the_budget_and_every_position_once() -> None:
    counts = np.random.default_rng(1).integers(10, 301, 5000)
    batches = plan_atom_batches(counts, 2000, seed=3, epoch=0)
    assert max(counts[b].sum() for b in batches) <= 2000
    assert sorted(np.concatenate(batches).tolist()) == list(range(5000))
    # next fit: a batch is closed only when the next structure would not fit
    for batch, following in zip(batches, batches[1:]):
        assert counts[batch].sum() + counts[following[0]] > 2000
    again = plan_atom_batches(counts, 2000, seed=3, epoch=0)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))
    other = plan_atom_batches(counts, 2000, seed=3, epoch=1)
    assert not np.array_equal(np.concatenate(batches), np.concatenate(other))
    plain = plan_atom_batches(counts, 2000, shuffle=False)
    assert np.concatenate(plain).tolist() == list(range(5000))


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_ranks_get_equal_steps_without_loss_or_repeats(world_size: int) -> None:
    counts = np.random.default_rng(world_size).integers(10, 301, 333)
    batches = plan_atom_batches(counts, 1000, seed=0)
    shares = [rank_batches(batches, rank, world_size) for rank in range(world_size)]
    assert len({len(share) for share in shares}) == 1
    assert len(shares[0]) * world_size - len(batches) < world_size  # splits only
    seen = np.concatenate([b for share in shares for b in share])
    assert sorted(seen.tolist()) == list(range(333))
    assert max(counts[b].sum() for share in shares for b in share) <= 1000
    steps = len(shares[0]) // 2
    head = consumed_positions(batches, steps, world_size)
    assert sorted(head.tolist()) == sorted(
        np.concatenate([b for share in shares for b in share[:steps]]).tolist())


def test_fewer_structures_than_ranks_pad_by_repeating() -> None:
    batches = plan_atom_batches([50, 60], 1000, seed=0)  # one batch of two
    balanced = balance_batches(batches, 3)
    assert len(balanced) == 3
    assert sorted(np.concatenate(balanced[:2]).tolist()) == [0, 1]


def test_oversize_structures_error_or_get_their_own_batch() -> None:
    counts = np.asarray([100, 5000, 200, 300, 7000, 50])
    with pytest.raises(AtomBudgetError, match=r"record 1 of x\.atp has 5000 atoms.*"
                                              r"max_atoms=1000"):
        plan_atom_batches(counts, 1000, describe=lambda i: f"record {i} of x.atp")
    batches = plan_atom_batches(counts, 1000, oversize="own_batch", seed=4)
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))
    assert [1] in [b.tolist() for b in batches] and [4] in [b.tolist() for b in batches]
    assert all(counts[b].sum() <= 1000 for b in batches if len(b) > 1)


def test_group_by_atoms_fills_from_its_window() -> None:
    counts = np.random.default_rng(5).integers(10, 301, 2000).tolist()
    for window in (0, 32):
        batches = list(group_by_atoms(iter(range(2000)), 1000, counts.__getitem__,
                                      window=window))
        assert sorted(i for b in batches for i in b) == list(range(2000))
        assert max(sum(counts[i] for i in b) for b in batches) <= 1000
        if window == 0:
            assert [i for b in batches for i in b] == list(range(2000))
            fill_next = np.mean([sum(counts[i] for i in b) for b in batches[:-1]])
        else:
            fill_window = np.mean([sum(counts[i] for i in b) for b in batches[:-3]])
    assert fill_window > fill_next  # the window fills batches better
    taken = list(group_by_atoms(iter(range(2000)), 1000, counts.__getitem__, limit=37))
    assert sorted(i for b in taken for i in b) == list(range(37))


# ---------------------------------------------------------------- AtompackLoader
def test_loader_batches_keep_the_budget_and_cover_the_epoch(atp_path: Path,
                                                            atoms: np.ndarray) -> None:
    dataset = AtompackDataset(atp_path)
    loader = AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=SEED)
    first, second = epoch_batches(loader), epoch_batches(loader)
    for epoch in (first, second):
        assert sorted(i for b in epoch for i in b) == list(range(N_MOLECULES))
        assert max(atoms[b].sum() for b in epoch) <= MAX_ATOMS
    assert first != second
    assert len(loader) == len(second)
    again = AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=SEED)
    assert epoch_batches(again) == first and epoch_batches(again) == second
    workers = AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=SEED,
                             num_workers=2)
    assert epoch_batches(workers) == first and epoch_batches(workers) == second
    # a dataset view: counts follow the view's positions
    view = dataset[10:70]
    batches = epoch_batches(AtompackLoader(view, max_atoms=MAX_ATOMS, shuffle=True, seed=1))
    assert sorted(i for b in batches for i in b) == list(range(10, 70))
    assert max(atoms[b].sum() for b in batches) <= MAX_ATOMS
    with pytest.raises(ValueError, match="max_atoms plans the batches itself"):
        AtompackLoader(dataset, max_atoms=MAX_ATOMS, batch_size=8)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_mid_epoch_exactly(atp_path: Path, num_workers: int) -> None:
    dataset = AtompackDataset(atp_path)

    def make() -> AtompackLoader:
        return AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=SEED,
                              num_workers=num_workers)

    full = make()
    epochs = [epoch_batches(full) for _ in range(2)]
    interrupted = make()
    iterator = iter(interrupted)
    head = [ids(next(iterator)) for _ in range(5)]
    state = json.loads(json.dumps(interrupted.state_dict()))  # JSON-serialisable
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    tail = epoch_batches(resumed)
    assert head + tail == epochs[0]
    assert epoch_batches(resumed) == epochs[1]


def test_sampler_state_is_epoch_and_steps() -> None:
    sampler = AtomBudgetBatchSampler(np.full(50, 100), 1000, seed=2, rank=1, world_size=2)
    passes = iter(sampler)
    next(passes), next(passes)
    state = sampler.state_dict()
    assert (state["epoch"], state["steps"]) == (0, 2)
    other = AtomBudgetBatchSampler(np.full(50, 100), 1000, seed=3, rank=1, world_size=2)
    with pytest.raises(ValueError, match="seed=2, this sampler 3"):
        other.load_state_dict(state)


def test_oversize_in_the_loader_names_file_and_record(tmp_path: Path) -> None:
    path = write_atp(tmp_path / "one_big.atp", 30, big=17)
    dataset = AtompackDataset(path)
    with pytest.raises(AtomBudgetError,
                       match=rf"record 17 of {path}.*2000 atoms.*max_atoms={MAX_ATOMS}"):
        AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=0)
    loader = AtompackLoader(dataset, max_atoms=MAX_ATOMS, shuffle=True, seed=0,
                            oversize="own_batch")
    batches = epoch_batches(loader)
    assert [17] in batches
    assert sorted(i for b in batches for i in b) == list(range(30))


def test_oversize_in_a_sharded_dataset_names_the_shard(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    write_atp(tmp_path / "shards" / "part_000.atp", 10)
    write_atp(tmp_path / "shards" / "part_001.atp", 10, big=3)
    dataset = AtompackDataset(tmp_path / "shards")
    with pytest.raises(AtomBudgetError, match=r"record 3 of .*part_001\.atp \(dataset "
                                              r"position 13\)"):
        AtompackLoader(dataset, max_atoms=MAX_ATOMS)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("budget", [False, True])
def test_state_after_the_last_batch_resumes_at_the_next_epoch(atp_path: Path,
                                                              num_workers: int,
                                                              budget: bool) -> None:
    """A shuffled loader saved after its epoch ended resumes at the next epoch.

    With ``budget=False`` (a plain ``batch_size``) and workers this failed before the
    fix: the resumed loader skipped an epoch.
    """
    dataset = AtompackDataset(atp_path)
    size = {"max_atoms": MAX_ATOMS} if budget else {"batch_size": 16}

    def make() -> AtompackLoader:
        return AtompackLoader(dataset, shuffle=True, seed=SEED, num_workers=num_workers,
                              **size)

    full = make()
    epochs = [epoch_batches(full) for _ in range(3)]
    first = make()
    assert epoch_batches(first) == epochs[0]
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert epoch_batches(resumed) == epochs[1]
    assert epoch_batches(resumed) == epochs[2]


def test_stateful_loader_after_the_last_batch_resumes_at_the_next_epoch(
        atp_path: Path) -> None:
    """The same for ``StatefulLoader(shuffle=True)`` behind workers (it skipped an epoch)."""
    dataset = AtompackDataset(atp_path)

    def make() -> StatefulLoader:
        return StatefulLoader(dataset, batch_size=16, shuffle=True, seed=SEED, num_workers=2)

    full = make()
    epochs = [epoch_batches(full) for _ in range(2)]
    first = make()
    assert epoch_batches(first) == epochs[0]
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert epoch_batches(resumed) == epochs[1]


# ---------------------------------------------------------------- ShardStreamDataset
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory, atp_path: Path) -> Path:
    out = tmp_path_factory.mktemp("budget-shards") / "shards"
    convert.shard(atp_path, out, 25)
    return out


@pytest.mark.parametrize("shuffle_buffer", [0, 16])
def test_stream_batches_keep_the_budget(shards: Path, atoms: np.ndarray,
                                        shuffle_buffer: int) -> None:
    def make() -> ShardStreamDataset:
        return ShardStreamDataset(shards, shuffle=True, seed=SEED, max_atoms=MAX_ATOMS,
                                  shuffle_buffer=shuffle_buffer)

    batches = epoch_batches(make())
    assert sorted(i for b in batches for i in b) == list(range(N_MOLECULES))
    assert max(atoms[b].sum() for b in batches) <= MAX_ATOMS
    assert epoch_batches(make()) == batches
    # resume: the interrupted part and the rest cover the epoch exactly once
    stream = make()
    iterator = iter(stream)
    head = [ids(next(iterator)) for _ in range(4)]
    state = stream.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    tail = epoch_batches(resumed)
    assert sorted(i for b in head + tail for i in b) == list(range(N_MOLECULES))
    assert max(atoms[b].sum() for b in tail) <= MAX_ATOMS


def test_stream_batches_resume_behind_workers(shards: Path, atoms: np.ndarray) -> None:
    def make() -> StatefulLoader:
        stream = ShardStreamDataset(shards, shuffle=True, seed=SEED, max_atoms=MAX_ATOMS,
                                    shuffle_buffer=8)
        return StatefulLoader(stream, batch_size=None, num_workers=2)

    full = epoch_batches(make())
    assert sorted(i for b in full for i in b) == list(range(N_MOLECULES))
    assert max(atoms[b].sum() for b in full) <= MAX_ATOMS
    interrupted = make()
    iterator = iter(interrupted)
    head = [ids(next(iterator)) for _ in range(5)]
    state = interrupted.state_dict()
    del iterator
    resumed = make()
    resumed.load_state_dict(state)
    tail = epoch_batches(resumed)
    assert sorted(i for b in head + tail for i in b) == list(range(N_MOLECULES))
    assert max(atoms[b].sum() for b in tail) <= MAX_ATOMS


def test_stream_oversize_names_the_shard(tmp_path: Path) -> None:
    convert.shard(write_atp(tmp_path / "big.atp", 30, big=17), tmp_path / "shards", 10)
    stream = ShardStreamDataset(tmp_path / "shards", max_atoms=MAX_ATOMS)
    with pytest.raises(AtomBudgetError, match=r"sample 7 of shard \S+1\.pt has 2000"):
        epoch_batches(stream)
    batches = epoch_batches(ShardStreamDataset(tmp_path / "shards", max_atoms=MAX_ATOMS,
                                               oversize="own_batch"))
    assert [17] in batches


# ---------------------------------------------------------------- the benchmark
def test_benchmark_quick_run_reports_every_measure(tmp_path: Path) -> None:
    """A smoke run of ``benchmarks/atom_budget.py --quick`` (not a timed assertion)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "atom_budget.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "atom_budget.json").read_text())
    assert report["spread"]["budget"]["max"] <= report["setup"]["max_atoms"]
    assert sum(report["atoms"]["fixed"]) == sum(report["atoms"]["budget"])  # same epoch
    assert set(report["memory"]) == {"fixed", "budget"}
    assert all(m["peak_mib"] > 0 for m in report["memory"].values())
    assert report["loader"]["ratio_median"] > 0
    assert "## Atoms per batch" in (tmp_path / "atom_budget.md").read_text()


# ---------------------------------------------------------------- torchrun, 2 ranks
def test_two_ranks_take_equal_steps_under_torchrun(tmp_path: Path, atp_path: Path,
                                                   shards: Path, atoms: np.ndarray) -> None:
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", __file__, str(atp_path), str(shards), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        steps = [reports[r]["epochs"][epoch] for r in range(2)]
        assert len(steps[0]) == len(steps[1]) == reports[0]["len"][epoch]
        seen = [i for rank in steps for b in rank for i in b]
        assert sorted(seen) == list(range(N_MOLECULES))  # split, not padded or dropped
        assert max(atoms[b].sum() for rank in steps for b in rank) <= MAX_ATOMS
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]
    # the stream: EqualSteps stops both ranks at the shorter one, nothing is repeated
    streamed = [reports[r]["stream"] for r in range(2)]
    assert len(streamed[0]) == len(streamed[1]) > 0
    seen = [i for rank in streamed for b in rank for i in b]
    assert len(seen) == len(set(seen))
    assert max(atoms[b].sum() for rank in streamed for b in rank) <= MAX_ATOMS
    cut = [reports[r]["cut_short"] for r in range(2)]
    assert not all(cut)  # the shortest rank ran to its end


def _ddp_main(atp_file: str, shard_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = AtompackLoader(AtompackDataset(atp_file), max_atoms=MAX_ATOMS, shuffle=True,
                            seed=SEED, num_workers=1)
    report: dict = {"epochs": [], "len": []}
    for _ in range(2):
        report["len"].append(len(loader))
        steps = []
        for batch in loader:
            # every step all-reduces gradients: unequal step counts would hang
            loss = model(batch.pos.float()).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps.append(ids(batch))
        report["epochs"].append(steps)
    stream = ShardStreamDataset(shard_dir, shuffle=True, seed=SEED, max_atoms=MAX_ATOMS,
                                shuffle_buffer=8)
    steps = EqualSteps(StatefulLoader(stream, batch_size=None, num_workers=1))
    report["stream"] = []
    for batch in steps:
        loss = model(batch.pos.float()).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report["stream"].append(ids(batch))
    report["cut_short"] = steps.cut_short
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _ddp_main(sys.argv[1], sys.argv[2], sys.argv[3])
