"""ShardStreamDataset behind DataLoader workers: the per-rank budget and the packed hand-off."""

from __future__ import annotations

import os
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from servers.http_server import serve_directory, write_pt_shards
from torch_geometric.data import Batch, Data, HeteroData
from torch_geometric.loader import DataLoader

from pyg_atompack.pyg import handoff
from pyg_atompack.stream import LocalSource, RemoteSource, ShardStreamDataset
from pyg_atompack.stream.splitting import StreamSlot, worker_share
from pyg_atompack.transport import RetryPolicy

FAST = RetryPolicy(retries=2, backoff=0.01, timeout=10.0)


class _PackingPickler(ForkingPickler):
    """ForkingPickler with the hand-off reducers, without touching the class this process uses."""

    _extra_reducers = {**ForkingPickler._extra_reducers,
                       **{cls: handoff.reduce_packed for cls in
                          (Data, HeteroData, type(Batch(_base_cls=Data)))}}


def _round_trip(obj):
    return pickle.loads(_PackingPickler.dumps(obj))


def _assert_same(left, right):
    assert type(left) is type(right)
    keys = sorted(left.keys())
    assert keys == sorted(right.keys())
    for key in keys:
        a, b = left[key], right[key]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), key
        else:
            assert a == b, key


def _odd_sample(i: int) -> Data:
    return Data(pos=torch.randn(5, 3), z=torch.arange(5, dtype=torch.uint8) + i,
                mask=torch.tensor([True, False, True, True, False]),
                half=torch.randn(2, 2).to(torch.bfloat16),
                wave=torch.randn(3, dtype=torch.complex64),
                energy=torch.tensor(float(i), dtype=torch.float64),  # 0-dim
                empty=torch.empty(0, 3), cell=torch.randn(3, 3).t(),  # not contiguous
                name=f"mol-{i}", charge=i - 1)


def test_worker_share_splits_the_rank_budget():
    shares = [worker_share(3, StreamSlot(0, 1, w, 2)) for w in range(2)]
    assert shares == [2, 2]  # equal, rounded up: no worker sets the pace of the others
    assert [worker_share(4, StreamSlot(0, 1, w, 2)) for w in range(2)] == [2, 2]
    assert [worker_share(1, StreamSlot(0, 1, w, 2)) for w in range(2)] == [1, 1]  # floor of 1
    assert worker_share(0, StreamSlot(0, 1, 1, 2), minimum=0) == 0  # prefetch=0 stays off
    assert worker_share(4, StreamSlot(1, 2, 0, 1)) == 4  # ranks do not share


def test_packed_batches_and_samples_come_back_equal():
    batch = Batch.from_data_list([_odd_sample(i) for i in range(4)])
    kind, arguments = handoff.reduce_packed(batch)
    assert kind is handoff._rebuild_inline  # small: the bytes travel in the pickle
    back = _round_trip(batch)
    _assert_same(batch, back)
    assert torch.equal(back.get_example(2).pos, batch.get_example(2).pos)
    assert back.num_graphs == 4 and back.to_data_list()[3].name == "mol-3"
    # every tensor views one buffer, and they are writable like any other
    assert len({back[k].untyped_storage().data_ptr() for k in ("pos", "z", "batch")}) == 1
    back.pos += 1
    assert torch.equal(back.pos, batch.pos + 1)
    sample = _odd_sample(7)
    _assert_same(sample, _round_trip(sample))


def test_big_objects_travel_as_one_shared_tensor(monkeypatch):
    monkeypatch.setattr(handoff, "INLINE_BYTES", 64)
    batch = Batch.from_data_list([_odd_sample(i) for i in range(3)])
    kind, arguments = handoff.reduce_packed(batch)
    assert kind is handoff._rebuild_packed and arguments[0].is_shared()
    _assert_same(batch, _round_trip(batch))


def test_aliasing_or_autograd_falls_back_to_the_default_pickle():
    base = torch.arange(10.0)
    aliased = Data(x=base, y=base[2:6])  # y overlaps x: copies would break the aliasing
    assert handoff.reduce_packed(aliased)[0] is not handoff._rebuild_inline
    back = _round_trip(aliased)
    _assert_same(aliased, back)
    graded = Data(x=torch.ones(3, requires_grad=True))
    assert handoff.reduce_packed(graded)[0] is not handoff._rebuild_inline
    assert _round_trip(graded).x.requires_grad
    # views of one buffer that do not overlap (samples of a lazily decoded shard) pack
    split = Data(x=base[:5], y=base[5:])
    assert handoff.reduce_packed(split)[0] is handoff._rebuild_inline
    _assert_same(split, _round_trip(split))


