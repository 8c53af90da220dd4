"""A hostile server, manifest or bucket listing cannot write outside the cache (issue 30).

Real parts only: the fault-injecting HTTP file server, moto for S3, the fake Hub, and
a real read-only bind mount (``unshare``) for the shared-cache case. Every case ends in
the documented error (``remote.RemoteNameError``, ``CachePathError``,
``CacheReadOnlyError``) or behaviour, and a snapshot of the file system outside the
cache root (paths, modes, sizes, modification times) is unchanged, including the
user's ``victim.atp`` a hostile name points at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from servers.fake_hub import serve_fake_hub
from servers.http_server import serve_directory
from servers.stores import use_store

from pyg_atompack import AtompackDataset, hub
from pyg_atompack.remote import (
    CachePathError,
    CacheReadOnlyError,
    RemoteFile,
    RemoteNameError,
    atp_meta,
    cached_path,
)
from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.stream import ShardStreamDataset, SourceOptions
from pyg_atompack.transport import RemoteIntegrityError, RetryPolicy, TransportError

TESTS_DIR = Path(__file__).resolve().parent
FAST = RetryPolicy(retries=1, backoff=0.01, max_backoff=0.02, jitter=0.0, timeout=5.0,
                   connect_timeout=2.0)
BUCKET = "atompack-hostile"

# the names a hostile manifest or bucket may list (ABSOLUTE is filled in per test)
ABSOLUTE = "<absolute>"
HOSTILE_NAMES = {
    "dotdot": "../../../../victim.atp",
    "dotdot_deep": "sub/../../../../../../victim.atp",
    "absolute": ABSOLUTE,
    "double_slash": "a//part.atp",
    "trailing_slash": "part.atp/",
    "nul": "part\x00.atp",
    "newline": "part\n.atp",
    "backslash": "..\\..\\victim.atp",
    "drive_letter": "C:victim.atp",
    "long_component": "x" * 300 + ".atp",
    "long_name": "/".join(["d" * 200] * 6) + "/part.atp",
    "encoded_dotdot": "%2e%2e/%2e%2e/%2e%2e/victim.atp",
}


def _write_shard(path: Path, seed: int) -> bytes:
    """An uncompressed reference `.atp` (same size for every seed; energies 100*seed+i)."""
    import atompack

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = atompack.Database(str(path), compression="none", overwrite=True)
    db.add_arrays_batch(rng.normal(size=(3, 2, 3)).astype(np.float32),
                        rng.integers(1, 30, size=(3, 2)).astype(np.uint8),
                        energy=seed * 100.0 + np.arange(3, dtype=np.float64))
    db.flush()
    return path.read_bytes()


def _snapshot(base: Path, cache: Path) -> dict[str, tuple[int, int, int]]:
    """Every path below ``base`` except the cache root: (mode, size, mtime_ns)."""
    found = {}
    for directory, dirs, files in os.walk(base):
        for name in list(dirs):
            if Path(directory, name) == cache:
                dirs.remove(name)
        for name in dirs + files:
            path = Path(directory, name)
            info = path.lstat()
            found[str(path.relative_to(base))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def _energies(dataset) -> list[float]:
    return [float(dataset[i].energy) for i in range(len(dataset))]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A served directory with one good shard, the user's victim file, a cache root."""
    www = tmp_path / "www"
    good = _write_shard(www / "part.atp", 1)
    # what a hostile name resolves to on the server: other bytes of the same size
    _write_shard(www / "victim.atp", 7)
    victim = tmp_path / "victim.atp"
    victim.write_bytes(b"the user's own file, not a shard\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(cache))
    atp_meta._MEMORY.clear()
    for server in serve_directory(www):
        yield {"www": www, "server": server, "victim": victim, "cache": cache,
               "good": good, "tmp": tmp_path}


def _manifest(site, name: str, **fields) -> str:
    """Write manifest.json listing the good shard and ``name``; return its URL."""
    if name == ABSOLUTE:
        name = str(site["victim"])
    size = len(site["good"])
    shards = [{"name": "part.atp", "records": 3, "bytes": size,
               "sha256": hashlib.sha256(site["good"]).hexdigest()},
              {"name": name, "records": 3, "bytes": size, **fields}]
    (site["www"] / "manifest.json").write_text(json.dumps({"shards": shards}))
    return site["server"].url("manifest.json")


def _assert_names(error: BaseException, url: str, name: str) -> None:
    text = str(error)
    assert url in text, text
    assert repr(name)[:60] in text, text
    assert "\n" not in text


ENTRY_POINTS = {
    "prefetch_shards": lambda url, cache: AtompackDataset(url, prefetch_shards=True)[0],
    "by_record": lambda url, cache: AtompackDataset(url, cache_dir=cache)[0],
    "stream": lambda url, cache: next(iter(ShardStreamDataset(url,
                                                              options=SourceOptions(cache_dir=cache)))),
    "open_remote_atp": lambda url, cache: hub.open_remote_atp(url, cache_dir=cache,
                                                             policy=FAST).download_all(),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
def test_a_hostile_manifest_name_is_refused_when_listed(site, case, entry):
    name = HOSTILE_NAMES[case]
    url = _manifest(site, name)
    before = _snapshot(site["tmp"], site["cache"])
    with pytest.raises(RemoteNameError) as caught:
        ENTRY_POINTS[entry](url, site["cache"])
    _assert_names(caught.value, url, str(site["victim"]) if name == ABSOLUTE else name)
    assert isinstance(caught.value, (TransportError, ValueError))
    assert _snapshot(site["tmp"], site["cache"]) == before
    assert site["victim"].read_bytes() == b"the user's own file, not a shard\n"


@pytest.mark.parametrize("command", ["head", "verify"])
@pytest.mark.parametrize("case", ["dotdot", "absolute", "nul", "backslash"])
def test_cli_refuses_a_hostile_manifest_name_in_one_line(site, case, command):
    name = HOSTILE_NAMES[case]
    url = _manifest(site, name)
    before = _snapshot(site["tmp"], site["cache"])
    env = dict(os.environ, PYG_ATOMPACK_CACHE=str(site["cache"]),
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pyg_atompack.cli", command, url],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pyg-atompack: error: "), result.stderr
    _assert_names(lines[0], url, str(site["victim"]) if name == ABSOLUTE else name)
    assert "all checks passed" not in result.stdout
    assert _snapshot(site["tmp"], site["cache"]) == before


@pytest.mark.parametrize("sha256", ["../../../../victim.atp", "../x", "/etc/passwd",
                                    "A" * 63, "g" * 64, "a" * 64 + "\n"])
def test_a_sha256_that_is_not_a_digest_is_refused(site, sha256):
    url = _manifest(site, "part2.atp", sha256=sha256)
    before = _snapshot(site["tmp"], site["cache"])
    for entry in ("prefetch_shards", "by_record", "stream"):
        with pytest.raises(RemoteNameError, match="sha256") as caught:
            ENTRY_POINTS[entry](url, site["cache"])
        assert url in str(caught.value) and repr(sha256) in str(caught.value)
    assert _snapshot(site["tmp"], site["cache"]) == before
    assert not site["cache"].exists()


def test_a_planted_listing_with_a_path_for_a_sha256_is_refused_before_any_write(site):
    # a listing that bypassed the parsers (a hand-made RemoteFile, a planted listing
    # cache): the one path function still refuses it, and nothing of the listed size
    # outside the cache is served as the verified shard
    (site["tmp"] / "x").write_bytes(site["good"])
    before = _snapshot(site["tmp"], site["cache"])
    remote = RemoteFile("part.atp", size=len(site["good"]), sha256="../../../x",
                        url=site["server"].url("part.atp"))
    with pytest.raises(RemoteNameError, match=r"sha256.*'\.\./\.\./\.\./x'"):
        hub.download(remote, site["cache"], policy=FAST)
    assert _snapshot(site["tmp"], site["cache"]) == before


def test_same_size_rewrite_without_sha256_is_downloaded_again(site):
    """No sha256 listed: the cached copy is keyed by the server's ETag, so a file
    rewritten at the same size is fetched again (on main it was served forever)."""
    server, www = site["server"], site["www"]
    for url in (server.url("part.atp"), _manifest_without_digests(site)):
        _write_shard(www / "part.atp", 1)
        first = AtompackDataset(url, prefetch_shards=True)
        assert _energies(first)[:3] == [100.0, 101.0, 102.0]
        again = AtompackDataset(url, prefetch_shards=True)
        assert _energies(again)[:3] == [100.0, 101.0, 102.0]
        downloads = _full_downloads(server)
        rewritten = _write_shard(www / "part.atp", 2)  # same size, other records
        assert len(rewritten) == len(site["good"])
        os.utime(www / "part.atp", ns=(0, (www / "part.atp").stat().st_mtime_ns + 10**9))
        fresh = AtompackDataset(url, prefetch_shards=True)
        assert _energies(fresh)[:3] == [200.0, 201.0, 202.0]
        assert _full_downloads(server) == downloads + 1  # the new version, once
        versions = [p for p in site["cache"].rglob("part.atp") if "versions" in p.parts]
        assert len(versions) >= 2  # one folder per version, never one overwritten copy


def _manifest_without_digests(site) -> str:
    size = len(site["good"])
    (site["www"] / "manifest.json").write_text(json.dumps(
        {"shards": [{"name": "part.atp", "records": 3, "bytes": size}]}))
    return site["server"].url("manifest.json")


def _full_downloads(server) -> int:
    return sum(1 for e in server.requests if e.range is None and e.path == "/part.atp")


def test_a_download_is_pinned_to_the_listed_version(site):
    url = site["server"].url("part.atp")
    reader = hub.open_remote_atp(url, policy=FAST)  # lists the ETag of this version
    _write_shard(site["www"] / "part.atp", 2)
    os.utime(site["www"] / "part.atp",
             ns=(0, (site["www"] / "part.atp").stat().st_mtime_ns + 10**9))
    with pytest.raises(RemoteIntegrityError, match="changed"):
        reader[0]
    assert not [p for p in site["cache"].rglob("part.atp")]  # nothing stored


def test_a_symlink_in_the_cache_pointing_out_is_never_written_through(site):
    outside = site["tmp"] / "elsewhere"
    outside.mkdir()
    site["cache"].mkdir()
    (site["cache"] / "http").symlink_to(outside)
    (site["cache"] / "atp-meta").symlink_to(outside)
    url = _manifest(site, "part.atp")
    before = _snapshot(site["tmp"], site["cache"])
    with pytest.raises(CachePathError, match="leads outside the cache"):
        AtompackDataset(url, prefetch_shards=True)[0]
    with pytest.raises(CachePathError, match="leads outside the cache"):
        AtompackDataset(site["server"].url("part.atp"), cache_dir=site["cache"])[0]
    assert _snapshot(site["tmp"], site["cache"]) == before
    assert list(outside.iterdir()) == []


def test_a_planted_lock_symlink_is_not_followed(site):
    url = site["server"].url("part.atp")
    reader = hub.open_remote_atp(url, policy=FAST)
    final = cached_path(reader.shards[0], site["cache"], verified=False)
    final.parent.mkdir(parents=True)
    Path(f"{final}.lock").symlink_to(site["victim"])
    before = _snapshot(site["tmp"], site["cache"])
    with pytest.raises(CachePathError, match="symlink"):
        reader[0]
    assert _snapshot(site["tmp"], site["cache"]) == before
    assert site["victim"].read_bytes() == b"the user's own file, not a shard\n"


# ---------------------------------------------------------------------- object stores
@pytest.fixture
def s3(store_servers, monkeypatch, tmp_path):
    server = store_servers("s3")
    server.create_bucket(BUCKET)
    use_store(monkeypatch, server)
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "cache"))
    atp_meta._MEMORY.clear()
    return server


