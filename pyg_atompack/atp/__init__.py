"""The Atompack `.atp` format: read, write and inspect files (numpy only, never torch).

Example:
    >>> from pyg_atompack import atp
    >>> with atp.open("data.atp") as f:          # doctest: +SKIP
    ...     mol = f[0]
    ...     batch = f.read_batch([0, 5, 7], fields=["energy", "forces"])
"""

from __future__ import annotations

import os

from .base import RecordReader
from .check import describe, verify
from .errors import (
    AtpError,
    AtpIndexError,
    AtpValueError,
    FileLockedError,
    FrameError,
    HeaderError,
    IndexBlockError,
    NotAtpFileError,
    ReadOnlyError,
    RecordDecodeError,
    RecoveredWriteWarning,
    SchemaConflictError,
    SchemaError,
    TruncatedCommitWarning,
    TruncatedFileError,
)
from .fields import FieldInfo
from .header import Header
from .molecule import Molecule
from .reader import Reader
from .sharded import ShardedReader, find_shards
from .writer import Writer


def open(  # noqa: A001
    path: str | os.PathLike | list[str | os.PathLike] | tuple[str | os.PathLike, ...],
    access: str = "auto",
) -> Reader | ShardedReader:
    """Open an `.atp` file, a directory of shards, or a list of files, read-only.

    Args:
        path (str or os.PathLike or list or tuple): A file, a directory searched
            recursively for ``*.atp`` shards, or a list/tuple of files read as one
            dataset in the given order.
        access (str, optional): ``"auto"`` (zero-copy views of a mapping advised for random access;
            batches of records not in the page cache are read with concurrent
            ``pread``), ``"mmap"`` (zero-copy views, the kernel's read-ahead) or
            ``"pread"`` (owned, writable arrays; batches read concurrently).
            (default: :obj:`"auto"`)

    Returns:
        A :class:`Reader` for a file, a :class:`ShardedReader` for a directory or a list.
    """
    if isinstance(path, (list, tuple)):
        return ShardedReader.from_paths(path, access=access)
    if os.path.isdir(path):
        return ShardedReader(path, access=access)
    return Reader(path, access=access)


__all__ = [
    "AtpError",
    "AtpIndexError",
    "AtpValueError",
    "FieldInfo",
    "FileLockedError",
    "FrameError",
    "Header",
    "HeaderError",
    "IndexBlockError",
    "Molecule",
    "NotAtpFileError",
    "ReadOnlyError",
    "Reader",
    "RecordDecodeError",
    "RecordReader",
    "RecoveredWriteWarning",
    "SchemaConflictError",
    "SchemaError",
    "ShardedReader",
    "TruncatedCommitWarning",
    "TruncatedFileError",
    "Writer",
    "describe",
    "find_shards",
    "open",
    "verify",
]
