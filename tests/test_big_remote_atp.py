"""Multi-hundred-MB `.atp` files over a real loopback HTTP server: record blocks and caches.

One uncompressed (~200 MB) and one zstd file are written once per session and served by
the range-capable :class:`~tests.servers.http_server.ShardServer`.
"""

from __future__ import annotations

import collections
import re
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pyg_atompack import atp
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream.splitting import StreamSlot
from tests.big_atp import write_big_atp, write_manifest
from tests.servers.http_server import ShardServer

RECORDS = 11520  # ~200 MB uncompressed
BLOCK = 8 << 20
NAMES = ("big_none.atp", "big_zstd.atp")


@pytest.fixture(scope="session")
def big_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_atp")
    counts = [write_big_atp(root / NAMES[0], RECORDS, compression="none"),
              write_big_atp(root / NAMES[1], RECORDS, compression="zstd", seed=1)]
    write_manifest(root, list(NAMES), counts)
    return root


@pytest.fixture
def server(big_files):
    server = ShardServer(big_files).start()
    try:
        yield server
    finally:
        server.stop()


def _energies(samples) -> list[int]:
    return [int(s.energy.item()) for s in samples]


def _span(entry) -> tuple[int, int]:
    first, last = re.fullmatch(r"bytes=(\d+)-(\d+)", entry.range).groups()
    return int(first), int(last) + 1


@pytest.mark.parametrize("name", NAMES)
def test_blocks_deliver_every_record_once_across_workers_and_ranks(big_files, server, tmp_path,
                                                                   name):
    source = RemoteSource(server.url("manifest.json"))
    source._shards = tuple(s for s in source.list_shards() if s.name == name)
    local = atp.open(big_files / name)
    delivered: dict[int, list[int]] = {}
    checked = 0
    for rank in range(2):
        dataset = ShardStreamDataset(source,
                                     options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path),
                                     rank=rank, world_size=2, shuffle=True, prefetch=2,
                                     batch_size=512)
        assert dataset.blocks is not None and len(dataset.blocks) > 10
        delivered[rank] = []
        for batch in DataLoader(dataset, batch_size=None, num_workers=2):
            delivered[rank].extend(batch.energy.long().tolist())
            sample = batch.get_example(checked % batch.num_graphs)  # equal to local reads
            mol = local[int(sample.energy.item())]
            assert torch.equal(sample.pos, torch.from_numpy(np.array(mol.positions)))
            assert torch.equal(sample.forces, torch.from_numpy(np.array(mol.forces)))
            assert torch.equal(sample.z,
                               torch.from_numpy(np.array(mol.atomic_numbers)).long())
            checked += 1
            del batch, sample
    counts = collections.Counter(e for rank in delivered for e in delivered[rank])
    assert sorted(counts) == list(range(len(local))) and set(counts.values()) == {1}
    assert len(delivered[0]) == len(delivered[1]) == len(local) // 2
    header = local.header
    meta_start = min(header.schema_offset or header.index_offset, header.index_offset)
    requests = server.requests_for(name)
    assert all(r.range is not None for r in requests)  # never the whole file
    spans = [_span(r) for r in requests]
    # metadata: the header once (workers and the second rank read the disk cache) ...
    assert spans.count((0, 8192)) == 1
    assert spans.count((0, 1)) == 1  # the version (ETag) probe, once: it travels too
    records = [s for s in spans if s not in ((0, 8192), (0, 1)) and s[0] < meta_start]
    assert records and all(b - a <= BLOCK for a, b in records)  # ... and blocks
    assert sum(b - a for a, b in records) == int(local.index["stored"].sum())


def test_block_order_is_seeded_per_epoch(big_files, server, tmp_path):
    source = RemoteSource(server.url("manifest.json"))
    dataset = ShardStreamDataset(source,
                                 options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path),
                                 shuffle=True, seed=3)
    slot = StreamSlot(0, 1, 0, 1)
    first = dataset.plan(slot).blocks
    dataset.set_epoch(1)
    second = dataset.plan(slot).blocks
    assert [b.global_first for b in first] != [b.global_first for b in second]
    assert sorted(b.global_first for b in first) == sorted(b.global_first for b in second)
    again = ShardStreamDataset(source,
                               options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path),
                               shuffle=True, seed=3)
    again.set_epoch(1)
    assert again.plan(slot).blocks == second
    # blocks of both files alternate: the order is global, not file by file
    shards = [b.shard for b in second]
    assert sum(a != b for a, b in zip(shards, shards[1:])) > 5


def test_resume_mid_epoch_from_state_dict(server, tmp_path):
    source = RemoteSource(server.url("manifest.json"))
    source._shards = source.list_shards()[:1]
    # one rank of four: a quarter of the file, cut into blocks at record granularity
    options = dict(options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path), shuffle=True,
                   seed=5, prefetch=1, rank=1, world_size=4)
    dataset = ShardStreamDataset(source, **options)
    everything = _energies(dataset)
    assert len(everything) == RECORDS // 4
    iterator = iter(dataset)
    head = _energies(next(iterator) for _ in range(1000))  # inside the 2nd block
    state = dataset.state_dict()
    iterator.close()
    resumed = ShardStreamDataset(source, **options)
    resumed.load_state_dict(state)
    rest = _energies(resumed)
    assert head + rest == everything