HOSTILE_KEYS = {
    "dotdot": "../../../../victim.atp",
    "double_slash": "a//part.atp",
    "absolute": "/abs/victim.atp",
    "backslash": "..\\..\\victim.atp",
    "control": "part\x01.atp",
    "long_component": "x" * 300 + ".atp",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_KEYS))
def test_a_hostile_bucket_key_is_refused_when_listed(s3, tmp_path, case):
    good = _write_shard(tmp_path / "good.atp", 1)
    prefix = f"hostile-{case}"
    s3.put(BUCKET, f"{prefix}/part.atp", good)
    s3.put(BUCKET, f"{prefix}/{HOSTILE_KEYS[case]}", good)
    victim = tmp_path / "victim.atp"
    victim.write_bytes(b"the user's own file\n")
    cache = tmp_path / "cache"
    before = _snapshot(tmp_path, cache)
    url = f"s3://{BUCKET}/{prefix}/"
    # the store keeps the key as written: the hostile name reaches the listing
    assert HOSTILE_KEYS[case] in [o.name for o in _raw_listing(url)]
    for entry in ("prefetch_shards", "by_record", "stream"):
        with pytest.raises(RemoteNameError) as caught:
            ENTRY_POINTS[entry](url, cache)
        assert url.rstrip("/") in str(caught.value)
        assert f"refusing the remote name {HOSTILE_KEYS[case]!r}"[:70] in str(caught.value)
    assert _snapshot(tmp_path, cache) == before


