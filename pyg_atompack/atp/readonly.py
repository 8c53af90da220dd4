"""What every `.atp` reader shares: its access mode, use in ``with``, refused writes."""

from __future__ import annotations

from typing import Any, TypeVar

from .errors import ReadOnlyError

_R = TypeVar("_R", bound="ReadOnlyReader")


class ReadOnlyReader:
    """Base of the read-only readers (:class:`~pyg_atompack.atp.Reader`,
    :class:`~pyg_atompack.atp.ShardedReader`).

    A subclass sets ``_access``, defines :meth:`close` and says in
    :meth:`_read_only_message` how a refused write names it.
    """

    _access: str

    @property
    def access(self) -> str:
        """How records are read: ``"auto"``, ``"mmap"`` or ``"pread"`` (``"memory"`` for
        an in-memory image, ``"remote"`` for remote shards)."""
        return self._access

    def close(self) -> None:
        """Release what the reader holds (it reopens lazily on the next access)."""
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
