"""RemoteSource over hf:// against the loopback fake Hub (and the real huggingface_hub)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from servers.fake_hub import FakeHub, serve_fake_hub
from servers.http_server import make_samples

from pyg_atompack.stream import RemoteSource, ShardIntegrityError, ShardStreamDataset

REPO = "org/streamed"
TESTS_DIR = Path(__file__).resolve().parent


def _pt(shard: int, count: int) -> bytes:
    buffer = io.BytesIO()
    torch.save(make_samples(shard, count), buffer)
    return buffer.getvalue()


def _files(sizes: list[int], *, version: int = 0) -> dict[str, bytes]:
    files = {f"data/shard-{i:04d}.pt": _pt(i + 10 * version, n) for i, n in enumerate(sizes)}
    manifest = {"shards": [
        {"name": f"shard-{i:04d}.pt", "records": n,
         "bytes": len(files[f"data/shard-{i:04d}.pt"]),
         "sha256": hashlib.sha256(files[f"data/shard-{i:04d}.pt"]).hexdigest()}
        for i, n in enumerate(sizes)]}
    files["data/manifest.json"] = json.dumps(manifest).encode()
    files["README.md"] = b"card\n"
    return files


@pytest.fixture
def fake_hub() -> FakeHub:
    yield from serve_fake_hub()


def _api_calls(server: FakeHub) -> list:
    # small files' bytes come from /api/resolve-cache/ (the 307 target): not API calls
    return [r for r in server.requests
            if r.path.startswith("/api/") and not r.path.startswith("/api/resolve-cache/")]


def _ids(dataset) -> list[int]:
    return [int(sample.sample_id) for sample in dataset]


def test_hub_source_lists_once_with_pinned_revision(fake_hub):
    sha = fake_hub.commit(REPO, _files([3, 2]))
    fake_hub.clear_requests()
    source = RemoteSource(f"hf://datasets/{REPO}@main/data", endpoint=fake_hub.endpoint)
    assert source.backend.revision == sha
    shards = source.list_shards()
    assert [s.name for s in shards] == ["shard-0000.pt", "shard-0001.pt"]
    assert [s.records for s in shards] == [3, 2]  # from the manifest in the repo
    files = _files([3, 2])
    for shard in shards:
        data = files[f"data/{shard.name}"]
        assert shard.size == len(data)
        assert shard.sha256 == hashlib.sha256(data).hexdigest()  # from the LFS listing
        assert sha in shard.file.url
    api_calls = _api_calls(fake_hub)
    assert len(api_calls) == 2  # one revision lookup, one tree listing
    dataset = ShardStreamDataset(source, prefetch=1)
    assert _ids(dataset) == [0, 1, 2, 1000, 1001]
    # iterating (and re-iterating) never asks the API again
    assert _ids(dataset) == [0, 1, 2, 1000, 1001]
    assert len(_api_calls(fake_hub)) == 2


def test_revision_stays_pinned_after_a_new_push(fake_hub):
    old = fake_hub.commit(REPO, _files([2, 2]))
    source = RemoteSource(f"hf://datasets/{REPO}/data", endpoint=fake_hub.endpoint)
    new = fake_hub.commit(REPO, _files([2, 2], version=1))  # branch moves on
    assert new != old and source.backend.revision == old
    assert _ids(ShardStreamDataset(source)) == [0, 1, 1000, 1001]
    fresh = RemoteSource(f"hf://datasets/{REPO}/data", endpoint=fake_hub.endpoint)
    assert fresh.backend.revision == new
    assert _ids(ShardStreamDataset(fresh)) == [10000, 10001, 11000, 11001]
    pinned = RemoteSource(f"hf://datasets/{REPO}@{old}/data", endpoint=fake_hub.endpoint)
    assert _ids(ShardStreamDataset(pinned)) == [0, 1, 1000, 1001]


def test_hub_checksum_mismatch_is_reported(fake_hub):
    fake_hub.commit(REPO, _files([2, 2]))
    source = RemoteSource(f"hf://datasets/{REPO}/data", endpoint=fake_hub.endpoint)
    good = _files([2, 2])["data/shard-0001.pt"]
    fake_hub.serve_wrong_bytes(REPO, "data/shard-0001.pt", good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ShardIntegrityError, match=r"shard shard-0001\.pt: sha256"):
        list(ShardStreamDataset(source))


def test_hub_source_via_hf_endpoint_in_a_subprocess(fake_hub):
    sha = fake_hub.commit(REPO, _files([2, 1]))
    script = (
        "import json\n"
        "from pyg_atompack.stream import RemoteSource, ShardStreamDataset\n"
        f"source = RemoteSource('hf://datasets/{REPO}/data')\n"
        "ids = [int(s.sample_id) for s in ShardStreamDataset(source, prefetch=2)]\n"
        "print(json.dumps({'revision': source.backend.revision, 'ids': ids}))\n"
    )
    env = fake_hub.subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer == {"revision": sha, "ids": [0, 1, 1000]}
