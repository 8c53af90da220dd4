"""A ``torch.save`` list of ``Data`` indexed while its bytes arrive (:class:`ArrivingPt`).

The pickle machine of :mod:`.pt_pickle` runs over storages that have not arrived yet
(virtual offsets), and the samples of :mod:`.pt_index` become ready, a prefix at a time,
as the storage records they are built from arrive and pass their checks.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Data

from pyg_atompack.transport.buffers import WritableBuffer, is_writable_buffer

from .errors import PtPayloadError
from .pt_archive import (
    LocalRecord,
    TorchArchive,
    TorchZipError,
    crc_problem,
    data_crc,
    find_record_end,
    read_local_record,
    read_torch_archive,
    record_end,
)
from .pt_index import LazyPtSamples, list_columns, refuse_problem
from .pt_pickle import NotLazyLayout, ShardPickleMachine

__all__ = ["ArrivingPt", "ArrivingPtSamples"]


# ``torch.save`` writes its archive front to back: the pickle ``data.pkl`` first, then a
# few small metadata records, then the storages ``data/0``, ``data/1``, ... in the order
# the pickle first names them, then the central directory. Each record is a local header,
# the data and, because torch streams every record, a data descriptor stating the size.
# So a list of ``Data`` can be indexed once its pickle has arrived, and each sample built
# once the records of its storages have: :class:`ArrivingPt` does that over a buffer
# that is being filled from its first byte on.

#: Until its record has arrived, a storage's tensors are indexed at a virtual offset:
#: the storage number in the top bits, the byte offset inside the storage below.
_KEY_SHIFT = 40
_INSIDE = (1 << _KEY_SHIFT) - 1
_UNBOUNDED = 1 << 62
#: The records ``torch.save`` writes besides the pickle and the storages.
_METADATA_RECORDS = frozenset({".format_version", ".storage_alignment", "byteorder",
                               "version", ".data/version", ".data/serialization_id"})
#: Largest metadata record looked for (they hold a few bytes).
_METADATA_LIMIT = 4096


class _PendingStorages:
    """The storage table of an archive whose storage records have not arrived yet."""

    def get(self, key: Any) -> tuple[int, int] | None:
        if type(key) is str and key.isdigit() and key == str(int(key)):
            return int(key) << _KEY_SHIFT, _UNBOUNDED
        return None  # the machine then gives up: only torch's numbered keys stream


class _ArrivingPickleMachine(ShardPickleMachine):
    """The pickle machine over storages not yet arrived; notes each storage's size.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, its pickle arrived.
        pickle (tuple[int, int]): ``(offset, size)`` of the pickle.
    """

    def __init__(self, buffer: WritableBuffer, pickle: tuple[int, int]) -> None:
        super().__init__(buffer, TorchArchive("", pickle, None, _PendingStorages()))
        self.sizes: dict[int, int] = {}  # storage number -> bytes its record must hold
        self.alignment: dict[int, int] = {}  # storage number -> largest item size

    def _storage(self, pid: Any) -> tuple[int, torch.dtype, int]:
        offset, dtype, numel = super()._storage(pid)
        key = offset >> _KEY_SHIFT
        if self.sizes.setdefault(key, numel * dtype.itemsize) != numel * dtype.itemsize:
            raise NotLazyLayout(f"storage {key} is named with two sizes")
        if dtype.itemsize > self.alignment.get(key, 1):
            self.alignment[key] = dtype.itemsize
        return offset, dtype, numel


class ArrivingPtSamples(LazyPtSamples):
    """The samples of a ``.pt`` list of ``Data`` whose bytes are still arriving.

    A :class:`LazyPtSamples` whose first :attr:`ready` samples may be built: their
    storages have arrived (and were checked against the archive's records). The rest
    become ready as :meth:`ArrivingPt.feed` takes in more bytes.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, being filled.
        tensor_columns (dict[str, tuple]): As for :class:`LazyPtSamples`, with virtual
            offsets for the storages that have not arrived.
        object_columns (dict[str, list]): As for :class:`LazyPtSamples`.
        length (int): Number of samples.
    """

    def __init__(self, buffer: WritableBuffer, tensor_columns: dict[str, tuple],
                 object_columns: dict[str, list], length: int) -> None:
        super().__init__(buffer, tensor_columns, object_columns, length)
        #: Samples whose bytes have all arrived (a prefix of the samples).
        self.ready = 0

    def _build(self, index: int) -> Data:
        if index >= self.ready:  # the caller waits for arrival first
            raise RuntimeError(f"sample {index} has not arrived yet ({self.ready} have)")
        return super()._build(index)


class ArrivingPt:
    """Indexes a ``torch.save`` list of ``Data`` while its bytes arrive, front to back.

    Feed it the length of the buffer's filled prefix as it grows: once the pickle and
    the metadata records before the first storage are in, :meth:`feed` returns the
    samples (:class:`ArrivingPtSamples`), whose :attr:`~ArrivingPtSamples.ready` prefix
    grows as the storage records arrive. Each storage record is checked as it arrives
    (its name, its size from the pickle, its data descriptor, its alignment); once the
    whole archive is in, :meth:`complete` checks every record against the central
    directory and makes all samples ready.

    Only lists of ``Data`` whose samples own their storages stream this way (what
    ``torch.save([data, ...])`` writes); other layouts (collated ``(data, slices)``,
    views of storages shared between samples, anything the in-place indexer declines)
    raise :class:`NotLazyLayout` before any sample is published, and are decoded whole.

    With ``check_crc``, no sample is made ready before every record it is built from
    (the pickle, the metadata records before it, its storages) matched the CRC-32 the
    archive stores for it: a record that does not raises :class:`NotLazyLayout` before
    the samples are published and :class:`~pyg_atompack.pyg.errors.PtPayloadError`
    after; an archive written without CRC-32s
    (``torch.utils.serialization.config.save.compute_crc32 = False``) is declined.

    Args:
        buffer (bytearray | mmap.mmap): The archive's buffer, of its final size, filled
            from its first byte on. Kept (not copied) as the samples' storage.
        check_crc (bool, optional): Check every record against its CRC-32 before any
            sample built from it is made ready. (default: :obj:`False`)

    Raises:
        NotLazyLayout: The buffer cannot hold samples built in place.
    """

    def __init__(self, buffer: WritableBuffer, check_crc: bool = False) -> None:
        if not is_writable_buffer(buffer):
            raise NotLazyLayout("needs a writable bytearray or memory map")
        self.buffer = buffer
        self.check_crc = check_crc
        self.samples: ArrivingPtSamples | None = None  # once published
        self._arrived = 0
        self._pickle_record: LocalRecord | None = None
        self._scan_from: int | None = None
        self._pickle: tuple[int, int] | None = None
        self._prefix = ""
        self._candidate: ArrivingPtSamples | None = None  # indexed, not yet published
        self._sizes: dict[int, int] = {}
        self._alignment: dict[int, int] = {}
        self._base = np.zeros(0, dtype=np.int64)  # data offset per storage, -1: not in
        self._needs = np.zeros(0, dtype=np.int64)  # per sample: storages 0..n-1 needed
        self._resolved = 0  # storages 0 .. _resolved - 1 have all arrived
        self._at = 0  # the next local header to read
        self._walking = True
        self._columns: list[array] = []  # the offsets of each tensor column

    @property
    def published(self) -> bool:
        """Whether :meth:`feed` has returned the samples."""
        return self.samples is not None

    def feed(self, arrived: int) -> ArrivingPtSamples | None:
        """Take in the buffer's first ``arrived`` bytes.

        Args:
            arrived (int): Length of the filled prefix (never smaller than before).

        Returns:
            The samples once they are published, else :obj:`None`.

        Raises:
            NotLazyLayout: Before the samples are published: the archive is not a
                layout that streams (decode it whole once it has arrived).
            PtPayloadError: After they are published: the archive is damaged.
        """
        self._arrived = max(self._arrived, min(arrived, len(self.buffer)))
        try:
            if self._candidate is None and not self._index_pickle():
                return None
            self._walk()
        except TorchZipError as error:
            if self.samples is None:
                raise NotLazyLayout(str(error)) from None
            # what is left waits for the central directory (complete())
            self._walking = False
        if self.samples is not None:
            self._advance()
        return self.samples

    def complete(self) -> ArrivingPtSamples:
        """Check the whole archive against what was read, and make every sample ready.

        Returns:
            The samples, all ready.

        Raises:
            NotLazyLayout: The samples were never published (decode the archive whole).
            PtPayloadError: The archive's directory disagrees with the records read as
                they arrived, or a storage record is missing, short or misaligned.
        """
        self.feed(len(self.buffer))
        if self.samples is None:
            raise NotLazyLayout("the archive ended before its samples were indexed")
        try:
            archive = read_torch_archive(self.buffer, with_crcs=self.check_crc)
        except TorchZipError as error:
            raise PtPayloadError(f"damaged .pt archive: {error}") from None
        if archive.prefix != self._prefix or archive.pickle != self._pickle:
            raise PtPayloadError("damaged .pt archive: its directory places the pickle "
                                 "elsewhere than its records")
        if archive.byteorder is not None:
            offset, size = archive.byteorder
            if bytes(self.buffer[offset:offset + size]) != b"little":
                raise PtPayloadError("damaged .pt archive: a big-endian byte order record "
                                     "after its storages")
        base = self._base
        for key, size in self._sizes.items():
            record = archive.storages.get(str(key))
            if record is None or record[1] != size:
                raise PtPayloadError(f"damaged .pt archive: storage {key} is missing or "
                                     f"not {size} bytes")
            if base[key] >= 0 and base[key] != record[0]:
                raise PtPayloadError(f"damaged .pt archive: storage {key} lies elsewhere "
                                     f"than its directory says")
            if record[0] % self._alignment.get(key, 1):
                raise PtPayloadError(f"damaged .pt archive: storage {key} is misaligned")
            if self.check_crc and base[key] < 0 and \
                    data_crc(self.buffer, record[0], size) != archive.crcs[str(key)]:
                # a record the walk did not reach, checked against the directory
                raise PtPayloadError(f"damaged .pt archive: storage {key} does not match "
                                     f"its CRC-32")
            base[key] = record[0]
        self._resolved = len(base)
        self._advance()
        return self.samples

    # ------------------------------------------------------------------ steps
    def _index_pickle(self) -> bool:
        """Index the pickle once it has arrived; whether it has."""
        buffer, arrived = self.buffer, self._arrived
        record = self._pickle_record
        if record is None:
            record = read_local_record(buffer, 0, arrived)
            if record is None:
                return False
            if not record.name.endswith("/data.pkl"):
                raise TorchZipError("the archive does not start with its pickle")
            self._pickle_record = record
            self._prefix = record.name[:-len("/data.pkl")]
        if record.size is not None:
            after = record_end(buffer, record, record.size, arrived)
            found = None if after is None else (record.size, after)
        else:
            found = find_record_end(buffer, record, arrived, search_from=self._scan_from,
                                    ends_with=pickle.STOP)
        if found is None:
            self._scan_from = max(record.data_at, arrived - 32)
            return False
        size, self._at = found
        self._check_crc(record, size, "the pickle: ")
        self._pickle = (record.data_at, size)
        machine = _ArrivingPickleMachine(buffer, self._pickle)
        try:
            result = machine.run()
        except (IndexError, KeyError, struct.error, UnicodeDecodeError, TypeError,
                ValueError, OverflowError) as error:
            raise NotLazyLayout(f"{type(error).__name__}: {error}") from None
        tensor_columns, object_columns = list_columns(machine, result)
        refuse_problem(machine, "list")
        self._sizes, self._alignment = machine.sizes, machine.alignment
        count = len(result)
        row_needs = np.full(count, -1, dtype=np.int64)
        keys = []
        for _, offsets, *_ in tensor_columns.values():
            column = np.frombuffer(offsets, dtype=np.int64) if len(offsets) else \
                np.zeros(0, dtype=np.int64)
            column_keys = np.where(column >= 0, column >> _KEY_SHIFT, -1)
            np.maximum(row_needs, column_keys, out=row_needs)
            keys.append(column_keys[column_keys >= 0])
            self._columns.append(offsets)
        named = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
        if np.unique(named).size != named.size:
            raise NotLazyLayout("samples share storages")
        highest = int(named.max()) + 1 if named.size else 0
        if highest > 4 * named.size + 16:
            raise NotLazyLayout("storage numbers far beyond the storages named")
        self._base = np.zeros(highest, dtype=np.int64)
        self._base[named] = -1  # unnamed numbers count as arrived
        self._needs = np.maximum.accumulate(row_needs) + 1 if count else row_needs
        self._candidate = ArrivingPtSamples(buffer, tensor_columns, object_columns, count)
        return True

    def _walk(self) -> None:
        """Read the records after the pickle as far as they have arrived."""
        buffer, arrived = self.buffer, self._arrived
        while self._walking:
            at = self._at
            if at + 4 > arrived:
                return
            if bytes(buffer[at:at + 4]) == b"PK\x01\x02":  # the central directory
                self._walking = False
                self._publish()
                return
            record = read_local_record(buffer, at, arrived)
            if record is None:
                return
            if not record.name.startswith(self._prefix + "/"):
                raise TorchZipError(f"record {record.name} of another archive")
            name = record.name[len(self._prefix) + 1:]
            if name.startswith("data/"):
                self._publish()
                number = name[len("data/"):]
                if not (number.isdigit() and number == str(int(number))) or int(
                        number) not in self._sizes:
                    raise TorchZipError(f"storage record {record.name} the pickle does "
                                        f"not name")
                key = int(number)
                after = record_end(buffer, record, self._sizes[key], arrived)
                if after is None:
                    return
                if record.data_at % self._alignment.get(key, 1) or self._base[key] >= 0:
                    raise TorchZipError(f"storage record {record.name} misaligned or "
                                        f"repeated")
                self._check_crc(record, self._sizes[key])
                self._base[key] = record.data_at
                while self._resolved < len(self._base) and self._base[self._resolved] >= 0:
                    self._resolved += 1
            elif name in _METADATA_RECORDS:
                if record.size is not None:
                    after = record_end(buffer, record, record.size, arrived)
                    found = None if after is None else (record.size, after)
                else:
                    found = find_record_end(buffer, record, arrived, limit=_METADATA_LIMIT)
                if found is None:
                    if arrived - record.data_at > _METADATA_LIMIT + 64:
                        raise TorchZipError(f"record {record.name} has no end")
                    return
                size, after = found
                self._check_crc(record, size)
                if name == "byteorder" and bytes(
                        buffer[record.data_at:record.data_at + size]) != b"little":
                    if self.samples is not None:
                        raise PtPayloadError("damaged .pt archive: a big-endian byte "
                                             "order record after its storages")
                    raise TorchZipError("big-endian archive")
            else:
                raise TorchZipError(f"unexpected record {record.name}")
            self._at = after

    def _publish(self) -> None:
        self.samples = self._candidate

    def _check_crc(self, record: LocalRecord, size: int, what: str = "") -> None:
        """With ``check_crc``, refuse a record whose data does not match its CRC-32: as a
        layout that does not stream before the samples are published (:meth:`feed`
        turns the :class:`TorchZipError` into :class:`NotLazyLayout`), as a damaged
        archive after."""
        problem = crc_problem(self.buffer, record, size) if self.check_crc else None
        if problem is None:
            return
        if self.samples is not None:
            raise PtPayloadError(f"damaged .pt archive: {what}{problem}")
        raise TorchZipError(f"{what}{problem}")

    def _advance(self) -> None:
        """Give the samples whose storages have all arrived their real offsets."""
        samples = self.samples
        ready = int(np.searchsorted(self._needs, self._resolved, side="right"))
        if ready <= samples.ready:
            return
        start, base = samples.ready, self._base
        for offsets in self._columns:
            rows = np.frombuffer(offsets, dtype=np.int64)[start:ready]
            present = rows >= 0
            virtual = rows[present]
            rows[present] = base[virtual >> _KEY_SHIFT] + (virtual & _INSIDE)
            del rows  # no view may stay exported on the column
        samples.ready = ready
