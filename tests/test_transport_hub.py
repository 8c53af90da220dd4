"""The one transport against the faithful fake Hub: credentials, retries, gates, offline.

Every test runs with a Hub token set (``HF_TOKEN``), as a logged-in user would: the fake
Hub's CDN (a second origin) answers 400 to any request that carries it, as pre-signed
storage URLs do.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from servers.fake_hub import FakeHub, serve_fake_hub, write_reference_shard

from pyg_atompack import AtompackDataset, hub
from pyg_atompack.hub import transfer as hub_transfer
from pyg_atompack.transport import (
    RemoteAuthError,
    RemoteNotFoundError,
    RemoteUnavailableError,
    RetryPolicy,
    TransportError,
)

REPO = "org/remote"
TOKEN = "hf_fake_user_token_123"
FAST = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=0.5,
                   connect_timeout=2.0)


@pytest.fixture(autouse=True)
def logged_in(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def shard_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    write_reference_shard(root / "train" / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(root / "train" / "part_1.atp", 4, 3, seed=2)
    (root / "README.md").write_text("a small plain git file\n")
    return root


@pytest.fixture
def server(shard_root) -> FakeHub:
    for started in serve_fake_hub():
        started.commit(REPO, shard_root)
        started.stall_s = 3.0
        yield started


def _open(server: FakeHub, cache: Path, **options):
    return hub.open_hub_atp(REPO, "train", cache_dir=cache, endpoint=server.endpoint,
                            policy=FAST, **options)


def test_token_goes_to_the_hub_and_never_to_the_cdn(server, shard_root, tmp_path):
    dataset = AtompackDataset(_open(server, tmp_path / "cache"))
    local = AtompackDataset(shard_root / "train")
    assert [float(dataset[i].energy) for i in range(7)] == \
        [float(local[i].energy) for i in range(7)]
    readme = hub.list_remote_files(REPO, "README.md", revision="main",
                                   endpoint=server.endpoint, policy=FAST)[0]
    assert hub_transfer.fetch_bytes(readme, policy=FAST) == (shard_root / "README.md").read_bytes()
    hub_side = [r for r in server.requests if r.origin == "hub"]
    cdn_side = [r for r in server.requests if r.origin == "cdn"]
    assert hub_side and cdn_side
    # every Hub request (API, resolve/, the small file's relative 307 target) was
    # authenticated; no CDN request ever was, so none was refused
    assert all(r.headers.get("authorization") == f"Bearer {TOKEN}" for r in hub_side)
    assert all("authorization" not in r.headers for r in cdn_side)
    assert all(r.status in (200, 206) for r in cdn_side)
    readme_requests = [("resolve-cache" if "/resolve-cache/" in r.path else "resolve", r.status)
                       for r in server.requests_to("/README.md") if "resolve" in r.path]
    assert readme_requests == [("resolve", 307), ("resolve-cache", 200)]


def test_the_cdn_refuses_a_forwarded_token(server):
    """The fake's second origin bites: a client that forwards the token fails there."""
    target = hub.list_remote_files(REPO, "train/part_0.atp", revision="main",
                                   endpoint=server.endpoint, policy=FAST)[0]
    answer = httpx.get(target.url, headers={"Authorization": f"Bearer {TOKEN}"})
    location = answer.headers["location"]
    assert answer.status_code == 302 and location.startswith(server.cdn_endpoint)
    assert httpx.get(location, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 400
    assert httpx.get(location).status_code == 200


@pytest.mark.parametrize("route", ["api", "resolve", "cdn"])
@pytest.mark.parametrize("kind", ["502", "503", "stall"])
def test_transient_faults_on_every_route_are_retried(server, tmp_path, route, kind):
    server.fail(route, kind, times=2)
    reader = _open(server, tmp_path / "cache")
    assert len(reader) == 7
    assert float(reader[-1].energy) == 203.0
    faulted = [r for r in server.requests if r.fault == kind]
    assert len(faulted) == 2


def test_rate_limit_header_is_honoured_without_retry_after(server):
    server.fail("api", "429")  # RateLimit: "api";r=0;t=1 and no Retry-After
    sha = hub.resolve_revision(REPO, endpoint=server.endpoint, policy=FAST)
    first, second = server.requests_to("/revision/")
    assert first.status == 429 and "retry-after" not in first.headers
    assert second.status == 200 and len(sha) == 40
    # the backoff alone would be ~0.01 s; the Hub said the window resets in 1 s
    assert second.started - first.started >= 0.9


def test_persistent_failure_gives_up_naming_the_file_without_secrets(server, tmp_path):
    reader = _open(server, tmp_path / "cache")
    server.fail("cdn", "503", times=10)
    with pytest.raises(hub.HubTransferError) as caught:
        reader[0]
    message = str(caught.value)
    assert "org/remote" in message and "train/part_0.atp" in message
    assert "after 4 attempts" in message and "HTTP 503" in message
    assert TOKEN not in message
    assert isinstance(caught.value, TransportError)
    assert len([r for r in server.requests if r.fault == "503"]) == 4
    # nothing from the failed download is left in the cache
    assert not [p for p in (tmp_path / "cache").rglob("*")
                if p.is_file() and ("blobs" in p.parts or "versions" in p.parts)
                and not p.name.endswith(".lock")]


def test_gated_repository_is_told_apart(server, shard_root, tmp_path):
    server.commit("org/gated", shard_root)
    server.make_gated("org/gated", granted=("hf_granted",))
    common = {"cache_dir": tmp_path / "cache", "endpoint": server.endpoint, "policy": FAST}
    # the listing is public, the files are not: anonymous -> 401, not granted -> 403
    with pytest.raises(hub.HubGatedRepoError, match=r"gated \(HTTP 401.*no token.*"
                       r"datasets/org/gated.*HF_TOKEN"):
        hub.open_hub_atp("org/gated", "train", token=False, **common)
    with pytest.raises(hub.HubGatedRepoError, match=r"gated \(HTTP 403.*not been granted"):
        hub.open_hub_atp("org/gated", "train", **common)
    granted = hub.open_hub_atp("org/gated", "train", token="hf_granted", **common)
    assert float(granted[0].energy) == 100.0
    assert issubclass(hub.HubGatedRepoError, RemoteAuthError)
    # a missing repository and a private one without token are "not found", with the status
    with pytest.raises(hub.HubRepositoryNotFoundError, match=r"HTTP 404") as missing:
        hub.resolve_revision("org/absent", endpoint=server.endpoint, policy=FAST)
    assert isinstance(missing.value, RemoteNotFoundError)
    server.commit("org/private", shard_root, token="owner-token")
    with pytest.raises(hub.HubRepositoryNotFoundError, match=r"HTTP 401.*private"):
        hub.resolve_revision("org/private", token=False, endpoint=server.endpoint,
                             policy=FAST)


def test_offline_mode_uses_recorded_branch_and_cached_shards(server, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "cache"
    online = _open(server, cache, revision="main")
    online.download_all()
    energies = [float(online[i].energy) for i in range(len(online))]
    server.clear_requests()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    offline = _open(server, cache, revision="main")
    assert offline.revision == online.revision
    assert [float(offline[i].energy) for i in range(len(offline))] == energies
    assert server.requests == []  # nothing asked of the Hub
    with pytest.raises(hub.HubOfflineError, match=r"'v2'.*HF_HUB_OFFLINE=1.*never resolved"):
        _open(server, cache, revision="v2")
    # a commit whose listing is not cached cannot be opened offline: a clear error
    with pytest.raises(hub.HubOfflineError, match="HF_HUB_OFFLINE"):
        hub.open_hub_atp(REPO, "train", revision=online.revision, cache_dir=tmp_path / "other",
                         endpoint=server.endpoint, policy=FAST)


def test_unreachable_hub_is_bounded(tmp_path):
    spare = FakeHub()
    endpoint = spare.endpoint
    spare.server_close()
    with pytest.raises(hub.HubTransferError, match="after 4 attempts") as caught:
        hub.resolve_revision(REPO, endpoint=endpoint, policy=FAST)
    assert isinstance(caught.value.__cause__, RemoteUnavailableError)


def test_pickled_hub_source_holds_no_token_and_still_streams(server):
    import io
    import pickle

    import torch
    from servers.http_server import make_samples

    from pyg_atompack.stream import RemoteSource, ShardStreamDataset

    buffer = io.BytesIO()
    torch.save(make_samples(7, 3), buffer)
    server.commit("org/streamed", {"s/a.pt": buffer.getvalue()})
    source = RemoteSource("hf://datasets/org/streamed/s", endpoint=server.endpoint, retry=FAST)
    blob = pickle.dumps(source)
    assert TOKEN.encode() not in blob  # the logged-in token is read when needed
    clone = pickle.loads(blob)
    assert [int(s.sample_id) for s in ShardStreamDataset(clone)] == [7000, 7001, 7002]
    downloads = server.requests_to("/s/a.pt")
    assert downloads[-1].headers["authorization"] == f"Bearer {TOKEN}"
    assert all("authorization" not in r.headers for r in server.requests_to("/cdn/"))


def test_http_source_credentials_stay_at_their_origin(server):
    """Any Authorization header given to a source (not only the Hub token) stops at the
    origin it was given for: the CDN, which refuses requests carrying one, serves the
    redirected download."""
    from pyg_atompack.stream import CancelToken, RemoteSource

    target = hub.list_remote_files(REPO, "train/part_0.atp", revision="main",
                                   endpoint=server.endpoint, policy=FAST)[0]
    source = RemoteSource([target.url], headers={"Authorization": "Bearer site-secret"},
                        retry=FAST)
    server.clear_requests()
    body = source.fetch(source.list_shards()[0], CancelToken())
    assert len(body) == target.size
    resolve, cdn = server.requests
    assert resolve.headers["authorization"] == "Bearer site-secret" and resolve.status == 302
    assert "authorization" not in cdn.headers and cdn.status == 200


def test_a_file_too_large_for_memory_is_a_project_error(server):
    from dataclasses import replace

    from pyg_atompack.stream import CancelToken, RemoteSource, ShardFetchError
    from pyg_atompack.transport import RemoteTooLargeError

    source = RemoteSource(f"hf://datasets/{REPO}/train/part_0.atp", endpoint=server.endpoint,
                          retry=FAST)
    (shard,) = source.list_shards()
    huge = replace(shard, file=replace(shard.file, size=1 << 62))
    with pytest.raises(ShardFetchError, match=r"part_0\.atp.*cannot be held in memory") as caught:
        source.fetch_in_parts(huge, CancelToken(), parts=2)
    assert isinstance(caught.value.__cause__, RemoteTooLargeError)


def test_every_shard_split_over_connections_keeps_the_token_off_the_cdn(server):
    """Later shards are fetched in parts too (``split_shards``): each range goes through
    the Hub's resolve (with the token) and its cross-origin 302 to the CDN (without it),
    from the main process and from two DataLoader workers."""
    import io

    import torch
    from servers.http_server import make_samples

    from pyg_atompack.stream import RemoteSource, ShardStreamDataset, SourceOptions
    from pyg_atompack.transport.transfers import MIN_PART_BYTES

    files = {}
    for shard in range(3):
        buffer = io.BytesIO()
        torch.save(make_samples(shard, 400, atoms=8), buffer)
        files[f"s/{shard}.pt"] = buffer.getvalue()
    assert all(len(data) > 3 * MIN_PART_BYTES for data in files.values())
    server.commit("org/split", files)
    expected = sorted(shard * 1000 + i for shard in range(3) for i in range(400))
    for workers in (0, 2):
        before = len(server.requests)
        dataset = ShardStreamDataset(RemoteSource("hf://datasets/org/split/s",
                                                  endpoint=server.endpoint, retry=FAST),
                                     options=SourceOptions(stream_shards="none"), prefetch=2,
                                     concurrency=4)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
        assert sorted(int(sample.sample_id) for sample in loader) == expected
        requests = server.requests[before:]
        cdn = [r for r in requests if r.origin == "cdn"]
        # every shard in two ranges or more (a stream's or a worker's share of the
        # connections), each a resolve on the Hub and a ranged GET on the CDN
        assert sum(r.status == 206 and "range" in r.headers for r in cdn) >= 2 * len(files)
        assert all("authorization" not in r.headers for r in cdn)
        assert all(r.headers.get("authorization") == f"Bearer {TOKEN}"
                   for r in requests if r.origin == "hub")
