"""The pyg-atompack command line, run as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import ase.io
import numpy as np
import pytest
from test_convert_ase import make_frames
from test_convert_diskdataset import build_disk_zip
from test_convert_memmap import hand_built


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=120)


def assert_bad_input(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pyg-atompack: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("command", [[], ["convert"], ["info"], ["verify"], ["shard"], ["head"]])
def test_help_everywhere(command):
    result = run(*command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: pyg-atompack")


@pytest.fixture()
def extxyz(tmp_path):
    path = tmp_path / "frames.extxyz"
    ase.io.write(path, make_frames(5))
    return path


def test_convert_info_verify_head_shard(extxyz, tmp_path):
    out = tmp_path / "frames.atp"
    result = run("convert", extxyz, out, "--compression", "zstd", "--level", "5")
    assert result.returncode == 0, result.stderr
    assert "wrote 5 structures" in result.stdout
    assert result.stderr == ""  # no progress bar when stderr is not a terminal

    info = run("info", out)
    assert info.returncode == 0, info.stderr
    assert "codec: zstd (level 5)" in info.stdout
    assert "structures: 5" in info.stdout
    assert "forces: float64[3] (per atom)" in info.stdout
    assert "properties/dipole: float64[3] (per structure)" in info.stdout

    verify = run("verify", out)
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout

    head = run("head", out, "-n", "2")
    assert head.returncode == 0
    lines = head.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0] ") and "energy=" in lines[0]

    shard = run("shard", out, tmp_path / "pt", "--shard-size", "2", "--quiet")
    assert shard.returncode == 0 and shard.stdout == ""
    manifest = json.loads((tmp_path / "pt" / "manifest.json").read_text())
    assert [s["records"] for s in manifest["shards"]] == [2, 2, 1]


def test_verify_reports_checksum_mismatch(extxyz, tmp_path):
    out = tmp_path / "shards"
    assert run("convert", extxyz, out, "--shard-size", "3", "-q").returncode == 0
    shard = out / "shard_00001.atp"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0xFF  # inside the index block
    shard.write_bytes(bytes(data))
    result = run("verify", out)
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "shard_00001.atp: sha256" in result.stdout


def test_memmap_convert_with_keys_and_units(tmp_path):
    _, arrays = hand_built(tmp_path / "mm")
    result = run("convert", tmp_path / "mm", tmp_path / "mm.atp", "--energy-key", "e",
                 "--forces-key", "f", "--key-map", "q=charges", "--energy-unit", "kcal/mol")
    assert result.returncode == 0, result.stderr
    from pyg_atompack import atp

    with atp.open(tmp_path / "mm.atp") as reader:
        assert reader[0].energy == pytest.approx(float(arrays["e"][0, 0]) * 0.0433641042418)
        assert reader[0].charges is not None


def test_bad_unknown_extension(tmp_path):
    (tmp_path / "data.foo").write_text("x")
    assert_bad_input(run("convert", tmp_path / "data.foo", tmp_path / "o.atp"),
                     "data.foo", "unknown extension '.foo'")
    assert not (tmp_path / "o.atp").exists()


def test_bad_output_extension(extxyz, tmp_path):
    assert_bad_input(run("convert", extxyz, tmp_path / "out.bin"), "out.bin", "unknown extension")


def test_bad_directory(tmp_path):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "readme.txt").write_text("hi")
    assert_bad_input(run("convert", tmp_path / "stuff", tmp_path / "o.atp"),
                     "stuff", "neither a shard directory", "memmap")


def test_bad_memmap_sizes(tmp_path):
    hand_built(tmp_path / "mm")
    np.zeros(3, dtype=np.float32).tofile(tmp_path / "mm" / "x.bin")
    assert_bad_input(run("convert", tmp_path / "mm", tmp_path / "o.atp"),
                     "x.bin", "but na.npy/ns.npy imply")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm"]


def test_bad_zip_missing_folder_and_missing_key(tmp_path):
    build_disk_zip(tmp_path / "holes.zip", count=3, skip=1)
    assert_bad_input(run("convert", tmp_path / "holes.zip", tmp_path / "o.atp"),
                     "holes.zip", "1/system.mta")
    build_disk_zip(tmp_path / "ok.zip", count=2)
    assert_bad_input(run("convert", tmp_path / "ok.zip", tmp_path / "o.atp",
                         "--energy-key", "nothere"), "ok.zip", "'nothere'", "not present")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["holes.zip", "ok.zip"]


def test_bad_key_in_extxyz_leaves_nothing(extxyz, tmp_path):
    assert_bad_input(run("convert", extxyz, tmp_path / "o.atp", "--stress-key", "virial"),
                     "frames.extxyz (structure 0)", "'virial'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["frames.extxyz"]


def test_bad_unit_and_missing_source(tmp_path):
    (tmp_path / "a.xyz").write_text("")
    assert_bad_input(run("convert", tmp_path / "a.xyz", tmp_path / "o.atp",
                         "--energy-unit", "erg"), "unknown energy unit 'erg'")
    assert_bad_input(run("info", tmp_path / "nothing.atp"), "nothing.atp", "no such file")
