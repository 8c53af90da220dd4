"""HTTP(S) range reads are pinned to the server's version of a file (ETag / Last-Modified).

A file rewritten in place under the same URL, while a manifest still names its old
sha256, must neither be served from the caches of its old version nor be read as a
splice of two versions. Against the loopback :class:`~tests.servers.http_server.ShardServer`,
which sends ``ETag`` and ``Last-Modified`` as nginx derives them.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from pyg_atompack import AtompackDataset
from pyg_atompack.remote import atp_meta
from pyg_atompack.remote.ranges import URLRangeReader
from pyg_atompack.stream import CancelToken, RemoteSource, ShardStreamDataset, SourceOptions
from pyg_atompack.transport import RemoteIntegrityError, RetryPolicy, transfers
from pyg_atompack.transport.buffers import ShardBuffer, ShardPart
from tests.big_atp import write_big_atp, write_manifest
from tests.servers.http_server import ShardServer

RECORDS = 192  # ~3.3 MB
NAME = "data.atp"
HEADER_RANGE = "bytes=0-8191"


@pytest.fixture
def served(tmp_path, monkeypatch):
    root = tmp_path / "srv"
    root.mkdir()
    write_manifest(root, [NAME], [write_big_atp(root / NAME, RECORDS, compression="zstd")])
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "root"))
    atp_meta._MEMORY.clear()  # metadata from the disk cache or the server only
    server = ShardServer(root).start()
    try:
        yield root, server
    finally:
        server.stop()


def _rewrite(path, flip_at: float) -> bytes:
    """The same size, other bytes, a later modification time: a new ETag."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * flip_at)] ^= 0x40
    path.write_bytes(bytes(data))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    return bytes(data)


def test_caches_follow_a_rewritten_file_despite_a_stale_manifest(served, tmp_path):
    root, server = served
    url = server.url("manifest.json")
    first = AtompackDataset(url, cache_dir=tmp_path / "cache")
    reader = first.reader.shards[0].range_reader if hasattr(first.reader, "shards") else \
        first.reader.range_reader
    assert reader.identity.startswith("sha256:") and '|"' in reader.identity  # + ETag
    old = [np.asarray(first[i].pos) for i in range(RECORDS)]  # every page cached
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / NAME).write_bytes(_rewrite(root / NAME, 0.5))  # manifest untouched
    headers_before = sum(r.range == HEADER_RANGE for r in server.requests_for(NAME))
    second = AtompackDataset(url, cache_dir=tmp_path / "cache")
    local = AtompackDataset(tmp_path / "v2" / NAME)
    differs = 0
    for i in range(RECORDS):  # the new version's metadata and pages, not the cached ones
        got, want = second[i], local[i]
        for key in ("pos", "z", "forces"):
            assert torch.equal(getattr(got, key), getattr(want, key)), (i, key)
        differs += not np.array_equal(old[i], want.pos.numpy())
    assert differs <= 1  # the flipped byte lies in one record (or in padding)
    assert sum(r.range == HEADER_RANGE for r in server.requests_for(NAME)) == \
        headers_before + 1  # the rewritten file's metadata again


def test_a_file_rewritten_mid_read_is_refused_not_spliced(served, tmp_path):
    root, server = served
    url = server.url("manifest.json")
    dataset = AtompackDataset(url, cache_dir=tmp_path / "cache")
    assert float(dataset[0].energy) == 0.0
    stream = ShardStreamDataset(RemoteSource(url),
                                options=SourceOptions(blocks=True, block_bytes=256 << 10,
                                                      cache_dir=tmp_path / "blocks"), prefetch=0,
                                shuffle=False)
    samples = iter(stream)
    assert float(next(samples).energy) == 0.0  # the first block is in
    _rewrite(root / NAME, 0.9)
    with pytest.raises(RemoteIntegrityError, match=rf"{url.rsplit('/', 1)[0]}/{NAME}: the file "
                                                   r"changed since it was opened"):
        dataset[RECORDS - 1]  # a page not cached yet
    with pytest.raises(RemoteIntegrityError, match=r"changed since it was opened"):
        list(samples)  # the next blocks


