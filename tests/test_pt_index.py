"""Lazy, in-place decoding of ``.pt`` files (``pyg/pt_index.py``, ``pyg/pt_pickle.py``)
and shard buffers.

Test files are made the way users make them: ``torch.save`` of a list of ``Data``, of
list slices of an ``InMemoryDataset`` (FoldPipe's shards: views of one storage), of
``InMemoryDataset.collate`` output, and ``InMemoryDataset.save``.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import sys
import threading
import time
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch
from servers.http_server import make_samples, serve_directory
from torch_geometric.data import Batch, Data, HeteroData, InMemoryDataset

from pyg_atompack.pyg.pt import load_pt_object
from pyg_atompack.pyg.pt_archive import TorchZipError, read_torch_archive
from pyg_atompack.pyg.pt_index import LazyPtSamples, index_pt
from pyg_atompack.pyg.pt_pickle import NotLazyLayout
from pyg_atompack.pyg.samples import CollatedSamples
from pyg_atompack.stream import (
    LocalSource,
    RemoteSource,
    ShardDecodeError,
    ShardStreamDataset,
    SourceOptions,
    UnsafePayloadError,
    decode_shard,
)
from pyg_atompack.stream.sources import CancelToken
from pyg_atompack.transport import RetryPolicy
from pyg_atompack.transport.buffers import ShardBuffer


def _saved(obj, **options) -> bytearray:
    stream = io.BytesIO()
    torch.save(obj, stream, **options)
    return bytearray(stream.getvalue())


def _as_mmap(data: bytes | bytearray) -> mmap.mmap:
    mapped = mmap.mmap(-1, len(data))
    mapped[:] = data
    return mapped


def _address_range(buffer) -> tuple[int, int]:
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return start, start + len(buffer)


def _assert_equal_samples(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is Data
        assert set(a.keys()) == set(b.keys())
        for key, value in b:  # iterating a Data yields (key, value) pairs
            if isinstance(value, torch.Tensor):
                assert a[key].dtype == value.dtype, key
                assert a[key].shape == value.shape, key
                assert torch.equal(a[key], value), key
            else:
                assert a[key] == value, key


def _varied_samples(count: int) -> list[Data]:
    generator = torch.Generator().manual_seed(5)
    samples = []
    for i in range(count):
        atoms = i % 7  # includes molecules without atoms (empty tensors)
        sample = Data(
            z=torch.randint(1, 90, (atoms,), generator=generator, dtype=torch.int64),
            pos=torch.randn(atoms, 3, generator=generator),
            energy=torch.tensor(float(i), dtype=torch.float64),  # 0-dim
            fixed=torch.rand(atoms, generator=generator) > 0.5,  # bool
            charge=torch.randn(atoms, generator=generator).half(),
            smiles=f"C{i}",
            idx=i,
            weight=0.5 * i,
        )
        if i % 3 == 0:
            sample.stress = torch.randn(3, 3, generator=generator)  # absent in most samples
        if i >= 5:
            sample.late = torch.tensor([i % 256], dtype=torch.uint8)  # appears after the first
        samples.append(sample)
    return samples


@pytest.mark.parametrize("as_mmap", [False, True], ids=["bytearray", "mmap"])
def test_lazy_decode_equals_torch_load(as_mmap):
    samples = _varied_samples(300)  # > 256 memo entries: LONG_BINPUT / LONG_BINGET
    buffer = _saved(samples)
    if as_mmap:
        buffer = _as_mmap(buffer)
    decoded = index_pt(buffer)
    assert isinstance(decoded, LazyPtSamples) and decoded.views_into_buffer
    _assert_equal_samples(decoded, samples)
    _assert_equal_samples(decoded, load_pt_object(io.BytesIO(bytes(buffer))))
    assert [d.idx for d in decoded[2:7]] == [2, 3, 4, 5, 6]
    assert decoded[-1].idx == 299
    with pytest.raises(IndexError, match="out of range"):
        decoded[300]


def test_tuple_of_data_and_newer_pickle_protocols():
    samples = make_samples(1, 40)
    _assert_equal_samples(index_pt(_saved(tuple(samples))), samples)
    # protocol 4 adds FRAME, MEMOIZE, SHORT_BINUNICODE and STACK_GLOBAL
    _assert_equal_samples(index_pt(_saved(samples, pickle_protocol=4)), samples)


def test_samples_are_zero_copy_views_with_storages_of_their_own():
    samples = make_samples(2, 50, atoms=8)
    buffer = _saved(samples)
    start, end = _address_range(buffer)
    sample = index_pt(buffer)[17]
    for key in ("pos", "z", "energy"):
        tensor = sample[key]
        assert start <= tensor.data_ptr() < end  # read in place, not copied
        # its storage spans just this tensor: sending it to another process shares
        # (copies into shared memory) one sample, not the whole shard
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert torch.equal(sample.pos, samples[17].pos)



def test_every_kind_of_column_builds_the_tensor_torch_load_gives():
    """One shard mixing the column kinds a sample is built from: a shape shared by every
    row (sliced from one typed view of the buffer), shapes that differ, a dtype numpy
    lacks (bfloat16), 0-d and empty tensors, a column some rows lack."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i in range(40):
        atoms = 1 + i % 5
        sample = Data(pos=torch.randn(6, 3, generator=generator),  # the same in every row
                      z=torch.randint(1, 9, (atoms,), generator=generator),  # differs
                      energy=torch.tensor([float(i)], dtype=torch.float64),
                      soft=torch.randn(atoms, 2, generator=generator).bfloat16(),
                      scalar=torch.tensor(i, dtype=torch.int32),  # 0-d
                      none=torch.zeros(0, 3))  # empty in every row
        if i % 4:
            sample.charge = torch.randn(atoms, generator=generator)  # missing in some
        samples.append(sample)
    buffer = _saved(samples)
    decoded = index_pt(buffer)
    assert isinstance(decoded, LazyPtSamples)
    _assert_equal_samples(decoded, samples)
    start, end = _address_range(buffer)
    for sample in (decoded[0], decoded[17], decoded[39]):
        for key in ("pos", "z", "energy", "soft", "scalar", "charge"):
            if key in sample:
                tensor = sample[key]
                assert start <= tensor.data_ptr() < end, key  # in place, not copied
                assert tensor.untyped_storage().nbytes() == (
                    tensor.numel() * tensor.element_size()), key  # just this tensor


