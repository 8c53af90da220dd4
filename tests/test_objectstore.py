"""S3-only object-store behaviour against a real S3-compatible server (moto, loopback).

What every store does alike (listing, streaming with forked workers, AtompackDataset,
secrets, bad input, resume, throttling) runs for s3://, gs:// and az:// in
``tests/test_objectstore_stores.py``; here: anonymous buckets, profiles, endpoint
variables, stalls, manifests' field checks, and a missing backend package. The moto
server is the test process's (``servers/stores.py``); shards are uploaded with boto3;
faults come from a TCP relay in front of it (``servers/tcp_proxy.py``).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading

import pytest
from servers.http_server import write_pt_shards
from servers.moto_s3 import ACCESS_KEY, SECRET_KEY, SESSION_TOKEN
from servers.stores import use_store
from servers.tcp_proxy import ThrottlingProxy

from pyg_atompack.remote.objectstore import ObjectStore
from pyg_atompack.stream import (
    CancelToken,
    RemoteSource,
    ShardStreamDataset,
    SourceOptions,
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

BUCKET = "atompack-test"
FAST = RetryPolicy(retries=2, backoff=0.01, jitter=0.0)
PT_SIZES = [5, 3, 4, 6]


@pytest.fixture(scope="module")
def server(store_servers):
    moto = store_servers("s3")  # the test process's moto server (servers/stores.py)
    moto.create_bucket(BUCKET)
    return moto


@pytest.fixture(autouse=True)
def aws_env(server, monkeypatch):
    use_store(monkeypatch, server)


@pytest.fixture(scope="module")
def pt_prefix(server, tmp_path_factory):
    """``.pt`` shards with the converter's manifest at ``s3://BUCKET/pt/``."""
    root = tmp_path_factory.mktemp("pt")
    write_pt_shards(root, PT_SIZES)
    server.upload_directory(root, BUCKET, "pt")
    return root


# ------------------------------------------------------------------ pickling and secrets
def test_pickled_source_carries_no_nested_secret_and_still_fetches(pt_prefix):
    nested = RemoteSource(f"s3://{BUCKET}/pt/", client_kwargs={
        "aws_access_key_id": ACCESS_KEY, "aws_secret_access_key": SECRET_KEY,
        "aws_session_token": SESSION_TOKEN, "region_name": "us-east-1"})
    for source in (nested,):
        shard = source.list_shards()[0]
        source.fetch(shard, CancelToken())  # a live client exists before pickling
        raw = pickle.dumps(source)
        assert SECRET_KEY.encode() not in raw
        assert SESSION_TOKEN.encode() not in raw
        clone = pickle.loads(raw)  # the environment's credentials serve the clone
        assert bytes(clone.fetch(shard, CancelToken())) == (pt_prefix / shard.name).read_bytes()


def test_anonymous_access(server, pt_prefix, monkeypatch):
    client = server.client()
    client.create_bucket(Bucket="public-shards", ACL="public-read")
    client.put_object(Bucket="public-shards", Key="p/a.pt", Body=b"open data", ACL="public-read")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    source = RemoteSource("s3://public-shards/p/", anon=True)
    assert bytes(source.fetch(source.list_shards()[0], CancelToken())) == b"open data"
    # a private object stays private to unsigned requests
    with pytest.raises(RemoteAuthError, match=r"s3://atompack-test/pt/manifest\.json: access "
                                              r"denied"):
        RemoteSource(f"s3://{BUCKET}/pt/", anon=True)


# ------------------------------------------------------------------ bad input
def test_bad_manifest_field_names_entry_and_field(server):
    document = {"shards": [{"name": "a.pt", "sha256": 5}]}
    server.client().put_object(Bucket=BUCKET, Key="badman/manifest.json",
                               Body=json.dumps(document).encode())
    server.client().put_object(Bucket=BUCKET, Key="badman/a.pt", Body=b"abc")
    with pytest.raises(TransportError, match=r"badman/manifest\.json: shards\[0\] \(a\.pt\): "
                                             r"'sha256' must be str"):
        RemoteSource(f"s3://{BUCKET}/badman/")


