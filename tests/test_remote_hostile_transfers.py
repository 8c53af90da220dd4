"""What a hostile server can and cannot make the transport do: credentials, sizes, pace, text.

Against real loopback servers (:mod:`tests.servers.hostile_http`, the range-capable
:class:`~tests.servers.http_server.ShardServer`) and the real clients: a credential never
reaches an origin it was not given for; no transfer takes more bytes than listed or outlives
its deadline; no URL secret appears in a ``repr`` or a message.
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest
import torch

from pyg_atompack import AtompackDataset
from pyg_atompack.hub import list_remote_files
from pyg_atompack.hub.errors import HubTransferError
from pyg_atompack.remote.backends import open_backend
from pyg_atompack.remote.manifest import ManifestError
from pyg_atompack.remote.record_reader import range_readers
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.stream.errors import ShardIntegrityError
from pyg_atompack.transport import (
    RemoteIntegrityError,
    RemoteUnavailableError,
    RetryPolicy,
    TransportError,
    UnsupportedURLError,
    bind_headers,
)
from pyg_atompack.transport import transfers as transport
from tests.big_atp import write_big_atp
from tests.servers.hostile_http import MAX_SENT, HostileServer
from tests.servers.http_server import ShardServer

FAST = RetryPolicy(retries=1, backoff=0.01, timeout=5.0, connect_timeout=2.0)
SECRET = "Bearer s3cr3t-t0ken"
COOKIE = "session=c00kie"


RECORDS = 64  # ~1.1 MB


@pytest.fixture(scope="module")
def shard_bytes(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("hostile")
    assert write_big_atp(root / "x.atp", RECORDS) == RECORDS
    return (root / "x.atp").read_bytes()


def _serve(shard_bytes: bytes):
    server = HostileServer({"x.atp": shard_bytes}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def hostile(shard_bytes):
    yield from _serve(shard_bytes)


@pytest.fixture
def other(shard_bytes):
    """A second origin (another port) that only ever logs what reaches it."""
    yield from _serve(shard_bytes)


def _manifest(entries: list[tuple[str, int]]) -> dict:
    return {"shards": [{"name": name, "bytes": size, "records": RECORDS}
                       for name, size in entries]}


# ---------------------------------------------------------------- credentials


def test_a_manifest_entry_on_another_origin_gets_no_credentials(hostile, other, shard_bytes):
    size = len(shard_bytes)
    hostile.set_document("manifest.json", _manifest(
        [(hostile.url("honest/x.atp"), size), (other.url("honest/x.atp"), size)]))
    headers = {"Authorization": SECRET, "Cookie": COOKIE, "X-Plain": "1"}
    source = RemoteSource(hostile.url("manifest/manifest.json"), headers=headers, retry=FAST)
    samples = list(ShardStreamDataset(source, shuffle=False))
    assert len(samples) == 2 * RECORDS
    assert {"authorization", "cookie", "x-plain"} <= set(hostile.headers_seen("x"))
    assert "x-plain" in other.headers_seen("x")  # the plain header travels, secrets do not
    assert not {"authorization", "cookie"} & set(other.headers_seen("x"))


def test_record_reads_and_listings_keep_credentials_at_the_users_origin(hostile, other,
                                                                          shard_bytes):
    size = len(shard_bytes)
    hostile.set_document("manifest.json", _manifest([(other.url("honest/x.atp"), size)]))
    url = hostile.url("manifest/manifest.json")
    readers = range_readers(url, headers={"Authorization": SECRET})
    dataset = AtompackDataset(readers[0].url)  # by record, from the other origin
    assert len(dataset) == RECORDS and dataset[RECORDS - 1].pos.shape[1] == 3
    for reader in readers:
        reader.read_into(0, memoryview(bytearray(16)))
    files = open_backend(url, headers={"Authorization": SECRET}).list()
    assert [f.size for f in files] == [size]
    assert "authorization" in hostile.headers_seen("x")
    assert "authorization" not in other.headers_seen("x")
    assert other.requests  # the other origin was read, without the token


def test_credentials_never_travel_over_plain_http_when_given_for_https():
    bound = bind_headers({"Authorization": SECRET}, "https://data.example.org/manifest.json")
    assert bound.for_url("https://data.example.org:443/a.atp")["Authorization"] == SECRET
    for elsewhere in ("http://data.example.org/a.atp", "https://data.example.org:8443/a.atp",
                      "https://cdn.example.org/a.atp", "https://data.example.org.evil/a.atp"):
        assert "Authorization" not in bound.for_url(elsewhere), elsewhere
    assert SECRET not in repr(bound)


def test_unbound_credentials_are_refused_by_the_transport(hostile):
    with pytest.raises(TypeError, match="bound to the origin"):
        transport.fetch(hostile.url("honest/x.atp"), policy=FAST,
                        headers={"Authorization": SECRET})
    assert hostile.requests == []  # refused before anything was sent


def test_a_pagination_link_to_another_host_is_refused(hostile, other):
    tree = [{"type": "file", "path": "a.atp", "size": 10, "oid": "0" * 40}]
    next_page = other.url("manifest/page2")
    hostile.set_document("api", tree, headers={"Link": f'<{next_page}>; rel="next"'})
    endpoint = hostile.url("").rstrip("/")
    with pytest.raises(HubTransferError, match="another origin"):
        list_remote_files("owner/name", "", revision="0" * 40, endpoint=endpoint,
                          token="hf_" + "x" * 20, policy=FAST)
    assert [path for path, _ in hostile.requests][0].startswith("/api/datasets/owner/name/tree")
    assert other.requests == []


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize("behaviour", ["oversize", "endless"])
def test_a_body_larger_than_listed_is_cut_off_at_the_listed_size(hostile, shard_bytes,
                                                                  behaviour):
    size = len(shard_bytes)
    hostile.set_document("manifest.json", _manifest([(hostile.url(f"{behaviour}/x.atp"), size)]))
    source = RemoteSource(hostile.url("manifest/manifest.json"), retry=FAST)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.monotonic()
    # oversize announces its length (refused before reading), endless does not (cut off)
    with pytest.raises(ShardIntegrityError, match="more than the .* bytes listed|announces"):
        list(ShardStreamDataset(source, shuffle=False, prefetch=0))
    assert time.monotonic() - began < 10
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 64, grown_mib  # a 256 MiB body was never held


def test_a_content_length_beyond_the_listing_is_refused_before_reading(hostile, shard_bytes):
    size = len(shard_bytes)
    with pytest.raises(RemoteIntegrityError, match=f"announces {MAX_SENT * 4} bytes where "
                                                   f"{size} are listed"):
        transport.fetch(hostile.url("lying-length/x.atp"), policy=FAST, size=size)
    with pytest.raises(RemoteIntegrityError, match="announces"):
        transport.fetch(hostile.url("oversize/x.atp"), policy=FAST, size=size)


def test_a_prefetched_download_never_writes_more_than_listed(hostile, shard_bytes, tmp_path,
                                                            monkeypatch):
    size = len(shard_bytes)
    hostile.set_document("manifest.json", _manifest([(hostile.url("endless/x.atp"), size)]))
    cache = tmp_path / "cache"
    dataset = AtompackDataset(hostile.url("manifest/manifest.json"), prefetch_shards=True,
                              cache_dir=cache)
    with pytest.raises(OSError, match="more than the .* bytes listed"):
        dataset[0]
    written = [p for p in cache.rglob("*") if p.is_file()]
    assert all(p.stat().st_size <= size for p in written), written
    assert not [p for p in written if p.name.endswith((".atp", ".incomplete"))]


def test_a_document_without_a_size_is_bounded(hostile, monkeypatch):
    monkeypatch.setattr(transport, "DOCUMENT_LIMIT", 1 << 20)
    with pytest.raises(RemoteIntegrityError, match="more than the 1048576 bytes"):
        transport.fetch(hostile.url("endless/x.atp"), policy=FAST, limit=1 << 20)


# ---------------------------------------------------------------- pace


def test_a_dripping_server_is_cut_off_by_the_deadline(hostile, shard_bytes):
    policy = RetryPolicy(retries=2, backoff=0.01, timeout=2.0, connect_timeout=1.0,
                         deadline=1.5)
    began = time.monotonic()
    with pytest.raises(RemoteUnavailableError, match="outlived its 1.5 s deadline after"):
        transport.fetch(hostile.url("drip/x.atp"), policy=policy, size=len(shard_bytes))
    assert time.monotonic() - began < 4  # the deadline, plus one drip interval


def test_the_derived_deadline_bounds_a_drip_under_the_read_timeout(hostile, shard_bytes):
    policy = RetryPolicy(retries=0, timeout=1.0, connect_timeout=0.5, min_speed=1 << 24)
    assert policy.deadline_for(len(shard_bytes)) < 2
    with pytest.raises(RemoteUnavailableError, match="deadline"):
        transport.fetch(hostile.url("drip/x.atp"), policy=policy, size=len(shard_bytes))


# ---------------------------------------------------------------- text


def test_reprs_and_messages_carry_no_url_secret(hostile, shard_bytes):
    size = len(shard_bytes)
    port = hostile.server_address[1]
    # manifest names never hold '..' (remote/cache.py): the shard is an absolute entry on
    # the same origin, secrets in its URL too
    hostile.set_document("manifest.json", _manifest(
        [(f"http://alice:pa55word@127.0.0.1:{port}/honest/x.atp?token=t0k3n", size)]))
    url = f"http://alice:pa55word@127.0.0.1:{port}/manifest/manifest.json?token=t0k3n&x=1"
    source = RemoteSource(url, retry=FAST)
    dataset = ShardStreamDataset(source)
    texts = [repr(source), repr(dataset)]
    broken = f"http://alice:pa55word@127.0.0.1:{port}/honest/x.atp?token=t0k3n"
    with pytest.raises(TransportError) as caught:
        RemoteSource(broken.replace("honest/x.atp", "manifest/missing.json"), retry=FAST)
    texts.append(str(caught.value))
    with pytest.raises(UnsupportedURLError) as caught:
        open_backend("ftp://alice:pa55word@host/x.atp?sig=t0k3n")
    texts.append(str(caught.value))
    with pytest.raises(TransportError) as caught:
        transport.fetch("http://alice:pa55word@[::1/x.atp?token=t0k3n", policy=FAST)
    texts.append(str(caught.value))
    for text in texts:
        assert "pa55word" not in text and "t0k3n" not in text, text


def test_a_malformed_url_is_an_error_of_the_family():
    for url in ("http://[::1/x.atp", "http://host:99999999/x.atp", "http://ho st/x.atp"):
        with pytest.raises(TransportError):
            transport.fetch(url, policy=FAST)


# ---------------------------------------------------------------- single files


def test_a_single_file_url_is_streamed_by_record_blocks(tmp_path):
    records = write_big_atp(tmp_path / "big.atp", 2048)  # ~36 MB
    server = ShardServer(tmp_path).start()
    try:
        url = server.url("big.atp")
        dataset = ShardStreamDataset(url, options=SourceOptions(block_bytes=4 << 20), prefetch=2,
                                     shuffle=False)
        assert dataset.source.list_shards()[0].size == os.path.getsize(tmp_path / "big.atp")
        seen = []
        for index, sample in enumerate(dataset):
            if index == 0:  # the first sample came after a block, not the file
                fetched = sum(r.body_bytes for r in server.requests_for("big.atp", 0.5))
                assert fetched <= 3 * (4 << 20) + (1 << 20), fetched
            seen.append(int(sample.energy.item()))
    finally:
        server.stop()
    assert sorted(seen) == list(range(records))
    assert torch.is_tensor(sample.pos)


def test_a_malformed_manifest_is_a_clear_error_naming_it(hostile):
    hostile.documents["manifest.json"] = (b'{"shards": ' + json.dumps("x").encode() + b"}", {})
    with pytest.raises(ManifestError, match="manifest.json: 'shards' must be a list"):
        RemoteSource(hostile.url("manifest/manifest.json"), retry=FAST)