def _raw_listing(url: str):
    from pyg_atompack.remote.objectstore import ObjectStore

    store = ObjectStore(url)
    return store._list_prefix(store.key)


def test_object_rewritten_at_the_same_size_is_downloaded_again(s3, tmp_path):
    good = _write_shard(tmp_path / "one.atp", 1)
    s3.put(BUCKET, "rewrite/part.atp", good)
    url = f"s3://{BUCKET}/rewrite/"
    assert _energies(AtompackDataset(url, prefetch_shards=True))[:3] == [100.0, 101.0, 102.0]
    s3.put(BUCKET, "rewrite/part.atp", _write_shard(tmp_path / "two.atp", 2))
    assert _energies(AtompackDataset(url, prefetch_shards=True))[:3] == [200.0, 201.0, 202.0]


# ---------------------------------------------------------------------- Hub listings
def test_a_hostile_hub_listing_is_refused(tmp_path):
    data = _write_shard(tmp_path / "good.atp", 1)
    for fake in serve_fake_hub():
        sha = fake.commit("org/hostile", {"train/a.atp": data, "train/b\\..\\x.atp": data})
        with pytest.raises(RemoteNameError, match=r"backslash"):
            hub.open_hub_atp("org/hostile", "train", revision=sha, endpoint=fake.endpoint,
                             cache_dir=tmp_path / "cache")
        for repo in ("../../x", "org/.."):
            with pytest.raises(RemoteNameError):
                hub.transfer.repo_cache_folder(tmp_path / "cache", repo, "dataset")