def test_the_version_travels_with_a_pickled_reader(served):
    root, server = served
    reader = URLRangeReader(server.url(NAME), size=(root / NAME).stat().st_size)
    identity = reader.identity  # one probe: a one-byte range request
    probes = [r for r in server.requests_for(NAME) if r.range == "bytes=0-0"]
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.identity == identity  # no second probe in the worker
    assert [r for r in server.requests_for(NAME) if r.range == "bytes=0-0"] == probes
    out = bytearray(64)
    clone.read_into(1000, memoryview(out))
    assert bytes(out) == (root / NAME).read_bytes()[1000:1064]
    wrong = URLRangeReader(server.url(NAME), size=(root / NAME).stat().st_size + 1)
    with pytest.raises(RemoteIntegrityError, match=r"data\.atp: the server has \d+ bytes, the "
                                                   r"listing says"):
        _ = wrong.identity


def _replace(path, flip_at: float) -> None:
    """Rewrite ``path`` as a new file (a new inode): a response already reading the
    old one goes on sending the old bytes, as a server does."""
    fresh = path.with_suffix(".new")
    fresh.write_bytes(path.read_bytes())
    _rewrite(fresh, flip_at)
    os.replace(fresh, path)


def test_a_resumed_download_of_a_rewritten_file_is_refused_not_spliced(served):
    root, server = served
    size = (root / NAME).stat().st_size
    gate = server.hold(NAME, size // 4)
    server.add_fault(NAME, "truncate", at_fraction=0.5)  # the connection ends halfway
    sink = ShardBuffer(NAME)
    failure: list[BaseException] = []

    def download() -> None:
        try:
            transfers.fill(server.url(NAME), sink, policy=RetryPolicy(backoff=0.01))
        except BaseException as error:  # noqa: BLE001 - asserted below
            failure.append(error)

    worker = threading.Thread(target=download)
    worker.start()
    while len(sink) == 0:  # the first answer (old version) is being received
        time.sleep(0.01)
    _replace(root / NAME, 0.75)  # rewritten before the transfer resumes
    gate.set()
    worker.join(60)
    assert [type(error) for error in failure] == [RemoteIntegrityError], failure
    assert "changed since it was opened" in str(failure[0])
    assert [r.range for r in server.requests_for(NAME)][1].startswith("bytes=")  # resumed


def test_the_ranges_of_one_download_come_from_one_version(served):
    root, server = served
    size = (root / NAME).stat().st_size
    url = server.url(NAME)
    buffer = bytearray(size)
    pin = transfers.VersionPin()
    policy = RetryPolicy()
    transfers.fill(url, ShardPart(buffer, 0, size // 2), policy=policy, pin=pin)
    _replace(root / NAME, 0.75)
    with pytest.raises(RemoteIntegrityError, match=r"changed since it was opened"):
        transfers.fill(url, ShardPart(buffer, size // 2, size), policy=policy, pin=pin)
    # a download of its own takes the new version whole
    fresh = bytearray(size)
    transfers.fill(url, ShardPart(fresh, 0, size), policy=policy)
    assert bytes(fresh) == (root / NAME).read_bytes()


def test_a_file_of_another_size_than_listed_is_refused_at_once(served):
    """Parts of a file that shrank since it was listed: the Content-Range total says so,
    and the transfer stops with an integrity error after one request a part instead of
    retrying the short ranges (and the HTTP 416 beyond the end) as dropped connections."""
    root, server = served
    size = (root / NAME).stat().st_size
    (root / "listing.json").write_text(json.dumps({"shards": [{"name": NAME, "bytes": size}]}))
    policy = RetryPolicy(retries=3, backoff=0.01, timeout=10.0)
    source = RemoteSource(server.url("listing.json"), suffixes=None, retry=policy)
    (root / NAME).write_bytes((root / NAME).read_bytes()[: size // 2])
    with pytest.raises(RemoteIntegrityError, match=rf"size {size // 2} bytes, expected {size}"):
        source.fetch_in_parts(source.list_shards()[0], CancelToken(), 2)
    assert len(server.requests_for(NAME)) <= 2  # no retries