def test_manifest_size_mismatch_is_refused_at_listing(server):
    document = {"shards": [{"name": "a.pt", "bytes": 99}]}
    server.client().put_object(Bucket=BUCKET, Key="short/manifest.json",
                               Body=json.dumps(document).encode())
    server.client().put_object(Bucket=BUCKET, Key="short/a.pt", Body=b"abc")
    with pytest.raises(RemoteIntegrityError, match=r"s3://atompack-test/short/a\.pt: the "
                                                   r"bucket lists 3 bytes.*says 99"):
        RemoteSource(f"s3://{BUCKET}/short/")


def test_unsupported_urls():
    with pytest.raises(UnsupportedURLError, match=r"ftp://x/y: not an object-store URL"):
        ObjectStore("ftp://x/y")
    with pytest.raises(UnsupportedURLError, match=r"carry no user info") as info:
        ObjectStore(f"s3://{ACCESS_KEY}:{SECRET_KEY}@{BUCKET}/pt/")
    assert SECRET_KEY not in str(info.value)


@pytest.mark.parametrize("url, package, extra", [("gs://some-bucket/shards/", "gcsfs", "gcs"),
                                                 ("az://some-container/shards/", "adlfs",
                                                  "azure")])
def test_scheme_without_its_package_names_the_package(url, package, extra):
    # a fresh interpreter in which the backend package cannot be imported
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "from pyg_atompack import AtompackDataset\n"
            "from pyg_atompack.stream import ShardStreamDataset\n"
            "for make in (AtompackDataset, ShardStreamDataset):\n"
            "    try:\n"
            f"        make({url!r})\n"
            "    except Exception as error:\n"
            "        print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=600)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout + result.stderr
    scheme = url.split(":")[0]
    for line in lines:
        assert line.startswith(f"UnsupportedURLError {url.rstrip('/')}: {scheme}:// needs the "
                               f"optional package {package!r} (pip install {package}, or pip "
                               f"install 'pyg_atompack[{extra}]')"), line


# ------------------------------------------------------------------ faults on the wire
@pytest.fixture
def proxy(server):
    relay = ThrottlingProxy(server.port).start()
    yield relay
    relay.stop()


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


def test_retries_argument_of_the_stream_sets_the_store_policy(pt_prefix):
    source = RemoteSource(f"s3://{BUCKET}/pt/", retry=FAST)
    dataset = ShardStreamDataset(source, options=SourceOptions(retries=0))
    assert dataset.source.retry.retries == 0 and dataset.source.backend.retry.retries == 0
    assert source.retry is FAST and source.backend.retry is FAST  # the original is untouched


def test_endpoint_for_s3_wins_over_the_generic_one(pt_prefix, server, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.endpoint_url)
    assert len(RemoteSource(f"s3://{BUCKET}/pt/").list_shards()) == len(PT_SIZES)


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
def test_named_profile_from_the_shared_credentials_file(pt_prefix, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    credentials = tmp_path / "credentials"
    credentials.write_text(f"[shards]\naws_access_key_id = {ACCESS_KEY}\n"
                           f"aws_secret_access_key = {SECRET_KEY}\n", encoding="utf-8")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    source = RemoteSource(f"s3://{BUCKET}/pt/", profile="shards")
    assert len(source.list_shards()) == len(PT_SIZES)
    assert SECRET_KEY.encode() not in pickle.dumps(source)
    monkeypatch.setenv("AWS_PROFILE", "shards")  # the same through the environment
    assert len(RemoteSource(f"s3://{BUCKET}/pt/").list_shards()) == len(PT_SIZES)


def test_transport_module_is_torch_free():
    code = ("import sys, pyg_atompack.remote.objectstore as m; "
            "m.ObjectStore('s3://b/p/'); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
