"""One writer per `.atp` file: the advisory lock every ``atp.Writer`` holds (issue #33, item 4).

Every test that involves a second process uses a real one (``subprocess`` or a
``multiprocessing`` fork), since what is tested is what the kernel does with the
lock: who else sees it, and that it dies with its process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack import atp

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 60

# a writer in another process: opens PATH (MODE "append" / "create" / "overwrite"),
# commits one molecule, says "ready PID", then waits for its stdin to close
HOLDER = textwrap.dedent("""
    import os, sys
    import numpy as np
    from pyg_atompack import atp
    path, mode = sys.argv[1], sys.argv[2]
    if mode == "append":
        writer = atp.Writer.append_to(path)
    else:
        writer = atp.Writer(path, overwrite=mode == "overwrite")
    writer.add(np.full((2, 3), 7.0, np.float32), np.array([7, 7]), energy=7.0)
    writer.flush()
    print("ready", os.getpid(), flush=True)
    sys.stdin.read()
    writer.add(np.full((1, 3), 8.0, np.float32), np.array([8]), energy=8.0)
    writer.flush()
    writer.close()
""")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _molecule(tag: float, n: int = 2) -> dict:
    return dict(positions=np.full((n, 3), tag, np.float32),
                atomic_numbers=np.full(n, int(tag) % 90 + 1, np.uint8), energy=float(tag))


def _new_file(path: Path, tags=(1.0, 2.0)) -> Path:
    with atp.Writer(path) as writer:
        for tag in tags:
            writer.add(**_molecule(tag))
    return path


class _Holder:
    """A writer process holding ``path`` until :meth:`finish` (or a kill)."""

    def __init__(self, path: Path, mode: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), mode],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, env=_env())
        line = self.process.stdout.readline().decode()
        if not line.startswith("ready"):
            self.process.kill()
            _, err = self.process.communicate(timeout=CHILD_TIMEOUT_S)
            pytest.fail(f"holder did not start: {line!r} {err.decode()}")
        self.pid = int(line.split()[1])

    def finish(self) -> int:
        _, err = self.process.communicate(timeout=CHILD_TIMEOUT_S)
        assert self.process.returncode == 0, err.decode()
        return self.process.returncode

    def kill(self) -> int:
        self.process.send_signal(signal.SIGKILL)
        self.process.communicate(timeout=CHILD_TIMEOUT_S)
        return self.process.returncode

    def __enter__(self) -> _Holder:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=CHILD_TIMEOUT_S)


def _energies(path: Path) -> list[float]:
    with atp.Reader(path, access="pread") as reader:
        return [reader[i].energy for i in range(len(reader))]


@pytest.mark.parametrize("mode", ["append", "overwrite"])
@pytest.mark.parametrize("second", ["append_to", "overwrite"])
def test_second_writer_of_another_process_fails_at_once_naming_file_and_pid(
        tmp_path: Path, mode: str, second: str) -> None:
    path = _new_file(tmp_path / "data.atp")
    with _Holder(path, mode) as holder:
        started = time.monotonic()
        with pytest.raises(atp.FileLockedError) as info:
            if second == "append_to":
                atp.Writer.append_to(path)
            else:
                atp.Writer(path, overwrite=True)
        assert time.monotonic() - started < 2.0  # fails at once, does not wait
        assert str(path) in str(info.value)
        assert f"pid {holder.pid}" in str(info.value)
        assert isinstance(info.value, atp.AtpError)
        holder.finish()
    # the refused writer changed nothing: the holder's commits are all there
    expected = [1.0, 2.0, 7.0, 8.0] if mode == "append" else [7.0, 8.0]
    assert _energies(path) == expected
    assert atp.verify(path) == []


def test_second_writer_in_the_same_process_fails(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    with atp.Writer.append_to(path) as first:
        for attempt in (lambda: atp.Writer.append_to(path),
                        lambda: atp.Writer(path, overwrite=True)):
            with pytest.raises(atp.FileLockedError, match=f"pid {os.getpid()}, this process"):
                attempt()
        with pytest.raises(FileExistsError):
            atp.Writer(path)
        first.add(**_molecule(3.0))
    with atp.Writer.append_to(path) as again:  # released by close
        again.add(**_molecule(4.0))
    assert _energies(path) == [1.0, 2.0, 3.0, 4.0]


def test_a_writer_dropped_without_close_releases_the_lock(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    writer = atp.Writer.append_to(path)
    writer.add(**_molecule(3.0))
    del writer  # never flushed nor closed
    with atp.Writer.append_to(path) as again:
        again.add(**_molecule(4.0))
    assert _energies(path) == [1.0, 2.0, 4.0]


def test_writer_killed_with_sigkill_does_not_block_the_next(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    with _Holder(path, "append") as holder:
        with pytest.raises(atp.FileLockedError):
            atp.Writer.append_to(path)
        assert holder.kill() == -signal.SIGKILL
    started = time.monotonic()
    with atp.Writer.append_to(path) as writer:  # at once: the lock died with its process
        assert time.monotonic() - started < 2.0
        assert len(writer) == 3  # the killed writer's commit survived
        writer.add(**_molecule(4.0))
    assert _energies(path) == [1.0, 2.0, 7.0, 4.0]
    assert atp.verify(path) == []


def test_readers_are_never_blocked_by_a_writer(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    with _Holder(path, "append") as holder:
        for access in ("auto", "mmap", "pread"):
            with atp.Reader(path, access=access) as reader:
                assert [reader[i].energy for i in range(len(reader))] == [1.0, 2.0, 7.0]
        assert atp.verify(path) == []
        holder.finish()


def _appender(path: str, worker: int, count: int, queue, start) -> None:
    """Append ``count`` molecules tagged ``worker * 1000 + j``, one writer session each.

    The workers start together and hold each session a few milliseconds, so they contend
    for the lock on any machine, quiet or loaded.
    """
    done = 0
    refusals = 0
    start.wait(CHILD_TIMEOUT_S)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while done < count and time.monotonic() < deadline:
        try:
            writer = atp.Writer.append_to(path)
        except atp.FileLockedError:
            refusals += 1
            time.sleep(0.001)
            continue
        with writer:
            writer.add(**_molecule(worker * 1000 + done, n=1 + done % 3))
            time.sleep(0.005)
        done += 1
    queue.put((worker, done, refusals))


def test_concurrent_appenders_never_lose_or_mix_records(tmp_path: Path) -> None:
    # the scenario: before the lock, a record committed by one writer read back
    # as the other's molecule and verify() saw nothing wrong
    path = _new_file(tmp_path / "data.atp", tags=())
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers, count = 4, 15
    start = context.Barrier(workers)
    processes = [context.Process(target=_appender, args=(str(path), w, count, queue, start))
                 for w in range(workers)]
    for process in processes:
        process.start()
    results = [queue.get(timeout=CHILD_TIMEOUT_S * 2) for _ in processes]
    for process in processes:
        process.join(CHILD_TIMEOUT_S)
        assert process.exitcode == 0
    assert sorted(done for _, done, _ in results) == [count] * workers
    assert sum(refusals for *_, refusals in results) > 0  # they did contend
    assert atp.verify(path) == []
    with atp.Reader(path, access="pread") as reader:
        tags = sorted(reader[i].energy for i in range(len(reader)))
        for i in range(len(reader)):
            mol = reader[i]
            j = int(mol.energy) % 1000
            assert len(mol.atomic_numbers) == 1 + j % 3
            assert (mol.positions == np.float32(mol.energy)).all()
    assert tags == sorted(float(w * 1000 + j) for w in range(workers) for j in range(count))


def _creator(path: str, barrier, queue) -> None:
    barrier.wait()
    try:
        with atp.Writer(path) as writer:
            writer.add(**_molecule(float(os.getpid() % 10000)))
        queue.put(("created", os.getpid() % 10000))
    except FileExistsError:
        queue.put(("exists", None))


def test_concurrent_creators_exactly_one_wins(tmp_path: Path) -> None:
    path = tmp_path / "new.atp"
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(4), context.Queue()
    processes = [context.Process(target=_creator, args=(str(path), barrier, queue))
                 for _ in range(4)]
    for process in processes:
        process.start()
    outcomes = [queue.get(timeout=CHILD_TIMEOUT_S) for _ in processes]
    for process in processes:
        process.join(CHILD_TIMEOUT_S)
    winners = [tag for what, tag in outcomes if what == "created"]
    assert len(winners) == 1 and sum(what == "exists" for what, _ in outcomes) == 3
    assert _energies(path) == [float(winners[0])]
    assert sorted(os.listdir(tmp_path)) == ["new.atp"]  # no temporary file left behind


def _hold_in_child(ready, release) -> None:
    ready.set()
    release.wait(CHILD_TIMEOUT_S)


def test_forked_child_does_not_keep_the_parents_lock(tmp_path: Path) -> None:
    # a DataLoader worker forked while a writer is open must not hold the file after
    # the parent closed its writer
    path = _new_file(tmp_path / "data.atp")
    writer = atp.Writer.append_to(path)
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    child = context.Process(target=_hold_in_child, args=(ready, release))
    child.start()
    try:
        assert ready.wait(CHILD_TIMEOUT_S)
        writer.add(**_molecule(3.0))
        writer.close()
        with atp.Writer.append_to(path) as again:  # the child is still alive
            again.add(**_molecule(4.0))
    finally:
        release.set()
        child.join(CHILD_TIMEOUT_S)
    assert child.exitcode == 0
    assert _energies(path) == [1.0, 2.0, 4.0]


def _use_inherited(writer, queue) -> None:
    try:
        writer.add(**_molecule(9.0))
        queue.put("wrote")
    except atp.AtpError as exc:
        queue.put(str(exc))


def test_a_writer_inherited_by_fork_is_closed_in_the_child(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    with atp.Writer.append_to(path) as writer:
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_use_inherited, args=(writer, queue))
        child.start()
        message = queue.get(timeout=CHILD_TIMEOUT_S)
        child.join(CHILD_TIMEOUT_S)
        assert message == f"{path}: writer is closed"
        writer.add(**_molecule(3.0))  # the parent's writer is untouched
    assert _energies(path) == [1.0, 2.0, 3.0]


def test_overwrite_replaces_the_file_and_open_readers_keep_the_old_one(tmp_path: Path) -> None:
    path = _new_file(tmp_path / "data.atp")
    os.chmod(path, 0o640)
    old_inode = os.stat(path).st_ino
    readers = {access: atp.Reader(path, access=access) for access in ("auto", "mmap", "pread")}
    arrays = readers["mmap"][1].positions  # a zero-copy view of the old mapping
    with atp.Writer(path, overwrite=True) as writer:
        assert len(writer) == 0
        assert _energies(path) == []  # replaced at once, empty until the first flush
        writer.add(**_molecule(5.0, n=1))
    assert os.stat(path).st_ino != old_inode
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640  # permission bits kept
    assert _energies(path) == [5.0]
    for reader in readers.values():
        assert [reader[i].energy for i in range(len(reader))] == [1.0, 2.0]
        reader.close()
    assert (arrays == 2.0).all()
    assert sorted(os.listdir(tmp_path)) == ["data.atp"]


def test_overwrite_through_a_symbolic_link_replaces_its_target(tmp_path: Path) -> None:
    target = _new_file(tmp_path / "real.atp")
    link = tmp_path / "link.atp"
    link.symlink_to(target.name)
    with atp.Writer(link, overwrite=True) as writer:
        writer.add(**_molecule(5.0))
    assert link.is_symlink()
    assert _energies(target) == [5.0]
    with _Holder(target, "append"), pytest.raises(atp.FileLockedError, match="link.atp"):
        atp.Writer.append_to(link)  # the same file under another name


def test_append_to_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        atp.Writer.append_to(tmp_path / "missing.atp")
    assert os.listdir(tmp_path) == []
