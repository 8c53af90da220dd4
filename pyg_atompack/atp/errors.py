"""Exceptions raised by the `.atp` format layer.

Every problem with a file or with a value the format cannot hold derives from
:class:`AtpError`, so callers can catch the whole family at once. Messages name
the file and, where it applies, the record index and the field.
"""

from __future__ import annotations

import struct


class AtpError(Exception):
    """Base class of every error raised by :mod:`pyg_atompack.atp`."""


class NotAtpFileError(AtpError):
    """The file does not start like an `.atp` file (no ``ATPK`` magic in any header slot)."""


class TruncatedFileError(AtpError):
    """The file is shorter than a structure it must contain (e.g. the 8192-byte header)."""


class TruncatedCommitWarning(UserWarning):
    """The newest commit of a file ends past the end of the file, so the previous one is read.

    The format's two header slots exist so that a torn commit falls back to the
    previous one (spec §2.2), which is what the reference does silently. A file cut
    short after it was written (an interrupted copy or upload) looks the same, and
    reading its previous commit silently would drop records, so the reader says so.
    """


class RecoveredWriteWarning(UserWarning):
    """A framed file in the writing state was opened: its records were recovered by a scan.

    A framed file whose write was interrupted (or is still under way) has no
    committed index; like the reference, the reader rebuilds the index by scanning
    the frames up to the first incomplete or damaged one. Records after that point
    are not read, so the reader says how many it recovered and where it stopped.
    """


class HeaderError(AtpError):
    """No header slot is valid, or the chosen slot holds an unsupported value."""


class SchemaError(AtpError):
    """The schema block is malformed, or a write conflicts with the schema lock."""


class SchemaConflictError(SchemaError, ValueError):
    """A write does not fit the file's schema lock or record format (spec §4, §5.1)."""


class IndexBlockError(AtpError):
    """The index block is malformed or points outside the file."""


class RecordDecodeError(AtpError):
    """A record cannot be decompressed or decoded."""


class FrameError(RecordDecodeError):
    """A frame of a framed file fails its CRC-32, or its header disagrees with the index."""


class AtpIndexError(AtpError, IndexError):
    """A molecule index is out of range."""


class AtpValueError(AtpError, ValueError):
    """A value cannot be stored in (or requested from) an `.atp` file."""


class ReadOnlyError(AtpError):
    """A write was attempted through a read-only handle."""


class FileLockedError(AtpError):
    """Another :class:`~pyg_atompack.atp.Writer` has the file open (one writer at a time).

    The message names the file and, where the system tells (``/proc/locks``), the
    holder's pid. The lock dies with its holder's process, so a crashed writer never
    blocks the next one.
    """


# What damaged bytes can make the decoders raise before a check catches them: struct and
# numpy complain about short buffers or impossible counts (struct.error, ValueError, which
# includes UnicodeDecodeError), sizes can fall outside a buffer (IndexError) or a C integer
# (OverflowError). Readers turn exactly these into RecordDecodeError; anything else
# (NameError, AttributeError, MemoryError, ...) is a bug and propagates unchanged.
CORRUPT_DATA_ERRORS = (struct.error, ValueError, IndexError, OverflowError)


__all__ = [
    "AtpError",
    "AtpIndexError",
    "AtpValueError",
    "FileLockedError",
    "FrameError",
    "HeaderError",
    "IndexBlockError",
    "NotAtpFileError",
    "ReadOnlyError",
    "RecordDecodeError",
    "RecoveredWriteWarning",
    "SchemaConflictError",
    "SchemaError",
    "TruncatedFileError",
]
