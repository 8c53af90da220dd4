"""The reader contract (``atp.RecordReader``): every reader implements it, and each reader's
batch read agrees with the contract's default, built on ``reader[i]``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest
from servers.http_server import serve_directory

import pyg_atompack
from pyg_atompack import atp
from pyg_atompack.atp import RecordReader
from pyg_atompack.atp.batch import resolve_fields

# indices with repeats, negative values and any order: what a sampler hands a reader
BATCHES = [[0], [3, 1, 1, -1, 0], list(range(9)), [], [8, 2, 5, 4]]


def _write(path, seed, compression, *, with_cell):
    """Nine records of 2..6 atoms whose optional fields come and go."""
    rng = np.random.default_rng(seed)
    with atp.Writer(path, compression=compression) as writer:
        for i in range(9):
            n = 2 + (i * 7 + seed) % 5
            properties = {"tag": f"m{i}", "weight": float(i) / 3}
            if i % 3:
                properties["spectrum"] = rng.normal(size=4)
            writer.add(
                rng.normal(size=(n, 3)), rng.integers(1, 30, n),
                energy=None if i % 4 == 1 else float(rng.normal()),
                forces=rng.normal(size=(n, 3)) if i % 2 else None,
                cell=np.eye(3) * (4 + i) if with_cell and i % 3 != 2 else None,
                pbc=(True, i % 2 == 0, False) if with_cell and i % 3 != 2 else None,
                properties=properties,
                atom_properties={"spin": rng.normal(size=n)} if i % 4 else None)
        writer.flush()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    _write(root / "a.atp", 1, "none", with_cell=True)
    _write(root / "b.atp", 2, "zstd", with_cell=False)
    return root


def _assert_same_values(got, want, where):
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        np.testing.assert_array_equal(got, want, err_msg=where)
        return
    assert type(got) is type(want) and len(got) == len(want), where
    for j, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, np.ndarray):
            np.testing.assert_array_equal(g, w, err_msg=f"{where}[{j}]")
        else:
            assert g == w, f"{where}[{j}]"


def _assert_same_batch(got, want):
    assert set(got) == set(want)
    for key in want:
        if key in ("properties", "atom_properties", "mask"):
            assert set(got[key]) == set(want[key]), key
            for inner in want[key]:
                _assert_same_values(got[key][inner], want[key][inner], f"{key}/{inner}")
        else:
            _assert_same_values(got[key], want[key], key)


def _reference(reader, indices, fields=None):
    """The contract's default batch read of any reader: record after record."""
    infos = resolve_fields(reader.fields, fields, reader.name)
    return RecordReader.read_resolved(reader, indices, infos)


class OnlyRecords(RecordReader):
    """A reader that implements only what the contract requires."""

    def __init__(self, inner):
        self.inner = inner
        self.name = f"only-records({inner.name})"

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]

    @property
    def fields(self):
        return self.inner.fields

    @property
    def n_atoms(self):
        return self.inner.n_atoms


def _readers_of_the_package():
    """Every class of the package that reads records in batches."""
    found = set()
    for module in pkgutil.walk_packages(pyg_atompack.__path__, "pyg_atompack."):
        loaded = importlib.import_module(module.name)
        for _, cls in inspect.getmembers(loaded, inspect.isclass):
            if cls.__module__ == loaded.__name__ and any(
                    name in vars(cls) for name in ("read_batch", "read_resolved")):
                found.add(cls)
    return found


def test_every_reader_of_the_package_implements_the_contract():
    from pyg_atompack.hub.atp_reader import HubAtpReader, _DownloadedShard, _PagedShard
    from pyg_atompack.remote.record_reader import RemoteAtpReader

    readers = _readers_of_the_package()
    expected = {atp.Reader, atp.ShardedReader, RemoteAtpReader, _DownloadedShard}
    assert expected <= readers  # the scan finds them (it would miss nothing bigger)
    outside = {cls.__qualname__ for cls in readers if not issubclass(cls, RecordReader)}
    assert not outside, f"readers that do not subclass atp.RecordReader: {outside}"
    for cls in (HubAtpReader, _PagedShard):
        assert issubclass(cls, RecordReader)
    # the contract is abstract: a class missing a required member cannot be built
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (RecordReader,), {"__len__": lambda self: 0})()


def test_the_default_batch_read_equals_per_record_reads(files):
    for name in ("a.atp", "b.atp"):
        with atp.open(files / name) as reader:
            only = OnlyRecords(reader)
            for indices in BATCHES:
                for fields in (None, ["energy", "spin"], ["forces", "properties/tag"]):
                    batch = only.read_batch(indices, fields=fields)
                    # ... equal to the reader's own fast path
                    _assert_same_batch(batch, reader.read_batch(indices, fields=fields))
                # ... and, record by record, to reader[i]
                batch = only.read_batch(indices)
                starts = np.concatenate([[0], np.cumsum(batch["n_atoms"])])
                for row, i in enumerate(indices):
                    molecule = reader[i]
                    atoms = slice(starts[row], starts[row + 1])
                    np.testing.assert_array_equal(batch["positions"][atoms], molecule.positions)
                    assert batch["mask"]["energy"][row] == (molecule.energy is not None)
                    if molecule.energy is not None:
                        assert batch["energy"][row] == molecule.energy
                    assert batch["properties"]["tag"][row] == molecule.properties["tag"]
            # and it works wherever a reader is taken: the sharded reader over it
            sharded = atp.ShardedReader.from_readers([only, OnlyRecords(reader)])
            _assert_same_batch(sharded.read_batch([10, 1, 17, 1]),
                               atp.ShardedReader.from_readers([reader, reader])
                               .read_batch([10, 1, 17, 1]))
    with pytest.raises(atp.AtpIndexError, match=r"only-records\(.*a\.atp\)"):
        OnlyRecords(atp.open(files / "a.atp")).read_batch([9])


def test_each_reader_agrees_with_the_default(files):
    from pyg_atompack import hub
    from pyg_atompack.remote.ranges import FileRangeReader
    from pyg_atompack.remote.record_reader import RemoteAtpReader

    local = [atp.open(files / "a.atp", access=access) for access in ("mmap", "pread")]
    local.append(atp.Reader.from_bytes((files / "b.atp").read_bytes(), name="b.atp"))
    local.append(atp.open(files))  # the directory: a sharded reader
    remote = [RemoteAtpReader(FileRangeReader(files / "b.atp"), cache_dir=files / "cache")]
    server_gen = serve_directory(files)
    server = next(server_gen)
    try:
        url = server.url("b.atp")
        remote.append(hub.open_remote_atp(url, cache_dir=files / "cache"))
        remote.append(hub.open_remote_atp(url, cache_dir=files / "cache").by_record(
            cache_dir=files / "cache"))
        for reader in local + remote:
            assert isinstance(reader, RecordReader)
            for indices in BATCHES:
                _assert_same_batch(reader.read_batch(indices), _reference(reader, indices))
            _assert_same_batch(reader.read_batch([2, 0], fields=["spin"]),
                               _reference(reader, [2, 0], ["spin"]))
    finally:
        server_gen.close()


def test_from_readers_refuses_what_is_not_a_reader(files):
    with atp.open(files / "a.atp") as reader, pytest.raises(
            atp.AtpValueError, match="RecordReader objects; shard 1 is a list"):
        atp.ShardedReader.from_readers([reader, [reader[0]]])
