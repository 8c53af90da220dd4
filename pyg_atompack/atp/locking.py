"""One writer per `.atp` file: an advisory ``flock`` held by every :class:`~.writer.Writer`,
and new files made locked under a temporary name, then linked or renamed into place.

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

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import threading
from typing import BinaryIO

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


# ---------------------------------------------------------------- new files
def create_locked(path: str, head: bytes, overwrite: bool) -> BinaryIO:
    """A new file at ``path`` that starts with ``head``, write-locked.

    The file is made under a hidden temporary name next to ``path`` and locked
    before it appears under ``path``: by a hard link when ``path`` is free (so a
    concurrent creator gets :class:`FileExistsError`, and nobody sees the file
    before its header is written), by a rename over the old file when overwriting,
    done while holding the old file's lock. Never truncating in place is what lets
    readers of the old file keep reading it: its inode lives on, unchanged, until
    they close it (a truncation would pull the pages from under their mappings).

    Args:
        path (str): The file to create (a symbolic link: the file it names).
        head (bytes): The two empty header slots.
        overwrite (bool): Replace an existing file (unless a writer holds it).

    Returns:
        The new file, open ``r+b`` and locked.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        FileLockedError: Another writer holds the file being overwritten.
    """
    target = os.path.realpath(path)
    while True:
        old = lock_path(target, os.O_RDONLY) if overwrite else None
        if old is None:
            fh = None if os.path.lexists(target) else _link_new(target, path, head)
            if fh is not None:
                return fh
            if not overwrite:
                raise FileExistsError(f"{path}: already exists (pass overwrite=True)")
            continue  # created meanwhile: overwrite that one, under its lock
        try:
            fh, temp = _sibling(target, os.fstat(old).st_mode)
            try:
                _start(fh, path, head)
                os.replace(temp, target)
            except BaseException:
                release(fh)
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            return fh
        finally:
            unlock(old)
            os.close(old)


def _link_new(target: str, path: str, head: bytes) -> BinaryIO | None:
    """A new locked file at ``target``, or :obj:`None` if one appeared there first."""
    fh, temp = _sibling(target, None)
    try:
        _start(fh, path, head)
        try:
            os.link(temp, target)
        except FileExistsError:
            release(fh)
            return None
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            release(fh)
            return _create_in_place(target, path, head)
    except BaseException:
        release(fh)
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
    return fh


def _start(fh: BinaryIO, path: str, head: bytes) -> None:
    """Lock a new file and write its empty header slots."""
    lock(fh.fileno(), path)
    fh.write(head)
    fh.flush()


# what link() says on a file system without hard links (vfat, many FUSE mounts)
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK)


def _create_in_place(target: str, path: str, head: bytes) -> BinaryIO | None:
    """:func:`_link_new` without hard links: an exclusive create, then the lock.

    Another writer could lock the empty file between the two steps; it then finds
    no header and fails, and if it still holds the lock this one says so.
    """
    try:
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL
                     | getattr(os, "O_CLOEXEC", 0), 0o666)
    except FileExistsError:
        return None
    fh = open(fd, "r+b")  # noqa: SIM115 - held until close()
    try:
        _start(fh, path, head)
    except BaseException:
        release(fh)
        raise
    return fh


def _sibling(path: str, mode: int | None) -> tuple[BinaryIO, str]:
    """A new hidden file next to ``path`` (``.NAME.writing-PID-RANDOM``), open ``w+b``.

    Args:
        path (str): The file it will become.
        mode (int | None): Permission bits to copy (those of a file it replaces);
            :obj:`None` leaves the process's umask to decide, like ``open()``.
    """
    directory, name = os.path.split(path)
    while True:
        temp = os.path.join(directory, f".{name}.writing-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL
                         | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as error:  # name the file the caller asked for, not the hidden one
            raise type(error)(error.errno, f"cannot write {path!r}: {error.strerror}") \
                from None
        if mode is not None:
            with contextlib.suppress(OSError):
                os.fchmod(fd, stat.S_IMODE(mode))
        return open(fd, "w+b"), temp  # noqa: SIM115 - held until close()


def release(fh: BinaryIO) -> None:
    """Forget the file's lock in this process's table, then close it (releasing the lock)."""
    try:
        unlock(fh.fileno())
    except (OSError, ValueError):
        pass
    finally:
        fh.close()