def test_indexing_a_shard_lets_a_waiting_thread_have_the_gil():
    """The prefetch thread indexes shards while the consumer sleeps through its steps:
    a consumer waking up must not wait for the whole index to finish. With a switch
    interval of one second, CPython would only take the GIL from a thread that never
    lets go of it after a second; the machine lets go every ``YIELD_AFTER_S``."""
    buffer = _saved(make_samples(0, 4000, atoms=4))
    finished = {}

    def index_in_background():
        started = time.perf_counter()
        finished["samples"] = len(index_pt(buffer))
        finished["seconds"] = time.perf_counter() - started

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        worker = threading.Thread(target=index_in_background)
        longest, steps = 0.0, 0
        before = time.perf_counter()
        worker.start()
        while worker.is_alive():
            time.sleep(0.001)  # a consumer's step that leaves the GIL free
            now = time.perf_counter()
            longest, steps, before = max(longest, now - before), steps + 1, now
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert finished["samples"] == 4000
    assert finished["seconds"] > 0.05  # long enough for a stall to show
    # the consumer kept stepping while the shard was indexed, never held up for long
    assert steps >= 10 and longest < finished["seconds"] / 4, (steps, longest, finished)

def test_zip64_archives_with_more_than_65535_records():
    # 16,400 samples x 4 tensors: the entry count needs the zip64 end record
    samples = make_samples(0, 16_400, atoms=1)
    buffer = _saved(samples)
    with zipfile.ZipFile(io.BytesIO(bytes(buffer))) as archive:
        assert len(archive.infolist()) > 65_535
        probe = [info for info in archive.infolist() if info.filename.endswith("/data/65000")]
        expected = archive.read(probe[0])
    table = read_torch_archive(buffer).storages
    offset, size = table.get("65000")
    assert bytes(buffer[offset:offset + size]) == expected
    decoded = index_pt(buffer)
    assert len(decoded) == 16_400
    _assert_equal_samples([decoded[0], decoded[16_399]], [samples[0], samples[16_399]])


def test_decoded_shard_costs_a_few_percent_of_its_file():
    samples = make_samples(4, 3000, atoms=16)
    buffer = _saved(samples)
    index_pt(buffer)  # warm up caches of the first call
    tracemalloc.start()
    try:
        decoded = index_pt(buffer)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(decoded) == 3000
    # measured on these 16-atom molecules: 5% kept and 15% at the peak (3% and 7% on
    # 64-atom ones); torch.load holds ~3x the file
    assert kept < 0.08 * len(buffer), (kept, len(buffer))
    assert peak < 0.25 * len(buffer), (peak, len(buffer))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _twice_the_same_sample():
    sample = Data(x=torch.ones(3))
    return [sample, sample]


