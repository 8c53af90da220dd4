"""Object-store shards (``s3://``) against a real S3-compatible server (moto, loopback).

One moto server runs for the module; shards are uploaded with boto3. Faults (dropped and
stalled connections, S3's ``503 SlowDown`` throttling) come from a TCP relay in front of
it (``servers/tcp_proxy.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import threading
from pathlib import Path

import atompack
import numpy as np
import pytest
import torch
from servers.http_server import write_pt_shards
from servers.moto_s3 import (
    ACCESS_KEY,
    SECRET_KEY,
    SESSION_TOKEN,
    MotoS3Server,
    s3_environment,
)
from servers.tcp_proxy import ThrottlingProxy
from torch_geometric.loader import DataLoader

from pyg_atompack import AtompackDataset
from pyg_atompack.stream import (
    CancelToken,
    ObjectStoreSource,
    ShardIntegrityError,
    ShardStreamDataset,
)
from pyg_atompack.stream.errors import StreamCancelled
from pyg_atompack.transport import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    RetryPolicy,
    TransportError,
    UnsupportedURLError,
)
from pyg_atompack.transport.objectstore import ObjectStore

BUCKET = "atompack-test"
FAST = RetryPolicy(retries=2, backoff=0.01, jitter=0.0)
PT_SIZES = [5, 3, 4, 6]


@pytest.fixture(scope="module")
def server():
    with MotoS3Server() as moto:
        moto.create_bucket(BUCKET)
        yield moto


@pytest.fixture(autouse=True)
def aws_env(server, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_environment(server.endpoint_url).items():
        monkeypatch.setenv(name, value)


def _write_atp(path: Path, n_mol: int, n_atoms: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression="zstd", overwrite=True)
    db.add_arrays_batch(rng.normal(size=(n_mol, n_atoms, 3)).astype(np.float32),
                        rng.integers(1, 30, size=(n_mol, n_atoms)).astype(np.uint8),
                        energy=seed * 100.0 + np.arange(n_mol, dtype=np.float64))
    db.flush()


@pytest.fixture(scope="module")
def pt_prefix(server, tmp_path_factory):
    """``.pt`` shards with the converter's manifest at ``s3://BUCKET/pt/``."""
    root = tmp_path_factory.mktemp("pt")
    write_pt_shards(root, PT_SIZES)
    server.upload_directory(root, BUCKET, "pt")
    return root


@pytest.fixture(scope="module")
def atp_prefix(server, tmp_path_factory):
    """Three ``.atp`` shards (one nested) without a manifest at ``s3://BUCKET/atp/``."""
    root = tmp_path_factory.mktemp("atp")
    for shard, (count, atoms) in enumerate([(3, 4), (2, 5), (4, 3)]):
        _write_atp(root / f"part-{shard}.atp", count, atoms, shard + 1)
    server.upload_directory(root, BUCKET, "atp")
    return root


def _ids(samples) -> list[int]:
    return [int(s.sample_id) for s in samples]


ALL_PT_IDS = sorted(shard * 1000 + i for shard, n in enumerate(PT_SIZES) for i in range(n))


# ------------------------------------------------------------------ listing
def test_listing_has_sizes_etags_and_manifest_facts(pt_prefix):
    source = ObjectStoreSource(f"s3://{BUCKET}/pt/")
    shards = source.list_shards()
    names = sorted(p.name for p in pt_prefix.glob("*.pt"))
    assert [s.name for s in shards] == names
    manifest = {e["name"]: e for e in json.loads((pt_prefix / "manifest.json").read_text())[
        "shards"]}
    for shard in shards:
        data = (pt_prefix / shard.name).read_bytes()
        assert shard.size == len(data)
        assert shard.sha256 == manifest[shard.name]["sha256"]
        assert shard.records == manifest[shard.name]["records"]
        assert shard.extra["etag"] == hashlib.md5(data).hexdigest()  # S3's single-part ETag
        assert shard.location == f"s3://{BUCKET}/pt/{shard.name}"
    by_manifest = ObjectStoreSource(f"s3://{BUCKET}/pt/manifest.json").list_shards()
    assert by_manifest == shards


