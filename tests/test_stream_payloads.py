"""Safe decoding of .pt and .atp shard payloads."""

from __future__ import annotations

import io
import os

import atompack
import numpy as np
import pytest
import torch
from servers.http_server import make_samples, serve_directory
from torch_geometric.data import Batch, Data, InMemoryDataset

from pyg_atompack.stream import (
    LocalSource,
    RemoteSource,
    ShardDecodeError,
    ShardStreamDataset,
    SourceOptions,
    UnsafePayloadError,
    decode_shard,
)


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _assert_same(decoded, expected):
    assert len(decoded) == len(expected)
    for got, want in zip(decoded, expected):
        assert set(got.keys()) == set(want.keys())
        for key, value in want:  # iterating a Data yields (key, value) pairs
            assert torch.equal(got[key], value), key


class Malicious:
    """Unpickling this runs a command: what weights_only=True must prevent."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


class Custom:
    def __init__(self, value):
        self.value = value


class Tagged(Data):
    """A Data subclass outside the allow-list."""


SAMPLES = make_samples(3, 4)


@pytest.mark.parametrize(
    "payload",
    [
        SAMPLES,
        tuple(SAMPLES),
        InMemoryDataset.collate(SAMPLES),
        (InMemoryDataset.collate(SAMPLES)[0].to_dict(), InMemoryDataset.collate(SAMPLES)[1],
         Data),
    ],
    ids=["list", "tuple", "data_slices", "save_triple"],
)
def test_pt_layouts_decode_with_weights_only(payload):
    _assert_same(decode_shard(_saved(payload), "s.pt"), SAMPLES)


def test_pickled_batch_needs_trust():
    # a pickled Batch is rebuilt through a class factory call that weights_only forbids
    data = _saved(Batch.from_data_list(SAMPLES))
    with pytest.raises(UnsafePayloadError, match=r"DynamicInheritanceGetter.*trusted=True"):
        decode_shard(data, "batch.pt")
    _assert_same(decode_shard(data, "batch.pt", trusted=True), SAMPLES)


def test_string_attributes_survive(tmp_path):
    named = [Data(pos=torch.zeros(1, 3), name=f"mol{i}") for i in range(3)]
    decoded = decode_shard(_saved(InMemoryDataset.collate(named)), "s.pt")
    assert [d.name for d in decoded] == ["mol0", "mol1", "mol2"]


@pytest.mark.parametrize("payload", [[Malicious()], [Custom(3)], {"x": Custom(1)}])
def test_arbitrary_pickles_are_refused_unless_trusted(payload):
    data = _saved(payload)
    with pytest.raises(UnsafePayloadError, match=r"shard evil\.pt.*trusted=True"):
        decode_shard(data, "evil.pt")


def test_trusted_true_loads_custom_objects_and_still_checks_layout():
    with pytest.raises(ShardDecodeError, match=r"element 0 is a Custom"):
        decode_shard(_saved([Custom(3)]), "c.pt", trusted=True)
    (sample,) = decode_shard(_saved([SAMPLES[0]]), "c.pt", trusted=True)
    assert torch.equal(sample.pos, SAMPLES[0].pos)


def test_refusal_through_the_dataset_and_trusted_override(tmp_path):
    torch.save([Tagged(pos=torch.zeros(2, 3), sample_id=torch.tensor([7]))],
               tmp_path / "tagged.pt")
    with pytest.raises(UnsafePayloadError, match=r"tagged\.pt.*trusted=True"):
        list(ShardStreamDataset(LocalSource(tmp_path)))
    (sample,) = ShardStreamDataset(LocalSource(tmp_path), options=SourceOptions(trusted=True))
    assert int(sample.sample_id) == 7


def test_malicious_pickle_never_runs(tmp_path):
    marker = tmp_path / "ran"

    class Touch:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = _saved([Touch()])
    with pytest.raises(UnsafePayloadError):
        decode_shard(payload, "touch.pt")
    assert not marker.exists()


@pytest.mark.parametrize("payload", [b"not a zip", _saved({"a": torch.zeros(2)}), _saved([])])
def test_bad_payloads_name_the_shard(payload):
    if payload == _saved([]):
        assert decode_shard(payload, "empty.pt") == []
        return
    with pytest.raises(ShardDecodeError, match=r"shard bad\.pt"):
        decode_shard(payload, "bad.pt")


def _write_atp(path, n_mol, n_atoms, seed):
    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), compression="zstd", overwrite=True)
    positions = rng.normal(size=(n_mol, n_atoms, 3)).astype(np.float32)
    numbers = rng.integers(1, 30, size=(n_mol, n_atoms)).astype(np.uint8)
    energy = seed * 100.0 + np.arange(n_mol, dtype=np.float64)
    forces = rng.normal(size=(n_mol, n_atoms, 3)).astype(np.float32)
    db.add_arrays_batch(positions, numbers, energy=energy, forces=forces)
    db.flush()
    return positions, numbers, energy, forces


def test_atp_shards_stream_over_http(tmp_path):
    expected = {}
    for shard, (count, atoms) in enumerate([(3, 4), (2, 5)]):
        expected[shard] = _write_atp(tmp_path / f"part-{shard}.atp", count, atoms, shard + 1)
    server_gen = serve_directory(tmp_path)
    server = next(server_gen)
    try:
        source = RemoteSource([server.url("part-0.atp"), server.url("part-1.atp")])
        samples = list(ShardStreamDataset(source, prefetch=1))
    finally:
        server_gen.close()
    assert len(samples) == 5
    flat = [(s, i) for s in (0, 1) for i in range(len(expected[s][0]))]
    for sample, (shard, i) in zip(samples, flat):
        positions, numbers, energy, forces = expected[shard]
        np.testing.assert_array_equal(sample.pos.numpy(), positions[i])
        np.testing.assert_array_equal(sample.z.numpy(), numbers[i].astype(np.int64))
        assert sample.z.dtype == torch.int64
        np.testing.assert_allclose(sample.energy.numpy(), [energy[i]])
        np.testing.assert_array_equal(sample.forces.numpy(), forces[i])
        assert int(sample.natoms) == positions.shape[1]


def test_golden_atp_matches_reference(golden_dir):
    data = (golden_dir / "builtins_zstd.atp").read_bytes()
    decoded = decode_shard(data, "builtins_zstd.atp")
    reference = atompack.Database.open(str(golden_dir / "builtins_zstd.atp"))
    assert len(decoded) == len(reference)
    for i, sample in enumerate(decoded):
        molecule = reference[i]
        np.testing.assert_array_equal(sample.pos.numpy(), molecule.positions)
        np.testing.assert_array_equal(sample.z.numpy(), molecule.atomic_numbers)
    # the bytes are not referenced by the decoded samples
    assert all(s.pos.untyped_storage().nbytes() == s.pos.numel() * s.pos.element_size()
               for s in decoded)


def test_corrupt_atp_names_the_shard():
    with pytest.raises(ShardDecodeError, match=r"shard broken\.atp"):
        decode_shard(b"ATPK" + b"\0" * 100, "broken.atp")


def test_atp_shard_decodes_lazily_into_the_same_graphs(tmp_path):
    from pyg_atompack import atp
    from pyg_atompack.pyg import flat_to_data_list
    from pyg_atompack.stream.payloads import AtpShardSamples

    positions, numbers, energy, forces = _write_atp(tmp_path / "s.atp", 6, 5, 3)
    raw = (tmp_path / "s.atp").read_bytes()
    decoded = decode_shard(raw, "s.atp")
    # no Data exists before a sample is taken: the shard is the reader over its bytes
    assert isinstance(decoded, AtpShardSamples) and len(decoded) == 6
    eager = flat_to_data_list(atp.Reader.from_bytes(raw).read_batch(range(6)))
    for index in (5, 0, 3):  # any order, any number of times
        got, want = decoded[index], eager[index]
        assert sorted(got.keys()) == sorted(want.keys())
        for key in want.keys():  # noqa: SIM118 - iterating a Data yields pairs
            assert torch.equal(got[key], want[key]), key
        np.testing.assert_array_equal(got.pos.numpy(), positions[index])
    # samples are writable and independent of each other
    decoded[1].pos += 1.0
    np.testing.assert_array_equal(decoded[2].pos.numpy(), positions[2])


def test_damaged_atp_record_fails_at_decode_time_not_mid_iteration(tmp_path):
    from pyg_atompack import atp

    _write_atp(tmp_path / "s.atp", 6, 5, 4)
    raw = bytearray((tmp_path / "s.atp").read_bytes())
    offset = int(atp.Reader.from_bytes(bytes(raw)).index[4][0])
    raw[offset:offset + 4] = b"\xff\xff\xff\xff"  # record 4's zstd frame magic
    with pytest.raises(ShardDecodeError, match=r"shard s\.atp"):
        decode_shard(raw, "s.atp")


def test_shard_formats_are_one_table_chosen_by_suffix_then_magic(tmp_path):
    from pyg_atompack.stream.payloads import SHARD_FORMATS, shard_format

    _write_atp(tmp_path / "s.atp", 3, 4, 5)
    atp_bytes = (tmp_path / "s.atp").read_bytes()
    pt_bytes = _saved(SAMPLES)
    assert list(SHARD_FORMATS) == ["pt", "atp"]
    # the suffix decides first, whatever the bytes say
    assert shard_format("a.atp", b"junk").name == "atp"
    assert shard_format("https://host/x/a.pt", atp_bytes).name == "pt"
    # a name without a known suffix: the leading bytes decide
    assert shard_format("blob-7", atp_bytes).name == "atp"
    assert shard_format("blob-7", pt_bytes).name == "pt"
    assert len(decode_shard(atp_bytes, "blob-7")) == 3
    _assert_same(decode_shard(pt_bytes, "blob-8"), SAMPLES)


@pytest.mark.parametrize("payload", [b"", b"\x00\x01parquet?", b"PAR1" + b"\0" * 64])
def test_a_shard_no_format_recognises_is_refused_naming_it(payload):
    with pytest.raises(ShardDecodeError, match=r"shard shards/part-3\.parquet: not a shard "
                                               r"format the stream reads.*pt: .*atp: "):
        decode_shard(payload, "shards/part-3.parquet")


def test_an_unknown_shard_is_skipped_or_raised_by_the_stream(tmp_path):
    from pyg_atompack.stream.payloads import SHARD_FORMATS, ShardFormat, register_shard_format

    torch.save(SAMPLES, tmp_path / "a.pt")
    (tmp_path / "b.pt").write_bytes(b"")  # listed by suffix, then empty
    # a format added to the table is what the stream reads, with nothing else changed
    register_shard_format(ShardFormat("twice", (".twice.pt",), (), lambda buffer, name, trusted,
                                      lazy: decode_shard(bytes(buffer), name[:-9] + ".pt") * 2,
                                      lambda buffer, lazy: buffer))
    try:
        torch.save(SAMPLES[:1], tmp_path / "c.twice.pt")
        got = list(ShardStreamDataset(LocalSource(tmp_path), on_error="skip"))
    finally:
        del SHARD_FORMATS["twice"]
    assert len(got) == len(SAMPLES) + 2