@pytest.mark.parametrize("payload", [
    [HeteroData({"atom": {"x": torch.ones(2, 1)}})],
    Batch.from_data_list(make_samples(1, 3)),
    [Data(x=torch.nn.Parameter(torch.ones(2)))],  # requires grad
    _twice_the_same_sample(),
    [Data(x=torch.ones(2)), {"not": "data"}],
    [Data(x=[torch.ones(2)])],  # a tensor inside a list attribute
    {"a": Data(x=torch.ones(2))},
    (Data(x=torch.ones(4)), {"x": [0, 2, 4]}),  # slices that are not tensors
], ids=["hetero", "batch", "parameter", "same twice", "mixed", "nested", "dict",
        "list slices"])
def test_other_layouts_are_left_to_torch_load(payload):
    buffer = _saved(payload)
    with pytest.raises(NotLazyLayout):
        index_pt(buffer)


class _Molecules(InMemoryDataset):
    """An ``InMemoryDataset`` of molecules with bonds (``edge_index`` is cut along its
    last dimension, so its per-sample views are strided) and names (a list)."""

    def __init__(self, root=None, count=30, path=None, atoms=5):
        super().__init__(root)
        if path is not None:
            self.load(path)
        else:
            samples = make_samples(9, count, atoms=atoms)
            for i, sample in enumerate(samples):
                sample.edge_index = torch.randint(0, atoms, (2, 3 + i % 4))
                sample.name = f"mol-{i}"
            self.data, self.slices = self.collate(samples)


def test_list_slices_of_a_collated_dataset_are_indexed_without_copying():
    """FoldPipe's shards: ``torch.save(all_data[a:b])`` with ``all_data = [d for d in
    dataset]``. Each sample views the dataset's storages, which the file holds once."""
    dataset = _Molecules(count=120, atoms=48)
    all_data = [data for data in dataset]
    shard = all_data[10:70]
    buffer = _saved(shard)
    decoded = index_pt(buffer)
    assert isinstance(decoded, LazyPtSamples)
    _assert_equal_samples(decoded, shard)
    _assert_equal_samples(decoded, load_pt_object(io.BytesIO(bytes(buffer))))
    start, end = _address_range(buffer)
    sample = decoded[3]
    assert all(start <= sample[key].data_ptr() < end for key in ("pos", "z", "edge_index"))
    assert sample.edge_index.stride() == shard[3].edge_index.stride() != (
        sample.edge_index.size(1), 1)  # a strided view, as in the dataset
    # the index costs a few percent of the file: the shared storages are not copied
    tracemalloc.start()
    try:
        kept_decoded = index_pt(buffer)
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept_decoded) == 60 and kept < 0.1 * len(buffer), (kept, len(buffer))


@pytest.mark.parametrize("how", ["collate", "save"])
def test_collated_datasets_are_cut_lazily_as_in_memory_dataset_does(tmp_path, how):
    dataset = _Molecules(count=12)
    if how == "collate":  # the (data, slices) tuple of older PyG processed files
        buffer = _saved((dataset._data, dataset.slices))
    else:  # InMemoryDataset.save: (data.to_dict(), slices, Data)
        _Molecules.save(list(dataset), str(tmp_path / "data.pt"))
        buffer = bytearray((tmp_path / "data.pt").read_bytes())
        dataset = _Molecules(path=str(tmp_path / "data.pt"))
    decoded = index_pt(buffer)
    assert isinstance(decoded, CollatedSamples) and decoded.views_into_buffer
    _assert_equal_samples(decoded, [dataset[i] for i in range(len(dataset))])
    start, end = _address_range(buffer)
    assert start <= decoded[5].pos.data_ptr() < end  # a view of the file, not a copy
    assert decoded[5].name == "mol-5"
    # the torch.load path gives the same sequence type and samples
    _assert_equal_samples(decode_shard(bytes(buffer), "c.pt"), decoded)


def test_collated_slices_that_do_not_fit_fail_at_decode_time():
    data, slices = InMemoryDataset.collate(make_samples(3, 3))
    slices["pos"] = torch.tensor([0, 100, 200, 300])  # the data holds 9 rows, not 300
    buffer = _saved((data, slices))
    for shard in (buffer, bytes(buffer)):  # indexed in place, and through torch.load
        with pytest.raises(ShardDecodeError, match=r"c\.pt: .*'pos'.*run past"):
            decode_shard(shard, "c.pt")


def test_fallback_keeps_every_layout_decodable():
    hetero = [HeteroData({"atom": {"x": torch.ones(2, 1)}})]
    (decoded,) = decode_shard(_saved(hetero), "h.pt")
    assert torch.equal(decoded["atom"].x, torch.ones(2, 1))
    same = _twice_the_same_sample()
    _assert_equal_samples(decode_shard(_saved(same), "s.pt"), same)


