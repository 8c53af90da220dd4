"""`AtompackDataset` over a Hub repository, served by a loopback fake Hub.

The real huggingface_hub client talks to `tests/servers/fake_hub.py` over HTTP
(in-process through ``endpoint=``, in a subprocess through ``HF_ENDPOINT``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from servers.fake_hub import FakeHub, serve_fake_hub, write_reference_shard
from test_loader import assert_batches_equal, assert_data_equal

from pyg_atompack import AtompackDataset, AtompackLoader, hub
from pyg_atompack.pyg import FieldSelectionError

REPO = "org/molecules"


@pytest.fixture(scope="module")
def local_root(tmp_path_factory) -> Path:
    """Shards of 3, 4 and 5 molecules in `train/` (order: a/…, part_1, part_2)."""
    root = tmp_path_factory.mktemp("hub_dataset")
    write_reference_shard(root / "train" / "a" / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(root / "train" / "part_1.atp", 4, 3, seed=2)
    write_reference_shard(root / "train" / "part_2.atp", 5, 4, seed=3)
    (root / "train" / "manifest.json").write_text(json.dumps({"output_files": []}))
    return root


@pytest.fixture
def fake_hub() -> FakeHub:
    yield from serve_fake_hub()


@pytest.fixture
def served(fake_hub: FakeHub, local_root: Path) -> FakeHub:
    fake_hub.commit(REPO, local_root)
    return fake_hub


def _from_hub(server: FakeHub, cache: Path, **kwargs) -> AtompackDataset:
    return AtompackDataset.from_hub(REPO, "train", cache_dir=cache, endpoint=server.endpoint,
                                    **kwargs)


def _shard_downloads(server: FakeHub) -> list[str]:
    """Shards fetched in full (range reads of headers and indexes do not count)."""
    return sorted(
        r.path.rsplit("/", 1)[-1] for r in server.requests
        if r.method == "GET" and r.path.endswith(".atp") and "range" not in r.headers
    )


def test_shards_download_only_when_first_read(served, local_root, tmp_path):
    dataset = _from_hub(served, tmp_path / "cache", prefetch_shards=True)
    local = AtompackDataset(local_root / "train")
    assert len(dataset) == len(local) == 12  # from shard headers only
    assert _shard_downloads(served) == []
    assert dataset.reader.downloaded_shards() == []
    assert_data_equal(dataset[8], local[8], "hub[8]")  # lives in part_2
    assert dataset.reader.downloaded_shards() == [2]
    assert _shard_downloads(served) == ["part_2.atp"]
    for index in range(len(local)):
        assert_data_equal(dataset[index], local[index], f"hub[{index}]")
    assert dataset.reader.downloaded_shards() == [0, 1, 2]
    assert _shard_downloads(served) == ["part_0.atp", "part_1.atp", "part_2.atp"]
    assert repr(dataset).startswith("AtompackDataset(12, source='hf://datasets/org/molecules@")


@pytest.mark.parametrize("prefetch_shards", [None, True])
def test_loader_over_hub_equals_local_loader_with_workers(served, local_root, tmp_path,
                                                          prefetch_shards):
    dataset = _from_hub(served, tmp_path / "cache", fields=["energy"],
                        prefetch_shards=prefetch_shards)
    local = AtompackDataset(local_root / "train", fields=["energy"])
    sampler_order = [11, 0, 5, 3, 7, 1, 10, 2, 9, 4, 6, 8]
    ours = AtompackLoader(dataset, batch_size=5, sampler=sampler_order, num_workers=2)
    reference = AtompackLoader(local, batch_size=5, sampler=sampler_order)
    for mine, theirs in zip(ours, reference, strict=True):
        assert_batches_equal(mine, theirs)
        assert "forces" not in mine
    if prefetch_shards:
        assert len(_shard_downloads(served)) >= 3  # the workers downloaded into the cache
    else:  # the default: the workers read records through the shared page cache
        assert _shard_downloads(served) == []
        assert list((tmp_path / "cache" / "pages").rglob("*.page"))


def test_revision_is_pinned_when_opened(served, local_root, tmp_path):
    dataset = _from_hub(served, tmp_path / "cache", revision="main")
    first_energy = float(dataset[0].energy)
    replacement = tmp_path / "new.atp"
    write_reference_shard(replacement, 2, 2, seed=9)
    served.commit(REPO, {"train/a/part_0.atp": replacement.read_bytes()})  # main moves on
    assert len(dataset) == 12 and float(dataset[0].energy) == first_energy
    assert float(_from_hub(served, tmp_path / "cache2")[0].energy) == 900.0


def test_corrupted_download_fails_verification(served, local_root, tmp_path):
    true_bytes = (local_root / "train" / "part_1.atp").read_bytes()
    # same size and header, one flipped byte in the records: only the sha256 can tell
    served.serve_wrong_bytes(REPO, "train/part_1.atp",
                             true_bytes[:8200] + bytes([true_bytes[8200] ^ 0xFF])
                             + true_bytes[8201:])
    dataset = _from_hub(served, tmp_path / "cache", prefetch_shards=True)
    assert float(dataset[0].energy) == 100.0  # other shards are unaffected
    with pytest.raises(hub.HubIntegrityError, match="part_1.atp"):
        dataset[4]


def test_unknown_field_on_hub_lists_remote_fields(served, tmp_path):
    with pytest.raises(FieldSelectionError, match="'charges'.*energy, forces"):
        _from_hub(served, tmp_path / "cache", fields=["charges"])


def test_hf_uri_source_in_a_subprocess(served, local_root, tmp_path):
    sha = hub.resolve_revision(REPO, endpoint=served.endpoint)
    script = (
        "import sys, torch\n"
        "from pyg_atompack import AtompackDataset, AtompackLoader\n"
        "ds = AtompackDataset(sys.argv[1], fields=['energy'], dtype=torch.float32)\n"
        "batch = next(iter(AtompackLoader(ds, batch_size=len(ds))))\n"
        "print(len(ds), batch.energy.tolist(), batch.pos.dtype)\n"
    )
    env = served.subprocess_env()
    env["PYG_ATOMPACK_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-c", script, f"hf://datasets/{REPO}@{sha}/train/part_1.atp"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "4"
    assert "[200.0, 201.0, 202.0, 203.0]" in result.stdout and "torch.float32" in result.stdout
    local = AtompackDataset(local_root / "train" / "part_1.atp")
    assert torch.equal(local[3].energy, torch.tensor([203.0], dtype=torch.float64))


def test_records_read_through_the_page_cache_without_shard_downloads(served, local_root,
                                                                     tmp_path):
    # the default for hf://, as for http(s)://: by record, through the bounded page cache
    dataset = _from_hub(served, tmp_path / "cache", cache_bytes=1 << 20)
    assert dataset.reader.reads_by_record and dataset.reader.revision in repr(dataset)
    local = AtompackDataset(local_root / "train")
    for index in (8, 0, 11, 3):
        assert_data_equal(dataset[index], local[index], f"hub[{index}]")
    for a, b in zip(AtompackLoader(dataset, batch_size=5), AtompackLoader(local, batch_size=5)):
        assert_batches_equal(a, b)
    assert _shard_downloads(served) == []  # range reads only
    assert list((tmp_path / "cache" / "pages").rglob("*.page"))
