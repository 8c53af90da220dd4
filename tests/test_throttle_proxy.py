"""The benchmarks' throttling reverse proxy forwards requests faithfully (real servers)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from servers.http_server import serve_directory
from servers.throttle_proxy import ThrottleProxy


@pytest.fixture
def proxied(tmp_path):
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 400)  # 100 KiB
    for upstream in serve_directory(tmp_path):
        proxy = ThrottleProxy(upstream.base_url, bandwidth=50e6).start()
        try:
            yield upstream, proxy
        finally:
            proxy.stop()


def test_forwards_whole_and_ranged_gets(proxied):
    upstream, proxy = proxied
    expected = bytes(range(256)) * 400
    with urllib.request.urlopen(f"{proxy.base_url}/blob.bin") as answer:
        assert answer.status == 200 and answer.read() == expected
    request = urllib.request.Request(f"{proxy.base_url}/blob.bin",
                                     headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 206
        assert answer.headers["Content-Range"] == f"bytes 10-19/{len(expected)}"
        assert answer.read() == expected[10:20]
    assert [r.range for r in upstream.requests] == [None, "bytes=10-19"]
    assert proxy.body_bytes == len(expected) + 10


def test_forwards_errors(proxied):
    _, proxy = proxied
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{proxy.base_url}/missing.bin")
    assert caught.value.code == 404


def test_s3_round_trip_through_proxy_to_moto():
    import boto3  # the bench extra, installed by `make venv`
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    proxy = ThrottleProxy(f"http://{host}:{port}", bandwidth=50e6).start()
    try:
        client = boto3.client("s3", endpoint_url=proxy.base_url, region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket="bench")
        client.put_object(Bucket="bench", Key="k/one", Body=b"x" * 5000)
        assert client.head_object(Bucket="bench", Key="k/one")["ContentLength"] == 5000
        assert client.get_object(Bucket="bench", Key="k/one")["Body"].read() == b"x" * 5000
        listed = client.list_objects_v2(Bucket="bench", Prefix="k/")["Contents"]
        assert [entry["Key"] for entry in listed] == ["k/one"]
    finally:
        proxy.stop()
        moto.stop()
