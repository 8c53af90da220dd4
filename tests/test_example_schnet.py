"""End-to-end tests of examples/schnet_md17.py and its helpers (reduced configurations).

The example runs for real: an EMT trajectory is generated with ASE, written as shards,
served by the throttled loopback HTTP server and streamed into SchNet training.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import aspirin  # noqa: E402
import schnet_md17  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402
import training  # noqa: E402
from loopback import LoopbackServer  # noqa: E402

from pyg_atompack import stream  # noqa: E402

SMALL_MODEL = training.ModelConfig(hidden_channels=32, num_filters=32, num_interactions=3)
TRAJECTORY = aspirin.TrajectoryConfig(frames=1024, shard_size=128)
TRACE_FIELDS = (
    "download_start_s",
    "download_finish_s",
    "deserialize_finish_s",
    "consume_start_s",
    "consume_finish_s",
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("aspirin")
    aspirin.prepare_aspirin_shards(root, TRAJECTORY, log=lambda message: None)
    return root


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """One reduced run through the loopback server, shared by the assertions below."""
    out = tmp_path_factory.mktemp("run")
    config = schnet_md17.RunConfig(
        data_dir=str(data_dir),
        trajectory=TRAJECTORY,
        model=SMALL_MODEL,
        epochs=5,
        # small batches give more optimiser steps per CPU second; the reference batch of 32
        # needs a few hundred more steps before the forces leave the zero-force plateau
        batch_size=8,
        latency_s=0.01,
        bandwidth_bps=4e6,
        out=str(out),
        progress=False,
    )
    lines: list[str] = []
    metrics = schnet_md17.run(config, log=lines.append)
    return metrics, out, lines


def test_embedded_geometry_is_aspirin():
    atoms = aspirin.aspirin_atoms()
    assert atoms.get_chemical_formula() == "C9H8O4"
    distances = atoms.get_all_distances()[np.triu_indices(len(atoms), k=1)]
    # an equilibrium geometry: no clashes, bonded neighbours near 1-1.5 Å
    assert distances.min() > 0.9
    assert np.sum(distances < 1.6) == 21  # 21 covalent bonds in aspirin


def test_shards_and_manifest(data_dir):
    root = data_dir / TRAJECTORY.cache_key()
    for shard_format in shards.SHARD_FORMATS:
        manifest = json.loads((root / shard_format / "manifest.json").read_text())
        assert manifest["format"] == "pyg_atompack-shards/1"
        assert manifest["total_records"] == TRAJECTORY.frames
        assert [s["records"] for s in manifest["shards"]] == [128] * 8
        for entry in manifest["shards"]:
            assert set(entry) == {"name", "records", "bytes", "sha256"}
            assert entry["name"].endswith(f".{shard_format}")
        assert shards.manifest_is_intact(root / shard_format / "manifest.json")
    frames = torch.load(root / "pt" / "shard_00000.pt", weights_only=False)
    assert len(frames) == 128
    first = frames[0]
    assert first.z.dtype == torch.long and first.pos.shape == (21, 3)
    assert first.forces.shape == (21, 3) and first.energy.shape == (1,)
    # every tensor owns just its own bytes, not a slice of the whole trajectory
    assert first.pos.untyped_storage().nbytes() == 21 * 3 * 4
    from pyg_atompack import atp

    with atp.open(root / "atp" / "shard_00000.atp") as reader:
        assert len(reader) == 128
        np.testing.assert_allclose(reader[0].positions, first.pos.numpy(), rtol=0, atol=1e-6)
        np.testing.assert_allclose(reader[0].forces, first.forces.numpy(), atol=1e-6)
        assert reader[0].energy == pytest.approx(float(first.energy), rel=1e-6)


def test_cache_is_reused_and_corruption_detected(data_dir):
    messages = []
    root = aspirin.prepare_aspirin_shards(data_dir, TRAJECTORY, log=messages.append)
    assert any("cached" in m for m in messages)
    manifest = root / "pt" / "manifest.json"
    shard = root / "pt" / "shard_00001.pt"
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert not shards.manifest_is_intact(manifest)
    finally:
        shard.write_bytes(original)
    assert shards.manifest_is_intact(manifest)


def test_loopback_server_ranges_latency_and_404(tmp_path):
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    with LoopbackServer(tmp_path, latency_s=0.0, bandwidth_bps=1e6) as server:
        with urllib.request.urlopen(server.url("blob.bin")) as response:
            assert response.read() == bytes(range(256)) * 4
        request = urllib.request.Request(server.url("blob.bin"), headers={"Range": "bytes=10-19"})
        with urllib.request.urlopen(request) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == "bytes 10-19/1024"
            assert response.read() == bytes(range(10, 20))
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(server.url("nope.bin"))
        assert missing.value.code == 404
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LoopbackServer(tmp_path, bandwidth_bps=0)


def test_run_streams_and_traces_every_shard(trained):
    metrics, out, lines = trained
    assert "embedded aspirin" in metrics["data"]
    assert any("not from quantum chemistry" in line for line in lines)
    trace = json.loads((out / "trace.json").read_text())
    assert len(trace) == 5
    for epoch in trace:
        records = epoch["records"]
        assert sorted(r["identifier"] for r in records) == [f"shard_{i:05d}.pt" for i in range(7)]
        for record in records:
            for name in TRACE_FIELDS:
                assert record[name] is not None and record[name] >= 0.0, (name, record)
            assert record["download_start_s"] <= record["download_finish_s"]
            assert record["download_finish_s"] <= record["deserialize_finish_s"]
            assert record["consume_start_s"] <= record["consume_finish_s"]
            assert record["bytes"] > 0 and record["structures"] == 128
        assert epoch["stats"]["overlap_s"] >= 0.0
    rows = metrics["shards"]
    assert len(rows) == 35
    assert all(row["overlap_s"] >= 0.0 and row["wait_s"] >= 0.0 for row in rows)
    # per-shard overlaps add up to the stream's own overlap figure
    total_overlap = sum(row["overlap_s"] for row in rows)
    assert total_overlap == pytest.approx(metrics["stream_totals"]["overlap_s"], abs=1e-6)
    assert total_overlap > 0.0  # with prefetch=1 some download ran during training
    # every training step is timed (CPU: the wall clock) and attributed to one shard
    totals = metrics["stream_totals"]
    assert totals["wait_clock"] == "wall"
    assert sum(e["stats"]["steps"] for e in metrics["epochs"]) == 5 * 7 * 128 // 8
    assert 0.0 <= totals["wait_share"] < 1.0
    assert sum(row["step_wait_s"] for row in rows) == pytest.approx(totals["step_wait_s"])
    assert all(0.0 <= row["wait_share"] < 1.0 for row in rows)
    table = next(line for line in lines if "wait share" in line)  # logged as one string
    assert table.splitlines()[0].split()[-2:] == ["wait", "share"]
    assert any(line.startswith("training steps spent") and "wall clock" in line
               for line in lines)
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["held_out_shard"] == "shard_00007.pt"
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("outputs written to" in line for line in lines)
    assert any(line.startswith("total") for line in lines)


def test_training_learns_forces(trained):
    metrics, _, _ = trained
    held_out = metrics["held_out"]
    assert held_out["structures"] == 128
    assert held_out["force_mae"] < 0.6 * held_out["zero_force_mae"], held_out


def test_cli_atp_local_source_and_bad_source(data_dir, tmp_path, capsys):
    root = data_dir / TRAJECTORY.cache_key()
    out = tmp_path / "cli"
    status = schnet_md17.main([
        "--source", str(root / "atp"), "--epochs", "1", "--max-shards", "1",
        "--hidden-channels", "16", "--num-interactions", "1", "--out", str(out),
        "--no-progress",
    ])
    assert status == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert [row["name"] for row in metrics["shards"]] == ["shard_00000.atp"]
    assert metrics["held_out_shard"] == "shard_00007.atp"
    assert "outputs written to" in capsys.readouterr().out
    status = schnet_md17.main(["--source", str(tmp_path / "empty"), "--no-progress"])
    assert status == 1
    assert "empty" in capsys.readouterr().err


def test_energy_statistics_hand_computed():
    from torch_geometric.data import Data

    two_atoms = torch.ones(2, dtype=torch.long)
    samples = [Data(z=two_atoms, energy=torch.tensor([e])) for e in (2.0, 4.0)]
    mean_per_atom, std = training.energy_statistics(samples)
    assert mean_per_atom == pytest.approx(1.5)
    assert std == pytest.approx(np.std([2.0, 4.0], ddof=1))
    assert training.energy_statistics(samples[:1])[1] == 1.0


def test_reduced_config_defaults_are_the_reference_model():
    config = schnet_md17.RunConfig()
    assert config.model == training.ModelConfig(128, 128, 6, 50, 10.0)
    assert (config.batch_size, config.lr, config.force_weight) == (32, 1e-3, 10.0)
    assert replace(config, epochs=1).epochs == 1


def test_paired_benchmark_end_to_end(data_dir, tmp_path):
    """One tiny pair of each arm (plus FoldPipe) through the loopback server."""
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import paired_schnet

    out, figure = tmp_path / "results", tmp_path / "fig.png"
    status = paired_schnet.main([
        "--pairs", "2", "--frames", str(TRAJECTORY.frames),
        "--shard-size", str(TRAJECTORY.shard_size), "--max-shards", "2",
        "--hidden-channels", "16", "--num-interactions", "1", "--resamples", "200",
        "--latency", "0.01", "--bandwidth", "2e6", "--foldpipe",
        "--data-dir", str(data_dir), "--out", str(out), "--figure", str(figure),
    ])
    assert status == 0
    result = json.loads((out / "schnet.json").read_text())
    assert [pair["first"] for pair in result["pairs"]] == ["sequential", "prefetch"]
    for pair in result["pairs"]:
        for arm in ("sequential", "prefetch", "foldpipe"):
            assert pair[arm]["seconds"] > 0 and pair[arm]["steps"] == 2 * 128 // 32
        # the sequential arm downloads only while the trainer waits: no overlap at all
        assert pair["sequential"]["overlap"] == pytest.approx(0.0, abs=1e-9)
        assert pair["prefetch"]["overlap"] >= 0.0
    times = [(p["sequential"]["seconds"], p["prefetch"]["seconds"]) for p in result["pairs"]]
    expected = float(np.exp(np.mean([np.log(s / c) for s, c in times])))
    assert result["summary"]["speedup_geomean"] == pytest.approx(expected)
    low, high = result["summary"]["speedup_ci"]
    assert low <= expected <= high
    assert result["peak_rss_mib"] > 0 and result["d_over_c"] > 0
    report = (out / "schnet.md").read_text()
    assert "geometric-mean speed-up" in report and "FoldPipe arm" in report
    assert figure.read_bytes()[:4] == b"\x89PNG"


def test_shard_subset_keeps_the_ranged_first_download(tmp_path):
    """The example's train/eval split of a source still fetches in parts (split_shards)."""
    from servers.http_server import serve_directory, write_pt_shards

    from pyg_atompack.transport.transfers import MIN_PART_BYTES

    names = write_pt_shards(tmp_path, [400, 400], atoms=8)
    assert (tmp_path / names[0]).stat().st_size > 2 * MIN_PART_BYTES
    for server in serve_directory(tmp_path):
        source = stream.RemoteSource(server.url("manifest.json"))
        listing = source.list_shards()
        subset = sources.ShardSubset(source, listing, [0])
        body = subset.fetch_in_parts(listing[0], stream.CancelToken(), 2)
        assert body[:] == (tmp_path / names[0]).read_bytes()
        assert len(server.requests_for(names[0])) == 2
