"""First-touch batches: half of the page faults on a pool thread (atp/prefault.py); pool
hand-offs at interpreter exit."""

from __future__ import annotations

import mmap
import resource
import sys

import atompack
import numpy as np
import pytest

from pyg_atompack import atp
from pyg_atompack.atp import prefault

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process_vm_readv is Linux's")

FIELDS = ("positions", "atomic_numbers", "energy", "forces", "cell", "pbc")
SPACING = 64  # records apart: > 64 KiB of 64-atom records, beyond the kernel's fault-around


def _write(path, sizes, seed=0):
    """An atompack-db file of molecules of the given atom counts, energy = index."""
    rng = np.random.default_rng(seed)
    db = atompack.Database(str(path), overwrite=True)
    sizes = np.asarray(sizes)
    start = 0
    for n in sizes.tolist() if len(set(sizes.tolist())) > 1 else [int(sizes[0])]:
        k = 1 if len(set(sizes.tolist())) > 1 else len(sizes)
        db.add_arrays_batch(rng.standard_normal((k, n, 3)).astype(np.float32),
                            rng.integers(1, 90, size=(k, n), dtype=np.uint8),
                            energy=np.arange(start, start + k, dtype=np.float64),
                            forces=rng.standard_normal((k, n, 3)).astype(np.float32),
                            cell=rng.standard_normal((k, 3, 3)),
                            pbc=rng.random((k, 3)) < 0.5)
        start += k
    db.flush()
    del db
    return path


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_the_pool_thread_maps_the_second_half_of_the_untouched_records(tmp_path, monkeypatch):
    """After the hand-off, reading the pool thread's records faults nothing in this
    thread, reading the other half does: the pages were mapped by the other thread."""
    path = _write(tmp_path / "u.atp", [64] * (40 * SPACING))
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4)
    with atp.open(path, access="mmap") as reader:
        st = reader._state()
        idx = np.arange(0, 40 * SPACING, SPACING)
        entries = st.index[idx]
        task = prefault.spread(st, idx, entries)
        assert task is not None
        assert task.result() > 0
        u8 = st.u8
        offsets = entries["offset"].astype(np.int64)

        base = u8.__array_interface__["data"][0]

        def mapped(records):
            """Whether the record's first page is in this process's page table (the
            present bit of /proc/self/pagemap, readable without privileges)."""
            with open("/proc/self/pagemap", "rb") as pagemap:
                present = []
                for off in offsets[records].tolist():
                    pagemap.seek((base + off) // mmap.PAGESIZE * 8)
                    entry = int.from_bytes(pagemap.read(8), "little")
                    present.append(bool(entry >> 63))
            return present

        def faults_reading(records):
            starts = offsets[records].tolist()  # allocated before counting
            before = _thread_faults()
            for off in starts:
                u8[off], u8[off + 1000]
            return _thread_faults() - before

        # the pool thread's half is mapped already, ours is not until we read it (but
        # record 0, which shares pages with the header read on opening), and then costs
        # about one fault per record in this thread
        assert all(mapped(slice(20, 40)))
        assert not any(mapped(slice(1, 20)))
        assert faults_reading(slice(0, 20)) >= 15
        assert all(mapped(slice(0, 20)))


def test_pages_of_lists_every_page_of_every_range():
    rng = np.random.default_rng(1)
    offsets = rng.integers(0, 1 << 24, 50).astype(np.int64)
    sizes = rng.integers(1, 5 * mmap.PAGESIZE, 50).astype(np.int64)
    expected = [p for o, s in zip(offsets.tolist(), sizes.tolist())
                for p in range(o // mmap.PAGESIZE, (o + s - 1) // mmap.PAGESIZE + 1)]
    assert prefault.pages_of(offsets, sizes).tolist() == expected


@pytest.mark.parametrize("sizes", ["uniform", "mixed"])
@pytest.mark.parametrize("helper", [True, False])
def test_first_touch_batches_equal_atompack_with_and_without_the_helper(
        tmp_path, monkeypatch, sizes, helper):
    count = 600
    atoms = [64] * count if sizes == "uniform" else \
        np.random.default_rng(2).integers(5, 200, count).tolist()
    path = _write(tmp_path / f"{sizes}.atp", atoms)
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4 if helper else 1 << 40)
    monkeypatch.setattr(prefault, "LATE_START_SECONDS", float("inf"))  # however busy
    db = atompack.Database.open(str(path))
    rng = np.random.default_rng(3)
    for access in ("mmap", "auto"):
        with atp.open(path, access=access) as reader:
            for size in (8, 100, 250):
                batch = rng.integers(0, count, size).tolist()
                got, want = reader.read_batch(batch), db.get_molecules_flat(batch)
                for key in FIELDS:
                    np.testing.assert_array_equal(got[key], want[key])
            task = reader._state().cache.helper
            assert (task is not None) == helper
            if task is not None:
                assert task.result() > 0


def test_no_hand_off_for_records_read_before_or_small_batches(tmp_path, monkeypatch):
    path = _write(tmp_path / "u.atp", [64] * 400)
    monkeypatch.setattr(prefault, "MIN_RECORDS", 16)
    monkeypatch.setattr(prefault, "LATE_START_SECONDS", float("inf"))  # however busy
    with atp.open(path, access="mmap") as reader:
        st = reader._state()
        idx = np.arange(0, 400, 4)
        assert prefault.spread(st, idx[:15], st.index[idx[:15]]) is None  # too few
        reader.read_batch(idx.tolist())
        st.cache.helper.result()
        # every record checked: nothing left to hand off
        assert prefault.spread(st, idx, st.index[idx]) is None
        fresh = np.arange(1, 400, 4)
        assert prefault.spread(st, fresh, st.index[fresh]) is not None


def test_without_process_vm_readv_batches_read_in_this_thread(tmp_path, monkeypatch):
    path = _write(tmp_path / "u.atp", [64] * 300)
    monkeypatch.setattr(prefault, "_readv", None)
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4)
    with atp.open(path) as reader:
        got = reader.read_batch(list(range(0, 300, 3)))
        assert reader._state().cache.helper is None
    assert got["energy"].tolist() == [float(i) for i in range(0, 300, 3)]


def test_a_damaged_entry_is_not_handed_off_and_the_batch_names_it(tmp_path, monkeypatch):
    path = _write(tmp_path / "u.atp", [64] * 200)
    with atp.open(path) as reader:
        st = reader._state()
        entries = st.index[np.arange(100)].copy()
        entries["offset"][70] = st.size  # a record beyond the end of the file
        assert prefault.spread(st, np.arange(100), entries) is None
    # the same damage in the file: the batch's own check names file and record
    data = bytearray(path.read_bytes())
    with atp.open(path) as reader:
        at = reader.header.index_offset + 8 + 20 * 70  # record 70's offset
    data[at:at + 8] = (len(data) + 10).to_bytes(8, "little")
    bad = tmp_path / "bad.atp"
    bad.write_bytes(bytes(data))
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4)
    with atp.open(bad) as reader, pytest.raises(atp.RecordDecodeError,
                                                match=r"bad\.atp: record 70"):
        reader.read_batch(list(range(100)))


