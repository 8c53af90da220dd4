"""Record-level reads of `.atp` objects in a real S3-compatible server (moto, loopback).

The same seams as over HTTP(S) (``tests/test_big_remote_atp.py``), on a smaller scale:
``ShardStreamDataset("s3://...")`` streams record blocks (one ranged ``GET`` each), and
``AtompackDataset("s3://...")`` reads records through the bounded page cache. Every
request passes a TCP relay in front of moto (``servers/tcp_proxy.py``), which records
the ``Range`` of each one.
"""

from __future__ import annotations

import collections
import os
import pickle
import re

import numpy as np
import pytest
import torch
from servers.moto_s3 import ACCESS_KEY, SECRET_KEY, MotoS3Server, s3_environment
from servers.tcp_proxy import ThrottlingProxy
from torch.utils.data import DataLoader

from pyg_atompack import AtompackDataset, AtompackLoader, atp
from pyg_atompack.remote import RemoteAtpReader, atp_meta
from pyg_atompack.remote.ranges import BackendRangeReader
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.transport import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RetryPolicy,
)
from tests.big_atp import write_big_atp, write_manifest

BUCKET = "atp-records"
NAMES = ("none.atp", "zstd.atp")
RECORDS = 192  # ~3.3 MB a file
BLOCK = 512 << 10
HEADER_RANGE = "bytes=0-8191"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3_atp")
    counts = [write_big_atp(root / NAMES[0], RECORDS, compression="none"),
              write_big_atp(root / NAMES[1], RECORDS, compression="zstd", seed=1,
                            start=RECORDS)]
    write_manifest(root, list(NAMES), counts)
    return root


@pytest.fixture(scope="module")
def moto(files):
    with MotoS3Server() as server:
        server.upload_directory(files, BUCKET, "big")
        yield server


@pytest.fixture
def proxy(moto, monkeypatch, tmp_path):
    relay = ThrottlingProxy(moto.port).start()
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_environment(relay.endpoint_url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "cache"))
    atp_meta._MEMORY.clear()  # each test starts without metadata in memory (or on disk)
    yield relay
    relay.stop()


def _span(value: str) -> int:
    first, last = re.fullmatch(r"bytes=(\d+)-(\d+)", value).groups()
    return int(last) + 1 - int(first)


def test_blocks_deliver_every_record_once_with_two_workers(files, proxy, tmp_path):
    dataset = ShardStreamDataset(f"s3://{BUCKET}/big/",
                                 options=SourceOptions(blocks=True, block_bytes=BLOCK,
                                                       cache_dir=tmp_path), shuffle=True, seed=3,
                                 prefetch=2)
    assert isinstance(dataset.source, RemoteSource)
    assert dataset.blocks is not None and len(dataset.blocks) > 10
    local = atp.ShardedReader.from_paths([files / n for n in NAMES])
    delivered = []
    for batch in DataLoader(dataset, batch_size=None, num_workers=2,
                            multiprocessing_context="fork"):
        energy = int(batch.energy.item())
        delivered.append(energy)
        mol = local[energy]  # record i has energy i: equal to the local read
        assert torch.equal(batch.pos, torch.from_numpy(np.array(mol.positions)))
        assert torch.equal(batch.forces, torch.from_numpy(np.array(mol.forces)))
    counts = collections.Counter(delivered)
    assert sorted(counts) == list(range(len(local))) and set(counts.values()) == {1}
    # one ranged GET per block (<= block_bytes); metadata once per file, by the
    # constructing process: the workers read the disk cache
    assert proxy.ranges and max(_span(r) for r in proxy.ranges) <= BLOCK
    assert proxy.ranges.count(HEADER_RANGE) == len(NAMES)
    shipped = sum(_span(r) for r in proxy.ranges)
    total = sum((files / n).stat().st_size for n in NAMES)
    assert shipped < total + (64 << 10)  # records once, plus the small metadata


def _spans(ranges: list[str]) -> list[tuple[int, int]]:
    out = []
    for value in ranges:
        first, last = re.fullmatch(r"bytes=(\d+)-(\d+)", value).groups()
        out.append((int(first), int(last) + 1))
    return out


