"""Sources and HTTP transfers: listing, manifest, retries on every injected fault."""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import pytest
from servers.http_server import ShardServer, serve_directory, write_pt_shards

from pyg_atompack.remote import RemoteFile
from pyg_atompack.remote.manifest import ManifestError
from pyg_atompack.stream import (
    CancelToken,
    LocalSource,
    RemoteSource,
    ShardFetchError,
    ShardInfo,
    ShardIntegrityError,
    ShardStreamDataset,
    Source,
    SourceOptions,
)
from pyg_atompack.stream.errors import StreamCancelled
from pyg_atompack.transport import RemoteNotFoundError, RetryPolicy
from pyg_atompack.transport.retry import parse_retry_after

FAST = RetryPolicy(retries=3, backoff=0.01, max_backoff=0.05, jitter=0.1, timeout=5.0)


@pytest.fixture
def server(tmp_path) -> ShardServer:
    write_pt_shards(tmp_path, [4, 3, 5])
    yield from serve_directory(tmp_path)


def _ids(dataset) -> list[int]:
    return [int(sample.sample_id) for sample in dataset]


EXPECTED_IDS = [0, 1, 2, 3, 1000, 1001, 1002, 2000, 2001, 2002, 2003, 2004]


def test_local_source_lists_directory_and_glob(server):
    source = LocalSource(server.root)
    assert isinstance(source, Source)
    shards = source.list_shards()
    assert [s.name for s in shards] == ["shard-0000.pt", "shard-0001.pt", "shard-0002.pt"]
    assert [s.records for s in shards] == [4, 3, 5]  # from manifest.json
    assert all(s.size == (server.root / s.name).stat().st_size for s in shards)
    digest = hashlib.sha256((server.root / "shard-0001.pt").read_bytes()).hexdigest()
    assert shards[1].sha256 == digest
    globbed = LocalSource(str(server.root / "shard-000[12].pt"))
    assert [s.name for s in globbed.list_shards()] == ["shard-0001.pt", "shard-0002.pt"]
    assert _ids(ShardStreamDataset(source)) == EXPECTED_IDS


def test_local_source_counts_atp_records(tmp_path, golden_dir, golden_expected):
    (tmp_path / "a.atp").write_bytes((golden_dir / "builtins_none.atp").read_bytes())
    (shard,) = LocalSource(tmp_path).list_shards()
    assert shard.records == golden_expected["files"]["builtins_none.atp"]["n_molecules"]


def test_local_source_without_shards_is_an_error(tmp_path):
    # a listing that fails raises the backend's error (the transport family), naming it
    with pytest.raises(RemoteNotFoundError, match="no .pt or .atp shards"):
        LocalSource(tmp_path)


def test_http_source_from_manifest_and_url_list(server):
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    shards = source.list_shards()
    assert [(s.name, s.records) for s in shards] == [
        ("shard-0000.pt", 4), ("shard-0001.pt", 3), ("shard-0002.pt", 5)]
    assert all(s.sha256 and s.size for s in shards)
    assert _ids(ShardStreamDataset(source)) == EXPECTED_IDS
    by_url = RemoteSource([server.url(s.name) for s in shards], retry=FAST)
    assert [s.name for s in by_url.list_shards()] == [s.name for s in shards]
    assert _ids(ShardStreamDataset(by_url)) == EXPECTED_IDS
    # listing happened once, at construction: one manifest request in total
    assert len(server.requests_for("manifest.json")) == 1


def test_bad_manifest_names_the_problem(server):
    (server.root / "bad.json").write_text('{"shards": [{"name": "x.pt", "records": "many"}]}')
    with pytest.raises(ManifestError, match=r"bad\.json: .*records"):
        RemoteSource(server.url("bad.json"), retry=FAST)
    (server.root / "broken.json").write_text("{not json")
    with pytest.raises(ManifestError, match="broken.json: manifest is not valid JSON"):
        RemoteSource(server.url("broken.json"), retry=FAST)


@pytest.mark.parametrize("fault", ["500", "503", "429", "reset", "truncate", "wrong_bytes"])
def test_each_fault_is_retried_and_data_arrives_intact(server, fault, caplog):
    server.add_fault("shard-0001.pt", fault, times=1, retry_after=0)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST))
    with caplog.at_level(logging.WARNING):
        assert _ids(dataset) == EXPECTED_IDS
    log = server.requests_for("shard-0001.pt")
    assert [entry.fault for entry in log] == [fault, None]
    assert "shard-0001.pt" in caplog.text


def test_truncated_transfer_resumes_with_range(server):
    server.add_fault("shard-0002.pt", "truncate", at_fraction=0.5)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST))
    assert _ids(dataset) == EXPECTED_IDS
    first, second = server.requests_for("shard-0002.pt")
    assert first.range is None and first.body_bytes > 0
    assert second.range == f"bytes={first.body_bytes}-"
    assert second.status == 206
    size = (server.root / "shard-0002.pt").stat().st_size
    assert first.body_bytes + second.body_bytes == size  # nothing fetched twice


def test_retry_after_is_honoured(server):
    server.add_fault("shard-0000.pt", "429", retry_after=1)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST))
    assert _ids(dataset) == EXPECTED_IDS
    first, second = server.requests_for("shard-0000.pt")
    # the backoff alone would be ~0.01 s; the server asked for a full second
    assert second.started - first.started >= 0.9