def test_fault_mid_block_resumes_without_refetching_it(big_files, server, tmp_path):
    source = RemoteSource(server.url("manifest.json"))
    source._shards = source.list_shards()[:1]
    dataset = ShardStreamDataset(source,
                                 options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path),
                                 prefetch=1, rank=0, world_size=4)
    clean = _energies(dataset)
    server.requests.clear()
    server.add_fault(NAMES[0], "reset", at_fraction=0.5)
    assert _energies(dataset) == clean
    requests = server.requests_for(NAMES[0])
    cut = next(r for r in requests if r.fault == "reset")
    resumed = requests[requests.index(cut) + 1]
    a, b = _span(cut)
    c, d = _span(resumed)
    # the retry asks for the rest of the block only (bytes lost in flight with the
    # reset are asked for again)
    assert d == b and a < c <= a + cut.body_bytes < b
    local = atp.open(big_files / NAMES[0])
    stored = local.index["stored"][:len(clean)]
    assert sum(r.body_bytes for r in requests) == int(stored.sum()) + (a + cut.body_bytes - c)


# in a retrieval process one more block may download while the consumer's process
# unpacks the items of the last one handed over (stream/offproc.py)
@pytest.mark.parametrize("retrieval,extra", [("threads", 1), ("process", 2)])
def test_at_most_k_plus_one_blocks_alive(server, tmp_path, retrieval, extra):
    source = RemoteSource(server.url("manifest.json"))
    source._shards = source.list_shards()[:1]
    for k in (1, 3):
        dataset = ShardStreamDataset(source,
                                     options=SourceOptions(block_bytes=2 << 20, cache_dir=tmp_path,
                                                           retrieval=retrieval), prefetch=k,
                                     concurrency=2, rank=0, world_size=4)
        for i, _ in enumerate(dataset):
            if i % 64 == 0:
                # a consumer with some compute, as in training: without it a consumer
                # faster than loopback downloads leaves at most one block alive
                time.sleep(0.005)
        stats = dataset.stats()
        assert stats["shards"] > 2 * (k + 1)  # many more blocks than can be alive
        assert 1 < stats["peak_live_shards"] <= k + extra


# ---------------------------------------------------------------------- random access