def test_unknown_globals_never_run_and_are_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    buffer = _saved([Data(x=torch.ones(1)), Data(bad=Evil())])
    with pytest.raises(NotLazyLayout, match="global"):
        index_pt(buffer)
    with pytest.raises(UnsafePayloadError, match="posix.system|os.system|trusted=True"):
        decode_shard(buffer, "evil.pt")
    assert not marker.exists()


def test_damaged_archives_fall_back_and_fail_with_the_shard_name():
    buffer = _saved(make_samples(3, 20))
    for damaged in (buffer[: len(buffer) // 2], bytearray(b"PK") + buffer[2:100],
                    bytearray(len(buffer))):
        with pytest.raises(NotLazyLayout):
            index_pt(damaged)
        with pytest.raises(Exception, match="broken.pt"):
            decode_shard(damaged, "broken.pt")
    with pytest.raises(NotLazyLayout, match="writable"):
        index_pt(bytes(buffer))


def test_archive_reader_rejects_compressed_records():
    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("archive/data.pkl", b"x" * 100)
    with pytest.raises(TorchZipError, match="compressed"):
        read_torch_archive(stream.getvalue())
    with pytest.raises(TorchZipError, match="end-of-central-directory"):
        read_torch_archive(b"not a zip at all")


def test_shard_buffer_uses_an_exact_memory_map_when_the_size_is_known():
    buffer = ShardBuffer("s.pt")
    buffer.restart(10)
    buffer.append(b"01234")
    buffer.append(b"56789")
    data = buffer.take()
    assert isinstance(data, mmap.mmap) and data[:] == b"0123456789"
    assert len(buffer) == 0
    # more than announced: everything is kept, in a growable buffer
    buffer.restart(4)
    buffer.append(b"abc")
    buffer.append(b"defg")
    data = buffer.take()
    assert isinstance(data, bytearray) and data == b"abcdefg"
    # fewer than announced: just what arrived
    buffer.restart(8)
    buffer.append(b"xyz")
    assert buffer.take() == bytearray(b"xyz")
    # unknown size
    buffer.restart(None)
    buffer.append(b"q" * 3)
    assert buffer.take() == bytearray(b"qqq")


def test_http_and_local_sources_deliver_memory_maps(tmp_path):
    samples = make_samples(6, 30)
    (tmp_path / "a.pt").write_bytes(bytes(_saved(samples)))
    local = LocalSource(str(tmp_path / "*.pt"))
    data = local.fetch(local.list_shards()[0], CancelToken())
    assert isinstance(data, mmap.mmap)
    _assert_equal_samples(decode_shard(data, "a.pt"), samples)
    for server in serve_directory(tmp_path):
        server.add_fault("a.pt", "truncate", at_fraction=0.4)  # resumed into the same map
        source = RemoteSource([server.url("a.pt")], retry=RetryPolicy(retries=2, backoff=0.01))
        fetched = source.fetch(source.list_shards()[0], CancelToken())
        assert isinstance(fetched, mmap.mmap)
        assert fetched[:] == (tmp_path / "a.pt").read_bytes()


class _RecordingSource(LocalSource):
    """A local source remembering the address range of every buffer it handed out."""

    def __init__(self, pattern: str) -> None:
        super().__init__(pattern)
        self.ranges: list[tuple[int, int]] = []

    def fetch(self, shard, cancel):
        data = super().fetch(shard, cancel)
        self.ranges.append(_address_range(data))
        return data


def test_stream_copies_the_samples_that_may_outlive_their_shard(tmp_path):
    # the samples' addresses are compared with this process's shard buffers: the stream
    # runs on threads here (a retrieval process hands out copies made in shared memory)
    for shard in range(2):
        (tmp_path / f"s{shard}.pt").write_bytes(bytes(_saved(make_samples(shard, 6))))

    def in_a_shard_buffer(sample, source):
        return any(start <= sample.pos.data_ptr() < end for start, end in source.ranges)

    source = _RecordingSource(str(tmp_path / "*.pt"))
    flags = [in_a_shard_buffer(sample, source)
             for sample in ShardStreamDataset(source, options=SourceOptions(retrieval="threads"),
                                              prefetch=1)]
    # only the last sample of each shard is copied (the consumer may still hold it
    # while the next shard is fetched); the others are views of the shard buffer
    assert flags == [True] * 5 + [False] + [True] * 5 + [False]
    source = _RecordingSource(str(tmp_path / "*.pt"))
    samples = list(ShardStreamDataset(source, options=SourceOptions(retrieval="threads"),
                                      shuffle_buffer=4))
    assert not any(in_a_shard_buffer(s, source) for s in samples)  # the mixing buffer copies
    assert sorted(int(s.sample_id) for s in samples) == [*range(6), *range(1000, 1006)]
    assert np.isfinite(torch.cat([s.pos for s in samples]).numpy()).all()
