"""One backend per scheme, in one registry that another package extends.

A third-party distribution is installed the way pip leaves one (a ``.dist-info`` folder
with ``entry_points.txt``, next to its module on ``sys.path``); a fresh interpreter then
finds its ``mem://`` backend through the ``pyg_atompack.backends`` entry points and
every entry point that takes a URL reads through it: the stream, ``AtompackDataset`` by
record and with whole shards downloaded into the one cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from servers.fake_hub import write_reference_shard
from servers.http_server import write_pt_shards

from pyg_atompack.remote import RemoteFile, cached_path
from pyg_atompack.remote.backends import ENTRY_POINT_GROUP, open_backend, supported_schemes
from pyg_atompack.transport import UnsupportedURLError

ROOT = Path(__file__).resolve().parents[1]

# a backend serving "mem://prefix/" from a folder, as another package would ship one
_MODULE = '''
import os

from pyg_atompack.remote import RemoteFile
from pyg_atompack.remote.files import SHARD_SUFFIXES, Backend

FOLDER = os.environ["MEMSTORE_FOLDER"]
READS = []


class MemoryBackend(Backend):
    def list(self, suffixes=SHARD_SUFFIXES):
        prefix = self.url.split("://", 1)[1].strip("/")
        names = sorted(os.listdir(os.path.join(FOLDER, prefix)))
        return [RemoteFile(name, size=os.path.getsize(os.path.join(FOLDER, prefix, name)),
                           version="v1", url=f"mem://{prefix}/{name}")
                for name in names if suffixes is None or name.endswith(tuple(suffixes))]

    def read_into(self, file, out, start=0, cancel=None, progress=None, pin=None):
        READS.append((file.name, start, len(out)))
        with open(os.path.join(FOLDER, file.url.split("://", 1)[1]), "rb") as handle:
            handle.seek(start)
            out[:] = handle.read(len(out))
        if progress is not None:
            progress(start + len(out))
'''


@pytest.fixture
def installed(tmp_path):
    """A distribution ``memstore`` installed in a folder of its own."""
    site = tmp_path / "site"
    info = site / "memstore-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: memstore\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmem = memstore:MemoryBackend\n")
    (site / "memstore.py").write_text(_MODULE)
    folder = tmp_path / "store"
    (folder / "data" / "pt").mkdir(parents=True)
    (folder / "data" / "atp").mkdir(parents=True)
    write_pt_shards(folder / "data" / "pt", [3, 2])
    write_reference_shard(folder / "data" / "atp" / "a.atp", 4, 3, seed=1)
    write_reference_shard(folder / "data" / "atp" / "b.atp", 3, 2, seed=2)
    env = dict(os.environ, MEMSTORE_FOLDER=str(folder),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(site)]),
               PYG_ATOMPACK_CACHE=str(tmp_path / "cache"))
    return env, tmp_path


def _run(code: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_installed_backend_serves_its_scheme_everywhere(installed):
    env, tmp_path = installed
    got = _run("""
        import json
        import memstore
        from pyg_atompack import AtompackDataset
        from pyg_atompack.remote.backends import supported_schemes
        from pyg_atompack.stream import RemoteSource, ShardStreamDataset

        stream = ShardStreamDataset("mem://data/pt/", prefetch=1)
        assert isinstance(stream.source, RemoteSource)
        ids = [int(sample.sample_id) for sample in stream]
        by_record = AtompackDataset("mem://data/atp/")
        paged = float(by_record[5].energy)
        ranged = len(memstore.READS)
        whole = AtompackDataset("mem://data/atp", prefetch_shards=True)
        print(json.dumps({"schemes": supported_schemes(), "ids": ids, "paged": paged,
                          "energies": [float(whole[i].energy) for i in (0, 3, 4, 6)],
                          "ranged": ranged, "reads": memstore.READS}))
    """, env)
    assert "mem" in got["schemes"]
    assert got["ids"] == [0, 1, 2, 1000, 1001]
    assert got["paged"] == 201.0 and got["ranged"] > 0  # records read by range
    assert got["energies"] == [100.0, 103.0, 200.0, 202.0]
    # the downloads went into the one cache, keyed by the version the backend listed
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.atp"))
    assert cached == ["a.atp", "b.atp"]
    expected = cached_path(RemoteFile("a.atp", size=1, version="v1", url="mem://data/atp/a.atp"),
                           tmp_path / "cache")
    assert expected.is_file()


def test_without_the_distribution_the_scheme_is_refused_naming_the_supported_ones():
    assert "mem" not in supported_schemes()
    with pytest.raises(UnsupportedURLError, match=r"mem://.*supported: http://, https://, hf://"):
        open_backend("mem://data/")


def test_every_builtin_scheme_has_one_backend():
    from pyg_atompack.hub import HubBackend
    from pyg_atompack.remote.http_backend import FileBackend, HTTPBackend
    from pyg_atompack.remote.objectstore import ObjectStore

    kinds = {url: type(open_backend(url)) for url in (
        "data/shards", "http://127.0.0.1:9/m.json", "https://127.0.0.1:9/x.atp",
        "hf://datasets/org/data", "s3://bucket/p/", "gs://bucket/p/", "az://box/p/")}
    assert kinds == {"data/shards": FileBackend, "http://127.0.0.1:9/m.json": HTTPBackend,
                     "https://127.0.0.1:9/x.atp": HTTPBackend,
                     "hf://datasets/org/data": HubBackend, "s3://bucket/p/": ObjectStore,
                     "gs://bucket/p/": ObjectStore, "az://box/p/": ObjectStore}