def test_a_connection_cut_mid_block_resumes_that_block(files, proxy, tmp_path):
    source = RemoteSource(f"s3://{BUCKET}/big/",
                               retry=RetryPolicy(retries=3, backoff=0.01))
    dataset = ShardStreamDataset(source,
                                 options=SourceOptions(blocks=True, block_bytes=BLOCK,
                                                       cache_dir=tmp_path, split_shards=False),
                                 prefetch=0)  # metadata read here
    proxy.ranges.clear()
    proxy.cut_next(after_bytes=200_000)  # the next connection: the first block's GET
    assert [int(s.energy.item()) for s in dataset] == list(range(2 * RECORDS))
    spans = _spans(proxy.ranges)
    first = spans[0]
    assert first[1] - first[0] > 200_000  # the cut fell inside the block
    # the retry asked for the block's missing tail only, then the next blocks followed
    assert spans[1][1] == first[1] and first[0] < spans[1][0] <= first[0] + 200_000
    assert all(b - a <= BLOCK for a, b in spans)


def test_auto_blocks_for_object_shards_larger_than_a_block(proxy, tmp_path):
    dataset = ShardStreamDataset(f"s3://{BUCKET}/big/",
                                 options=SourceOptions(block_bytes=BLOCK, cache_dir=tmp_path))
    assert dataset.blocks is not None
    whole = ShardStreamDataset(f"s3://{BUCKET}/big/",
                               options=SourceOptions(block_bytes=64 << 20, cache_dir=tmp_path))
    assert whole.blocks is None  # small shards keep whole-file reads