# ---------------------------------------------------------------------- read-only cache
_READ_ONLY_SCRIPT = r"""
import json, sys
from pyg_atompack import AtompackDataset
from pyg_atompack.remote import CacheReadOnlyError
url, part_url, cache = sys.argv[1:4]
out = {}
by_record = AtompackDataset(url, cache_dir=cache)
out["by_record"] = [float(by_record[i].energy) for i in range(len(by_record))]
whole = AtompackDataset(url, prefetch_shards=True)
out["prefetched"] = [float(whole[i].energy) for i in range(3)]
try:
    AtompackDataset(part_url, prefetch_shards=True)[0]
except CacheReadOnlyError as error:
    out["miss"] = str(error)
print(json.dumps(out))
"""


def _unshare_available(tmp_path: Path) -> bool:
    probe = tmp_path / "ro-probe"
    probe.mkdir()
    command = f"mount --bind {probe} {probe} && mount -o remount,ro,bind {probe} && " \
              f"! touch {probe}/x 2>/dev/null"
    found = shutil.which("unshare")
    return bool(found) and subprocess.run(
        [found, "-rm", "sh", "-c", command], capture_output=True).returncode == 0


def test_a_read_only_populated_cache_serves_hits_and_names_itself_on_a_miss(site):
    if not _unshare_available(site["tmp"]):
        pytest.skip("needs unshare -rm and mount (a real read-only bind mount)")
    server, cache = site["server"], site["cache"]
    _write_shard(site["www"] / "other.atp", 3)
    url = _manifest(site, "victim.atp", sha256=hashlib.sha256(
        (site["www"] / "victim.atp").read_bytes()).hexdigest())
    # fill the shared cache: the records of the manifest by record (a few pages only,
    # the rest will be misses) and its shards whole
    AtompackDataset(url, cache_dir=cache)[0]
    whole = AtompackDataset(url, prefetch_shards=True)
    expected = _energies(whole)
    filled = _snapshot(cache, cache / "none")
    outside = _snapshot(site["tmp"], cache)
    env = dict(os.environ, PYG_ATOMPACK_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(TESTS_DIR.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    command = (f'mount --bind "$3" "$3" && mount -o remount,ro,bind "$3" && '
               f'exec "{sys.executable}" -c "$0" "$1" "$2" "$3"')
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command, _READ_ONLY_SCRIPT, url,
         server.url("other.atp"), str(cache)],
        env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["by_record"] == expected  # hits from disk, misses fetched into memory
    assert out["prefetched"] == expected[:3]  # downloaded shards served, nothing written
    assert "read-only" in out["miss"] and str(cache) in out["miss"]
    assert "other.atp" in out["miss"]
    assert _snapshot(cache, cache / "none") == filled
    assert _snapshot(site["tmp"], cache) == outside


def test_read_only_errors_are_the_family_never_a_bare_oserror(tmp_path):
    # the translation the read-only mount above exercises for real, where unshare is
    # available: refused writes become the family's error, naming directory and URL
    assert remote_cache.read_only(PermissionError(13, "Permission denied"))
    assert remote_cache.read_only(OSError(30, "Read-only file system"))
    assert not remote_cache.read_only(FileNotFoundError(2, "No such file"))
    assert issubclass(CacheReadOnlyError, TransportError)
    assert issubclass(CacheReadOnlyError, PermissionError)
    with pytest.raises(CacheReadOnlyError, match=str(tmp_path)) as caught, \
            remote_cache.writes_to(tmp_path, url="https://u:p@host/x.atp?token=abc"):
        raise OSError(30, "Read-only file system")
    assert "host/x.atp" in str(caught.value) and "abc" not in str(caught.value)
    assert "u:p" not in str(caught.value)
