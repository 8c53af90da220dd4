"""Indexing a ``.pt`` archive while its bytes arrive (``ArrivingPt`` in ``pyg/pt_arriving.py``).

The archives are real ``torch.save`` files; each test hands the indexer growing
prefixes of a buffer of the file's final size, as a download fills it.
"""

from __future__ import annotations

import io
import mmap
import struct
import zipfile

import pytest
import torch
from servers.http_server import make_samples
from test_pt_index import _assert_equal_samples, _Molecules, _saved, _varied_samples
from torch_geometric.data import Data

from pyg_atompack.pyg.errors import PtPayloadError
from pyg_atompack.pyg.pt_arriving import ArrivingPt, ArrivingPtSamples
from pyg_atompack.pyg.pt_index import index_pt
from pyg_atompack.pyg.pt_pickle import NotLazyLayout


def _arriving(raw: bytes | bytearray, filled: int) -> tuple[mmap.mmap, ArrivingPt]:
    buffer = mmap.mmap(-1, len(raw))
    buffer[:filled] = raw[:filled]
    return buffer, ArrivingPt(buffer)


def _storage_ends(raw: bytes | bytearray) -> list[int]:
    """One past the last data byte of each storage record, by storage number."""
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        ends = {}
        for info in archive.infolist():
            head, _, key = info.filename.rpartition("/data/")
            if head and key.isdigit():
                name_length, extra_length = struct.unpack_from(
                    "<HH", raw, info.header_offset + 26)
                ends[int(key)] = (info.header_offset + 30 + name_length + extra_length
                                  + info.file_size)
    return [ends[key] for key in sorted(ends)]


def test_every_prefix_publishes_exactly_the_samples_whose_bytes_are_in():
    samples = make_samples(4, 3)  # 4 storages a sample: z, pos, energy, sample_id
    raw = _saved(samples)
    reference = index_pt(bytearray(raw))
    ends = _storage_ends(raw)
    published_at = None
    for filled in range(len(raw) + 1):
        buffer, arriving = _arriving(raw, filled)
        got = arriving.feed(filled)
        if got is None:
            assert published_at is None  # once published, longer prefixes publish too
            continue
        published_at = filled if published_at is None else published_at
        # a sample is ready exactly when the last byte of its last storage is in
        # (plus the 16-byte data descriptor and the next record's signature that
        # prove where the record ends)
        expected = sum(1 for row in range(3) if ends[4 * row + 3] + 20 <= filled)
        assert got.ready == expected, filled
        for row in range(got.ready):
            _assert_equal_samples([got[row]], [reference[row]])
        if got.ready < 3:
            with pytest.raises(RuntimeError, match="not arrived"):
                got[got.ready]
    assert published_at is not None and published_at < ends[0]  # before any storage


def test_growing_prefixes_fed_to_one_indexer_end_in_the_whole_file():
    samples = _varied_samples(300)  # dtypes, 0-dim, empty, absent and late attributes
    raw = _saved(samples)
    buffer = mmap.mmap(-1, len(raw))
    arriving = ArrivingPt(buffer)
    readies = []
    for filled in range(0, len(raw) + 4096, 4096):
        filled = min(filled, len(raw))
        buffer[:filled] = raw[:filled]
        got = arriving.feed(filled)
        readies.append(got.ready if got is not None else -1)
    assert readies == sorted(readies) and 0 < readies[len(readies) // 2] < 300
    done = arriving.complete()
    assert isinstance(done, ArrivingPtSamples) and done.ready == 300
    _assert_equal_samples(done, samples)


@pytest.mark.parametrize("payload", [
    (Data(x=torch.ones(4)), {"x": torch.tensor([0, 2, 4])}),  # collated (data, slices)
    [Data(x=torch.ones(2)), {"not": "data"}],
    [Data(x=torch.ones(2))] * 2,  # one sample twice
], ids=["collated", "mixed", "same twice"])
def test_layouts_that_do_not_stream_are_declined_before_anything_is_published(payload):
    raw = _saved(payload)
    buffer, arriving = _arriving(raw, len(raw))
    with pytest.raises(NotLazyLayout):
        arriving.feed(len(raw))
    assert not arriving.published


def test_views_of_one_shared_storage_are_declined():
    dataset = _Molecules(count=12)
    raw = _saved([dataset[i] for i in range(len(dataset))])  # FoldPipe's shards
    index_pt(bytearray(raw))  # the whole-file indexer takes them
    buffer, arriving = _arriving(raw, len(raw))
    with pytest.raises(NotLazyLayout, match="share"):
        arriving.feed(len(raw))


def test_a_truncated_archive_never_publishes_a_sample_beyond_its_bytes():
    raw = _saved(make_samples(2, 10))
    ends = _storage_ends(raw)
    for cut in (ends[0] - 1, ends[17] + 5, len(raw) - 30):
        buffer, arriving = _arriving(raw, cut)  # the rest of the buffer stays zero
        got = arriving.feed(cut)
        assert got is not None and got.ready <= sum(1 for e in ends[3::4] if e < cut)
        with pytest.raises(PtPayloadError, match="damaged"):
            arriving.complete()  # the zero tail has no central directory


def test_a_record_that_disagrees_with_the_pickle_stops_the_stream_and_fails_at_the_end():
    raw = _saved(make_samples(2, 6))
    ends = _storage_ends(raw)
    damaged = bytearray(raw)
    descriptor = ends[9]  # storage 9's data descriptor: its size is now wrong
    assert damaged[descriptor:descriptor + 4] == b"PK\x07\x08"
    struct.pack_into("<I", damaged, descriptor + 8, 12345)
    buffer, arriving = _arriving(damaged, len(damaged))
    got = arriving.feed(len(damaged))
    assert got.ready == 2  # samples 0 and 1 own storages 0-7; storage 9 is sample 2's
    # the directory still agrees with the pickle: the rest is resolved from it
    done = arriving.complete()
    assert done.ready == 6
    _assert_equal_samples(done, make_samples(2, 6))
    damaged[-22:] = bytes(22)  # no end-of-directory record either: damaged for good
    buffer, arriving = _arriving(damaged, len(damaged))
    assert arriving.feed(len(damaged)).ready == 2
    with pytest.raises(PtPayloadError, match="damaged"):
        arriving.complete()


def test_a_damaged_pickle_is_declined_and_left_to_the_whole_file_path():
    raw = bytearray(_saved(make_samples(2, 4)))
    raw[200:260] = b"\xff" * 60  # inside the pickle
    buffer, arriving = _arriving(raw, len(raw))
    with pytest.raises(NotLazyLayout):
        arriving.feed(len(raw))


def test_needs_a_writable_buffer():
    with pytest.raises(NotLazyLayout, match="writable"):
        ArrivingPt(bytes(_saved(make_samples(1, 1))))


def _crc_arriving(raw: bytes | bytearray) -> tuple[mmap.mmap, ArrivingPt]:
    buffer = mmap.mmap(-1, len(raw))
    buffer[:] = raw
    return buffer, ArrivingPt(buffer, check_crc=True)


def _data_start(raw: bytes | bytearray, storage: int) -> int:
    ends = _storage_ends(raw)
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(f"/data/{storage}"))
    return ends[storage] - info.file_size