def test_random_access_by_record_equals_local_and_stays_bounded(files, proxy, tmp_path):
    bound = 1 << 20
    remote = AtompackDataset(f"s3://{BUCKET}/big/", cache_dir=tmp_path, cache_bytes=bound)
    assert all(isinstance(s, RemoteAtpReader) for s in remote.reader.shards)
    local = AtompackDataset([files / n for n in NAMES])
    assert len(remote) == len(local) == 2 * RECORDS
    rng = np.random.default_rng(0)
    total = sum((files / n).stat().st_size for n in NAMES)
    for i in rng.integers(0, len(local), 3).tolist():
        a, b = remote[i], local[i]
        for key in ("pos", "z", "energy", "forces"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
    # the pages of three records (and the metadata), not the objects
    assert sum(_span(r) for r in proxy.ranges) < total // 2
    picks = rng.permutation(len(local))[:128]
    batches = 0
    for a, b in zip(AtompackLoader(remote[picks], batch_size=32, num_workers=2),
                    AtompackLoader(local[picks], batch_size=32)):
        for key in ("pos", "z", "energy", "forces", "natoms", "batch"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key
        batches += 1
    assert batches == 4
    pages = list((tmp_path / "pages").rglob("*.page"))
    assert pages and sum(p.stat().st_size for p in pages) <= bound
    # metadata once per file for the main process and both workers
    assert proxy.ranges.count(HEADER_RANGE) == len(NAMES)


def test_prefetch_shards_downloads_verified_whole_objects(files, proxy, tmp_path):
    dataset = AtompackDataset(f"s3://{BUCKET}/big/", prefetch_shards=True)
    assert dataset.reader.downloaded_shards() == []
    assert float(dataset[RECORDS].energy) == RECORDS
    assert dataset.reader.downloaded_shards() == [1]


def test_range_reader_pickles_without_secrets_and_reads_in_a_clone(files, proxy):
    source = RemoteSource(f"s3://{BUCKET}/big/", key=ACCESS_KEY, secret=SECRET_KEY)
    reader = source.range_reader(source.list_shards()[0])
    assert isinstance(reader, BackendRangeReader)
    assert reader.identity.startswith("sha256:")  # the manifest's digest
    out = bytearray(100)
    reader.read_into(5000, memoryview(out))
    raw = pickle.dumps(reader)
    assert SECRET_KEY.encode() not in raw
    clone = pickle.loads(raw)  # credentials from the environment in the new process
    again = bytearray(100)
    clone.read_into(5000, memoryview(again))
    assert out == again == (files / NAMES[0]).read_bytes()[5000:5100]


def test_altered_object_is_detected(files, moto, proxy, tmp_path):
    client = moto.client()
    client.upload_file(str(files / NAMES[0]), BUCKET, "moving/a.atp")
    dataset = AtompackDataset(f"s3://{BUCKET}/moving/", cache_dir=tmp_path)
    assert float(dataset[0].energy) == 0.0
    data = bytearray((files / NAMES[0]).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: a new ETag
    client.put_object(Bucket=BUCKET, Key="moving/a.atp", Body=bytes(data))
    with pytest.raises(RemoteIntegrityError, match=r"s3://atp-records/moving/a\.atp: the "
                                                   r"object changed since it was listed"):
        dataset[RECORDS - 1]  # a page not cached yet
    stream = ShardStreamDataset(f"s3://{BUCKET}/moving/",
                                options=SourceOptions(blocks=True, block_bytes=BLOCK,
                                                      cache_dir=tmp_path))
    client.put_object(Bucket=BUCKET, Key="moving/a.atp", Body=(files / NAMES[0]).read_bytes())
    with pytest.raises(RemoteIntegrityError, match=r"moving/a\.atp.*changed since it was "
                                                   r"listed"):
        list(stream)


def test_caches_follow_a_rewritten_object_despite_a_stale_manifest(files, moto, proxy,
                                                                   tmp_path):
    client = moto.client()
    client.put_object(Bucket=BUCKET, Key="stale/manifest.json",
                      Body=(files / "manifest.json").read_bytes())
    for name in NAMES:
        client.upload_file(str(files / name), BUCKET, f"stale/{name}")
    first = AtompackDataset(f"s3://{BUCKET}/stale/", cache_dir=tmp_path)
    assert first.reader.shards[0].range_reader.identity.startswith("sha256:")
    assert [float(first[i].energy) for i in range(RECORDS)] == list(range(RECORDS))
    # rewritten with other bytes of the same size; the manifest still names the old sha256
    data = bytearray((files / NAMES[0]).read_bytes())
    data[len(data) // 2] ^= 0x40
    (tmp_path / "v2.atp").write_bytes(bytes(data))
    client.put_object(Bucket=BUCKET, Key=f"stale/{NAMES[0]}", Body=bytes(data))
    second = AtompackDataset(f"s3://{BUCKET}/stale/", cache_dir=tmp_path)
    local = AtompackDataset(tmp_path / "v2.atp")
    differs = 0
    for i in range(RECORDS):  # new metadata and pages, not the cached ones of version 1
        got, want, old = second[i], local[i], first.reader.shards[0][i]
        for key in ("pos", "z", "forces"):
            assert torch.equal(getattr(got, key), getattr(want, key)), (i, key)
        differs += not np.array_equal(np.asarray(old.positions), want.pos.numpy()) or \
            not np.array_equal(np.asarray(old.forces), want.forces.numpy())
    assert differs == 1  # the rewritten record is read as it now is
    assert proxy.ranges.count(HEADER_RANGE) == 3  # the rewritten file's metadata again


def test_truncated_object_is_detected(files, moto, proxy, tmp_path):
    # the converter's manifest names the full size; the bucket holds half the object
    data = (files / NAMES[0]).read_bytes()
    client = moto.client()
    client.put_object(Bucket=BUCKET, Key="cut/manifest.json",
                      Body=(files / "manifest.json").read_bytes())
    client.put_object(Bucket=BUCKET, Key="cut/none.atp", Body=data[:len(data) // 2])
    client.put_object(Bucket=BUCKET, Key="cut/zstd.atp", Body=(files / NAMES[1]).read_bytes())
    pattern = (rf"s3://atp-records/cut/none\.atp: the bucket lists {len(data) // 2} bytes, "
               rf"the manifest s3://atp-records/cut/manifest\.json says {len(data)}")
    with pytest.raises(RemoteIntegrityError, match=pattern):
        AtompackDataset(f"s3://{BUCKET}/cut/", cache_dir=tmp_path)
    with pytest.raises(RemoteIntegrityError, match=pattern):
        ShardStreamDataset(f"s3://{BUCKET}/cut/", options=SourceOptions(cache_dir=tmp_path))


def test_wrong_bucket_key_and_missing_credentials(proxy, monkeypatch, tmp_path):
    with pytest.raises(RemoteNotFoundError, match=r"s3://no-such-bucket/big: bucket "
                                                  r"'no-such-bucket' does not exist"):
        AtompackDataset("s3://no-such-bucket/big/", cache_dir=tmp_path)
    with pytest.raises(RemoteNotFoundError, match=r"s3://atp-records/big/nope\.atp: no such "
                                                  r"object"):
        ShardStreamDataset(f"s3://{BUCKET}/big/nope.atp",
                           options=SourceOptions(blocks=True, cache_dir=tmp_path))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    for make in (lambda: AtompackDataset(f"s3://{BUCKET}/big/", cache_dir=tmp_path),
                 lambda: ShardStreamDataset(f"s3://{BUCKET}/big/",
                                            options=SourceOptions(cache_dir=tmp_path))):
        with pytest.raises(RemoteAuthError, match=r"s3://atp-records/big.*no credentials "
                                                  r"found") as info:
            make()
        assert SECRET_KEY not in str(info.value)
