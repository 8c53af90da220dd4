"""The Hugging Face ``datasets`` arm of ``benchmarks/peers.py`` (``peer_hf_datasets.py``).

Parquet shards written as the arm writes them, served by the loopback test server and
read through ``load_dataset("parquet", data_files=[http URLs], streaming=True)`` behind
a real ``DataLoader`` (in-process and with 2 worker processes): every structure
arrives once, with the energies written (the check ``peers.py`` makes of every pass),
and the check itself reports a pass that lost or changed structures.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import pytest
from servers.http_server import serve_directory

pytest.importorskip("datasets")  # the ``bench`` extra declares it

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"
_SPEC = importlib.util.spec_from_file_location("peers", _PATH)
peers = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("peers", peers)
_SPEC.loader.exec_module(peers)

import peer_hf_datasets  # noqa: E402  (peers.py put benchmarks/ on sys.path)

served = contextlib.contextmanager(serve_directory)


@pytest.fixture
def library_sleep(monkeypatch):
    # the arms set datasets' sleep when the shuffle's shards run dry (5 s, its Arrow
    # thread-shutdown workaround); these tests pass 0 and leave the library as it was
    import datasets

    value = datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", value)
    return value


def _serve_parquet(tmp_path: Path, shards: int, per_shard: int, atoms):
    www = tmp_path / "www"
    (www / "parquet").mkdir(parents=True)
    parts = [peers.make_items(s, per_shard, atoms) for s in range(shards)]
    names = peer_hf_datasets.write_parquet(www / "parquet", parts)
    return www, names


@pytest.mark.parametrize("workers", [0, 2])
def test_the_datasets_arm_streams_every_structure_once(tmp_path, library_sleep, workers):
    www, names = _serve_parquet(tmp_path, 3, 40, 16)
    assert names == [f"shard-{s:04d}.parquet" for s in range(3)]
    with served(www) as server:
        build = peer_hf_datasets.hf_datasets_arm(server.base_url, names, 32, workers,
                                                 shutdown_sleep=0.0)
        result = peers.consume(build, 0.0)
        requested = {r.path for r in server.requests}
    assert result["samples"] == 120
    assert result["energy_digest"] == peers.expected_digest(3, 40, 16)
    assert requested == {f"/parquet/{n}" for n in names}  # over HTTP, from this server
    assert result["last_batch_s"] <= result["seconds"]


def test_the_arm_keeps_the_library_sleep_unless_told(tmp_path, library_sleep):
    import datasets

    www, names = _serve_parquet(tmp_path, 1, 4, 4)
    with served(www) as server:
        peer_hf_datasets.hf_datasets_arm(server.base_url, names, 4, shutdown_sleep=0.0)()
        assert datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN == 0.0
        peer_hf_datasets.hf_datasets_arm(server.base_url, names, 4)()
        assert datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN == library_sleep > 0


def test_structures_of_different_sizes_batch_through_the_concat_collate(
        tmp_path, library_sleep):
    www, names = _serve_parquet(tmp_path, 2, 24, (8, 20))
    with served(www) as server:
        build = peer_hf_datasets.hf_datasets_arm(server.base_url, names, 32,
                                                 collate_fn=peers.concat_collate,
                                                 shutdown_sleep=0.0)
        batches = list(build())
    assert sum(len(b["energy"]) for b in batches) == 48
    for batch in batches:  # atoms concatenated, cut by the counts
        assert batch["pos"].shape == (int(batch["n_atoms"].sum()), 3)
    energies = [e for b in batches for e in b["energy"].tolist()]
    assert peers.energy_digest(energies) == peers.expected_digest(2, 24, (8, 20))


def test_the_sample_check_reports_a_lost_or_changed_structure():
    digest = peers.expected_digest(2, 8, 4)
    good = {"samples": 16, "energy_digest": digest}
    assert peers.check_samples({"ours_pt": [good, good], "hf": [good]}, 16, digest) == []
    lost = {"samples": 15, "energy_digest": digest}
    changed = {"samples": 16, "energy_digest": peers.expected_digest(2, 8, 5)}
    lines = peers.check_samples({"ours_pt": [good], "hf": [good, lost], "w": [changed]},
                                16, digest)
    assert len(lines) == 2
    assert lines[0].startswith("hf: samples per pass [15, 16]")
    assert lines[1].startswith("w: energy digests") and digest in lines[1]