def test_nested_atp_shards_sorted_by_posix_path(server, atp_prefix, tmp_path):
    (tmp_path / "b").mkdir()
    _write_atp(tmp_path / "b" / "x.atp", 1, 2, 9)
    server.client().upload_file(str(tmp_path / "b" / "x.atp"), BUCKET, "nested/b/x.atp")
    server.client().upload_file(str(atp_prefix / "part-0.atp"), BUCKET, "nested/a.atp")
    server.client().put_object(Bucket=BUCKET, Key="nested/readme.txt", Body=b"not a shard")
    names = [s.name for s in ObjectStoreSource(f"s3://{BUCKET}/nested").list_shards()]
    assert names == ["a.atp", "b/x.atp"]


# ------------------------------------------------------------------ streaming
def test_stream_every_pt_sample_once_per_epoch_two_forked_workers(pt_prefix):
    source = ObjectStoreSource(f"s3://{BUCKET}/pt/")  # the parent's client is in use now
    dataset = ShardStreamDataset(source, shuffle=True, seed=1, prefetch=1)
    for epoch in range(2):
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=4, num_workers=2,
                            multiprocessing_context="fork")
        ids = torch.cat([batch.sample_id for batch in loader]).tolist()
        assert sorted(ids) == ALL_PT_IDS
        assert {r["worker"] for r in dataset.trace} == {0, 1}


def test_stream_atp_shards_two_forked_workers(atp_prefix):
    dataset = ShardStreamDataset(ObjectStoreSource(f"s3://{BUCKET}/atp/"), prefetch=1)
    loader = DataLoader(dataset, batch_size=2, num_workers=2,
                        multiprocessing_context="fork")
    energies = sorted(torch.cat([batch.energy for batch in loader]).tolist())
    local = ShardStreamDataset(ObjectStoreSource(f"s3://{BUCKET}/atp/"), prefetch=0)
    assert energies == sorted(float(s.energy) for s in local)
    assert energies == sorted(seed * 100.0 + i for seed, n in ((1, 3), (2, 2), (3, 4))
                              for i in range(n))


def test_first_shard_in_parts_equals_the_object(server, tmp_path):
    payload = os.urandom(3 << 20)
    server.client().put_object(Bucket=BUCKET, Key="parts/big.pt", Body=payload)
    source = ObjectStoreSource(f"s3://{BUCKET}/parts/big.pt")
    (shard,) = source.list_shards()
    assert bytes(source.fetch_in_parts(shard, CancelToken(), 4)) == payload
    assert bytes(source.fetch(shard, CancelToken())) == payload


# ------------------------------------------------------------------ pickling and secrets
def test_pickled_source_carries_no_secret_and_still_fetches(pt_prefix, monkeypatch):
    explicit = ObjectStoreSource(f"s3://{BUCKET}/pt/", key=ACCESS_KEY, secret=SECRET_KEY,
                                 token=SESSION_TOKEN)
    nested = ObjectStoreSource(f"s3://{BUCKET}/pt/", client_kwargs={
        "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY,
        "aws_session_token": SESSION_TOKEN, "region_name": "us-east-1"})
    for source in (explicit, nested, ObjectStoreSource(f"s3://{BUCKET}/pt/")):
        shard = source.list_shards()[0]
        source.fetch(shard, CancelToken())  # a live client exists before pickling
        raw = pickle.dumps(source)
        assert SECRET_KEY.encode() not in raw
        assert SESSION_TOKEN.encode() not in raw
        clone = pickle.loads(raw)  # the environment's credentials serve the clone
        assert bytes(clone.fetch(shard, CancelToken())) == (pt_prefix / shard.name).read_bytes()


