"""The one URL rule over an object store: s3:// URLs given to AtompackDataset,
ShardStreamDataset, open_source and the CLI, against moto's S3 server on 127.0.0.1."""

from __future__ import annotations

import os

import pytest
from servers.fake_hub import write_reference_shard
from servers.http_server import write_pt_shards
from servers.moto_s3 import MotoS3Server, s3_environment

from pyg_atompack import AtompackDataset
from pyg_atompack.cli import main
from pyg_atompack.stream import ObjectStoreSource, ShardStreamDataset, open_source

BUCKET = "url-rule"


@pytest.fixture(scope="module")
def moto():
    with MotoS3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(autouse=True)
def aws_env(moto, monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in s3_environment(moto.endpoint_url).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYG_ATOMPACK_HUB_CACHE", str(tmp_path / "cache"))


def test_s3_urls_everywhere(moto, tmp_path, capsys):
    atp_dir, pt_dir = tmp_path / "atp", tmp_path / "pt"
    write_reference_shard(atp_dir / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(atp_dir / "part_1.atp", 4, 3, seed=2)
    pt_dir.mkdir()
    write_pt_shards(pt_dir, [2, 3])
    moto.upload_directory(atp_dir, BUCKET, "atp")
    moto.upload_directory(pt_dir, BUCKET, "pt")

    local = AtompackDataset(atp_dir)
    by_record = AtompackDataset(f"s3://{BUCKET}/atp/", cache_dir=tmp_path / "pages")
    assert [float(by_record[i].energy) for i in range(7)] == \
        [float(local[i].energy) for i in range(7)]
    assert not (tmp_path / "cache").exists()  # no shard downloaded whole
    dataset = AtompackDataset(f"s3://{BUCKET}/atp/", prefetch_shards=True)
    assert dataset.reader.downloaded_shards() == []  # opened from header range reads
    assert len(dataset) == len(local) == 7
    assert [float(dataset[i].energy) for i in range(7)] == \
        [float(local[i].energy) for i in range(7)]
    assert dataset.reader.downloaded_shards() == [0, 1]

    source = open_source(f"s3://{BUCKET}/pt/")
    assert isinstance(source, ObjectStoreSource)
    ids = [int(s.sample_id) for s in ShardStreamDataset(f"s3://{BUCKET}/pt/")]
    assert ids == [0, 1, 1000, 1001, 1002]

    assert main(["info", f"s3://{BUCKET}/atp/"]) == 0
    out = capsys.readouterr().out
    assert "structures: 7" in out and "part_1.atp: 4 records" in out
