"""The format registry: detection from the formats' facts, and outside formats added
through the ``pyg_atompack.formats`` entry-point group (a real package, pip-installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack import atp, convert
from pyg_atompack.convert import registry

PLUGIN_SOURCE = Path(__file__).parent / "data" / "plugin_format"
TINY = "TINYXYZ 2 -1.5\n8 0.0 0.0 0.0\n1 0.0 0.0 0.96\nTINYXYZ 1 -0.25\n1 1.0 2.0 3.0\n"


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The tiny format package, installed by pip into a folder of its own."""
    work = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(PLUGIN_SOURCE, work / "src")  # the build writes beside it
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-index", "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, capture_output=True, timeout=240)
    assert any(site.glob("tinyxyz_format-*.dist-info/entry_points.txt"))
    return site


def cli(*args, site: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=120)


def test_plugin_format_reads_writes_and_is_detected(plugin_site, tmp_path):
    source = tmp_path / "sample.tinyxyz"
    source.write_text(TINY, encoding="ascii")

    result = cli("convert", source, tmp_path / "out.atp", site=plugin_site)
    assert result.returncode == 0, result.stderr
    with atp.open(tmp_path / "out.atp") as f:
        assert len(f) == 2
        assert f[0].energy == -1.5 and f[1].energy == -0.25
        assert f[0].atomic_numbers.tolist() == [8, 1]
        np.testing.assert_allclose(f[1].positions, [[1.0, 2.0, 3.0]])

    # the plugin's writer, chosen by its write extension
    result = cli("convert", tmp_path / "out.atp", tmp_path / "back.tinyxyz", site=plugin_site)
    assert result.returncode == 0, result.stderr
    back = (tmp_path / "back.tinyxyz").read_text(encoding="ascii").splitlines()
    assert back[0] == "TINYXYZ 2 -1.5" and back[3] == "TINYXYZ 1 -0.25"

    # no known extension: the plugin's magic bytes tell
    disguised = tmp_path / "sample.dat"
    shutil.copy(source, disguised)
    info = cli("info", disguised, site=plugin_site)
    assert info.returncode == 0, info.stderr
    assert "format: tinyxyz" in info.stdout and "structures: 2" in info.stdout


def test_without_the_plugin_the_format_is_unknown(tmp_path):
    source = tmp_path / "sample.tinyxyz"
    source.write_text(TINY, encoding="ascii")
    result = cli("convert", source, tmp_path / "out.atp")
    assert result.returncode == 2
    assert "sample.tinyxyz" in result.stderr and "unknown extension '.tinyxyz'" in result.stderr
    assert not (tmp_path / "out.atp").exists()


def test_broken_plugins_are_skipped_with_a_warning(tmp_path):
    # a distribution known to importlib.metadata only by its dist-info folder
    dist = tmp_path / "broken_formats-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-formats\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[pyg_atompack.formats]\nghost = no_such_module_here:FORMAT\n"
        "atp = pyg_atompack.convert.registry:FORMATS\n")
    code = textwrap.dedent("""
        import warnings
        from pyg_atompack.convert import registry
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = list(registry.formats())
        print(names)
        for w in caught:
            print(w.category.__name__, w.message)
    """)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "ghost" not in lines[0] and "'atp'" in lines[0]
    warned = "\n".join(lines[1:])
    assert "'ghost'" in warned and "failed to load" in warned and "broken-formats" in warned
    assert "'atp'" in warned and "skipped" in warned
    assert registry.FORMATS["atp"].reader == "atp_io.AtpReader"


def test_detection_reads_the_registry(tmp_path):
    class DirReader(convert.StructureReader):
        format_name = "lab-dir"

        def _iter_raw(self):
            yield convert.Structure(positions=np.zeros((1, 3)), atomic_numbers=np.array([6]))

    fmt = convert.Format("lab-dir", "a lab's directory layout", reader=DirReader,
                         contains=("frames/*.lab", "meta.txt"), globs=("LAB_*",))
    convert.register(fmt)
    try:
        layout = tmp_path / "run"
        (layout / "frames").mkdir(parents=True)
        (layout / "meta.txt").write_text("x")
        with pytest.raises(convert.ConvertError, match="lab-dir: frames/\\*.lab, meta.txt"):
            convert.detect_source_format(layout)  # one pattern does not match yet
        (layout / "frames" / "0.lab").write_text("x")
        assert convert.detect_source_format(layout) == "lab-dir"
        (tmp_path / "LAB_0001").write_text("x")
        assert convert.detect_source_format(tmp_path / "LAB_0001") == "lab-dir"
        with convert.open_reader(layout) as reader:
            assert [s.atomic_numbers.tolist() for s in reader] == [[6]]
    finally:
        del registry.FORMATS["lab-dir"]
    # builtin facts: ATPK magic recognises an .atp file under any name
    with atp.Writer(tmp_path / "x.atp") as w:
        w.add(np.zeros((1, 3), np.float32), np.array([1], np.uint8))
    os.replace(tmp_path / "x.atp", tmp_path / "x.bin")
    assert convert.detect_source_format(tmp_path / "x.bin") == "atp"
    assert convert.detect_destination_format(tmp_path / "o.atp") == "atp"
    assert convert.detect_destination_format(tmp_path / "o.atp", shard_size=5) == "atp-shards"
    assert convert.detect_destination_format(tmp_path / "o", shard_size=5) == "atp-shards"
    assert convert.detect_destination_format(tmp_path / "o.xyz", shard_size=5) == "extxyz"
    with pytest.raises(convert.ConvertError, match="o.bin"):
        convert.detect_destination_format(tmp_path / "o.bin")