def test_missing_credentials(pt_prefix, monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    with pytest.raises(RemoteAuthError, match=r"s3://atompack-test/pt: no credentials") as info:
        ObjectStoreSource(f"s3://{BUCKET}/pt/")
    assert "anon=True" in str(info.value)


def test_anonymous_access(server, pt_prefix, monkeypatch):
    client = server.client()
    client.create_bucket(Bucket="public-shards", ACL="public-read")
    client.put_object(Bucket="public-shards", Key="p/a.pt", Body=b"open data", ACL="public-read")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    source = ObjectStoreSource("s3://public-shards/p/", anon=True)
    assert bytes(source.fetch(source.list_shards()[0], CancelToken())) == b"open data"
    # a private object stays private to unsigned requests
    with pytest.raises(RemoteAuthError, match=r"s3://atompack-test/pt/manifest\.json: access "
                                              r"denied"):
        ObjectStoreSource(f"s3://{BUCKET}/pt/", anon=True)


# ------------------------------------------------------------------ bad input
def test_wrong_bucket_and_wrong_key():
    with pytest.raises(RemoteNotFoundError, match=r"s3://no-such-bucket/pt: bucket "
                                                  r"'no-such-bucket' does not exist"):
        ObjectStoreSource("s3://no-such-bucket/pt/")
    with pytest.raises(RemoteNotFoundError, match=r"s3://atompack-test/pt/nope\.pt: no such"):
        ObjectStoreSource(f"s3://{BUCKET}/pt/nope.pt")
    with pytest.raises(RemoteNotFoundError, match=r"s3://atompack-test/void: no objects"):
        ObjectStoreSource(f"s3://{BUCKET}/void/")
    with pytest.raises(RemoteNotFoundError, match=r"manifest\.json"):
        ObjectStoreSource(f"s3://{BUCKET}/void/manifest.json")


def test_manifest_naming_a_missing_shard(server):
    document = {"shards": [{"name": "gone.pt", "bytes": 3}]}
    server.client().put_object(Bucket=BUCKET, Key="orphan/manifest.json",
                               Body=json.dumps(document).encode())
    server.client().put_object(Bucket=BUCKET, Key="orphan/here.pt", Body=b"abc")
    for url in (f"s3://{BUCKET}/orphan/", f"s3://{BUCKET}/orphan/manifest.json"):
        with pytest.raises(RemoteNotFoundError,
                           match=r"s3://atompack-test/orphan/gone\.pt: named by the manifest"):
            ObjectStoreSource(url)


def test_bad_manifest_field_names_entry_and_field(server):
    document = {"shards": [{"name": "a.pt", "sha256": 5}]}
    server.client().put_object(Bucket=BUCKET, Key="badman/manifest.json",
                               Body=json.dumps(document).encode())
    server.client().put_object(Bucket=BUCKET, Key="badman/a.pt", Body=b"abc")
    with pytest.raises(TransportError, match=r"badman/manifest\.json: shards\[0\] \(a\.pt\): "
                                             r"'sha256' must be str"):
        ObjectStoreSource(f"s3://{BUCKET}/badman/")


def test_manifest_size_mismatch_is_refused_at_listing(server):
    document = {"shards": [{"name": "a.pt", "bytes": 99}]}
    server.client().put_object(Bucket=BUCKET, Key="short/manifest.json",
                               Body=json.dumps(document).encode())
    server.client().put_object(Bucket=BUCKET, Key="short/a.pt", Body=b"abc")
    with pytest.raises(RemoteIntegrityError, match=r"s3://atompack-test/short/a\.pt: the "
                                                   r"bucket lists 3 bytes.*says 99"):
        ObjectStoreSource(f"s3://{BUCKET}/short/")


def test_sha256_mismatch_detected_and_nothing_cached(server, tmp_path):
    good = b"the right bytes"
    document = {"shards": [{"name": "a.pt", "bytes": len(good),
                            "sha256": hashlib.sha256(good).hexdigest()}]}
    client = server.client()
    client.put_object(Bucket=BUCKET, Key="altered/manifest.json",
                      Body=json.dumps(document).encode())
    client.put_object(Bucket=BUCKET, Key="altered/a.pt", Body=b"the wrong bytes")
    source = ObjectStoreSource(f"s3://{BUCKET}/altered/")
    with pytest.raises(ShardIntegrityError, match=r"shard a\.pt: sha256"):
        list(ShardStreamDataset(source, prefetch=0))
    store = ObjectStore(f"s3://{BUCKET}/altered/")
    (obj,) = store.list()
    cache = tmp_path / "cache"
    with pytest.raises(RemoteIntegrityError, match=r"s3://atompack-test/altered/a\.pt: sha256"):
        store.download(obj, cache)
    assert [p for p in cache.rglob("*") if p.is_file() and p.suffix != ".lock"] == []


def test_object_replaced_after_listing(server):
    client = server.client()
    client.put_object(Bucket=BUCKET, Key="moving/a.pt", Body=b"version one")
    source = ObjectStoreSource(f"s3://{BUCKET}/moving/")
    client.put_object(Bucket=BUCKET, Key="moving/a.pt", Body=b"version two")
    with pytest.raises(RemoteIntegrityError, match=r"s3://atompack-test/moving/a\.pt: the "
                                                   r"object changed since it was listed"):
        source.fetch(source.list_shards()[0], CancelToken())


def test_unreachable_endpoint_bounded_retries():
    with pytest.raises(RemoteUnavailableError, match=r"s3://atompack-test/pt: giving up after "
                                                     r"3 attempts: .* from http://127\.0\.0"
                                                     r"\.1:9") as info:
        ObjectStoreSource(f"s3://{BUCKET}/pt/", endpoint_url="http://127.0.0.1:9", retry=FAST)
    assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)


