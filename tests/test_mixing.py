"""MixedDataset: sources drawn by weight, passes that cycle, determinism and exact resume.

Real parts: ``.atp`` files read by ``AtompackDataset``, ``.pt`` shards streamed by
``ShardStreamDataset`` from a directory, torchdata ``StatefulDataLoader`` workers
(``StatefulLoader``) for resume. Proportions are checked against a binomial bound:
each draw picks source ``k`` with probability ``p_k`` independently, so its count over
``n`` draws is Binomial(n, p_k) and lies within ``5 sigma`` of ``n p_k`` except with
probability below 1e-6 (the draws are seeded, so the test is also deterministic).
Elastic resume of a mix (2 -> 1 ranks, 2 -> 3 workers under torchrun) is in
``test_elastic.py``.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from test_resume import write_atp

from pyg_atompack import AtompackDataset, ShardStreamDataset, convert
from pyg_atompack.pyg.mixing import MixedDataset
from pyg_atompack.pyg.resume import StatefulLoader
from pyg_atompack.stream import LocalSource

SIZES = (40, 25, 30)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("mixing")
    paths = [write_atp(root / f"source{n}.atp", size) for n, size in enumerate(SIZES)]
    convert.shard(paths[2], root / "shards", 5)
    return {"atp": paths, "shards": root / "shards"}


def sources(files: dict) -> list:
    return [AtompackDataset(files["atp"][0]), AtompackDataset(files["atp"][1]),
            ShardStreamDataset(LocalSource(files["shards"]), shuffle=True, seed=3)]


def drawn(samples) -> list[tuple[int, int]]:
    return [(int(s.source), int(s.sample_id)) for s in samples]


def test_proportions_are_within_sampling_error_and_sources_cycle(files: dict) -> None:
    weights = [0.5, 0.3, 0.2]
    n = 3000
    mixed = MixedDataset(sources(files), weights, samples_per_epoch=n, seed=1,
                         source_key="source")
    draws = drawn(mixed)
    assert len(draws) == n
    counts = Counter(source for source, _ in draws)
    for source, p in enumerate(weights):
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[source] - n * p) <= 5 * sigma, (source, counts[source], n * p)
    # a source's draws are its passes one after another: each pass every sample once
    for source, size in enumerate(SIZES):
        ids = [i for s, i in draws if s == source]
        assert len(ids) > 2 * size, "the source ran out and cycled"
        passes = [ids[k:k + size] for k in range(0, len(ids), size)]
        for number, part in enumerate(passes):
            assert len(set(part)) == len(part), f"source {source} pass {number} repeats"
            if len(part) == size:
                assert sorted(part) == list(range(size))
        assert passes[0] != passes[1], "each pass is shuffled anew"
    stats = mixed.stats()
    assert [s["drawn"] for s in stats["per_source"]] == [counts[k] for k in range(3)]
    assert stats["samples"] == n


def test_draws_are_deterministic_per_seed_and_epoch(files: dict) -> None:
    def run(seed: int, epoch: int) -> list[tuple[int, int]]:
        mixed = MixedDataset(sources(files), [1, 1, 1], samples_per_epoch=120, seed=seed,
                             source_key="source")
        mixed.set_epoch(epoch)
        return drawn(mixed)

    first = run(5, 0)
    assert run(5, 0) == first
    assert run(5, 1) != first
    assert run(6, 0) != first


def test_default_weights_follow_sizes_and_one_epoch_reads_about_everything(files: dict) -> None:
    mixed = MixedDataset(sources(files), source_key="source")
    assert mixed.samples_per_epoch == sum(SIZES)
    assert mixed.weights.tolist() == pytest.approx([s / sum(SIZES) for s in SIZES])
    assert len(drawn(mixed)) == sum(SIZES)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_on_the_same_grid_continues_exactly(files: dict, workers: int) -> None:
    def loader() -> StatefulLoader:
        mixed = MixedDataset(sources(files), [0.5, 0.2, 0.3], samples_per_epoch=150, seed=9,
                             source_key="source")
        return StatefulLoader(mixed, batch_size=4, num_workers=workers)

    def ids(batch) -> list[tuple[int, int]]:
        return list(zip(batch.source.tolist(), batch.sample_id.view(-1).tolist()))

    reference = loader()
    full = [i for batch in reference for i in ids(batch)]
    assert len(full) == 150
    per_source = [s["drawn"] for s in reference.dataset.stats()["per_source"]]
    assert per_source == [sum(1 for s, _ in full if s == k) for k in range(3)], \
        "stats() counts every worker's draws"
    interrupted = loader()
    head = []
    for step, batch in enumerate(interrupted):
        head += ids(batch)
        if step == 12:
            break
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    tail = [i for batch in resumed for i in ids(batch)]
    assert head + tail == full


def test_bad_arguments_are_refused(files: dict) -> None:
    with pytest.raises(ValueError, match="3 weights for 2 sources"):
        MixedDataset(sources(files)[:2], [1, 2, 3])
    with pytest.raises(ValueError, match="non-negative"):
        MixedDataset(sources(files)[:2], [1, -1])
    batched = ShardStreamDataset(LocalSource(files["shards"]), batch_size=4)
    with pytest.raises(ValueError, match="mixed source 1 yields batches"):
        MixedDataset([sources(files)[0], batched], [1, 1])
    with pytest.raises(ValueError, match="offsets attributes named"):
        MixedDataset(sources(files), source_key="dataset_index")
    mixed = MixedDataset(sources(files), seed=2)
    with pytest.raises(ValueError, match="seed=2, this dataset 3"):
        MixedDataset(sources(files), seed=3).load_state_dict(mixed.state_dict())


@pytest.mark.parametrize("second", ["map", "stream"])
def test_elastic_resume_while_ranks_are_in_different_passes(files: dict, second: str) -> None:
    # two "ranks" draw different amounts from sources that cycle many times an epoch,
    # so they stop in different passes; one rank finishes the epoch. Each pass that was
    # in flight must then be covered exactly once by both parts together.
    sizes = [SIZES[0], SIZES[1] if second == "map" else SIZES[2]]

    def make(rank: int, world: int) -> MixedDataset:
        other = (AtompackDataset(files["atp"][1]) if second == "map" else
                 ShardStreamDataset(LocalSource(files["shards"]), shuffle=True, seed=3,
                                    rank=rank, world_size=world))
        return MixedDataset([AtompackDataset(files["atp"][0]), other],
                            [0.4, 0.6], samples_per_epoch=300, seed=4,
                            source_key="source", rank=rank, world_size=world)

    first, states = [], []
    for rank, count in enumerate((70, 110)):
        mixed = make(rank, 2)
        iterator = iter(mixed)
        first.append(drawn(next(iterator) for _ in range(count)))
        states.append(mixed.state_dict())
    merged = make(0, 1).merge_states(states)
    resumed = make(0, 1)
    resumed.load_state_dict(merged)
    rest = drawn(resumed)
    assert sum(map(len, first)) + len(rest) == 300, "the epoch's draws, none lost"
    for source, size in enumerate(sizes):
        passes: dict[int, list[int]] = {}
        low = None
        for rank, part in enumerate(first):
            ids = [i for s, i in part if s == source]
            # the rank's share of every pass: every other position, or 3 of 6 shards
            share = len(range(rank, size, 2))
            for k in range(0, len(ids), share):
                passes.setdefault(k // share, []).extend(ids[k:k + share])
            stopped = len(ids) // share
            low = stopped if low is None else min(low, stopped)
        ids = [i for s, i in rest if s == source]
        for number in sorted(p for p in passes if p >= low):
            left = size - len(passes[number])
            passes[number] += ids[:left]
            ids = ids[left:]
        assert len(passes) >= 3, "the ranks went through several passes"
        for number, part in passes.items():
            assert sorted(part) == list(range(size)), f"source {source} pass {number}"
        for k in range(0, len(ids), size):  # then whole new passes
            assert len(set(ids[k:k + size])) == len(ids[k:k + size])