def test_with_crc_a_storage_whose_bytes_changed_is_never_made_ready():
    samples = make_samples(2, 6)
    raw = bytearray(_saved(samples))
    raw[_data_start(raw, 9) + 3] ^= 0x10  # storage 9 belongs to sample 2
    buffer, plain = _arriving(raw, len(raw))
    assert plain.feed(len(raw)).ready == 6  # nothing notices without the check
    buffer, checked = _crc_arriving(raw)
    assert checked.feed(_storage_ends(raw)[8] + 20).ready == 2  # storages 0-7 checked
    _assert_equal_samples([checked.samples[0], checked.samples[1]], samples[:2])
    with pytest.raises(PtPayloadError, match=r"data/9 does not match its CRC-32"):
        checked.feed(len(raw))
    assert checked.samples.ready == 2


def test_with_crc_the_records_left_to_the_directory_are_checked_too():
    """A walk stopped by a record it cannot place (a damaged descriptor) leaves the rest to
    complete(), which checks their CRC-32s against the central directory."""
    samples = make_samples(2, 6)
    raw = bytearray(_saved(samples))
    ends = _storage_ends(raw)
    struct.pack_into("<I", raw, ends[9] + 8, 12345)  # storage 9's descriptor: wrong size
    buffer, checked = _crc_arriving(raw)
    assert checked.feed(len(raw)).ready == 2
    _assert_equal_samples(checked.complete(), samples)  # intact: every sample ready
    raw[_data_start(raw, 13) + 1] ^= 0x01
    buffer, checked = _crc_arriving(raw)
    assert checked.feed(len(raw)).ready == 2
    with pytest.raises(PtPayloadError, match="storage 13 does not match its CRC-32"):
        checked.complete()


def test_with_crc_a_changed_pickle_or_an_archive_without_crcs_is_declined():
    from torch.utils.serialization import config

    raw = bytearray(_saved(make_samples(2, 4)))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        info = archive.getinfo("archive/data.pkl")
    name_length, extra_length = struct.unpack_from("<HH", raw, info.header_offset + 26)
    flipped = bytearray(raw)
    flipped[info.header_offset + 30 + name_length + extra_length + 40] ^= 0x01
    with pytest.raises(NotLazyLayout, match="the pickle"):
        _crc_arriving(flipped)[1].feed(len(flipped))
    saved = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        bare = _saved(make_samples(2, 4))
    finally:
        config.save.compute_crc32 = saved
    assert _arriving(bare, len(bare))[1].feed(len(bare)).ready == 4
    with pytest.raises(NotLazyLayout, match="no CRC-32"):
        _crc_arriving(bare)[1].feed(len(bare))


def _rewritten_with_sizes_in_headers(raw: bytes) -> bytes:
    """The same archive written again by Python's zipfile: every local header states
    its record's size and CRC-32 (no data descriptors, as other zip writers do), the
    storages still 64-byte aligned (padding in the extra field, as torch pads)."""
    source = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            entry = zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0))
            start = out.tell() + 30 + len(info.filename.encode())
            pad = -(start + 4) % 64
            entry.extra = struct.pack("<HH", 0xCAFE, pad) + bytes(pad)
            target.writestr(entry, data)
    return out.getvalue()


def test_with_crc_records_whose_headers_state_their_size():
    samples = make_samples(2, 5)
    raw = bytearray(_rewritten_with_sizes_in_headers(_saved(samples)))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as archive:
        assert all(not info.flag_bits & 0x8 for info in archive.infolist())  # no descriptors
    buffer, checked = _crc_arriving(raw)
    _assert_equal_samples(checked.complete(), samples)
    raw[_data_start(raw, 7) + 2] ^= 0x04
    buffer, checked = _crc_arriving(raw)
    with pytest.raises(PtPayloadError, match=r"data/7 does not match its CRC-32"):
        checked.feed(len(raw))
