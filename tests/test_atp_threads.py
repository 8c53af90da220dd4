"""One reader shared by threads: every record decodes as itself, however the threads interleave.

Thread-based pipelines (``torchdata.nodes.ParallelMapper(method="thread")``, a
``ThreadPoolExecutor`` mapping ``dataset.get``) call ``reader[i]`` and ``read_batch``
of one reader from several threads at once. Each record's first touch fills the
reader's decode cache (memo ids, per-size plans, the mixed-size structure memo); the
interpreter may switch threads between any two of those steps, so these tests switch
every microsecond (``sys.setswitchinterval``) over a file of many sizes and two
structures per size, written by atompack-db.
"""

from __future__ import annotations

import pickle
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import atompack
import numpy as np
import pytest

from pyg_atompack import atp

COUNT = 3000
THREADS = 4


@pytest.fixture(scope="module")
def sizes_file(tmp_path_factory) -> tuple[str, np.ndarray]:
    """3,000 molecules of 3-8 atoms, even ones with property ``a``, odd ones with ``b``.

    Record ``j`` has energy ``j`` and every position coordinate ``j``: a record decoded
    with another record's layout or plan shows at once.
    """
    sizes = np.random.default_rng(0).integers(3, 9, COUNT)
    molecules = []
    for j, n in enumerate(sizes.tolist()):
        molecule = atompack.Molecule.from_arrays(
            np.full((n, 3), j, np.float32), np.arange(1, n + 1, dtype=np.uint8),
            energy=float(j))
        molecule.set_property("b" if j % 2 else "a", float(j), scope="molecule")
        molecules.append(molecule)
    path = tmp_path_factory.mktemp("threads") / "sizes.atp"
    db = atompack.Database(str(path), compression="none", overwrite=True)
    db.add_molecules(molecules)
    db.flush()
    del db
    return str(path), sizes


@pytest.fixture
def switch_often():
    """Switch threads every microsecond (the default 5 ms hides most interleavings)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def _on_fresh_readers(path: str, access: str, work, readers: int = 4) -> list:
    """``work(reader, seed, failures)`` on THREADS threads sharing a fresh reader, for each
    of ``readers`` readers (every record's first touch races); the failures seen."""
    failures: list = []
    for number in range(readers):
        with atp.open(path, access=access) as reader:
            threads = [threading.Thread(target=work,
                                        args=(reader, number * THREADS + t, failures))
                       for t in range(THREADS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if failures:
            break
    return failures


@pytest.mark.parametrize("access", ["auto", "mmap"])
def test_threads_sharing_a_fresh_reader_read_every_record_as_itself(
        sizes_file, access, switch_often):
    path, sizes = sizes_file

    def work(reader, seed, failures):
        order = np.random.default_rng(seed).permutation(COUNT).tolist()
        try:
            for i in order:
                mol = reader[i]
                key = "b" if i % 2 else "a"
                if (len(mol.atomic_numbers) != sizes[i] or mol.energy != i
                        or mol.positions[0, 0] != i or mol.properties != {key: float(i)}):
                    failures.append(f"record {i} decoded as another")
        except Exception as exc:  # any error here is a failure of the test
            failures.append(repr(exc))

    assert _on_fresh_readers(path, access, work) == []


@pytest.mark.parametrize("access", ["auto", "mmap"])
def test_threads_mixing_batches_and_single_reads_of_a_fresh_reader(
        sizes_file, access, switch_often):
    path, sizes = sizes_file

    def work(reader, seed, failures):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                idx = rng.integers(0, COUNT, 16)
                batch = reader.read_batch(idx, ["energy"])
                if not (np.array_equal(batch["n_atoms"], sizes[idx])
                        and np.array_equal(batch["energy"], idx.astype(float))
                        and np.array_equal(batch["positions"][:, 0],
                                           np.repeat(idx, sizes[idx]).astype(np.float32))):
                    failures.append(f"batch {idx.tolist()} decoded wrongly")
                i = int(rng.integers(0, COUNT))
                if reader[i].energy != i:
                    failures.append(f"record {i} decoded as another")
        except Exception as exc:  # any error here is a failure of the test
            failures.append(repr(exc))

    assert _on_fresh_readers(path, access, work) == []


def test_a_thread_pool_mapping_dataset_get(sizes_file, switch_often):
    """As a thread-based loader would: ``dataset.get`` mapped over a pool of threads."""
    from pyg_atompack import AtompackDataset

    path, sizes = sizes_file
    dataset = AtompackDataset(path)
    order = np.random.default_rng(1).permutation(COUNT)[:1000].tolist()
    with ThreadPoolExecutor(THREADS) as pool:
        graphs = list(pool.map(dataset.get, order))
    assert [float(g.energy) for g in graphs] == [float(i) for i in order]
    assert [g.num_nodes for g in graphs] == sizes[order].tolist()
    assert all(float(g.pos[0, 0]) == i for g, i in zip(graphs, order))


def test_threads_opening_an_unpickled_reader_open_it_once(sizes_file, switch_often,
                                                          monkeypatch):
    """An unpickled (or closed) reader opens on first use; threads using it at once
    open one state between them (each extra state leaked its file descriptor)."""
    from pyg_atompack.atp import reader as reader_module

    path, _ = sizes_file
    opened = []
    original = reader_module.FileState
    monkeypatch.setattr(reader_module, "FileState",
                        lambda *args: opened.append(1) or original(*args))
    for _ in range(40):
        reader = pickle.loads(pickle.dumps(atp.open(path)))
        opened.clear()
        start = threading.Barrier(THREADS)
        energies = []

        def first_read(reader=reader, start=start, energies=energies):
            start.wait()
            energies.append(reader[0].energy)

        threads = [threading.Thread(target=first_read) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        reader.close()
        assert energies == [0.0] * THREADS
        assert len(opened) == 1