def test_unsupported_urls():
    with pytest.raises(UnsupportedURLError, match=r"ftp://x/y: not an object-store URL"):
        ObjectStore("ftp://x/y")
    with pytest.raises(UnsupportedURLError, match=r"carry no user info") as info:
        ObjectStore(f"s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/pt/")
    assert SECRET_KEY not in str(info.value)


def test_scheme_without_its_package_names_the_package():
    store = ObjectStore("gs://some-bucket/shards/")
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(UnsupportedURLError, match=r"gs://some-bucket/shards: gs:// needs "
                                                      r"the optional package 'gcsfs'"):
            store.list()
    else:
        assert store.fs.protocol[0] in ("gs", "gcs")


# ------------------------------------------------------------------ faults on the wire
@pytest.fixture
def proxy(server):
    relay = ThrottlingProxy(server.port).start()
    yield relay
    relay.stop()


def test_dropped_transfer_resumes_by_range(server, proxy):
    payload = os.urandom(2 << 20)
    server.client().put_object(Bucket=BUCKET, Key="resume/a.pt", Body=payload)
    (obj,) = ObjectStore(f"s3://{BUCKET}/resume/").list()
    proxy.cut_next(after_bytes=700_000)
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url, retry=FAST)
    buffer = bytearray(obj.size)
    store.read_into(obj, buffer)
    assert bytes(buffer) == payload
    assert proxy.ranges[0] == f"bytes=0-{obj.size - 1}"
    resumed_at = int(proxy.ranges[1].split("=")[1].split("-")[0])
    assert 0 < resumed_at < obj.size  # the rest only, not the whole object again


def test_download_truncated_every_time_fails_and_caches_nothing(server, proxy, tmp_path):
    payload = os.urandom(1 << 20)
    server.client().put_object(Bucket=BUCKET, Key="trunc/a.pt", Body=payload)
    (obj,) = ObjectStore(f"s3://{BUCKET}/trunc/").list()
    proxy.cut_next(after_bytes=1000, times=10)
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url, retry=FAST)
    with pytest.raises(RemoteUnavailableError, match=r"s3://atompack-test/trunc/a\.pt: giving "
                                                     r"up after 3 attempts"):
        store.download(obj, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()
            and p.suffix != ".lock"] == []


def test_permanent_errors_are_not_retried(server, proxy):
    server.client().put_object(Bucket=BUCKET, Key="deleted/a.pt", Body=b"soon gone")
    (obj,) = ObjectStore(f"s3://{BUCKET}/deleted/").list()
    server.client().delete_object(Bucket=BUCKET, Key="deleted/a.pt")
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url, retry=FAST)
    with pytest.raises(RemoteNotFoundError, match=r"s3://atompack-test/deleted/a\.pt: no such "
                                                  r"object"):
        store.read_into(obj, bytearray(obj.size))
    assert len(proxy.ranges) == 1


