"""pyg_atompack.hub against a loopback fake Hub, with the real huggingface_hub client."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys
from pathlib import Path

import atompack
import numpy as np
import pytest
from servers.fake_hub import FakeHub, git_blob_id, serve_fake_hub, write_reference_shard

from pyg_atompack import hub
from pyg_atompack.hub import remote as hub_remote
from pyg_atompack.hub import transfer as hub_transfer
from pyg_atompack.remote import cached_path
from pyg_atompack.transport import RetryPolicy

REPO = "org/mols"
FAST = RetryPolicy(retries=2, backoff=0.01, max_backoff=0.05, timeout=2.0, connect_timeout=2.0)
TESTS_DIR = Path(__file__).resolve().parent


# ---------------------------------------------------------------------- data
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """Three shards of 2, 3 and 4 molecules (3, 2, 4 atoms each) plus a manifest."""
    root = tmp_path_factory.mktemp("hubdata")
    write_reference_shard(root / "train" / "b" / "part_0.atp", 2, 3, seed=1)
    write_reference_shard(root / "train" / "part_1.atp", 3, 2, seed=2)
    write_reference_shard(root / "train" / "part_2.atp", 4, 4, seed=3)
    (root / "train" / "manifest.json").write_text(json.dumps({"output_files": []}))
    (root / "README.md").write_text("fake dataset card\n")
    return root


@pytest.fixture(scope="module")
def files(shard_dir) -> dict[str, bytes]:
    return {p.relative_to(shard_dir).as_posix(): p.read_bytes()
            for p in sorted(shard_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def fake_hub() -> FakeHub:
    yield from serve_fake_hub()


@pytest.fixture
def server(fake_hub: FakeHub, files) -> FakeHub:
    fake_hub.commit(REPO, files)
    return fake_hub


def _oracle(shard_dir: Path) -> list[tuple[str, int]]:
    """(shard path, local index) per global index, shard order = POSIX path sort."""
    shards = sorted(p.relative_to(shard_dir).as_posix() for p in shard_dir.rglob("*.atp"))
    return [(s, i) for s in shards for i in range(len(atompack.Database.open(str(shard_dir / s))))]


def _full_gets(server: FakeHub, fragment: str = ".atp") -> list:
    return [r for r in server.requests_to("/resolve/", "GET")
            if fragment in r.path and "range" not in r.headers]


# ---------------------------------------------------------------------- URIs
@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("hf://datasets/org/data@main/omat/train",
         hub.HubLocation("org/data", "main", "omat/train", "dataset")),
        ("hf://datasets/org/data/omat/train/", hub.HubLocation("org/data", None, "omat/train")),
        ("hf://org/data@" + "a" * 40, hub.HubLocation("org/data", "a" * 40, "")),
        ("hf://models/org/net@refs%2Fpr%2F3/w.atp",
         hub.HubLocation("org/net", "refs/pr/3", "w.atp", "model")),
        ("hf://datasets/org/data//x//", hub.HubLocation("org/data", None, "x")),
    ],
)
def test_parse_hf_uri(uri, expected):
    assert hub.parse_hf_uri(uri) == expected


@pytest.mark.parametrize(
    "uri", ["s3://bucket/x", "hf://datasets/onlyowner", "hf://datasets/org/data@/x",
            "hf://datasets/org/data@main/a/../b", "hf://datasets/org@v/data"],
)
def test_parse_hf_uri_rejects(uri):
    with pytest.raises(hub.HubURIError, match="hf://|\\.\\.|owner|revision|URI"):
        hub.parse_hf_uri(uri)


def test_parse_hf_uri_error_is_value_error():
    with pytest.raises(ValueError, match=r"'\.\.'"):
        hub.parse_hf_uri("hf://datasets/org/data/../../etc")


# ---------------------------------------------------------------------- revisions
def test_resolve_branch_and_sha(fake_hub, files):
    first = fake_hub.commit(REPO, files)
    second = fake_hub.commit(REPO, {"extra.atp": b"x"}, replace=False)
    assert first != second
    assert hub.resolve_revision(REPO, "main", endpoint=fake_hub.endpoint) == second
    assert hub.resolve_revision(REPO, first, endpoint=fake_hub.endpoint) == first
    assert hub_remote.is_commit_sha(first) and not hub_remote.is_commit_sha("main")


def test_resolve_errors_name_repo_and_revision(server):
    with pytest.raises(hub.HubRepositoryNotFoundError, match="org/absent"):
        hub.resolve_revision("org/absent", endpoint=server.endpoint)
    with pytest.raises(hub.HubRevisionNotFoundError, match="org/mols.*'v9'"):
        hub.resolve_revision(REPO, "v9", endpoint=server.endpoint)
    with pytest.raises(ValueError, match="repo_type"):
        hub.resolve_revision(REPO, repo_type="bucket", endpoint=server.endpoint)


def test_unreachable_endpoint_is_a_transfer_error():
    spare = FakeHub()
    endpoint = spare.endpoint
    spare.server_close()  # nothing listens on that port any more
    with pytest.raises(hub.HubTransferError, match="org/mols.*after 3 attempts.*ConnectError"):
        hub.resolve_revision(REPO, endpoint=endpoint, policy=FAST)


# ---------------------------------------------------------------------- listing
def test_listing_sizes_checksums_and_order(server, files):
    sha = hub.resolve_revision(REPO, endpoint=server.endpoint)
    server.clear_requests()
    listed = hub.list_remote_files(REPO, "train", revision=sha, endpoint=server.endpoint)
    assert [f.name for f in listed] == sorted(p for p in files if p.startswith("train/"))
    assert listed[0].name == "train/b/part_0.atp"  # nested dirs sort by POSIX path
    for f in listed:
        assert f.size == len(files[f.name])
        assert f.version == sha and f.repo == f"datasets/{REPO}"
        assert f.blob_id == git_blob_id(files[f.name])
        assert f.url == f"{server.endpoint}/datasets/{REPO}/resolve/{sha}/{f.name}"
        if f.name.endswith(".atp"):
            assert f.sha256 == hashlib.sha256(files[f.name]).hexdigest()
        else:
            assert f.sha256 is None  # plain git file: only the git blob id is known
    # exactly one request: the recursive tree listing, nothing per file
    assert [(r.method, r.path) for r in server.requests] == [
        ("GET", f"/api/datasets/{REPO}/tree/{sha}/train")]
    assert server.requests[0].query["recursive"] == ["true"]


def test_listing_pattern_pagination_and_single_file(server, files):
    server.page_size = 2  # the client must follow Link: rel="next"
    atp_files = hub.list_remote_files(REPO, "/train/", revision="main", pattern="*.atp",
                                      endpoint=server.endpoint)
    assert [f.name for f in atp_files] == sorted(p for p in files if p.endswith(".atp"))
    assert len(server.requests_to("/tree/")) >= 2
    single = hub.list_remote_files(REPO, "train/part_1.atp", revision="main",
                                   endpoint=server.endpoint)
    assert [(f.name, f.size) for f in single] == [("train/part_1.atp",
                                                   len(files["train/part_1.atp"]))]
    everything = hub.list_remote_files(REPO, revision="main", endpoint=server.endpoint)
    assert [f.name for f in everything] == sorted(files)


def test_listing_errors(server):
    with pytest.raises(hub.HubPathNotFoundError, match="org/mols.*'main'.*'nowhere'"):
        hub.list_remote_files(REPO, "nowhere", revision="main", endpoint=server.endpoint)
    with pytest.raises(hub.HubNoShardsError, match=r"org/mols.*\*\.pt"):
        hub.list_remote_files(REPO, "train", revision="main", pattern="*.pt",
                              endpoint=server.endpoint)
    assert hub.list_remote_files(REPO, "train", revision="main", pattern="*.pt",
                                 endpoint=server.endpoint, allow_empty=True) == []
    with pytest.raises(hub.HubURIError, match=r"\.\."):
        hub.list_remote_files(REPO, "train/../..", revision="main", endpoint=server.endpoint)


def test_pinned_sha_keeps_old_content(fake_hub, files, shard_dir, tmp_path):
    old = fake_hub.commit(REPO, files)
    changed = dict(files)
    changed["train/part_1.atp"] = files["train/part_2.atp"]
    new = fake_hub.commit(REPO, changed)
    assert hub.resolve_revision(REPO, endpoint=fake_hub.endpoint) == new

    def part_1(rev):
        listed = hub.list_remote_files(REPO, "train/part_1.atp", revision=rev,
                                       endpoint=fake_hub.endpoint)
        return hub.download(listed[0], tmp_path).read_bytes()

    assert part_1(old) == files["train/part_1.atp"]
    assert part_1(new) == files["train/part_2.atp"]
    assert part_1("main") == files["train/part_2.atp"]


# ---------------------------------------------------------------------- ranges
def test_fetch_range_reads_only_the_range(server, files):
    target = hub.list_remote_files(REPO, "train/part_2.atp", revision="main",
                                   endpoint=server.endpoint)[0]
    data = files[target.name]
    server.clear_requests()
    assert hub_transfer.fetch_range(target, 100, 50) == data[100:150]
    assert hub_transfer.fetch_range(target, len(data) - 7, 7) == data[-7:]
    assert hub_transfer.fetch_range(target, 5, 0) == b""
    ranges = ["bytes=100-149", f"bytes={len(data) - 7}-{len(data) - 1}"]
    # the Hub redirects (302, the Range kept) to the CDN, which sends exactly those bytes
    seen = server.requests_to("/resolve/")
    assert [(r.headers["range"], r.status) for r in seen] == [(ranges[0], 302),
                                                              (ranges[1], 302)]
    cdn = server.requests_to("/cdn/")
    assert [(r.headers["range"], r.status, r.body_bytes) for r in cdn] == [
        (ranges[0], 206, 50), (ranges[1], 206, 7)]
    assert all("authorization" not in r.headers for r in cdn)


def test_fetch_range_bounds(server):
    target = hub.list_remote_files(REPO, "train/part_2.atp", revision="main",
                                   endpoint=server.endpoint)[0]
    with pytest.raises(ValueError, match="exceeds the file size"):
        hub_transfer.fetch_range(target, target.size - 1, 2)
    with pytest.raises(ValueError, match="negative"):
        hub_transfer.fetch_range(target, -1, 2)


def test_private_repo_needs_token(fake_hub, files):
    fake_hub.commit("org/private", files, token="s3cret")
    with pytest.raises(hub.HubRepositoryNotFoundError, match="org/private"):
        hub.resolve_revision("org/private", token=False, endpoint=fake_hub.endpoint)
    listed = hub.list_remote_files("org/private", "train", revision="main", token="s3cret",
                                   endpoint=fake_hub.endpoint)
    target = listed[-1]
    with pytest.raises(hub.HubRepositoryNotFoundError, match="org/private"):
        hub_transfer.fetch_range(target, 0, 4, token=False)
    assert hub_transfer.fetch_range(target, 0, 4, token="s3cret") == b"ATPK"
    resolve, cdn = fake_hub.requests[-2:]
    assert (resolve.origin, resolve.status) == ("hub", 302)
    assert resolve.headers["authorization"] == "Bearer s3cret"
    assert (cdn.origin, cdn.status) == ("cdn", 206)
    assert "authorization" not in cdn.headers  # the token never left the Hub's origin


# ---------------------------------------------------------------------- downloads
def test_download_verifies_and_reuses_cache(server, files, tmp_path):
    listed = hub.list_remote_files(REPO, "train", revision="main", endpoint=server.endpoint)
    server.clear_requests()
    for f in listed:
        local = hub.download(f, tmp_path)
        assert local.read_bytes() == files[f.name]
        assert local == cached_path(f, tmp_path)
    assert len(server.requests_to("/resolve/", "GET")) == len(listed)
    again = [hub.download(f, tmp_path) for f in listed]
    assert len(server.requests_to("/resolve/", "GET")) == len(listed)  # nothing refetched
    assert all(p.exists() for p in again)
    assert not list(tmp_path.rglob("*.incomplete"))


def test_download_detects_wrong_bytes(server, files, tmp_path):
    path = "train/part_1.atp"
    true = files[path]
    target = hub.list_remote_files(REPO, path, revision="main", endpoint=server.endpoint)[0]
    server.serve_wrong_bytes(REPO, path, bytes(len(true)))  # same size, other content
    with pytest.raises(hub.HubIntegrityError, match=r"org/mols.*train/part_1\.atp.*sha256"):
        hub.download(target, tmp_path)
    assert not cached_path(target, tmp_path).exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
    # verify=False only checks the size: the wrong bytes land under the commit's version
    unverified = hub.download(target, tmp_path, verify=False)
    assert "versions" in unverified.parts and "blobs" not in unverified.parts
    assert unverified.read_bytes() == bytes(len(true))
    server.serve_wrong_bytes(REPO, path, true[:-10])  # short body
    with pytest.raises(hub.HubIntegrityError, match=r"train/part_1\.atp"):
        hub.download(target, tmp_path / "other")


def test_download_plain_file_checks_git_blob_id(server, files, tmp_path):
    target = hub.list_remote_files(REPO, "README.md", revision="main",
                                   endpoint=server.endpoint)[0]
    assert hub.download(target, tmp_path).read_bytes() == files["README.md"]
    server.serve_wrong_bytes(REPO, "README.md", b"FAKE dataset card\n")
    with pytest.raises(hub.HubIntegrityError, match="git blob id"):
        hub.download(target, tmp_path / "fresh")


def test_fetch_bytes_in_memory(server, files, tmp_path):
    target = hub.list_remote_files(REPO, "train/b/part_0.atp",
                                   revision="main", endpoint=server.endpoint)[0]
    assert hub_transfer.fetch_bytes(target) == files[target.name]
    wrong = bytearray(files[target.name])
    wrong[-1] ^= 0xFF
    server.serve_wrong_bytes(REPO, target.name, bytes(wrong))
    with pytest.raises(hub.HubIntegrityError, match=r"train/b/part_0\.atp.*sha256"):
        hub_transfer.fetch_bytes(target)
    assert hub_transfer.fetch_bytes(target, verify=False) == bytes(wrong)
    with pytest.raises(hub.HubIntegrityError, match="received size 3 bytes"):
        hub_transfer.check_bytes(target, b"abc", verify=False)


def test_download_follows_cdn_redirect(server, files, tmp_path):
    target = hub.list_remote_files(REPO, "train/part_2.atp", revision="main",
                                   endpoint=server.endpoint)[0]
    assert hub_transfer.fetch_range(target, 0, 4) == b"ATPK"
    assert hub.download(target, tmp_path).read_bytes() == files[target.name]
    assert [r.status for r in server.requests_to("/cdn/")] == [206, 200]
    from huggingface_hub import hf_hub_download  # the real client copes with the redirect too

    local = hf_hub_download(REPO, target.name, repo_type="dataset", endpoint=server.endpoint,
                            cache_dir=tmp_path / "hf")
    assert Path(local).read_bytes() == files[target.name]


def test_real_client_hf_hub_download_against_fake(server, files, tmp_path):
    from huggingface_hub import hf_hub_download

    local = hf_hub_download(REPO, "train/part_1.atp", repo_type="dataset",
                            endpoint=server.endpoint, cache_dir=tmp_path)
    assert Path(local).read_bytes() == files["train/part_1.atp"]


# ---------------------------------------------------------------------- lazy sharded .atp
def _energies(reader, n):
    return [float(reader[i].energy) for i in range(n)]


def test_open_reads_only_headers(server, shard_dir, tmp_path):
    sha = hub.resolve_revision(REPO, endpoint=server.endpoint)
    server.clear_requests()
    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    assert len(reader) == 2 + 3 + 4
    assert reader.shard_lengths.tolist() == [2, 3, 4]  # b/part_0 sorts first
    assert reader.revision == sha
    # one resolve (default branch), one listing, one 8192-byte range per shard, nothing else
    api = [r.path for r in server.requests if r.path.startswith("/api/")]
    assert api == [f"/api/datasets/{REPO}", f"/api/datasets/{REPO}/tree/{sha}/train"]
    file_requests = server.requests_to("/resolve/")
    assert len(file_requests) == 3
    assert all(r.headers.get("range") == "bytes=0-8191" for r in file_requests)
    cdn = server.requests_to("/cdn/")
    assert sum(r.body_bytes for r in file_requests + cdn) == 3 * 8192
    assert reader.downloaded_shards() == []
    assert "molecules=9" in repr(reader)


def test_reading_downloads_only_the_holding_shard(server, shard_dir, tmp_path):
    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    oracle = _oracle(shard_dir / "train")
    server.clear_requests()
    mol = reader[3]  # global 3 = second molecule of train/part_1.atp
    assert [r.path.rsplit("/", 2)[-2:] for r in _full_gets(server)] == [["train", "part_1.atp"]]
    assert reader.downloaded_shards() == [1]
    shard, local = oracle[3]
    ref = atompack.Database.open(str(shard_dir / "train" / shard))[local]
    np.testing.assert_array_equal(mol.positions, ref.positions)
    np.testing.assert_array_equal(mol.atomic_numbers, ref.atomic_numbers)
    np.testing.assert_array_equal(mol.forces, ref.forces)
    assert mol.energy == ref.energy
    reader[4]  # same shard: nothing new
    assert len(_full_gets(server)) == 1
    assert float(reader[-1].energy) == 303.0  # last molecule of the last shard
    assert reader.downloaded_shards() == [1, 2]
    with pytest.raises(IndexError, match="out of range"):
        reader[9]
    with pytest.raises(IndexError, match="out of range"):
        reader[-10]


def test_values_match_reference_and_format_layer(server, shard_dir, tmp_path):
    from pyg_atompack import atp

    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    expected = []
    for shard, local in _oracle(shard_dir / "train"):
        ref = atompack.Database.open(str(shard_dir / "train" / shard))
        expected.append(float(ref[local].energy))
    assert _energies(reader, len(reader)) == expected
    with atp.open(shard_dir / "train") as local:
        assert len(local) == len(reader)
        np.testing.assert_array_equal(reader.n_atoms, local.n_atoms)
        assert set(reader.fields) == set(local.fields)
        for i in range(len(reader)):
            np.testing.assert_array_equal(reader[i].positions, local[i].positions)
            np.testing.assert_array_equal(reader[i].forces, local[i].forces)
        order = [8, 0, 3, 8, -9, 5]
        got, ref = reader.read_batch(order), local.read_batch(order)
        assert set(got) >= {"n_atoms", "positions", "atomic_numbers", "energy", "forces"}
        for key in ("n_atoms", "positions", "atomic_numbers", "energy", "forces"):
            np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        sub = reader.read_batch([1, 0], fields=["energy"])
        ref_sub = local.read_batch([1, 0], fields=["energy"])
        np.testing.assert_array_equal(sub["energy"], ref_sub["energy"])
        assert "forces" not in sub


def test_n_atoms_and_fields_without_downloading(server, shard_dir, tmp_path):
    from pyg_atompack.remote import atp_meta

    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    server.clear_requests()
    assert reader.n_atoms.tolist() == [3, 3, 2, 2, 2, 4, 4, 4, 4]
    assert {"positions", "atomic_numbers", "energy", "forces"} <= set(reader.fields)
    assert reader.fields["forces"].per_atom
    assert reader.downloaded_shards() == []
    assert _full_gets(server) == []
    # one range read per shard: its schema and index blocks together; the header slots
    # read when opening are not read again, and the fields come from the same read
    ranges = [r.headers.get("range", "") for r in server.requests_to("/resolve/")]
    assert len(ranges) == 3 and all(r.startswith("bytes=") for r in ranges)
    assert not [r for r in ranges if r.startswith("bytes=0-")]
    # reopened by another process (nothing in memory): counts and fields come from the
    # metadata cached on disk, with no request at all
    atp_meta._MEMORY.clear()
    again = hub.open_hub_atp(REPO, "train", revision=reader.revision, cache_dir=tmp_path,
                             endpoint=server.endpoint)
    server.clear_requests()
    assert again.n_atoms.tolist() == reader.n_atoms.tolist()
    assert set(again.fields) == set(reader.fields)
    assert server.requests == []


def test_fields_alone_read_only_the_schema_blocks(server, shard_dir, tmp_path):
    from pyg_atompack import atp

    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    server.clear_requests()
    with atp.open(shard_dir / "train") as local:
        assert reader.fields == local.fields
    file_requests = server.requests_to("/resolve/")
    assert len(file_requests) == 3  # one per shard
    schema_bytes = sum(header["schema_len"] for header in reader.headers)
    assert sum(r.body_bytes for r in file_requests + server.requests_to("/cdn/")) == \
        schema_bytes  # the index blocks were not read


def test_pickled_reader_reuses_listing_and_cache(server, shard_dir, tmp_path):
    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    first = float(reader[0].energy)
    server.clear_requests()
    clone = pickle.loads(pickle.dumps(reader))
    assert len(clone) == 9 and clone.downloaded_shards() == []
    assert float(clone[0].energy) == first
    assert float(clone[8].energy) == 303.0
    # the clone listed nothing and re-downloaded nothing already cached
    assert [r.path for r in server.requests if r.path.startswith("/api/")] == []
    assert [r.path.rsplit("/", 1)[-1] for r in _full_gets(server)] == ["part_2.atp"]
    reader.close()
    clone.close()


def test_pickled_reader_in_subprocess(server, tmp_path):
    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path / "cache",
                              endpoint=server.endpoint)
    blob = tmp_path / "reader.pkl"
    blob.write_bytes(pickle.dumps(reader))
    script = (
        "import pickle, sys\n"
        "r = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "print(len(r), float(r[2].energy), float(r[-1].energy), r.downloaded_shards())\n"
    )
    env = server.subprocess_env()
    env.pop("HF_ENDPOINT")  # the pickled URLs alone must reach the server
    out = subprocess.run([sys.executable, "-c", script, str(blob)], capture_output=True,
                         text=True, env=env, timeout=120, check=True)
    assert out.stdout.split() == ["9", "200.0", "303.0", "[1,", "2]"]
    assert {r.path.rsplit("/", 1)[-1] for r in _full_gets(server)} == {"part_1.atp",
                                                                       "part_2.atp"}


def test_listing_cache_skips_api_for_pinned_sha(server, tmp_path):
    sha = hub.resolve_revision(REPO, endpoint=server.endpoint)
    hub.open_hub_atp(REPO, "train", revision=sha, cache_dir=tmp_path, endpoint=server.endpoint)
    server.clear_requests()
    again = hub.open_hub_atp(REPO, "train", revision=sha, cache_dir=tmp_path,
                             endpoint=server.endpoint)
    assert len(again) == 9
    assert server.requests == []


def test_hf_uri_and_single_file(server, shard_dir, tmp_path):
    loc = hub.parse_hf_uri(f"hf://datasets/{REPO}@main/train/part_2.atp")
    reader = hub.open_hub_atp(loc.repo_id, loc.path_in_repo, revision=loc.revision,
                              cache_dir=tmp_path, endpoint=server.endpoint)
    assert len(reader) == 4 and reader.shards[0].name == "train/part_2.atp"
    assert float(reader[1].energy) == 301.0


def test_env_endpoint_in_subprocess(server, tmp_path):
    """HF_ENDPOINT set before import is honoured when no endpoint= is passed."""
    script = (
        "from pyg_atompack import hub\n"
        f"r = hub.open_hub_atp({REPO!r}, 'train', cache_dir={str(tmp_path)!r})\n"
        "print(len(r), float(r[0].energy))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=server.subprocess_env(), timeout=120, check=True)
    assert out.stdout.split() == ["9", "100.0"]


def test_open_errors(server, tmp_path):
    with pytest.raises(hub.HubNoShardsError, match=r"org/mols.*no \.atp"):
        hub.open_hub_atp(REPO, "README.md", cache_dir=tmp_path, endpoint=server.endpoint)
    with pytest.raises(hub.HubPathNotFoundError, match="missing"):
        hub.open_hub_atp(REPO, "missing", cache_dir=tmp_path, endpoint=server.endpoint)
    with pytest.raises(hub.HubRevisionNotFoundError, match="'v2'"):
        hub.open_hub_atp(REPO, "train", revision="v2", cache_dir=tmp_path,
                         endpoint=server.endpoint)


def test_not_an_atp_file_names_the_remote(fake_hub, tmp_path):
    from pyg_atompack import atp

    fake_hub.commit("org/bad", {"x/bogus.atp": b"not an atp file" * 1000})
    with pytest.raises(atp.AtpError, match=r"hf://datasets/org/bad@[0-9a-f]{40}/x/bogus\.atp"):
        hub.open_hub_atp("org/bad", "x", cache_dir=tmp_path, endpoint=fake_hub.endpoint)


def test_corrupted_shard_is_refused_on_first_read(server, files, tmp_path):
    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    true = files["train/part_2.atp"]
    server.serve_wrong_bytes(REPO, "train/part_2.atp", true[:-1] + bytes([true[-1] ^ 1]))
    with pytest.raises(hub.HubIntegrityError, match=r"train/part_2\.atp"):
        reader[-1]
    assert float(reader[0].energy) == 100.0  # other shards stay readable


def _assert_same(got, want, where="batch"):
    """Deep equality of read_batch values (dicts, arrays with dtypes, lists, scalars)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype, where
        if want.dtype == object:
            assert got.shape == want.shape, where
            for i, (g, w) in enumerate(zip(got, want)):
                _assert_same(g, w, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def test_read_batch_across_heterogeneous_shards_matches_local(fake_hub, golden_dir, tmp_path):
    """Shards with different fields (sparse builtins, custom and ragged properties)."""
    from pyg_atompack import atp

    layout = {"a/builtins_none.atp": "builtins_none.atp",
              "b/custom_props_none.atp": "custom_props_none.atp",
              "c/sparse_builtins.atp": "sparse_builtins.atp"}
    local_dir = tmp_path / "local"
    for dest, src in layout.items():
        (local_dir / dest).parent.mkdir(parents=True, exist_ok=True)
        (local_dir / dest).write_bytes((golden_dir / src).read_bytes())
    fake_hub.commit("org/het", local_dir)
    reader = hub.open_hub_atp("org/het", cache_dir=tmp_path / "cache",
                              endpoint=fake_hub.endpoint)
    with atp.open(local_dir) as local:
        assert len(reader) == len(local) == 11
        assert list(reader.fields) == list(local.fields)
        for order in ([10, 0, 6, 1, 5], [7, 6, 5], [0, 1, 2], [9, 9, -1, 4, 8, 3],
                      list(range(11))[::-1]):
            _assert_same(reader.read_batch(order), local.read_batch(order), f"batch{order}")
        fields = ["energy", "forces", "properties/p_str", "atom_properties/a_f64"]
        _assert_same(reader.read_batch([8, 2, 9], fields=fields),
                     local.read_batch([8, 2, 9], fields=fields))
        _assert_same(reader.read_batch([]), local.read_batch([]))


def test_concurrent_readers_download_a_shard_once(server, files, tmp_path):
    import threading

    reader = hub.open_hub_atp(REPO, "train", cache_dir=tmp_path, endpoint=server.endpoint)
    server.clear_requests()
    server.delay_s = 0.05  # widen the window in which threads race
    energies: list[float] = []
    threads = [threading.Thread(target=lambda: energies.append(float(reader[-1].energy)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert energies == [303.0] * 4
    assert len(_full_gets(server)) == 1
    # a second reader object (as in another worker) shares the verified cache entry
    other = pickle.loads(pickle.dumps(reader))
    paths = other.download_all(max_workers=3)
    assert [p.read_bytes() for p in paths] == [files[s.name] for s in other.shards]
    assert len(_full_gets(server)) == 3  # only the two shards not yet cached


def test_listing_cache_is_per_endpoint(fake_hub, files, tmp_path):
    sha = fake_hub.commit(REPO, files)
    hub.open_hub_atp(REPO, "train", revision=sha, cache_dir=tmp_path, endpoint=fake_hub.endpoint)
    with FakeHub().start() as mirror:
        mirror.commit(REPO, files)
        mirror_sha = hub.resolve_revision(REPO, endpoint=mirror.endpoint)
        assert mirror_sha == sha  # the same commit, served by a mirror
        reader = hub.open_hub_atp(REPO, "train", revision=mirror_sha, cache_dir=tmp_path,
                                  endpoint=mirror.endpoint)
        assert all(s.url.startswith(mirror.endpoint) for s in reader.shards)
        assert float(reader[0].energy) == 100.0


def test_hub_layer_does_not_import_torch():
    code = ("import sys, pyg_atompack.hub\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import pyg_atompack\n"
            "assert pyg_atompack.hub.open_hub_atp is not None\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_pinned_and_cached_dataset_opens_without_server(fake_hub, files, tmp_path):
    sha = fake_hub.commit(REPO, files)
    reader = hub.open_hub_atp(REPO, "train", revision=sha, cache_dir=tmp_path,
                              endpoint=fake_hub.endpoint)
    reader.download_all()
    endpoint = fake_hub.endpoint
    fake_hub.stop()  # from here on every request would fail
    again = hub.open_hub_atp(REPO, "train", revision=sha, cache_dir=tmp_path, endpoint=endpoint)
    assert [float(again[i].energy) for i in (0, 2, -1)] == [100.0, 200.0, 303.0]
    with pytest.raises(hub.HubTransferError, match="org/mols"):
        hub.open_hub_atp(REPO, "train", revision="main", cache_dir=tmp_path, endpoint=endpoint,
                         policy=FAST)


def test_local_and_hub_readers_share_one_index_and_batching(fake_hub, tmp_path):
    """The same shards read locally, downloaded from the Hub and by record from the Hub go
    through one ShardedReader: the same global index, the same batches, and the same
    errors, naming the user's file (never a cache path) and the record as the file numbers it.
    """
    import re

    from pyg_atompack import atp
    from pyg_atompack.atp.sharded import ShardedReader

    local_dir = tmp_path / "local"
    for name, (count, atoms, seed) in {"a.atp": (3, 2, 1), "b.atp": (4, 3, 2),
                                       "c.atp": (2, 4, 3)}.items():
        write_reference_shard(local_dir / "train" / name, count, atoms, seed=seed)
    damaged = local_dir / "train" / "b.atp"
    with atp.open(damaged) as shard:  # wreck the zstd frame of record 2 of b.atp
        offset, stored = int(shard.index["offset"][2]), int(shard.index["stored"][2])
    data = bytearray(damaged.read_bytes())
    data[offset:offset + stored] = b"\x00" * stored
    damaged.write_bytes(bytes(data))
    fake_hub.commit("org/one", local_dir)
    downloaded = hub.open_hub_atp("org/one", "train", cache_dir=tmp_path / "dl",
                                  endpoint=fake_hub.endpoint)
    by_record = downloaded.by_record(cache_dir=tmp_path / "pages", cache_bytes=1 << 20)
    local = atp.open(local_dir / "train")
    readers = {"local": local, "downloaded": downloaded, "by record": by_record}
    for reader in readers.values():
        assert isinstance(reader, ShardedReader)
    for method in ("__len__", "__getitem__", "__iter__", "locate", "read_batch"):
        assert getattr(hub.HubAtpReader, method) is getattr(ShardedReader, method), method

    good = [i for i in range(9) if i != 5]  # global 5 = record 2 of b.atp
    for name, reader in readers.items():
        assert len(reader) == 9 and reader.n_atoms.tolist() == local.n_atoms.tolist()
        assert [reader.locate(i) for i in range(-9, 9)] == [local.locate(i)
                                                             for i in range(-9, 9)]
        for i in good:
            np.testing.assert_array_equal(reader[i].positions, local[i].positions, name)
        order = [8, 0, 4, 8, -9, 6, 1]
        _assert_same(reader.read_batch(order), local.read_batch(order), name)
        _assert_same(reader.read_batch(order, fields=["energy"]),
                     local.read_batch(order, fields=["energy"]), name)

    def failure(reader, call):
        with pytest.raises(atp.AtpError) as caught:
            call(reader)
        return caught.value

    hub_name = f"hf://datasets/org/one@{downloaded.revision}/train"
    for call in (lambda r: r[9], lambda r: r[-10], lambda r: r.read_batch([0, 9]),
                 lambda r: r["1"], lambda r: r[5], lambda r: r.read_batch([8, 5, 3, 0])):
        want = failure(local, call)
        for name, reader in readers.items():
            got = failure(reader, call)
            assert type(got) is type(want), (name, got, want)
            # the same message, naming the Hub dataset or shard where the local one names
            # the directory or file
            assert str(got).replace(hub_name, str(local_dir / "train")) == str(want), name
            if isinstance(want, atp.RecordDecodeError):
                assert str(got).startswith(f"{reader.path}/b.atp: record 2: "), got
    assert re.match(rf"{re.escape(str(damaged))}: record 2\b", str(failure(local,
                                                                            lambda r: r[5])))
    assert downloaded.downloaded_shards() == [0, 1, 2] and by_record.downloaded_shards() == []