def test_closing_the_reader_while_the_pool_thread_reads_is_safe(tmp_path, monkeypatch):
    """The pool thread holds the mapping's array: closing the reader leaves the pages
    it reads mapped until it is done, and its result is still the page count."""
    path = _write(tmp_path / "u.atp", [64] * (40 * SPACING))
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4)
    reader = atp.open(path, access="mmap")
    st = reader._state()
    idx = np.arange(0, 40 * SPACING, SPACING)
    task = prefault.spread(st, idx, st.index[idx])
    reader.close()
    assert task.result() > 0
    with atp.open(path) as again:  # and the file reads normally afterwards
        assert again.read_batch(idx.tolist())["energy"].tolist() == idx.astype(float).tolist()


def test_a_batch_read_while_the_interpreter_exits_needs_no_new_thread(tmp_path):
    """At interpreter exit the pool takes no new work: a batch read from an atexit
    handler is still read (in the calling thread), not an error."""
    import subprocess

    path = _write(tmp_path / "u.atp", [64] * 300)
    script = (
        "import atexit, concurrent.futures.thread as t\n"
        "from pyg_atompack import atp\n"
        "from pyg_atompack.atp import prefault\n"
        "prefault.MIN_RECORDS = 4\n"
        f"reader = atp.open({str(path)!r})\n"
        "def late():\n"
        "    t._shutdown = True\n"
        "    print(reader.read_batch(list(range(0, 300, 3)))['energy'].sum())\n"
        "atexit.register(late)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == float(sum(range(0, 300, 3)))


def test_batches_off_the_page_cache_read_while_the_interpreter_exits(tmp_path):
    """The same for the concurrent ``pread`` of records not in memory (preads.py)."""
    import subprocess

    path = _write(tmp_path / "u.atp", [64] * 300)
    script = (
        "import atexit, os, concurrent.futures.thread as t\n"
        "from pyg_atompack import atp\n"
        f"reader = atp.open({str(path)!r}, access='pread')\n"
        "st = reader._state()\n"
        "def slow(fd, n, off):\n"
        "    import time; time.sleep(0.001); return os.pread(fd, n, off)\n"
        "st.pread = slow\n"
        "def late():\n"
        "    t._shutdown = True\n"
        "    print(reader.read_batch(list(range(0, 300, 3)))['energy'].sum())\n"
        "atexit.register(late)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == float(sum(range(0, 300, 3)))


def test_a_helper_that_found_no_free_core_pauses_the_hand_offs(tmp_path, monkeypatch):
    """A pool thread that started late (no free core) makes the next BACK_OFF eligible
    batches fault in the calling thread; then the hand-off is tried again. Nothing is
    timed: the clock is replaced."""
    import itertools

    path = _write(tmp_path / "u.atp", [64] * 4000)
    monkeypatch.setattr(prefault, "MIN_RECORDS", 4)
    monkeypatch.setattr(prefault, "BACK_OFF", 3)
    batches = [list(range(start, start + 8)) for start in range(0, 4000, 8)]
    for step, late in ((0.0, False), (1.0, True)):
        clock = itertools.count(0.0, step)  # submit -> start takes ``step`` seconds
        monkeypatch.setattr(prefault, "perf_counter", lambda clock=clock: next(clock))
        with atp.open(path, access="mmap") as reader:
            cache = reader._state().cache
            handed = []
            for batch in batches[:9]:
                got = reader.read_batch(batch)
                assert got["energy"].tolist() == [float(i) for i in batch]
                handed.append(cache.helper is not None)
                if cache.helper is not None:
                    cache.helper.result()
        # late: every hand-off is followed by 3 batches without one
        assert handed == (([True, False, False, False] * 3)[:9] if late else [True] * 9)