class _RecordingCancel(CancelToken):
    """A cancel token that records the backoff waits instead of sleeping them."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


def test_throttling_is_retried_under_the_one_policy(server, proxy):
    payload = os.urandom(100_000)
    server.client().put_object(Bucket=BUCKET, Key="throttle/a.pt", Body=payload)
    (obj,) = ObjectStore(f"s3://{BUCKET}/throttle/").list()
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url,
                        retry=RetryPolicy(retries=3, backoff=0.01, jitter=0.0))
    proxy.fail_next(503, "SlowDown", times=2, retry_after=7)
    cancel = _RecordingCancel()
    buffer = bytearray(obj.size)
    store.read_into(obj, buffer, cancel=cancel)
    assert bytes(buffer) == payload
    assert proxy.failed == 2 and len(proxy.ranges) == 3  # two throttled, one served
    # the backoff of the transport's RetryPolicy, never shorter than the Retry-After
    assert cancel.waits == [7.0, 7.0]


def test_throttling_outlasting_the_retries_names_the_url(server, proxy):
    server.client().put_object(Bucket=BUCKET, Key="throttle/b.pt", Body=b"x" * 1000)
    (obj,) = ObjectStore(f"s3://{BUCKET}/throttle/b.pt").list()
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url, retry=FAST,
                        key=ACCESS_KEY, secret=SECRET_KEY)
    proxy.fail_next(503, "SlowDown", times=5)
    with pytest.raises(RemoteUnavailableError, match=r"s3://atompack-test/throttle/b\.pt: "
                                                     r"giving up after 3 attempts: SlowDown "
                                                     r"from http://127\.0\.0\.1") as info:
        store.read_into(obj, bytearray(obj.size))
    assert proxy.failed == 3  # bounded: FAST allows two retries
    assert SECRET_KEY not in str(info.value) and ACCESS_KEY not in str(info.value)


def test_access_denied_is_not_retried(server, proxy):
    server.client().put_object(Bucket=BUCKET, Key="denied/a.pt", Body=b"private")
    (obj,) = ObjectStore(f"s3://{BUCKET}/denied/").list()
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url, retry=FAST)
    proxy.fail_next(403, "AccessDenied", times=3)
    with pytest.raises(RemoteAuthError, match=r"s3://atompack-test/denied/a\.pt: access "
                                              r"denied \(AccessDenied\)"):
        store.read_into(obj, bytearray(obj.size))
    assert proxy.failed == 1


def test_retries_argument_of_the_stream_sets_the_store_policy(pt_prefix):
    source = ObjectStoreSource(f"s3://{BUCKET}/pt/", retry=FAST)
    dataset = ShardStreamDataset(source, retries=0)
    assert dataset.source.retry.retries == 0 and dataset.source.store.retry.retries == 0
    assert source.retry is FAST and source.store.retry is FAST  # the original is untouched


def test_endpoint_for_s3_wins_over_the_generic_one(pt_prefix, server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    assert len(ObjectStoreSource(f"s3://{BUCKET}/pt/").list_shards()) == len(PT_SIZES)


def test_cancel_interrupts_a_stalled_transfer(server, proxy):
    server.client().put_object(Bucket=BUCKET, Key="stall/a.pt", Body=os.urandom(1 << 20))
    (obj,) = ObjectStore(f"s3://{BUCKET}/stall/").list()
    proxy.stall_next(after_bytes=2000)
    store = ObjectStore(obj.url, endpoint_url=proxy.endpoint_url,
                        retry=RetryPolicy(timeout=120))
    cancel = CancelToken()
    timer = threading.Timer(0.5, cancel.cancel)
    timer.start()
    with pytest.raises(StreamCancelled):
        store.read_into(obj, bytearray(obj.size), cancel=cancel)
    timer.join()


# ------------------------------------------------------------------ AtompackDataset
@pytest.mark.parametrize("prefetch_shards", [None, True])
def test_atompack_dataset_over_s3_equals_local(atp_prefix, tmp_path, monkeypatch,
                                               prefetch_shards):
    # by record through the page cache (default), or lazy verified whole-shard downloads
    monkeypatch.setenv("PYG_ATOMPACK_HUB_CACHE", str(tmp_path / "hub"))
    local = AtompackDataset(atp_prefix)
    remote = AtompackDataset(f"s3://{BUCKET}/atp/", cache_dir=tmp_path / "cache",
                             prefetch_shards=prefetch_shards)
    assert len(remote) == len(local) == 9
    for got, want in zip(remote, local):
        assert set(got.keys()) == set(want.keys())
        for key, value in want:  # iterating a Data yields (key, value) pairs
            assert torch.equal(got[key], value), key
    if prefetch_shards:
        assert remote.reader.downloaded_shards() == [0, 1, 2]
    else:
        assert not (tmp_path / "hub").exists()  # nothing downloaded whole
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["atp-meta", "pages"]


def test_named_profile_from_the_shared_credentials_file(pt_prefix, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[shards]\naws_access_key_id = {ACCESS_KEY}\n"
                           f"aws_secret_access_key = {SECRET_KEY}\n", encoding="utf-8")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    source = ObjectStoreSource(f"s3://{BUCKET}/pt/", profile="shards")
    assert len(source.list_shards()) == len(PT_SIZES)
    assert SECRET_KEY.encode() not in pickle.dumps(source)
    monkeypatch.setenv("AWS_PROFILE", "shards")  # the same through the environment
    assert len(ObjectStoreSource(f"s3://{BUCKET}/pt/").list_shards()) == len(PT_SIZES)


def test_transport_module_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, pyg_atompack.transport.objectstore as m; "
            "m.ObjectStore('s3://b/p/'); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
