"""The first ``.pt`` shard handed out as its bytes arrive (``stream/arriving.py``).

Every test streams real ``torch.save`` shards from the loopback HTTP server; the server
holds back the last quarter of every shard (``ShardServer.hold``) until the test lets it
go, so what the stream hands out before that can only come from the bytes already in.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from servers.fake_hub import serve_fake_hub
from servers.http_server import ShardServer, make_samples, serve_directory, write_pt_shards
from servers.stores import use_store
from torch.utils.data import DataLoader

from pyg_atompack.stream import (
    RemoteSource,
    ShardDecodeError,
    ShardIntegrityError,
    ShardStreamDataset,
    SourceOptions,
    arriving,
)
from pyg_atompack.stream.arriving import ARRIVAL_WINDOW, arrival_order
from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX
from pyg_atompack.transport import RetryPolicy

FAST = RetryPolicy(retries=1, backoff=0.01, max_backoff=0.02, timeout=10.0)
SIZES = [150, 150, 150]


def _without_hashes(root: Path) -> None:
    """Keep sizes and record counts in the manifest, drop the sha256s."""
    path = root / "manifest.json"
    document = json.loads(path.read_text())
    for entry in document["shards"]:
        entry.pop("sha256")
    path.write_text(json.dumps(document))


@pytest.fixture
def shards(tmp_path: Path) -> tuple[Path, list[str]]:
    names = write_pt_shards(tmp_path, SIZES, atoms=20)  # ~220 kB each: several chunks
    return tmp_path, names


def _hold_tails(server: ShardServer, root: Path, names: list[str]) -> threading.Event:
    """Hold back the last quarter of every shard; one event releases them all."""
    release = threading.Event()
    gates = [server.hold(name, (root / name).stat().st_size * 3 // 4) for name in names]

    def relay() -> None:
        release.wait()
        for gate in gates:
            gate.set()
    threading.Thread(target=relay, daemon=True).start()
    # a stream that waited for whole shards would block on the held bytes: let them go
    # in the end so that such a stream fails the test's assertions instead of hanging
    backstop = threading.Timer(30, release.set)
    backstop.daemon = True
    backstop.start()
    return release


def _dataset(server: ShardServer, options: SourceOptions | None = None,
             **settings) -> ShardStreamDataset:
    settings = {"prefetch": 2, "concurrency": 2, **settings}
    return ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                              options=options, **settings)


def _ids(samples) -> list[int]:
    return [int(value) for sample in samples for value in sample.sample_id.view(-1)]


def _expected() -> dict[int, torch.Tensor]:
    return {int(s.sample_id): s.pos for shard, count in enumerate(SIZES)
            for s in make_samples(shard, count, atoms=20)}


def test_first_samples_come_before_the_rest_of_the_first_shard_has_arrived(shards,
                                                                            monkeypatch):
    root, names = shards
    _without_hashes(root)  # sizes only: samples may flow as they arrive
    monkeypatch.setattr(arriving, "MIN_CHUNK_BYTES", 32 << 10)  # several ranges a shard
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        iterator = iter(_dataset(server))
        first = [next(iterator) for _ in range(20)]
        assert not release.is_set()  # nothing of any shard's last quarter was sent
        assert _ids(first) == list(range(20))  # no shuffle: the stored order
        release.set()
        samples = first + list(iterator)
        expected = _expected()
        assert sorted(_ids(samples)) == sorted(expected)  # each sample exactly once
        for sample in samples:
            assert torch.equal(sample.pos, expected[int(sample.sample_id)])
        ranges = sorted(tuple(int(bound) for bound in entry.range[6:].split("-"))
                        for entry in server.requests_for(names[0]))
        assert len(ranges) >= 3  # 2 connections, growing ranges in file order
        assert ranges[0][0] == 0 and ranges[-1][1] == (root / names[0]).stat().st_size - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))


def test_with_split_shards_off_the_arriving_first_shard_is_one_range_downloaded_alone(
        shards, monkeypatch):
    """``split_shards=False``: the first shard streams over one connection (one range),
    and no other download starts before it has ended; later shards come whole."""
    root, names = shards
    _without_hashes(root)
    monkeypatch.setattr(arriving, "MIN_CHUNK_BYTES", 32 << 10)
    for server in serve_directory(root, bandwidth=2_000_000):
        samples = list(_dataset(server, SourceOptions(split_shards=False)))
        assert sorted(_ids(samples)) == sorted(_expected())
        first = server.requests_for(names[0])
        size = (root / names[0]).stat().st_size
        assert [entry.range for entry in first] == [f"bytes=0-{size - 1}"]
        later = [entry for name in names[1:] for entry in server.requests_for(name)]
        assert [entry.range for entry in later] == [None, None]
        assert min(entry.started for entry in later) >= first[0].finished - 0.05


def test_a_listed_hash_waits_for_the_whole_shard_only_when_asked_for(shards):
    """By default (``"records"``) a hashed shard streams, each record checked against its
    CRC-32; ``True`` hashes it whole before the first sample; ``False`` checks nothing."""
    root, names = shards
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        iterator = iter(_dataset(server, SourceOptions(verify_before_use=True)))
        next(iterator)
        assert release.is_set()  # the first sample waited for the whole (hashed) shard
        assert len(list(iterator)) == sum(SIZES) - 1
        timer.join()

        for choice in ("records", False):
            release = _hold_tails(server, root, names)
            iterator = iter(_dataset(server, SourceOptions(verify_before_use=choice)))
            next(iterator)
            assert not release.is_set()
            release.set()
            assert len(list(iterator)) == sum(SIZES) - 1
    with pytest.raises(ValueError, match="verify_before_use"):
        ShardStreamDataset(root, options=SourceOptions(verify_before_use="sha256"))


def _flip_storage_byte(path: Path, storage: int) -> None:
    """Change one byte inside the data of storage record ``storage`` (CRC now wrong)."""
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(f"/data/{storage}"))
    name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_length + extra_length + 5] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("hashed", [True, False])
def test_bytes_changed_in_transit_are_never_handed_out_by_default(shards, hashed):
    """A storage whose bytes differ from what torch.save wrote (the listing still names
    the original file) stops the stream before any sample built from it, naming the
    shard, whether or not the listing has hashes; with ``verify_before_use=False`` the
    changed sample is handed out."""
    root, names = shards
    if not hashed:
        _without_hashes(root)
    for name in names:
        _flip_storage_byte(root / name, 4 * 60)  # sample 60's positions (its first storage)
    expected = _expected()
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        got = []
        with pytest.raises(ShardDecodeError, match=r"shard-000\d\.pt: .*CRC-32"):
            for sample in _dataset(server):
                got.append(sample)
        assert not release.is_set()  # found by the record's CRC-32, not the file's end
        release.set()
        assert len(got) <= 60  # (none at all when the damage was found first)
        for sample in got:
            assert torch.equal(sample.pos, expected[int(sample.sample_id)])

        release = _hold_tails(server, root, names)
        iterator = iter(_dataset(server, SourceOptions(verify_before_use=False)))
        got = [next(iterator) for _ in range(80)]  # all within the first 3/4 of the file
        assert not release.is_set()
        release.set()
        if hashed:  # the file's hash, once it is in
            with pytest.raises(ShardIntegrityError, match=r"shard-000\d\.pt: sha256"):
                got.extend(iterator)
        else:  # nothing checks the bytes
            got.extend(iterator)
        changed = [s for s in got if not torch.equal(s.pos, expected[int(s.sample_id)])]
        assert [int(s.sample_id) % 1000 for s in changed] == [60] * (1 if hashed else 3)


def test_a_shard_saved_without_crcs_is_hashed_whole_before_use(shards, tmp_path):
    from torch.utils.serialization import config

    root, names = shards
    for index, name in enumerate(names):
        samples = make_samples(index, SIZES[index], atoms=20)
        saved = config.save.compute_crc32
        config.save.compute_crc32 = False
        try:
            torch.save(samples, root / name)
        finally:
            config.save.compute_crc32 = saved
    write_manifest = json.loads((root / "manifest.json").read_text())
    for entry in write_manifest["shards"]:
        data = (root / entry["name"]).read_bytes()
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (root / "manifest.json").write_text(json.dumps(write_manifest))
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        timer = threading.Timer(0.5, release.set)
        timer.start()
        iterator = iter(_dataset(server))
        first = next(iterator)
        assert release.is_set()  # no CRC-32 to check records by: the whole file first
        samples = [first, *iterator]
        timer.join()
        assert sorted(_ids(samples)) == sorted(_expected())


def test_a_shuffled_arriving_shard_draws_from_what_has_arrived_the_same_way_every_run(shards):
    root, names = shards
    _without_hashes(root)
    for server in serve_directory(root):
        orders = []
        for _ in range(2):
            release = _hold_tails(server, root, names)
            dataset = _dataset(server, shuffle=True, seed=3)
            iterator = iter(dataset)
            head = [next(iterator) for _ in range(10)]
            assert not release.is_set()
            release.set()
            orders.append(_ids(head + list(iterator)))
        assert orders[0] == orders[1]  # the seed decides, not the timing
        first_shard = dataset.plan().shards[0]
        first = [i - 1000 * first_shard for i in orders[0][:SIZES[first_shard]]]
        assert first == arrival_order(SIZES[first_shard], shuffle=True, seed=3, epoch=0,
                                      shard_index=first_shard)
        assert sorted(first) == list(range(SIZES[first_shard])) and first != sorted(first)
        assert all(index < ARRIVAL_WINDOW + k for k, index in enumerate(first))
        assert sorted(orders[0]) == sorted(_expected())


def test_a_first_shard_damaged_at_its_end_fails_naming_it_and_never_yields_a_torn_sample(
        shards):
    root, names = shards
    for name in names:  # whichever comes first: its directory is gone
        path = root / name
        data = bytearray(path.read_bytes())
        data[-22:] = bytes(22)
        path.write_bytes(bytes(data))
    _without_hashes(root)
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        iterator = iter(_dataset(server))
        got = [next(iterator) for _ in range(5)]  # from the records already in
        release.set()
        with pytest.raises(ShardDecodeError, match=r"shard-000\d\.pt"):
            for sample in iterator:
                got.append(sample)
        expected = _expected()
        assert 5 <= len(got) <= SIZES[0]  # never a sample after the damage was found
        for sample in got:
            assert torch.equal(sample.pos, expected[int(sample.sample_id)])


def test_a_hash_mismatch_found_at_the_end_raises_when_the_user_opted_out(shards):
    root, names = shards
    for server in serve_directory(root):
        for name in names:
            path = root / name
            data = bytearray(path.read_bytes())
            data[-40] ^= 0xFF  # in the central directory's last entry name: the hash changes
            path.write_bytes(bytes(data))
        with pytest.raises(ShardIntegrityError, match=r"shard-000\d\.pt"):
            list(_dataset(server, SourceOptions(verify_before_use=False)))


def test_inside_dataloader_workers(shards):
    root, names = shards
    _without_hashes(root)
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        dataset = _dataset(server, batch_size=10)
        loader = DataLoader(dataset, batch_size=None, num_workers=2)
        iterator = iter(loader)
        first = next(iterator)  # from worker 0's first shard, its tail still held
        assert not release.is_set()
        release.set()
        batches = [first, *iterator]
        assert sorted(_ids(batches)) == sorted(_expected())


def test_closing_while_the_first_shard_is_arriving_stops_every_download(shards):
    root, names = shards
    _without_hashes(root)
    for server in serve_directory(root):
        release = _hold_tails(server, root, names)
        iterator = iter(_dataset(server))
        next(iterator)
        iterator.close()  # the held ranges are cancelled, not waited for
        for thread in threading.enumerate():
            if thread.name.startswith(THREAD_NAME_PREFIX):
                thread.join(5)
                assert not thread.is_alive(), thread.name
        release.set()


@pytest.mark.parametrize("taken", [37, SIZES[0] + 7], ids=["inside", "after"])
def test_resume_repeats_the_uninterrupted_order(shards, taken):
    """Resumed inside the arriving first shard, or after it: only the epoch's first shard
    arrives record by record (its order is a shuffle buffer over arrival), so a resumed
    epoch whose first shard left is another one must not stream that one, or its order
    would change."""
    root, names = shards
    _without_hashes(root)
    for server in serve_directory(root):
        whole = _ids(_dataset(server, shuffle=True, seed=1))
        dataset = _dataset(server, shuffle=True, seed=1)
        iterator = iter(dataset)
        head = [next(iterator) for _ in range(taken)]
        state = dataset.state_dict()
        iterator.close()
        again = _dataset(server, shuffle=True, seed=1)
        again.load_state_dict(state)
        assert _ids(head) + _ids(again) == whole


def test_layouts_that_do_not_stream_and_servers_without_ranges_take_the_whole_path(
        tmp_path):
    names = write_pt_shards(tmp_path, [40, 40], collated=(0, 1), atoms=5)
    _without_hashes(tmp_path)
    for server in serve_directory(tmp_path):
        assert sorted(_ids(_dataset(server))) == [*range(40), *range(1000, 1040)]
    write_pt_shards(tmp_path, [40, 40], atoms=5)
    _without_hashes(tmp_path)
    server = ShardServer(tmp_path, ignore_ranges=True).start()
    try:
        assert sorted(_ids(_dataset(server))) == [*range(40), *range(1000, 1040)]
        assert all(entry.status == 200 for entry in server.requests_for(names[0]))
    finally:
        server.stop()


def test_from_an_object_store(store_servers, monkeypatch, tmp_path):
    server = store_servers("s3")
    server.create_bucket("arriving")
    use_store(monkeypatch, server)
    write_pt_shards(tmp_path, [150, 150], atoms=20, manifest=False)  # sizes, no hashes
    server.upload_directory(tmp_path, "arriving", "pt")
    ranges = []
    read_into = RemoteSource.read_into

    def recording(self, shard, buffer, start, end, cancel, progress=None, pin=None):
        ranges.append((shard.name, start, end))
        return read_into(self, shard, buffer, start, end, cancel, progress, pin=pin)

    monkeypatch.setattr(RemoteSource, "read_into", recording)
    monkeypatch.setattr(arriving, "MIN_CHUNK_BYTES", 32 << 10)
    # in this process, where the reads are recorded
    dataset = ShardStreamDataset("s3://arriving/pt/", options=SourceOptions(retrieval="threads"),
                                 prefetch=2, concurrency=2)
    samples = list(dataset)
    assert sorted(_ids(samples)) == [*range(150), *range(1000, 1150)]
    first = dataset.plan().shards[0]
    size = (tmp_path / f"shard-{first:04d}.pt").stat().st_size
    assert {name for name, _, _ in ranges} == {f"shard-{first:04d}.pt"}  # the first only
    covered = sorted((start, end) for _, start, end in ranges)
    assert len(covered) >= 3 and covered[0][0] == 0 and covered[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # the file, in order


def test_every_shard_as_it_arrives(shards):
    root, names = shards
    _without_hashes(root)
    for server in serve_directory(root):
        orders = []
        for _ in range(2):
            gates = {name: server.hold(name, (root / name).stat().st_size * 3 // 4)
                     for name in names}
            dataset = _dataset(server, SourceOptions(stream_shards="all"), shuffle=True, seed=2)
            first, second = (names[i] for i in dataset.plan().shards[:2])
            iterator = iter(dataset)
            head = [next(iterator) for _ in range(10)]
            gates[first].set()  # the first shard may end; the second is still held
            head += [next(iterator) for _ in range(SIZES[0])]  # into the second shard
            assert not gates[second].is_set()
            assert {int(s.sample_id) // 1000 for s in head[-10:]} == {int(second[6:10])}
            for gate in gates.values():
                gate.set()
            orders.append(_ids(head + list(iterator)))
        assert orders[0] == orders[1] and sorted(orders[0]) == sorted(_expected())


def test_stream_shards_choices():
    with pytest.raises(ValueError, match="stream_shards"):
        ShardStreamDataset(Path(__file__).parent / "data",
                           options=SourceOptions(stream_shards="some"))


def test_from_the_hub_with_its_listed_hashes(monkeypatch):
    def saved(shard: int, count: int) -> bytes:
        buffer = io.BytesIO()
        torch.save(make_samples(shard, count, atoms=20), buffer)
        return buffer.getvalue()

    files = {f"data/shard-{i:04d}.pt": saved(i, 40) for i in range(2)}
    files["data/manifest.json"] = json.dumps({"shards": [
        {"name": name[5:], "records": 40, "bytes": len(data),
         "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()]}).encode()
    calls = []
    read_into = RemoteSource.read_into

    def recording(self, shard, *args, **kwargs):
        calls.append(shard.name)
        return read_into(self, shard, *args, **kwargs)

    monkeypatch.setattr(RemoteSource, "read_into", recording)
    for hub in serve_fake_hub():
        hub.commit("org/arriving", files)
        source = RemoteSource("hf://datasets/org/arriving/data", endpoint=hub.endpoint)
        assert all(shard.sha256 for shard in source.list_shards())  # LFS hashes
        # in this process, where the reads are recorded
        dataset = ShardStreamDataset(source,
                                     options=SourceOptions(verify_before_use=True,
                                                           retrieval="threads"), prefetch=1)
        assert _ids(dataset) == [*range(40), *range(1000, 1040)]
        assert calls == []  # listed hashes: checked whole before any sample
        for choice in ("records", False):
            dataset = ShardStreamDataset(source,
                                         options=SourceOptions(verify_before_use=choice,
                                                               retrieval="threads"), prefetch=1)
            assert _ids(dataset) == [*range(40), *range(1000, 1040)]
            assert calls == ["shard-0000.pt"]  # the first shard streamed by range
            calls.clear()
        good = files["data/shard-0000.pt"]
        hub.serve_wrong_bytes("org/arriving", "data/shard-0000.pt",
                              good[:-1] + bytes([good[-1] ^ 1]))
        with pytest.raises(ShardIntegrityError, match=r"shard-0000\.pt: sha256"):
            list(ShardStreamDataset(source, options=SourceOptions(verify_before_use=False),
                                    prefetch=1))
