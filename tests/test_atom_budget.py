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

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyg_atompack import atp  # noqa: E402
from pyg_atompack.pyg.budget import (  # noqa: E402
    AtomBudgetError,
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
