"""What every object store must do alike, against each one's real server on loopback.

Each test runs for ``s3://`` (moto), ``gs://`` (gcp-storage-emulator) and ``az://``
(Azurite) unless its parameters say otherwise (``tests/servers/stores.py``): the code
under test is the same :class:`~pyg_atompack.remote.objectstore.ObjectStore` for all
three, with a small backend per store. Faults (dropped connections, throttling, refused
requests) come from a TCP relay in front of the server (``servers/tcp_proxy.py``).
S3-only behaviour (profiles, anonymous buckets, stalls, ``AWS_ENDPOINT_URL_S3``) is in
``tests/test_objectstore.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import atompack
import numpy as np
import pytest
import torch
from servers.http_server import write_pt_shards
from servers.stores import STORES, use_store
from servers.tcp_proxy import ThrottlingProxy
from torch_geometric.loader import DataLoader

from pyg_atompack import AtompackDataset
from pyg_atompack.remote.objectstore import ObjectStore
from pyg_atompack.stream import (
    CancelToken,
    RemoteSource,
    ShardIntegrityError,
    ShardStreamDataset,
)
from pyg_atompack.transport import (
    RemoteAuthError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    RetryPolicy,
)

BUCKET = "atompack-stores"
FAST = RetryPolicy(retries=2, backoff=0.01, jitter=0.0)
PT_SIZES = [5, 3, 4, 6]
ALL_PT_IDS = sorted(shard * 1000 + i for shard, n in enumerate(PT_SIZES) for i in range(n))


@pytest.fixture(scope="module", params=STORES)
def store(request, store_servers):
    server = store_servers(request.param)
    server.create_bucket(BUCKET)
    return server


@pytest.fixture(autouse=True)
def store_env(store, monkeypatch, tmp_path):
    use_store(monkeypatch, store)
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "root"))


def _url(store, path: str) -> str:
    return f"{store.scheme}://{BUCKET}/{path}"


def _write_atp(path: Path, n_mol: int, n_atoms: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression="zstd", overwrite=True)
    db.add_arrays_batch(rng.normal(size=(n_mol, n_atoms, 3)).astype(np.float32),
                        rng.integers(1, 30, size=(n_mol, n_atoms)).astype(np.uint8),
                        energy=seed * 100.0 + np.arange(n_mol, dtype=np.float64))
    db.flush()


@pytest.fixture(scope="module")
def pt_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pt")
    write_pt_shards(root, PT_SIZES)  # with the converter's manifest.json
    return root


@pytest.fixture(scope="module")
def atp_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("atp")
    for shard, (count, atoms) in enumerate([(3, 4), (2, 5), (4, 3)]):
        _write_atp(root / f"part-{shard}.atp", count, atoms, shard + 1)
    return root


@pytest.fixture(scope="module")
def pt_prefix(store, pt_root):
    store.upload_directory(pt_root, BUCKET, "pt")
    return pt_root


@pytest.fixture(scope="module")
def atp_prefix(store, atp_root):
    store.upload_directory(atp_root, BUCKET, "atp")
    return atp_root


@pytest.fixture
def proxy(store):
    relay = ThrottlingProxy(store.port).start()
    yield relay
    relay.stop()


# ------------------------------------------------------------------ listing
def test_listing_has_sizes_versions_and_manifest_facts(store, pt_prefix):
    shards = RemoteSource(_url(store, "pt/")).list_shards()
    assert [s.name for s in shards] == sorted(p.name for p in pt_prefix.glob("*.pt"))
    manifest = {e["name"]: e for e in json.loads((pt_prefix / "manifest.json").read_text())[
        "shards"]}
    for shard in shards:
        assert shard.size == (pt_prefix / shard.name).stat().st_size
        assert shard.sha256 == manifest[shard.name]["sha256"]
        assert shard.records == manifest[shard.name]["records"]
        assert shard.file.version  # what caches and range reads are pinned to
        assert shard.file.version.isdigit() == (store.scheme == "gs")  # GCS: the generation
        assert shard.file.url == _url(store, f"pt/{shard.name}")
    assert RemoteSource(_url(store, "pt/manifest.json")).list_shards() == shards


def test_nested_shards_sorted_by_posix_path_and_other_objects_ignored(store, atp_root):
    store.put(BUCKET, "nested/b/x.atp", (atp_root / "part-1.atp").read_bytes())
    store.put(BUCKET, "nested/a.atp", (atp_root / "part-0.atp").read_bytes())
    store.put(BUCKET, "nested/readme.txt", b"not a shard")
    names = [s.name for s in RemoteSource(_url(store, "nested")).list_shards()]
    assert names == ["a.atp", "b/x.atp"]


# ------------------------------------------------------------------ streaming
def test_stream_every_pt_sample_once_per_epoch_two_forked_workers(store, pt_prefix):
    source = RemoteSource(_url(store, "pt/"))  # the parent's client is in use now
    dataset = ShardStreamDataset(source, shuffle=True, seed=1, prefetch=1)
    for epoch in range(2):
        dataset.set_epoch(epoch)
        loader = DataLoader(dataset, batch_size=4, num_workers=2,
                            multiprocessing_context="fork")
        ids = torch.cat([batch.sample_id for batch in loader]).tolist()
        assert sorted(ids) == ALL_PT_IDS
        assert {r["worker"] for r in dataset.trace} == {0, 1}


def test_stream_atp_shards_two_forked_workers(store, atp_prefix):
    dataset = ShardStreamDataset(_url(store, "atp/"), prefetch=1)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, multiprocessing_context="fork")
    energies = sorted(torch.cat([batch.energy for batch in loader]).tolist())
    assert energies == sorted(seed * 100.0 + i for seed, n in ((1, 3), (2, 2), (3, 4))
                              for i in range(n))


def test_first_shard_in_parts_equals_the_object(store):
    payload = os.urandom(3 << 20)
    store.put(BUCKET, "parts/big.pt", payload)
    source = RemoteSource(_url(store, "parts/big.pt"))
    (shard,) = source.list_shards()
    assert bytes(source.fetch_in_parts(shard, CancelToken(), 4)) == payload
    assert bytes(source.fetch(shard, CancelToken())) == payload


# ------------------------------------------------------------------ AtompackDataset
@pytest.mark.parametrize("prefetch_shards", [None, True])
def test_atompack_dataset_equals_local(store, atp_prefix, tmp_path, prefetch_shards):
    # by record through the page cache (default), or lazy verified whole-shard downloads
    local = AtompackDataset(atp_prefix)
    remote = AtompackDataset(_url(store, "atp/"), cache_dir=tmp_path / "cache",
                             prefetch_shards=prefetch_shards)
    assert len(remote) == len(local) == 9
    for got, want in zip(remote, local):
        assert set(got.keys()) == set(want.keys())
        for key, value in want:
            assert torch.equal(got[key], value), key
    if prefetch_shards:
        assert remote.reader.downloaded_shards() == [0, 1, 2]
    else:
        assert not (tmp_path / "root").exists()  # nothing downloaded whole
        assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["atp-meta", "pages"]


# ------------------------------------------------------------------ pickling and secrets
def test_pickled_source_carries_no_secret_and_still_fetches(store, pt_prefix):
    for options in (store.secret_options, {}):
        source = RemoteSource(_url(store, "pt/"), **options)
        shard = source.list_shards()[0]
        source.fetch(shard, CancelToken())  # a live client exists before pickling
        raw = pickle.dumps(source)
        for secret in store.secrets:
            assert secret.encode() not in raw
        clone = pickle.loads(raw)  # the environment's credentials serve the clone
        assert bytes(clone.fetch(shard, CancelToken())) == (pt_prefix / shard.name).read_bytes()


# ------------------------------------------------------------------ bad input
def test_wrong_bucket_and_wrong_key(store):
    scheme = store.scheme
    with pytest.raises(RemoteNotFoundError, match=rf"{scheme}://no-such-bucket/pt: bucket "
                                                  r"'no-such-bucket' does not exist"):
        RemoteSource(f"{scheme}://no-such-bucket/pt/")
    with pytest.raises(RemoteNotFoundError, match=rf"{scheme}://{BUCKET}/pt/nope\.pt: no such"):
        RemoteSource(_url(store, "pt/nope.pt"))
    with pytest.raises(RemoteNotFoundError, match=rf"{scheme}://{BUCKET}/void: no objects"):
        RemoteSource(_url(store, "void/"))
    with pytest.raises(RemoteNotFoundError, match=r"void/manifest\.json: no such object"):
        AtompackDataset(_url(store, "void/manifest.json"))


def test_manifest_naming_a_missing_shard(store):
    store.put(BUCKET, "orphan/manifest.json",
              json.dumps({"shards": [{"name": "gone.pt", "bytes": 3}]}).encode())
    store.put(BUCKET, "orphan/here.pt", b"abc")
    for url in (_url(store, "orphan/"), _url(store, "orphan/manifest.json")):
        with pytest.raises(RemoteNotFoundError, match=rf"{store.scheme}://{BUCKET}/orphan/"
                                                      r"gone\.pt: named by the manifest"):
            RemoteSource(url)


def test_sha256_mismatch_detected_and_nothing_cached(store, tmp_path):
    good = b"the right bytes"
    document = {"shards": [{"name": "a.pt", "bytes": len(good),
                            "sha256": hashlib.sha256(good).hexdigest()}]}
    store.put(BUCKET, "altered/manifest.json", json.dumps(document).encode())
    store.put(BUCKET, "altered/a.pt", b"the wrong bytes")
    with pytest.raises(ShardIntegrityError, match=r"shard a\.pt: sha256"):
        list(ShardStreamDataset(_url(store, "altered/"), prefetch=0))
    handle = ObjectStore(_url(store, "altered/"))
    (obj,) = handle.list()
    with pytest.raises(RemoteIntegrityError, match=rf"{store.scheme}://{BUCKET}/altered/a\.pt: "
                                                   r"sha256"):
        handle.download(obj, tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()
            and p.suffix != ".lock"] == []


# gcp-storage-emulator ignores ifGenerationMatch on media downloads (GCS answers 412),
# so the replaced-object check runs against the stores whose emulators enforce it
@pytest.mark.parametrize("store", ["s3", "az"], indirect=True)
def test_object_replaced_after_listing(store):
    store.put(BUCKET, "moving/a.pt", b"version one")
    source = RemoteSource(_url(store, "moving/"))
    store.put(BUCKET, "moving/a.pt", b"version two")
    with pytest.raises(RemoteIntegrityError, match=rf"{store.scheme}://{BUCKET}/moving/a\.pt: "
                                                   r"the object changed since it was listed"):
        source.fetch(source.list_shards()[0], CancelToken())


@pytest.mark.parametrize("store", ["s3", "az"], indirect=True)
def test_missing_credentials(store, pt_prefix, monkeypatch):
    use_store(monkeypatch, store, credentials=False)
    for make in (lambda: RemoteSource(_url(store, "pt/")),
                 lambda: AtompackDataset(_url(store, "pt/manifest.json"))):
        with pytest.raises(RemoteAuthError, match=rf"{store.scheme}://{BUCKET}/pt.*: no "
                                                  r"credentials found: set AZURE_STORAGE_|"
                                                  r"AWS_ACCESS_KEY_ID") as info:
            make()
        for secret in store.secrets:
            assert secret not in str(info.value)


@pytest.mark.parametrize("store", ["az"], indirect=True)
def test_azure_wrong_account_key_is_refused(store, monkeypatch):
    store.put(BUCKET, "key/a.pt", b"private")
    wrong = "d3Jvbmcta2V5LW5vdC10aGUtYWNjb3VudHMtb3duLWtleS0wMTIzNDU2Nzg5YWJjZGVm"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", store.connection_string(wrong))
    with pytest.raises(RemoteAuthError, match=rf"az://{BUCKET}/key: access denied "
                                              r"\(Authori[sz]ationFailure\)") as info:
        RemoteSource(f"az://{BUCKET}/key/", retry=FAST)
    assert wrong not in str(info.value)


# ------------------------------------------------------------------ faults on the wire
def test_unreachable_endpoint_bounded_retries(store):
    with pytest.raises(RemoteUnavailableError, match=rf"{store.scheme}://{BUCKET}/pt: giving "
                                                     r"up after 3 attempts: .*127\.0\.0\.1:9"
                                                     ) as info:
        RemoteSource(_url(store, "pt/"), retry=FAST,
                          **store.options_via("http://127.0.0.1:9"))
    for secret in store.secrets:
        assert secret not in str(info.value)


def test_dropped_transfer_resumes_by_range(store, proxy):
    payload = os.urandom(6 << 20)
    store.put(BUCKET, "resume/a.pt", payload)
    (obj,) = ObjectStore(_url(store, "resume/")).list()
    # a client of its own: every request through the relay on a new connection
    handle = ObjectStore(obj.url, retry=FAST, **store.options_via(proxy.endpoint_url))
    proxy.cut_next(after_bytes=5_000_000)  # past Azure's first 4 MiB GET
    buffer = bytearray(obj.size)
    handle.read_into(obj, buffer)
    assert bytes(buffer) == payload
    starts = [int(r.split("=")[1].split("-")[0]) for r in proxy.ranges]
    ends = [int(r.split("-")[1]) for r in proxy.ranges]
    assert starts[0] == 0 and max(ends) == obj.size - 1
    assert len(starts) >= 2 and starts.count(0) == 1  # resumed: the rest only


class _RecordingCancel(CancelToken):
    """A cancel token that records the backoff waits instead of sleeping them."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


