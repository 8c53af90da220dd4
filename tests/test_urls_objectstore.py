"""The one URL rule over object stores: s3://, gs:// and az:// URLs given to
AtompackDataset, ShardStreamDataset, open_source and the CLI, against each store's real
server on 127.0.0.1 (``tests/servers/stores.py``)."""

from __future__ import annotations

import pytest
from servers.fake_hub import write_reference_shard
from servers.http_server import write_pt_shards
from servers.stores import STORES, use_store

from pyg_atompack import AtompackDataset
from pyg_atompack.cli import main
from pyg_atompack.stream import RemoteSource, ShardStreamDataset, open_source

BUCKET = "url-rule"


@pytest.fixture(params=STORES)
def store(request, store_servers, monkeypatch, tmp_path):
    server = store_servers(request.param)
    server.create_bucket(BUCKET)
    use_store(monkeypatch, server)
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "cache"))
    return server


def test_object_store_urls_everywhere(store, tmp_path, capsys):
    atp_dir, pt_dir = tmp_path / "atp", tmp_path / "pt"
    write_reference_shard(atp_dir / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(atp_dir / "part_1.atp", 4, 3, seed=2)
    pt_dir.mkdir()
    write_pt_shards(pt_dir, [2, 3])
    store.upload_directory(atp_dir, BUCKET, "atp")
    store.upload_directory(pt_dir, BUCKET, "pt")
    url = f"{store.scheme}://{BUCKET}/atp/"

    local = AtompackDataset(atp_dir)
    by_record = AtompackDataset(url, cache_dir=tmp_path / "pages")
    assert [float(by_record[i].energy) for i in range(7)] == \
        [float(local[i].energy) for i in range(7)]
    assert not (tmp_path / "cache").exists()  # no shard downloaded whole
    dataset = AtompackDataset(url, prefetch_shards=True)
    assert dataset.reader.downloaded_shards() == []  # opened from header range reads
    assert len(dataset) == len(local) == 7
    assert [float(dataset[i].energy) for i in range(7)] == \
        [float(local[i].energy) for i in range(7)]
    assert dataset.reader.downloaded_shards() == [0, 1]

    source = open_source(f"{store.scheme}://{BUCKET}/pt/")
    assert isinstance(source, RemoteSource)
    ids = [int(s.sample_id) for s in ShardStreamDataset(f"{store.scheme}://{BUCKET}/pt/")]
    assert ids == [0, 1, 1000, 1001, 1002]

    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert "structures: 7" in out and "part_1.atp: 4 records" in out
    assert main(["head", url, "-n", "4"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
    assert main(["verify", url]) == 0
    assert capsys.readouterr().out.strip() == \
        f"OK {url}: 7 structures decoded, all checks passed"
