"""Publishing with ``hub.push`` / ``pyg-atompack push`` and ``pull``, against the loopback fake Hub.

The real huggingface_hub client uploads (repo creation, preupload, LFS batch and
object upload, commit) to ``tests/servers/hub_upload_routes.py``; Xet is disabled
(``HF_HUB_DISABLE_XET``), since with ``hf_xet`` installed the client would upload
through the Xet CAS, which the fake does not model. What was published is read
back with ``AtompackDataset.from_hub``, ``ShardStreamDataset("hf://...")`` and
the reference ``atompack.hub.open``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from servers.fake_hub import FakeHub, serve_fake_hub
from servers.hub_upload_routes import WRITE_TOKEN, upload_state
from test_loader import assert_data_equal

from pyg_atompack import AtompackDataset, cli, convert, hub
from pyg_atompack.hub import card
from pyg_atompack.hub import remote as hub_remote
from pyg_atompack.hub import transfer as hub_transfer

REPO = "org/water"
N_STRUCTURES = 25


@pytest.fixture(scope="module")
def xyz(tmp_path_factory) -> Path:
    """25 water-like structures with energies and forces, as extxyz."""
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    rng = np.random.default_rng(7)
    frames = []
    for i in range(N_STRUCTURES):
        atoms = Atoms("H2O" if i % 2 else "CH4", positions=rng.normal(size=(3 if i % 2 else 5, 3)))
        atoms.calc = SinglePointCalculator(atoms, energy=-10.0 - i,
                                           forces=rng.normal(size=(len(atoms), 3)))
        frames.append(atoms)
    path = tmp_path_factory.mktemp("publish") / "water.xyz"
    write(path, frames, format="extxyz")
    return path


@pytest.fixture(scope="module")
def local_shards(xyz, tmp_path_factory) -> Path:
    """The same conversion push makes (zstd, 10 per shard), done locally: the oracle."""
    out = tmp_path_factory.mktemp("oracle") / "shards"
    convert.convert(xyz, out, dst_format="atp-shards",
                    write_options=convert.WriteOptions(compression="zstd", shard_size=10))
    return out


@pytest.fixture(autouse=True)
def _client_settings(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    # never pick up a token saved on this machine
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)


@pytest.fixture
def fake_hub() -> FakeHub:
    yield from serve_fake_hub()


def _push(server: FakeHub, source, **kwargs) -> hub.PushResult:
    import huggingface_hub
    from huggingface_hub import constants

    kwargs.setdefault("token", WRITE_TOKEN)
    with pytest.MonkeyPatch.context() as patch:
        if huggingface_hub.__version__.startswith("0."):
            # 0.x commits only to HF_ENDPOINT (test_push_to_an_endpoint_other_than_hf_endpoint);
            # only around the push: 0.x downloads build URLs from the HF_ENDPOINT of import time
            patch.setattr(constants, "ENDPOINT", server.endpoint)
        return hub.push(source, REPO, endpoint=server.endpoint, **kwargs)


def _files(server: FakeHub, commit: str, repo: str = REPO) -> dict[str, bytes]:
    sha = hub.resolve_revision(repo, commit, token=WRITE_TOKEN, endpoint=server.endpoint)
    listed = hub.list_remote_files(repo, revision=sha, token=WRITE_TOKEN,
                                   endpoint=server.endpoint)
    return {f.name: hub_transfer.fetch_bytes(f, token=WRITE_TOKEN) for f in listed}


def _writes(server: FakeHub) -> list[str]:
    """Requests that change something on the Hub (or upload bytes)."""
    return [f"{r.method} {r.path}" for r in server.requests
            if r.method == "PUT" or (r.method == "POST" and any(
                key in r.path for key in ("/repos/create", "/preupload/", "/commit/",
                                          "lfs/objects/batch")))]


def _put_oids(server: FakeHub) -> list[str]:
    return [r.path.rsplit("/", 1)[-1] for r in server.requests if r.method == "PUT"]


# ---------------------------------------------------------------------- publish and read back
def test_push_converted_dataset_and_read_it_back(fake_hub, xyz, local_shards, tmp_path):
    from pyg_atompack.stream import RemoteSource, ShardStreamDataset

    result = _push(fake_hub, xyz, path_in_repo="train", create=True, shard_size=10)
    head = hub.resolve_revision(REPO, "main", token=WRITE_TOKEN, endpoint=fake_hub.endpoint)
    assert result.commit == head and hub_remote.is_commit_sha(result.commit)
    assert result.uri == f"hf://datasets/{REPO}@{head}/train"
    assert result.card == "written" and result.deleted == ()
    files = _files(fake_hub, head)
    shard_names = ["shard_00000.atp", "shard_00001.atp", "shard_00002.atp"]
    assert sorted(files) == sorted([".gitattributes", "README.md", "train/manifest.json"]
                                   + [f"train/{n}" for n in shard_names])
    for name in shard_names:  # deterministic conversion: the oracle's bytes exactly
        assert files[f"train/{name}"] == (local_shards / name).read_bytes()
    assert len([c for c in fake_hub.requests_to("/commit/", "POST")]) == 1  # one commit

    manifest = json.loads(files["train/manifest.json"])
    assert [s["name"] for s in manifest["shards"]] == shard_names
    assert [s["records"] for s in manifest["shards"]] == [10, 10, 5]
    for entry in manifest["shards"]:
        data = files[f"train/{entry['name']}"]
        assert entry["bytes"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert manifest["total_records"] == N_STRUCTURES
    assert manifest["total_atoms"] == 13 * 5 + 12 * 3  # 13 CH4, 12 H2O
    assert manifest["elements"] == ["H", "C", "O"]
    assert manifest["fields"]["positions"] == {"dtype": "float64", "shape": ["n", 3],
                                               "per_atom": True, "description": "float64[n,3]"}
    assert manifest["fields"]["energy"]["dtype"] == "float64"
    assert manifest["fields"]["energy"]["per_atom"] is False
    assert manifest["units"] == {"positions": "Å", "energy": "eV", "forces": "eV/Å"}
    assert manifest["source"] == {"name": "water.xyz", "format": "ase"}
    assert manifest["converter"]["name"] == "pyg_atompack"
    assert manifest["compression"] == "zstd"

    from huggingface_hub import DatasetCard

    readme = DatasetCard(files["README.md"].decode())
    assert card.is_generated(readme.content)
    assert readme.data.license == "other"
    assert {"atomistic", "chemistry", "pyg"} <= set(readme.data.tags)
    assert readme.data.size_categories == ["n<1K"]
    assert "| structures | 25 |" in readme.text and "| elements | H, C, O |" in readme.text
    assert "| `forces` | `float64[n,3]` (per atom) | eV/Å |" in readme.text
    for loader in ("AtompackDataset.from_hub", "ShardStreamDataset", "atompack.hub.open"):
        assert loader in readme.text

    local = AtompackDataset(local_shards)
    remote = AtompackDataset.from_hub(REPO, "train", revision=result.commit,
                                      cache_dir=tmp_path / "cache", endpoint=fake_hub.endpoint,
                                      token=WRITE_TOKEN)
    assert len(remote) == len(local) == N_STRUCTURES
    for index in range(len(local)):
        assert_data_equal(remote[index], local[index], f"hub[{index}]")
    source = RemoteSource(f"hf://datasets/{REPO}@{result.commit}/train", pattern="*.atp",
                          endpoint=fake_hub.endpoint, token=WRITE_TOKEN)
    streamed = list(ShardStreamDataset(source))
    assert [float(d.energy) for d in streamed] == [float(d.energy) for d in local]
    for index, data in enumerate(streamed):
        assert_data_equal(data, local[index], f"stream[{index}]")

    again = _push(fake_hub, xyz, path_in_repo="train", shard_size=10)  # nothing changed
    assert again.commit == result.commit and again.uploaded == ()
    assert len(again.unchanged) == 5 and again.card == "unchanged"


def test_interrupted_push_resumes_with_only_the_missing_shards(fake_hub, xyz, local_shards,
                                                               monkeypatch):
    import time

    # the client retries a dropped upload 5 times with 1..8 s pauses: shorten the pauses
    # (every huggingface_hub line sleeps with time.sleep; nothing here polls with it)
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda seconds: sleep(min(seconds, 0.01)))
    oids = [hashlib.sha256((local_shards / f"shard_0000{i}.atp").read_bytes()).hexdigest()
            for i in range(3)]
    state = upload_state(fake_hub)
    state.drop_uploads_of((local_shards / "shard_00001.atp").read_bytes())
    with pytest.raises(hub.HubTransferError, match=r"train/shard_00001\.atp.*run the same push "
                                                   r"again to resume"):
        _push(fake_hub, xyz, path_in_repo="train", create=True, shard_size=10)
    dropped = [r for r in fake_hub.requests if r.method == "PUT" and r.status == -1]
    assert dropped and all(r.path.endswith(oids[1]) for r in dropped)
    assert set(state.objects) == {oids[0]}  # the first shard made it, nothing else
    assert fake_hub.requests_to("/commit/") == []  # nothing was committed
    assert sorted(_files(fake_hub, "main")) == [".gitattributes"]

    state.stop_dropping()
    fake_hub.clear_requests()
    result = _push(fake_hub, xyz, path_in_repo="train", shard_size=10)
    assert _put_oids(fake_hub) == [oids[1], oids[2]]  # shard 0 was not sent again
    files = _files(fake_hub, result.commit)
    for i in range(3):
        name = f"shard_0000{i}.atp"
        assert files[f"train/{name}"] == (local_shards / name).read_bytes()


def test_stale_shards_are_removed_and_unchanged_ones_not_resent(fake_hub, local_shards, tmp_path):
    result = _push(fake_hub, local_shards, path_in_repo="data", create=True)
    assert result.manifest["source"]["name"] == "shards"
    smaller = tmp_path / "smaller"
    smaller.mkdir()
    for name in ("shard_00000.atp", "shard_00001.atp"):
        (smaller / name).write_bytes((local_shards / name).read_bytes())
    fake_hub.clear_requests()
    second = _push(fake_hub, smaller, path_in_repo="data")
    assert second.deleted == ("data/shard_00002.atp",)
    assert set(second.unchanged) == {"data/shard_00000.atp", "data/shard_00001.atp"}
    assert _put_oids(fake_hub) == []  # no shard bytes crossed the wire
    files = _files(fake_hub, second.commit)
    assert sorted(p for p in files if p.endswith(".atp")) == ["data/shard_00000.atp",
                                                              "data/shard_00001.atp"]
    assert json.loads(files["data/manifest.json"])["total_records"] == 20
    assert len(AtompackDataset.from_hub(REPO, "data", revision=second.commit,
                                        cache_dir=tmp_path / "c", endpoint=fake_hub.endpoint,
                                        token=WRITE_TOKEN)) == 20

    # a shard no push of ours listed is someone else's: refuse, do not delete it
    fake_hub.commit(REPO, {"data/theirs.atp": files["data/shard_00000.atp"]}, replace=False)
    fake_hub.clear_requests()
    with pytest.raises(hub.HubPublishError, match=r"data/theirs\.atp.*nothing was uploaded"):
        _push(fake_hub, smaller, path_in_repo="data")
    assert _writes(fake_hub) == []


def test_size_categories():
    assert [card.size_category(n) for n in (0, 999, 1000, 25_000, 10**6, 3 * 10**10)] == [
        "n<1K", "n<1K", "1K<n<10K", "10K<n<100K", "1M<n<10M", "10B<n<100B"]


def test_shard_size_reshards_an_atp_source(fake_hub, local_shards, tmp_path):
    result = _push(fake_hub, local_shards / "shard_00000.atp", create=True, shard_size=4,
                   compression="lz4")
    assert [s["records"] for s in result.manifest["shards"]] == [4, 4, 2]
    assert result.manifest["compression"] == "lz4"
    assert result.manifest["source"] == {"name": "shard_00000.atp", "format": "atp"}
    local = AtompackDataset(local_shards / "shard_00000.atp")
    assert [float(d.energy) for d in AtompackDataset.from_hub(
        REPO, "", revision=result.commit, endpoint=fake_hub.endpoint, token=WRITE_TOKEN,
        cache_dir=tmp_path)] == [float(d.energy) for d in local]


def test_hand_written_card_is_kept_unless_overwritten(fake_hub, local_shards, tmp_path):
    hand = b"---\nlicense: mit\n---\n# My water set\n\nWritten by hand.\n"
    fake_hub.commit(REPO, {"README.md": hand})
    single = local_shards / "shard_00002.atp"
    kept = _push(fake_hub, single, path_in_repo="val")
    assert kept.card == "kept"
    files = _files(fake_hub, kept.commit)
    assert files["README.md"] == hand and "val/shard_00002.atp" in files
    assert "README.md" not in kept.uploaded

    extra = tmp_path / "cite.md"
    extra.write_text("Please cite: A. Author, *Water*, 2026.\n")
    replaced = _push(fake_hub, single, path_in_repo="val", overwrite_card=True, license="mit",
                     card_extra=extra)
    assert replaced.card == "replaced" and replaced.uploaded == ("README.md",)
    text = _files(fake_hub, replaced.commit)["README.md"].decode()
    assert card.is_generated(text) and "Please cite: A. Author" in text
    assert "license: mit" in text and "Written by hand" not in text

    # a generated card gains a section per path and keeps the others
    updated = _push(fake_hub, local_shards, path_in_repo="train")
    assert updated.card == "updated"
    text = _files(fake_hub, updated.commit)["README.md"].decode()
    assert text.count("<!-- pyg_atompack:section") == 2
    assert "Please cite: A. Author" in text and "license: mit" in text
    assert "## Contents of `train`" in text and "## Contents of `val`" in text


def test_pt_shard_directory_is_published_as_is(fake_hub, tmp_path):
    from servers.http_server import write_pt_shards

    from pyg_atompack.stream import RemoteSource, ShardStreamDataset

    root = tmp_path / "pt"
    root.mkdir()
    write_pt_shards(root, [3, 4])
    (root / "manifest.json").unlink()  # no manifest: push writes one
    result = _push(fake_hub, root, create=True, private=True)
    with pytest.raises(hub.HubRepositoryNotFoundError):  # private: invisible without the token
        hub.resolve_revision(REPO, token=False, endpoint=fake_hub.endpoint)
    manifest = result.manifest
    assert manifest["shard_format"] == "pt" and manifest["total_records"] == 7
    assert [s["name"] for s in manifest["shards"]] == ["shard-0000.pt", "shard-0001.pt"]
    assert "sample_id" in str(manifest["fields"])
    streamed = list(ShardStreamDataset(RemoteSource(f"hf://datasets/{REPO}@{result.commit}",
                                                    pattern="*.pt", endpoint=fake_hub.endpoint,
                                                    token=WRITE_TOKEN)))
    assert [int(d.sample_id) for d in streamed] == [0, 1, 2, 1000, 1001, 1002, 1003]


# ---------------------------------------------------------------------- bad input
def _cli(monkeypatch, capsys, server: FakeHub, *argv: str, token: str | None = WRITE_TOKEN):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    server.clear_requests()
    code = cli.main(list(argv))
    return code, capsys.readouterr()


def _assert_refused(code, captured, server: FakeHub, *fragments: str) -> None:
    lines = captured.err.strip().splitlines()
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("pyg-atompack: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "nothing was uploaded" in lines[0]
    assert WRITE_TOKEN not in captured.err
    assert _writes(server) == []


def test_corrupt_shards_fail_before_anything_is_uploaded(fake_hub, local_shards, tmp_path,
                                                         monkeypatch, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for shard in local_shards.iterdir():
        (damaged / shard.name).write_bytes(shard.read_bytes())
    data = bytearray((damaged / "shard_00001.atp").read_bytes())
    data[9000] ^= 0xFF  # a flipped bit only the manifest's sha256 can see
    (damaged / "shard_00001.atp").write_bytes(bytes(data))
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", str(damaged), REPO,
                          "--create", "-q"), fake_hub, str(damaged), "shard_00001.atp", "sha256")

    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", str(local_shards), REPO,
                          "--create", "--shard-size", "0"), fake_hub, "shard_size")

    truncated = tmp_path / "truncated.atp"
    truncated.write_bytes((local_shards / "shard_00000.atp").read_bytes()[:-300])
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", str(truncated), REPO,
                          "--create", "-q"), fake_hub, "truncated.atp")


def test_missing_token_model_repo_and_unknown_branch_fail_before_upload(
        fake_hub, local_shards, monkeypatch, capsys):
    shards = str(local_shards)
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", shards, REPO, "--create",
                          token=None), fake_hub, "no Hub token", "HF_TOKEN")
    fake_hub.commit("org/net", {"config.json": b"{}"}, repo_type="model")
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", shards, "org/net"),
                    fake_hub, "'org/net' exists as a model repository")
    fake_hub.commit(REPO, {"README.md": b"# water\n"})
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", shards, REPO,
                          "--revision", "nope"), fake_hub, "org/water", "'nope'",
                    "branch not found")
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", shards, "org/absent"),
                    fake_hub, "'org/absent' not found", "--create")
    _assert_refused(*_cli(monkeypatch, capsys, fake_hub, "push", shards, REPO,
                          token="hf_wrong"), fake_hub, "rejected the token")


def test_push_to_an_endpoint_other_than_hf_endpoint(local_shards, monkeypatch):
    """huggingface_hub 1.x+ commits to the endpoint of the call; 0.x reads the commit's URL
    against HF_ENDPOINT (and raises after committing), so push refuses before uploading."""
    import huggingface_hub
    from huggingface_hub import constants

    for server in serve_fake_hub():
        monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
        push = {"token": WRITE_TOKEN, "endpoint": server.endpoint, "path_in_repo": "train",
                "create": True}
        if huggingface_hub.__version__.startswith("0."):
            with pytest.raises(hub.HubPublishError, match=rf"huggingface_hub 0\..*cannot commit "
                               rf"to {server.endpoint} while HF_ENDPOINT is https://hub\.invalid"
                               r".*nothing was uploaded"):
                hub.push(local_shards, REPO, **push)
            assert server.requests == []  # refused before asking anything
        else:
            result = hub.push(local_shards, REPO, **push)
            assert sorted(_files(server, result.commit)) == [
                ".gitattributes", "README.md", "train/manifest.json", "train/shard_00000.atp",
                "train/shard_00001.atp", "train/shard_00002.atp"]


# ---------------------------------------------------------------------- pull
def test_pull_downloads_and_verifies(fake_hub, local_shards, tmp_path):
    result = _push(fake_hub, local_shards, path_in_repo="train", create=True)
    pulled = hub.pull(REPO, tmp_path / "copy", "train", revision=result.commit,
                      token=WRITE_TOKEN, endpoint=fake_hub.endpoint)
    assert pulled.commit == result.commit and pulled.root == tmp_path / "copy" / "train"
    assert [p.name for p in pulled.files] == ["manifest.json", "shard_00000.atp",
                                              "shard_00001.atp", "shard_00002.atp"]
    for name in ("shard_00000.atp", "shard_00001.atp", "shard_00002.atp"):
        assert (pulled.root / name).read_bytes() == (local_shards / name).read_bytes()
    assert AtompackDataset(pulled.root)[24].energy.item() == -34.0
    true = (local_shards / "shard_00001.atp").read_bytes()
    fake_hub.serve_wrong_bytes(REPO, "train/shard_00001.atp", true[:-1] + bytes([true[-1] ^ 1]))
    with pytest.raises(hub.HubIntegrityError, match=r"train/shard_00001\.atp"):
        hub.pull(REPO, tmp_path / "other", "train", revision=result.commit, token=WRITE_TOKEN,
                 endpoint=fake_hub.endpoint)
    assert hub.pull.__module__ == "pyg_atompack.hub.pull"


@pytest.mark.parametrize(("spec", "expected"), [
    ("org/data", ("org/data", "", None)),
    ("org/data/omat/train@main", ("org/data", "omat/train", "main")),
    ("hf://datasets/org/data@v1/x", ("org/data", "x", "v1")),
])
def test_pull_spec(spec, expected):
    from pyg_atompack.hub.pull import parse_pull_spec

    assert parse_pull_spec(spec) == expected
    with pytest.raises(hub.HubURIError):
        parse_pull_spec("justaname@")


# ---------------------------------------------------------------------- one command each way
def test_cli_push_then_reference_reader_and_pull(fake_hub, xyz, local_shards, tmp_path):
    env = fake_hub.subprocess_env()
    env.update({"HF_TOKEN": WRITE_TOKEN, "HF_HUB_DISABLE_XET": "1",
                "HF_HOME": str(tmp_path / "hf_home")})
    pushed = subprocess.run(
        [sys.executable, "-m", "pyg_atompack.cli", "push", str(xyz), REPO, "--create",
         "--path-in-repo", "train", "--shard-size", "10", "-q"],
        env=env, capture_output=True, text=True, timeout=240)
    assert pushed.returncode == 0, pushed.stderr
    commit_line, uri = pushed.stdout.strip().splitlines()[-2:]
    sha = commit_line.split()[1]
    assert uri == f"hf://datasets/{REPO}@{sha}/train"
    assert WRITE_TOKEN not in pushed.stdout + pushed.stderr

    script = ("import sys, atompack.hub\n"
              "r = atompack.hub.open(sys.argv[1], 'train', revision=sys.argv[2],"
              " cache_dir=sys.argv[3])\n"
              "print(len(r), [float(r[i].energy) for i in range(len(r))])\n")
    opened = subprocess.run([sys.executable, "-c", script, REPO, sha, str(tmp_path / "ref")],
                            env=env, capture_output=True, text=True, timeout=240)
    assert opened.returncode == 0, opened.stderr
    local = AtompackDataset(local_shards)
    assert opened.stdout.strip() == (f"{N_STRUCTURES} "
                                     f"{[float(local[i].energy) for i in range(len(local))]}")

    pulled = subprocess.run(
        [sys.executable, "-m", "pyg_atompack.cli", "pull", f"{REPO}/train@{sha}",
         str(tmp_path / "copy")], env=env, capture_output=True, text=True, timeout=240)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().splitlines()[-1] == str(tmp_path / "copy" / "train")
    assert (tmp_path / "copy" / "train" / "shard_00002.atp").read_bytes() == \
        (local_shards / "shard_00002.atp").read_bytes()


def test_a_branch_that_moves_during_the_push_is_not_overwritten(fake_hub, local_shards):
    fake_hub.commit(REPO, {"README.md": b"# water\n"})

    def someone_else_commits(total):  # called between the checks and the commit
        fake_hub.commit(REPO, {"other.txt": b"meanwhile"}, replace=False)
        return types.SimpleNamespace(update=lambda n: None, close=lambda: None)

    with pytest.raises(hub.HubTransferError, match="branch moved"):
        _push(fake_hub, local_shards, path_in_repo="train", progress=someone_else_commits)
    assert sorted(_files(fake_hub, "main")) == ["README.md", "other.txt"]