def _assert_batches_equal(a, b) -> None:
    for key in ("pos", "z", "energy", "forces", "natoms", "batch"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


def test_remote_random_access_equals_local(big_files, server, tmp_path):
    from pyg_atompack import AtompackDataset, AtompackLoader

    remote = AtompackDataset(server.url("manifest.json"), cache_dir=tmp_path,
                             cache_bytes=32 << 20)
    local = AtompackDataset([big_files / n for n in NAMES])
    assert len(remote) == len(local) == 2 * RECORDS
    rng = np.random.default_rng(0)
    for i in rng.integers(0, len(local), 20).tolist():
        a, b = remote[i], local[i]
        for key in ("pos", "z", "energy", "forces"):
            assert torch.equal(getattr(a, key), getattr(b, key))
    picks = rng.permutation(len(local))[:256]
    for a, b in zip(AtompackLoader(remote[picks], batch_size=64),
                    AtompackLoader(local[picks], batch_size=64)):
        _assert_batches_equal(a, b)
    header_reads = [r for r in server.requests if r.range == "bytes=0-8191"]
    assert len(header_reads) == 2  # metadata once per file
    cache = remote.reader.shards[0].cache
    # a cold random batch: its records' pages only, adjacent pages in one request
    assert cache.stats["fetched_bytes"] < 20 * len(picks) * cache.page_bytes


def test_cache_is_bounded_shared_by_workers_and_refetches_damage(big_files, server, tmp_path):
    from pyg_atompack import AtompackDataset, AtompackLoader

    bound = 4 << 20  # far less than one epoch's pages: the workers evict as they read
    remote = AtompackDataset(server.url("manifest.json"), cache_dir=tmp_path,
                             cache_bytes=bound)
    local = AtompackDataset([big_files / n for n in NAMES])
    picks = np.random.default_rng(1).permutation(len(local))[:384]
    batches = AtompackLoader(remote[picks], batch_size=64, num_workers=2)
    expected = AtompackLoader(local[picks], batch_size=64)
    pairs = 0
    for a, b in zip(batches, expected):
        _assert_batches_equal(a, b)
        pairs += 1
        cache = remote.reader.shards[0].cache
        assert cache.disk_bytes() <= bound
    assert pairs == len(picks) // 64
    pages = sorted((tmp_path / "pages").rglob("*.page"))
    assert pages and sum(p.stat().st_size for p in pages) <= bound
    # only two metadata fetches (one per file) for the main process and both workers
    assert len([r for r in server.requests if r.range == "bytes=0-8191"]) == 2
    # damage one cached page: it is detected, deleted and fetched again
    reader = remote.reader
    victim = pages[-1]
    page = int(victim.stem)
    shard = next(s for s in reader.shards if s.cache._folder(s.range_reader) == victim.parent)
    record = int(np.searchsorted(shard.meta.record_ends, page * shard.page_bytes, side="right"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    before = len(server.requests)
    mol = shard[record]
    assert shard.cache.stats["damaged"] == 1 and len(server.requests) > before
    number = reader.shards.index(shard)
    expected_mol = atp.open(big_files / NAMES[number])[record]
    assert np.array_equal(mol.positions, expected_mol.positions)


# ---------------------------------------------------------------------- small local files


@pytest.fixture
def small_shards(tmp_path):
    from pyg_atompack.stream import LocalSource

    root = tmp_path / "shards"
    root.mkdir()
    for k in range(2):
        write_big_atp(root / f"s{k}.atp", 320, seed=k, start=320 * k)  # ~5.5 MB each
    return LocalSource(root)


def test_small_shards_keep_whole_file_reads_and_blocks_interleave(small_shards, tmp_path):
    # 5.5 MB < 64 MiB blocks
    whole = ShardStreamDataset(small_shards, options=SourceOptions(cache_dir=tmp_path))
    assert whole.blocks is None
    dataset = ShardStreamDataset(small_shards,
                                 options=SourceOptions(block_bytes=512 << 10, interleave=3,
                                                       cache_dir=tmp_path), prefetch=2,
                                 shuffle=True)
    assert dataset.blocks is not None and len(dataset.blocks) > 10
    starts = [b.global_first for b in dataset.blocks]
    order = _energies(dataset)
    assert sorted(order) == list(range(640))
    block = np.searchsorted(starts, order, side="right")
    switches = np.count_nonzero(np.diff(block))
    assert switches > len(order) // 2  # consecutive samples mostly from different blocks
    stats = dataset.stats()
    # prefetch + interleave, and the one block more a retrieval process may hold
    assert 3 < stats["peak_live_shards"] <= 2 + 3 + 1


def test_block_split_is_exact_at_record_granularity():
    from pyg_atompack.stream.blocks import Block, plan_block_stream

    sizes = [7, 30, 1, 12, 25, 3, 9]  # 87 records in blocks of uneven size
    blocks, start = [], 0
    for number, size in enumerate(sizes):
        blocks.append(Block(number % 2, start, start + size, start))
        start += size
    for world_size, workers in ((1, 1), (2, 2), (3, 2), (4, 3)):
        got = []
        for rank in range(world_size):
            per_rank = 0
            for worker in range(workers):
                plan = plan_block_stream(blocks, StreamSlot(rank, world_size, worker, workers),
                                         shuffle=True, seed=1, epoch=2)
                records = [r for b in plan.blocks for r in range(b.global_first,
                                                                 b.global_first + b.records)]
                per_rank += len(records)
                got.extend(records)
                assert plan.dropped_records == 87 % world_size
            assert per_rank == 87 // world_size  # equal counts on every rank
        assert len(got) == len(set(got)) == 87 - 87 % world_size


def test_damaged_metadata_cache_is_refetched(tmp_path):
    from pyg_atompack.remote import atp_meta
    from pyg_atompack.remote.atp_meta import load_meta, meta_path
    from pyg_atompack.remote.ranges import FileRangeReader

    write_big_atp(tmp_path / "f.atp", 64)
    reader = FileRangeReader(tmp_path / "f.atp")
    stats: dict = {}
    first = load_meta(reader, tmp_path / "cache", stats=stats)
    atp_meta._MEMORY.clear()  # what another process sees: the disk cache
    assert load_meta(reader, tmp_path / "cache", stats=stats).index.tobytes() == \
        first.index.tobytes() and stats["fetched"] == 1
    path = meta_path(tmp_path / "cache", reader.identity, reader.size)
    raw = bytearray(path.read_bytes())
    raw[100] ^= 0xFF
    path.write_bytes(bytes(raw))
    atp_meta._MEMORY.clear()
    again = load_meta(reader, tmp_path / "cache", stats=stats)
    assert stats["fetched"] == 2 and again.index.tobytes() == first.index.tobytes()
    assert len(again) == len(atp.open(tmp_path / "f.atp"))


def test_auto_blocks_only_for_sources_with_range_reads(small_shards, tmp_path):
    from pyg_atompack.remote.ranges import FileRangeReader

    class WholeFiles:  # a custom source without range reads (like an object store today)
        def list_shards(self):
            return small_shards.list_shards()

        def fetch(self, shard, cancel):
            return small_shards.fetch(shard, cancel)

    class Ranged(WholeFiles):
        def range_reader(self, shard):
            return FileRangeReader(shard.file.url)

    whole = ShardStreamDataset(WholeFiles(),
                               options=SourceOptions(block_bytes=512 << 10, cache_dir=tmp_path))
    assert whole.blocks is None and len(_energies(whole)) == 640
    ranged = ShardStreamDataset(Ranged(),
                                options=SourceOptions(block_bytes=512 << 10, cache_dir=tmp_path))
    assert ranged.blocks is not None and sorted(_energies(ranged)) == list(range(640))
