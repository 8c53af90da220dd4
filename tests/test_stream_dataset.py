"""ShardStreamDataset: splitting, determinism, resume, live-shard bound, cancellation, traces."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
import torch
from servers.http_server import ShardServer, serve_directory, write_pt_shards
from torch.utils.data import DataLoader
from torch_geometric.data import Batch

from pyg_atompack.stream import LocalSource, RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX
from pyg_atompack.stream.trace import TRACE_FIELDS
from pyg_atompack.transport import RetryPolicy

SIZES = [5, 7, 3, 6, 4, 8, 5, 2]  # 40 samples, uneven shards
ALL_IDS = sorted(s * 1000 + i for s, n in enumerate(SIZES) for i in range(n))
FAST = RetryPolicy(retries=2, backoff=0.01, timeout=5.0)


@pytest.fixture
def server(tmp_path) -> ShardServer:
    write_pt_shards(tmp_path, SIZES, collated=(1, 4))
    yield from serve_directory(tmp_path)


def _source(server: ShardServer) -> RemoteSource:
    return RemoteSource(server.url("manifest.json"), retry=FAST)


def _ids(items) -> list[int]:
    out = []
    for item in items:
        out.extend(int(v) for v in item.sample_id.view(-1))
    return out


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


def test_every_sample_once_in_order_without_shuffle(server):
    dataset = ShardStreamDataset(_source(server), prefetch=2, concurrency=2)
    assert _ids(dataset) == ALL_IDS
    assert not _prefetch_threads()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_prefetch_depth_does_not_change_the_stream(server, prefetch):
    reference = _ids(ShardStreamDataset(_source(server), prefetch=0, shuffle=True, seed=3))
    dataset = ShardStreamDataset(_source(server), prefetch=prefetch, concurrency=2,
                                 shuffle=True, seed=3)
    assert _ids(dataset) == reference


def test_exactly_once_across_two_workers_and_two_ranks(server):
    per_rank = []
    for rank in range(2):
        dataset = ShardStreamDataset(_source(server), rank=rank, world_size=2, shuffle=True,
                                     seed=5, prefetch=1)
        loader = DataLoader(dataset, batch_size=None, num_workers=2)
        ids = _ids(loader)
        per_rank.append(ids)
        stats = dataset.stats()  # traces of both workers reach the main process
        assert {r["worker"] for r in dataset.trace} == {0, 1}
        assert stats["structures"] == sum(SIZES[r["shard_index"]] for r in dataset.trace)
    # equal sample counts per rank (surplus dropped), and nothing delivered twice
    assert len(per_rank[0]) == len(per_rank[1])
    delivered = per_rank[0] + per_rank[1]
    assert len(set(delivered)) == len(delivered)
    assert set(delivered) <= set(ALL_IDS)
    # each shard read by exactly one (rank, worker)
    shards = [ShardStreamDataset(_source(server), rank=r, world_size=2, shuffle=True, seed=5)
              for r in range(2)]
    from pyg_atompack.stream.splitting import StreamSlot
    read = [s for r in range(2) for w in range(2)
            for s in shards[r].plan(StreamSlot(r, 2, w, 2)).shards]
    assert sorted(read) == list(range(len(SIZES)))


def test_equal_batches_per_rank(server):
    counts = []
    for rank in range(2):
        dataset = ShardStreamDataset(_source(server), rank=rank, world_size=2, batch_size=4,
                                     shuffle=True, seed=1)
        batches = list(dataset)
        assert all(isinstance(b, Batch) and b.num_graphs == 4 for b in batches)
        counts.append(len(batches))
    assert counts[0] == counts[1] > 0


def test_unknown_counts_give_equal_shard_counts(server):
    urls = [server.url(f"shard-{i:04d}.pt") for i in range(7)]  # 7 shards, 2 ranks
    plans = [ShardStreamDataset(RemoteSource(urls), rank=r, world_size=2).plan() for r in (0, 1)]
    assert len(plans[0].shards) == len(plans[1].shards) == 3
    assert plans[0].dropped_shards == plans[1].dropped_shards and len(plans[0].dropped_shards) == 1


def test_torch_distributed_rank_is_detected(server):
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dataset = ShardStreamDataset(_source(server))
        assert dataset.slot().world_size == 1 and dataset.slot().rank == 0
        assert sorted(_ids(dataset)) == ALL_IDS
    finally:
        torch.distributed.destroy_process_group()


def test_order_is_deterministic_per_seed_and_epoch(server):
    def run(seed, epoch, **options):
        dataset = ShardStreamDataset(_source(server), shuffle=True, seed=seed, **options)
        dataset.set_epoch(epoch)
        return _ids(dataset)

    first = run(7, 0)
    assert first == run(7, 0)
    assert sorted(first) == ALL_IDS and first != ALL_IDS
    assert run(7, 1) != first
    assert run(8, 0) != first
    buffered = run(7, 0, shuffle_buffer=6)
    assert buffered == run(7, 0, shuffle_buffer=6) and sorted(buffered) == ALL_IDS
    assert buffered != first


@pytest.mark.parametrize(
    "options",
    [{}, {"shuffle": True, "seed": 2}, {"shuffle": True, "shuffle_buffer": 5},
     {"batch_size": 3, "shuffle": True}],
)
def test_resume_after_mid_epoch_state_dict(server, options):
    reference = _ids(ShardStreamDataset(_source(server), **options))
    dataset = ShardStreamDataset(_source(server), prefetch=2, **options)
    dataset.set_epoch(0)
    iterator = iter(dataset)
    seen = []
    for _ in range(4):
        seen.extend(_ids([next(iterator)]))
    state = json.loads(json.dumps(dataset.state_dict()))  # checkpoints are JSON
    iterator.close()
    restored = ShardStreamDataset(_source(server), **options)
    restored.load_state_dict(state)
    rest = _ids(restored)
    assert sorted(seen + rest) == ALL_IDS  # nothing lost, nothing repeated
    if "shuffle_buffer" not in options:
        assert seen + rest == reference  # same order as an uninterrupted epoch
    # completed shards are not downloaded again
    first_shard = reference[0] // 1000
    if state["shards_done"]:
        assert len(server.requests_for(f"shard-{first_shard:04d}.pt")) == 2


def test_state_dict_rejects_other_settings(server):
    state = ShardStreamDataset(_source(server), shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed or shuffle"):
        ShardStreamDataset(_source(server), shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict"):
        ShardStreamDataset(_source(server), shuffle=True, seed=1).load_state_dict(
            {"seed": 1, "shuffle": True})


@pytest.mark.parametrize(("prefetch", "concurrency"), [(0, 1), (1, 1), (2, 2), (3, 3)])
def test_live_shard_bound_is_never_exceeded(server, prefetch, concurrency):
    # threads: the consumer below is the one the prefetcher runs ahead of (a retrieval
    # process builds items ahead of it, and its own consumer is fast)
    dataset = ShardStreamDataset(_source(server), options=SourceOptions(retrieval="threads"),
                                 prefetch=prefetch, concurrency=concurrency)
    for _ in dataset:
        time.sleep(0.003)  # a slow consumer lets the prefetcher run as far ahead as allowed
    stats = dataset.stats()
    assert stats["peak_live_shards"] <= prefetch + 1
    if prefetch:
        assert stats["peak_live_shards"] >= 2  # prefetching did happen
    assert not _prefetch_threads()


def test_breaking_out_cancels_in_flight_downloads_promptly(tmp_path):
    write_pt_shards(tmp_path, [3, 3, 3, 3])
    server = ShardServer(tmp_path).start()
    try:
        for name in ("shard-0001.pt", "shard-0002.pt"):
            server.add_fault(name, "stall")  # would hold the connection for 30 s
        dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"),
                                                  retry=RetryPolicy(timeout=60)),
                                     options=SourceOptions(retrieval="threads"), prefetch=3,
                                     concurrency=3)  # threads in this process
        iterator = iter(dataset)
        next(iterator)
        time.sleep(0.2)  # downloads of shards 1-3 are now in flight, two of them stalled
        assert _prefetch_threads()
        started = time.monotonic()
        iterator.close()
        elapsed = time.monotonic() - started
        assert not _prefetch_threads()
        # without cancellation close() would wait for the 30 s stall
        assert elapsed < 5.0
        statuses = {r["identifier"]: r["status"] for r in dataset.trace}
        assert statuses["shard-0001.pt"] == "cancelled"
    finally:
        server.stop()


def test_trace_records_and_summary(server):
    dataset = ShardStreamDataset(_source(server), prefetch=2, concurrency=2)
    for _ in dataset:
        pass
    trace = dataset.trace
    assert len(trace) == len(SIZES)
    for record in trace:
        assert set(TRACE_FIELDS) <= set(record)
        assert 0 <= record["download_start_s"] <= record["download_finish_s"]
        assert record["download_finish_s"] <= record["deserialize_finish_s"]
        assert record["deserialize_finish_s"] <= record["consume_start_s"]
        assert record["consume_start_s"] <= record["consume_finish_s"]
        assert record["structures"] == SIZES[record["shard_index"]]
        assert record["bytes"] == (server.root / record["identifier"]).stat().st_size
    stats = dataset.stats()
    json.dumps({"trace": trace, "stats": stats})
    assert stats["shards"] == len(SIZES) and stats["structures"] == sum(SIZES)
    assert stats["bytes"] == sum(r["bytes"] for r in trace)
    assert stats["io_s"] > 0 and stats["total_s"] >= stats["consume_s"]
    # prefetch + 1, and one more in the retrieval process the default forks (offproc)
    assert stats["peak_live_shards"] <= 4


def test_transform_and_local_source(server):
    def double(data):
        data.energy = data.energy * 2
        return data

    plain = list(ShardStreamDataset(LocalSource(server.root)))
    doubled = list(ShardStreamDataset(LocalSource(server.root), transform=double))
    assert all(torch.equal(b.energy, 2 * a.energy) for a, b in zip(plain, doubled))
    counts = Counter(_ids(doubled))
    assert sorted(counts) == ALL_IDS and set(counts.values()) == {1}


def test_bad_arguments(server):
    with pytest.raises(ValueError, match="on_error"):
        ShardStreamDataset(_source(server), on_error="ignore")
    with pytest.raises(ValueError, match="rank and world_size"):
        ShardStreamDataset(_source(server), rank=0)
    with pytest.raises(ValueError, match="prefetch"):
        ShardStreamDataset(_source(server), prefetch=-1)
    assert "ShardStreamDataset(RemoteSource" in repr(ShardStreamDataset(_source(server)))


def test_downloads_start_at_iter_and_stop_when_the_iterator_is_dropped(tmp_path):
    from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX

    write_pt_shards(tmp_path, [4, 4, 4], atoms=3)

    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]

    for server in serve_directory(tmp_path):
        # threads in this process
        dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json")),
                                     options=SourceOptions(retrieval="threads"), prefetch=1)
        samples = iter(dataset)  # a DataLoader worker calls iter() well before next()
        deadline = time.monotonic() + 30
        while not any(e.path.endswith(".pt") for e in server.requests):
            assert time.monotonic() < deadline, "no download started before next()"
            time.sleep(0.01)
        assert prefetch_threads()
        del samples  # never advanced: its finally clause never runs
        assert not prefetch_threads()
        assert len(list(dataset)) == 12
