"""What the local `.atp` readers add to the reader contract: the access mode, refused writes."""

from __future__ import annotations

from typing import Any

from .base import RecordReader
from .errors import ReadOnlyError


class ReadOnlyReader(RecordReader):
    """Base of the readers that share the writers' surface (:class:`~pyg_atompack.atp.Reader`,
    :class:`~pyg_atompack.atp.ShardedReader`): a :class:`~pyg_atompack.atp.RecordReader`
    with an access mode whose write methods are refused.

    A subclass sets ``_access``, defines :meth:`close` and says in
    :meth:`_read_only_message` how a refused write names it.
    """

    _access: str

    @property
    def access(self) -> str:
        """How records are read: ``"auto"``, ``"mmap"`` or ``"pread"`` (``"memory"`` for
        an in-memory image, ``"remote"`` for remote shards)."""
        return self._access

    def _read_only_message(self) -> str:
        raise NotImplementedError

    def add(self, *args: Any, **kwargs: Any) -> None:
        """Refused: readers are read-only (write with :class:`pyg_atompack.atp.Writer`).

        Raises:
            ReadOnlyError: Always.
        """
        raise ReadOnlyError(self._read_only_message())

    add_batch = add
    add_groups = add
    flush = add
