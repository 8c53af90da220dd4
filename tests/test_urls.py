"""URLs everywhere, one rule: datasets, sources and the CLI over http(s):// and hf://.

Real servers on 127.0.0.1: the fault-injecting file server (plain HTTP), the fake Hub,
and a real forward proxy (proxy.py) in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers.fake_hub import serve_fake_hub, write_reference_shard
from servers.forward_proxy import serve_proxy
from servers.http_server import serve_directory, write_manifest, write_pt_shards

from pyg_atompack import AtompackDataset, hub
from pyg_atompack.cli import main
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, open_source
from pyg_atompack.transport import (
    RemoteIntegrityError,
    RemoteNotFoundError,
    RetryPolicy,
    TransportError,
    UnsupportedURLError,
)

TESTS_DIR = Path(__file__).resolve().parent
FAST = RetryPolicy(retries=2, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=5.0,
                   connect_timeout=2.0)


@pytest.fixture(scope="module")
def www(tmp_path_factory) -> Path:
    """Two .atp shards and their manifest, plus .pt shards in pt/."""
    root = tmp_path_factory.mktemp("www")
    write_reference_shard(root / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(root / "part_1.atp", 4, 3, seed=2)
    write_manifest(root, ["part_0.atp", "part_1.atp"], [3, 4])
    (root / "pt").mkdir()
    write_pt_shards(root / "pt", [2, 3])
    return root


@pytest.fixture
def server(www):
    yield from serve_directory(www)


def _energies(dataset) -> list[float]:
    return [float(dataset[i].energy) for i in range(len(dataset))]


def _full_downloads(server) -> list[str]:
    return sorted(e.path for e in server.requests if e.range is None and e.path.endswith(".atp"))


def test_atompack_dataset_over_http_is_lazy_and_verified(server, www, tmp_path, monkeypatch):
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "cache"))
    local = AtompackDataset(www)
    # by default plain HTTP(S) is read record by record through the page cache
    for url in (server.url("manifest.json"), server.base_url + "/"):
        by_record = AtompackDataset(url, cache_dir=tmp_path / "pages")
        assert _energies(by_record) == _energies(local)
    assert _full_downloads(server) == []
    # prefetch_shards=True: whole shards, downloaded when first read and verified
    for url in (server.url("manifest.json"), server.base_url + "/"):
        dataset = AtompackDataset(url, prefetch_shards=True)
        assert len(dataset) == 7
        assert "127.0.0.1" in repr(dataset)
    assert _full_downloads(server) == []  # opening read only manifest and header ranges
    assert _energies(dataset) == _energies(local)
    assert _full_downloads(server) == ["/part_0.atp", "/part_1.atp"]
    again = AtompackDataset(server.url("manifest.json"), prefetch_shards=True)
    assert _energies(again) == _energies(local)
    assert _full_downloads(server) == ["/part_0.atp", "/part_1.atp"]  # verified cache reused
    single = AtompackDataset(server.url("part_1.atp"))
    assert _energies(single) == _energies(AtompackDataset(www / "part_1.atp"))


def test_opening_a_url_listing_reads_one_header_range_per_shard(server, www, tmp_path):
    from pyg_atompack.remote import atp_meta

    atp_meta._MEMORY.clear()
    reader = hub.open_remote_atp(server.url("manifest.json"), cache_dir=tmp_path, policy=FAST)
    # the manifest, then one range of the header slots per shard: no probe of a version
    # first (the first read's answer names it)
    assert sorted((e.path, e.range) for e in server.requests) == [
        ("/manifest.json", None), ("/part_0.atp", "bytes=0-8191"),
        ("/part_1.atp", "bytes=0-8191")]
    assert len(reader) == 7
    server.requests.clear()
    assert reader.n_atoms.tolist() == [2] * 3 + [3] * 4
    assert "forces" in reader.fields
    # then one range per shard for the counts and fields: schema and index together
    assert sorted(e.path for e in server.requests) == ["/part_0.atp", "/part_1.atp"]
    assert not [e for e in server.requests if e.range is None or e.range.startswith("bytes=0-")]
    # a reopening reads the manifest and the headers again (no listing cache for plain
    # URLs), but the counts and fields come from the metadata cached on disk
    atp_meta._MEMORY.clear()
    server.requests.clear()
    again = hub.open_remote_atp(server.url("manifest.json"), cache_dir=tmp_path, policy=FAST)
    assert again.n_atoms.tolist() == reader.n_atoms.tolist() and "forces" in again.fields
    assert sorted(e.path for e in server.requests) == ["/manifest.json", "/part_0.atp",
                                                       "/part_1.atp"]


def test_a_server_ignoring_ranges_still_serves_headers_metadata_and_records(www, tmp_path):
    # every range read falls back to the front of the whole body, cut off there
    local = AtompackDataset(www)
    for ignoring in serve_directory(www, ignore_ranges=True):
        url = ignoring.url("manifest.json")
        reader = hub.open_remote_atp(url, cache_dir=tmp_path / "a", policy=FAST)
        assert reader.n_atoms.tolist() == [2] * 3 + [3] * 4 and "forces" in reader.fields
        by_record = AtompackDataset(url, cache_dir=tmp_path / "b")
        assert _energies(by_record) == _energies(local)
        assert {e.status for e in ignoring.requests} == {200}


def test_altered_or_missing_shard_is_one_error_naming_the_url(server, www, tmp_path):
    reader = hub.open_remote_atp(server.url("manifest.json"), cache_dir=tmp_path, policy=FAST)
    server.add_fault("part_1.atp", "wrong_bytes", times=1, at_fraction=0.9)
    with pytest.raises(RemoteIntegrityError, match=r"http://127\.0\.0\.1:\d+/part_1\.atp.*sha256"):
        reader[5]
    assert not [p for p in tmp_path.rglob("*")
                if p.is_file() and "blobs" in p.parts and p.suffix != ".lock"]
    assert float(reader[5].energy) == 202.0  # the next download is good and verified
    server.add_fault("part_0.atp", "truncate", times=3)
    with pytest.raises(TransportError, match=r"part_0\.atp.*after 3 attempts"):
        reader[0]
    missing = hub.open_remote_atp(server.url("manifest.json"), cache_dir=tmp_path / "b",
                                  policy=FAST)
    (www / "part_0.atp").rename(www / "gone.atp")
    try:
        with pytest.raises(RemoteNotFoundError, match=r"part_0\.atp.*HTTP 404"):
            missing[0]
        statuses = [e.status for e in server.requests_for("part_0.atp")]
        assert statuses.count(404) == 1 and statuses[-1] == 404  # permanent: not retried
    finally:
        (www / "gone.atp").rename(www / "part_0.atp")


def test_unreachable_host_and_bad_urls(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{port}/manifest\.json.*3 attempts"):
        hub.open_remote_atp(f"http://127.0.0.1:{port}/manifest.json", cache_dir=tmp_path,
                            policy=FAST)
    for bad in ("ftp://host/data.atp", "file:///tmp/x.atp"):
        with pytest.raises(UnsupportedURLError, match=r"unsupported URL scheme .*hf://.*s3://"):
            AtompackDataset(bad)
        with pytest.raises(UnsupportedURLError, match="unsupported URL scheme"):
            open_source(bad)
    with pytest.raises(UnsupportedURLError, match="manifest.json"):
        open_source("http://127.0.0.1:9/data/table.csv")


def test_object_store_scheme_without_backend_says_what_to_install(monkeypatch):
    import fsspec

    def absent(protocol):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(fsspec, "get_filesystem_class", absent)  # as if s3fs were missing
    for opener in (AtompackDataset, open_source, ShardStreamDataset):
        with pytest.raises(UnsupportedURLError, match=r"s3://.*pip install s3fs"):
            opener("s3://bucket/prefix/")


def test_open_source_and_stream_dataset_take_urls(server, www):
    pt = server.base_url + "/pt/"
    source = open_source(pt, retry=FAST)
    assert isinstance(source, RemoteSource) and len(source.list_shards()) == 2
    ids = [int(s.sample_id) for s in ShardStreamDataset(pt + "manifest.json")]
    assert ids == [0, 1, 1000, 1001, 1002]
    single = ShardStreamDataset(server.url("pt/shard-0001.pt"))
    assert [int(s.sample_id) for s in single] == [1000, 1001, 1002]
    for fake in serve_fake_hub():
        sha = fake.commit("org/urls", {"d/a.atp": (www / "part_0.atp").read_bytes(),
                                       "d/b.pt": (www / "pt" / "shard-0000.pt").read_bytes(),
                                       "d/notes.txt": b"not a shard"})
        source = open_source(f"hf://datasets/org/urls@{sha}/d", endpoint=fake.endpoint)
        assert isinstance(source, RemoteSource) and source.backend.revision == sha
        assert [s.name for s in source.list_shards()] == ["a.atp", "b.pt"]
        one = open_source("hf://datasets/org/urls/d/b.pt", endpoint=fake.endpoint)
        assert [s.name for s in one.list_shards()] == ["b.pt"]


def test_cli_on_urls_reads_only_what_it_needs(server, www, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "cache"))
    url = server.url("manifest.json")
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert "structures: 7" in out and "shards: 2" in out and "energy" in out
    assert "part_1.atp: 4 records" in out
    assert _full_downloads(server) == []  # info never downloads a shard
    assert main(["head", url, "-n", "2"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2
    assert _full_downloads(server) == ["/part_0.atp"]  # only the shard holding them
    assert main(["verify", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["info", "ftp://host/x.atp"]) == 2
    assert "unsupported URL scheme ftp://" in capsys.readouterr().err


def test_every_shard_request_goes_through_the_proxy(www, tmp_path):
    """HTTP_PROXY set and NO_PROXY empty: plain HTTP shards and Hub/CDN reads all pass
    through a real forward proxy (asserted from the proxy's access log)."""
    for proxy in serve_proxy(tmp_path):
        for server in serve_directory(www):
            for fake in serve_fake_hub():
                sha = fake.commit("org/proxied", {"train/a.atp": (www / "part_0.atp").read_bytes(),
                                                  "train/b.atp": (www / "part_1.atp").read_bytes()})
                script = (
                    "import sys\n"
                    "from pyg_atompack import AtompackDataset\n"
                    "from pyg_atompack.stream import ShardStreamDataset\n"
                    "ids = [int(s.sample_id) for s in ShardStreamDataset(sys.argv[1])]\n"
                    "hub = AtompackDataset(sys.argv[2])\n"
                    "print(ids, [float(hub[i].energy) for i in (0, 6)])\n"
                )
                env = fake.subprocess_env()
                env.update({"HTTP_PROXY": proxy.url, "HTTPS_PROXY": proxy.url, "NO_PROXY": "",
                            "no_proxy": "", "HF_TOKEN": "hf_proxied_user",
                            "PYG_ATOMPACK_CACHE": str(tmp_path / "cache"),
                            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR.parent),
                                                           os.environ.get("PYTHONPATH", "")])})
                result = subprocess.run(
                    [sys.executable, "-c", script, server.url("pt/manifest.json"),
                     f"hf://datasets/org/proxied@{sha}/train"],
                    env=env, capture_output=True, text=True, timeout=180)
                assert result.returncode == 0, result.stderr
                assert result.stdout.split("]")[0] == "[0, 1, 1000, 1001, 1002"
                assert "[100.0, 203.0]" in result.stdout
                seen = proxy.seen()
                proxied = [target.split("/", 1)[1].split("?")[0] for _, target in seen]
                # from the proxy's side: every request the servers answered went through it,
                # one forwarded request per request answered
                answered = [e.path.lstrip("/") for e in server.requests] + \
                    [r.path.lstrip("/") for r in fake.requests]
                assert sorted(proxied) == sorted(answered)
                assert any(r.origin == "cdn" for r in fake.requests)
                assert any(p.endswith(".pt") for p in proxied)
