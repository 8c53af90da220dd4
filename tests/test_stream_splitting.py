"""Shard planning: exactly-once partitioning and equal per-rank quotas."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pyg_atompack.stream.splitting import StreamSlot, _water_fill, epoch_shard_order, plan_stream


def _plans(records, world_size, num_workers, **options):
    return {(r, w): plan_stream(records, StreamSlot(r, world_size, w, num_workers), **options)
            for r in range(world_size) for w in range(num_workers)}


@settings(max_examples=25, deadline=None)
@given(
    records=st.lists(st.integers(0, 30), min_size=1, max_size=24),
    world_size=st.integers(1, 4),
    num_workers=st.integers(1, 3),
    batch_size=st.sampled_from([None, 1, 4]),
    epoch=st.integers(0, 3),
)
# one batch for two workers of a rank: the worker without a whole batch must get none
@example(records=[4, 4], world_size=2, num_workers=2, batch_size=4, epoch=0)
def test_known_counts_partition_exactly_once_with_equal_rank_totals(
        records, world_size, num_workers, batch_size, epoch):
    plans = _plans(records, world_size, num_workers, shuffle=True, seed=1, epoch=epoch,
                   batch_size=batch_size)
    read = sorted(s for plan in plans.values() for s in plan.shards)
    assert read == list(range(len(records)))  # every shard exactly once
    if world_size == 1:
        assert all(plan.sample_quota is None for plan in plans.values())
        return
    unit = batch_size or 1
    totals = []
    for rank in range(world_size):
        quotas = [plans[(rank, w)].sample_quota for w in range(num_workers)]
        for w, quota in enumerate(quotas):
            available = sum(records[s] for s in plans[(rank, w)].shards)
            assert quota % unit == 0 and 0 <= quota <= available
        totals.append(sum(quotas))
    assert len(set(totals)) == 1


def test_unknown_counts_drop_surplus_shards_equally():
    plans = _plans([None] * 7, 2, 1, shuffle=False, seed=0, epoch=0)
    assert [len(p.shards) for p in plans.values()] == [3, 3]
    assert plans[(0, 0)].dropped_shards == (6,)
    single = _plans([None] * 7, 1, 2, shuffle=False, seed=0, epoch=0)
    assert sorted(s for p in single.values() for s in p.shards) == list(range(7))


def test_epoch_order_is_seeded():
    assert epoch_shard_order(5, shuffle=False, seed=1, epoch=3) == [0, 1, 2, 3, 4]
    first = epoch_shard_order(50, shuffle=True, seed=1, epoch=0)
    assert first == epoch_shard_order(50, shuffle=True, seed=1, epoch=0)
    assert first != epoch_shard_order(50, shuffle=True, seed=1, epoch=1)
    assert sorted(first) == list(range(50))


@pytest.mark.parametrize(
    ("capacities", "total", "expected"),
    [([5, 5], 6, [3, 3]), ([1, 9], 6, [1, 5]), ([0, 4, 4], 5, [0, 3, 2]), ([2, 2], 0, [0, 0]),
     # fewer units than bins, and a bin without room: the unit goes where it fits
     ([4, 0], 1, [1, 0]), ([0, 4], 1, [0, 1]), ([0, 0, 3], 2, [0, 0, 2])],
)
def test_water_fill_is_even_within_capacity(capacities, total, expected):
    quotas = _water_fill(capacities, total)
    assert sum(quotas) == total
    assert sorted(quotas) == sorted(expected)
    assert [q for q, c in zip(quotas, capacities) if c == 0] == [0] * capacities.count(0)
    assert all(q <= c for q, c in zip(quotas, capacities))


def test_slot_validation():
    with pytest.raises(ValueError, match="rank 2"):
        StreamSlot(2, 2, 0, 1)
    with pytest.raises(ValueError, match="worker 1"):
        StreamSlot(0, 1, 1, 1)