def test_retry_policy_backoff_and_retry_after():
    policy = RetryPolicy(backoff=0.5, max_backoff=4.0, jitter=0.0)
    assert [policy.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert policy.delay(0, retry_after=3.0) == 3.0
    jittered = RetryPolicy(backoff=1.0, jitter=0.5)
    assert all(1.0 <= jittered.delay(0) <= 1.5 for _ in range(50))
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert parse_retry_after("soon") is None


def test_persistent_server_error_gives_up_naming_the_shard(server):
    server.add_fault("shard-0001.pt", "500", times=10)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST))
    with pytest.raises(ShardFetchError, match=r"shard-0001\.pt.*4 attempts.*HTTP 500"):
        _ids(dataset)
    assert len(server.requests_for("shard-0001.pt")) == 4


def test_retries_argument_overrides_source_policy(server):
    server.add_fault("shard-0000.pt", "503", times=10, retry_after=0)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                                 options=SourceOptions(retries=1))
    with pytest.raises(ShardFetchError, match="2 attempts"):
        _ids(dataset)
    assert len(server.requests_for("shard-0000.pt")) == 2


def test_missing_file_is_permanent_and_not_retried(server):
    urls = [server.url("shard-0000.pt"), server.url("missing.pt")]
    dataset = ShardStreamDataset(RemoteSource(urls, retry=FAST))
    with pytest.raises(ShardFetchError, match=r"missing\.pt: HTTP 404"):
        _ids(dataset)
    # one size probe when listed, one download: neither retried
    assert len(server.requests_for("missing.pt")) == 2


def test_checksum_mismatch_retried_once_then_clear_error(server):
    server.add_fault("shard-0002.pt", "wrong_bytes", times=2)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST))
    with pytest.raises(ShardIntegrityError, match=r"shard shard-0002\.pt: sha256 .* expected"):
        _ids(dataset)
    assert len(server.requests_for("shard-0002.pt")) == 2
    # verify=False accepts the corrupted bytes' existence (here: still a loadable pickle
    # or a decode error, but never an integrity error)
    server.add_fault("shard-0002.pt", "wrong_bytes", times=2, at_fraction=0.0)
    unverified = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                                    options=SourceOptions(verify=False))
    with pytest.raises(Exception) as caught:
        _ids(unverified)
    assert not isinstance(caught.value, ShardIntegrityError)


def test_size_mismatch_is_detected(server):
    source = RemoteSource(server.url("manifest.json"), retry=FAST)
    expected = source.list_shards()[0].size
    (server.root / "shard-0000.pt").write_bytes(b"y" * 11)  # changed after listing
    with pytest.raises(ShardIntegrityError,
                       match=rf"shard-0000\.pt: size 11 bytes, expected {expected}"):
        _ids(ShardStreamDataset(source))


def test_on_error_skip_logs_and_continues(server, caplog):
    server.add_fault("shard-0001.pt", "500", times=10)
    dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                                 on_error="skip")
    with caplog.at_level(logging.WARNING):
        assert _ids(dataset) == [0, 1, 2, 3, 2000, 2001, 2002, 2003, 2004]
    assert "skipping shard shard-0001.pt" in caplog.text
    assert dataset.stats()["skipped"] == 1


def test_stalled_transfer_times_out_and_is_retried(server):
    server.add_fault("shard-0000.pt", "stall")
    policy = RetryPolicy(retries=2, backoff=0.01, timeout=0.5)
    assert _ids(ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=policy))) \
        == EXPECTED_IDS
    assert [e.fault for e in server.requests_for("shard-0000.pt")] == ["stall", None]


def test_cancel_token_interrupts_a_blocked_transfer(server):
    server.add_fault("shard-0000.pt", "stall")
    source = RemoteSource(server.url("manifest.json"), retry=RetryPolicy(timeout=60))
    token = CancelToken()
    outcome = {}

    def fetch():
        try:
            source.fetch(source.list_shards()[0], token)
        except StreamCancelled as error:
            outcome["error"] = error

    thread = threading.Thread(target=fetch)
    thread.start()
    time.sleep(0.2)
    token.cancel()
    thread.join(5)  # the stall lasts 30 s and the timeout 60 s: only cancellation ends it
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), StreamCancelled)


def test_custom_source_protocol(server):
    class MemorySource:
        def __init__(self, root):
            self.files = {p.name: p.read_bytes() for p in sorted(root.glob("*.pt"))}

        def list_shards(self):
            return [ShardInfo(RemoteFile(n, size=len(b))) for n, b in self.files.items()]

        def fetch(self, shard, cancel):
            cancel.raise_if_cancelled()
            return self.files[shard.name]

    source = MemorySource(server.root)
    assert isinstance(source, Source)
    assert _ids(ShardStreamDataset(source, prefetch=2)) == EXPECTED_IDS


def test_one_cancel_type_stops_a_remote_range_read_in_its_backoff(tmp_path):
    # stream's CancelToken is the transport's Cancel: the remote layer's range reads and
    # the transport's retry loop take it, and cancelling ends a 30 s backoff at once
    from pyg_atompack.remote.ranges import URLRangeReader, read_range
    from pyg_atompack.transport.http import Cancel

    (tmp_path / "x.atp").write_bytes(bytes(range(256)) * 64)
    token = CancelToken()
    assert Cancel in type(token).__mro__  # declared, not only alike
    for server in serve_directory(tmp_path):
        reader = URLRangeReader(server.url("x.atp"), size=256 * 64,
                                retry=RetryPolicy(retries=3, backoff=30.0, jitter=0.0))
        assert bytes(read_range(reader, 10, 20)) == bytes(range(10, 20))
        server.add_fault("x.atp", "503", times=4)
        threading.Timer(0.3, token.cancel).start()
        started = time.monotonic()
        with pytest.raises(StreamCancelled):
            read_range(reader, 100, 200, token)
        assert time.monotonic() - started < 10
        assert [e.status for e in server.requests_for("x.atp")][-1] == 503
