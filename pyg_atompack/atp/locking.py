"""One writer per `.atp` file: an advisory ``flock`` held by every :class:`~.writer.Writer`.

Two writers appending to one file each commit an index that knows only its own
records, so a record the first one committed silently reads back as the second
one's molecule. Every writer therefore holds an exclusive ``flock`` on the file
itself (not on a sidecar: nothing is left behind, and nothing needs cleaning up)
for as long as it is open:

* it is taken without waiting: a second writer fails at once with
  :class:`~.errors.FileLockedError`, naming the file and, where ``/proc/locks``
  tells, the holder's pid;
* it belongs to the open file description, so the kernel drops it when the writer
  closes, or when its process exits or is killed (no stale lock outlives a crash),
  and a second writer in the same process conflicts like one in another process;
* readers take no lock and are never blocked.

Where the file system emulates ``flock`` with per-process POSIX locks (NFS), two
writers of one process would not conflict; a table of the files this process
holds catches that case. A lock guards the inode it was taken on: callers check
that the path still names that inode after locking (:func:`lock_path`), since a
file replaced in between would leave them holding the lock of an orphan.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

from .errors import FileLockedError

_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino) of the files this process locks
_HELD_LOCK = threading.Lock()


def _key(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def holder(fd: int) -> str:
    """Who holds the write lock of the file open as ``fd``, in words.

    Args:
        fd (int): A descriptor of the locked file.

    Returns:
        ``"pid N"`` when ``/proc/locks`` (Linux) lists one flock on the file,
        else ``"another writer"``.
    """
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            for line in handle:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146446 0 EOF"
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == device:
                    pids.add(parts[4])
    except OSError:
        pass
    if len(pids) == 1:
        pid = pids.pop()
        return f"pid {pid}, this process" if pid == str(os.getpid()) else f"pid {pid}"
    return "another writer"


def lock(fd: int, name: str) -> None:
    """Take the exclusive write lock of the file open as ``fd``, without waiting.

    Args:
        fd (int): A descriptor of the file (any access mode).
        name (str): The file, as error messages name it.

    Raises:
        FileLockedError: Another writer holds the lock (in this or another process).
    """
    key = _key(fd)
    with _HELD_LOCK:
        if key in _HELD:
            raise FileLockedError(
                f"{name}: locked by another writer (pid {os.getpid()}, this process); "
                f"a file takes one writer at a time")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise FileLockedError(f"{name}: locked by another writer ({holder(fd)}); "
                                  f"a file takes one writer at a time") from None
        _HELD.add(key)


def unlock(fd: int) -> None:
    """Forget the lock of ``fd`` in this process's table (closing ``fd`` releases it).

    Args:
        fd (int): A descriptor :func:`lock` locked.
    """
    with _HELD_LOCK:
        _HELD.discard(_key(fd))


def lock_path(path: str, flags: int) -> int | None:
    """Open ``path`` and lock it, making sure it still names the locked file.

    Args:
        path (str): The file.
        flags (int): ``os.open`` flags (``O_CLOEXEC`` is added).

    Returns:
        The locked descriptor, or :obj:`None` when ``path`` does not exist.

    Raises:
        FileLockedError: Another writer holds the file.
    """
    while True:
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            lock(fd, path)
        except BaseException:
            os.close(fd)
            raise
        try:
            named = os.stat(path)
        except FileNotFoundError:
            named = None
        here = os.fstat(fd)
        if named is not None and (named.st_dev, named.st_ino) == (here.st_dev, here.st_ino):
            return fd
        # replaced (or removed) between our open and our lock: lock what it names now
        unlock(fd)
        os.close(fd)


def forget_all() -> None:
    """Empty this process's table (a forked child holds none of its parent's writers).

    Called in a child right after ``fork``, where another thread of the parent may
    have held the table's lock: both are made anew.
    """
    global _HELD_LOCK
    _HELD_LOCK = threading.Lock()
    _HELD.clear()