def test_batches_from_workers_equal_the_main_process_ones(tmp_path):
    write_pt_shards(tmp_path, [6, 5, 7, 4], atoms=4)
    dataset = ShardStreamDataset(LocalSource(tmp_path), prefetch=2, concurrency=2)
    expected = {int(s.sample_id) for s in dataset}
    seen = set()
    for batch in DataLoader(dataset, batch_size=3, num_workers=2):
        assert isinstance(batch, Batch)
        # packed in the worker: all tensors of the batch arrive in one buffer
        tensors = [value for _, value in batch if isinstance(value, torch.Tensor)]
        assert len({t.untyped_storage().data_ptr() for t in tensors if t.numel()}) == 1
        for sample in batch.to_data_list():
            assert sample.pos.shape == (4, 3)
            seen.add(int(sample.sample_id))
    assert seen == expected


def test_workers_share_the_ranks_connections_and_prefetch(tmp_path):
    names = write_pt_shards(tmp_path, [120] * 6, atoms=8)
    size = (tmp_path / names[0]).stat().st_size
    # each shard takes ~0.25 s at this rate, so both workers' transfers overlap
    for server in serve_directory(tmp_path, bandwidth=size * 4):
        dataset = ShardStreamDataset(RemoteSource(server.url("manifest.json"), retry=FAST),
                                     prefetch=2, concurrency=2)
        count = sum(len(b.sample_id) for b in DataLoader(dataset, batch_size=40,
                                                          num_workers=2))
        assert count == 720
        transfers = [e for e in server.requests if e.path.endswith(".pt")]
        # no parts: one request a shard (each worker's first one streamed as it
        # arrives, as one range over its one connection)
        assert len(transfers) == 6
        assert all(e.range in (None, f"bytes=0-{size - 1}") for e in transfers)
        assert sum(e.range is not None for e in transfers) == 2
        # the throttled server logs a transfer finished after pacing its last chunk, a
        # few ms after the client has every byte and may start the next one
        events = sorted([(e.started, 1) for e in transfers] + [(e.finished - 0.01, -1)
                                                               for e in transfers])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        assert peak <= 2  # the rank's two connections, not two per worker
        assert dataset.stats()["peak_live_shards"] <= 2  # one ahead per worker + one in use
        assert dataset.stats()["shards"] == 6


@pytest.mark.parametrize("workers", [1, 2])
def test_a_rank_budget_of_one_still_gives_every_worker_a_connection(tmp_path, workers):
    write_pt_shards(tmp_path, [3, 3, 3], atoms=3)
    dataset = ShardStreamDataset(LocalSource(tmp_path), prefetch=1, concurrency=1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)
    assert sorted(int(s.sample_id) for s in loader) == sorted(
        int(s.sample_id) for s in dataset)


@pytest.mark.parametrize("listed", ["manifest", "urls"])
def test_each_worker_makes_its_own_client_with_the_parents_trust_store(tmp_path, monkeypatch,
                                                                       listed):
    """No connection crosses a fork, and no worker loads the CA bundle again (the parent
    read the manifest, or asked each URL for its size, before the workers forked)."""
    import httpx

    from pyg_atompack.transport import http

    made = tmp_path / "made"
    client, trust_store = httpx.Client, httpx.create_ssl_context

    def recording(kind, make):
        def record(*args, **kwargs):
            with open(made, "a", encoding="utf-8") as handle:
                handle.write(f"{kind}:{os.getpid()}\n")
            return make(*args, **kwargs)
        return record

    monkeypatch.setattr(httpx, "Client", recording("client", client))
    monkeypatch.setattr(httpx, "create_ssl_context", recording("trust", trust_store))
    for name in ("_process_client", "_trust_store"):  # as in a new process
        monkeypatch.setattr(http, name, None)
    (tmp_path / "www").mkdir()
    write_pt_shards(tmp_path / "www", [5, 4, 6, 3], atoms=3)
    for server in serve_directory(tmp_path / "www"):
        names = [f"shard-{n:04d}.pt" for n in range(4)]
        where = (server.url("manifest.json") if listed == "manifest"
                 else [server.url(name) for name in names])
        dataset = ShardStreamDataset(RemoteSource(where, retry=FAST), prefetch=2, concurrency=2)
        loader = DataLoader(dataset, batch_size=4, num_workers=2)
        assert sum(len(b.sample_id) for b in loader) == 18
        downloads = [e for e in server.requests
                     if e.path.endswith(".pt") and e.range != "bytes=0-0"]  # not a size probe
        assert len(downloads) == 4
    events = made.read_text(encoding="utf-8").split()
    here = str(os.getpid())
    # this process: its client and the trust store; each worker: a client
    assert sorted(e for e in events if e.endswith(f":{here}")) == [f"client:{here}",
                                                                  f"trust:{here}"]
    workers = [e for e in events if not e.endswith(f":{here}")]
    assert sorted(e.split(":")[0] for e in workers) == ["client", "client"]
    assert len(set(workers)) == 2