def test_throttling_is_retried_under_the_one_policy(store, proxy):
    payload = os.urandom(100_000)
    store.put(BUCKET, "throttle/a.pt", payload)
    (obj,) = ObjectStore(_url(store, "throttle/a.pt")).list()
    handle = ObjectStore(obj.url, **store.options_via(proxy.endpoint_url),
                         retry=RetryPolicy(retries=3, backoff=0.01, jitter=0.0))
    proxy.fail_next(503, "SlowDown", times=2, retry_after=7)
    cancel = _RecordingCancel()
    buffer = bytearray(obj.size)
    handle.read_into(obj, buffer, cancel=cancel)
    assert bytes(buffer) == payload
    assert proxy.failed == 2 and len(proxy.ranges) == 3  # two throttled, one served
    assert cancel.waits == [7.0, 7.0]  # never shorter than the Retry-After


def test_refused_request_is_not_retried_and_names_the_url(store, proxy):
    # what a store answers a request without valid credentials (GCS: anonymous caller)
    store.put(BUCKET, "denied/a.pt", b"private")
    (obj,) = ObjectStore(_url(store, "denied/")).list()
    options = {**store.secret_options, **store.options_via(proxy.endpoint_url)}
    handle = ObjectStore(obj.url, retry=FAST, **options)
    proxy.fail_next(401, "Unauthorized", times=3)
    with pytest.raises(RemoteAuthError, match=rf"{store.scheme}://{BUCKET}/denied/a\.pt: "
                                              r"access denied") as info:
        handle.read_into(obj, bytearray(obj.size))
    assert proxy.failed == 1
    hint = {"s3": "AWS_ACCESS_KEY_ID", "gs": "GOOGLE_APPLICATION_CREDENTIALS",
            "az": "AZURE_STORAGE_CONNECTION_STRING"}[store.scheme]
    assert hint in str(info.value)
    for secret in store.secrets:
        assert secret not in str(info.value)
