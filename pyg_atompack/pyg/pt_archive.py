"""Where the records of a ``torch.save`` archive lie inside its bytes.

``torch.save`` writes a zip archive of uncompressed ("stored") records: the pickle
``<prefix>/data.pkl``, one ``<prefix>/data/<key>`` record per tensor storage (aligned to
64 bytes), and a few small metadata records. Reading the zip directories is enough to
find every record's data in the downloaded buffer, so storages can be used in place
instead of being copied out one by one.

Archives with many storages need zip64 records (a shard of a few thousand ``Data``
objects easily has more than 65,535 entries); both directory variants are read here.
"""

from __future__ import annotations

import struct
import zlib
from array import array

__all__ = ["StorageTable", "TorchArchive", "TorchZipError", "crc_problem", "data_crc",
           "read_torch_archive"]

_END = struct.Struct("<IHHHHIIH")  # end of central directory
_END_SIGNATURE = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_LOCATOR_SIGNATURE = 0x07064B50
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_END_SIGNATURE = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIGNATURE = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIGNATURE = 0x04034B50
_ZIP64_EXTRA_ID = 0x0001
_STORED = 0
_FULL32 = 0xFFFFFFFF
_MAX_COMMENT = 0xFFFF


class TorchZipError(ValueError):
    """The bytes are not a zip archive whose records can be read in place."""


class StorageTable:
    """Data offsets and sizes of an archive's storage records, by storage key.

    torch names storages ``0, 1, 2, ...``; those live in two flat arrays (16 bytes a
    storage, where a dict of names would cost ~20 times that on a shard of small
    molecules). Any other key goes to a dict.
    """

    def __init__(self) -> None:
        self.offsets = array("q")
        self.sizes = array("q")
        self.named: dict[str, tuple[int, int]] = {}

    def add(self, key: str, offset: int, size: int) -> None:
        """Record storage ``key`` at ``offset`` with ``size`` bytes."""
        if key.isdigit() and key == str(int(key)):
            number = int(key)
            if number >= len(self.offsets):
                grow = number + 1 - len(self.offsets)
                self.offsets.extend([-1] * grow)
                self.sizes.extend([0] * grow)
            self.offsets[number] = offset
            self.sizes[number] = size
        else:
            self.named[key] = (offset, size)

    def get(self, key: str) -> tuple[int, int] | None:
        """``(offset, size)`` of storage ``key``, or :obj:`None` if there is none."""
        if key.isdigit():
            number = int(key)
            if number < len(self.offsets) and self.offsets[number] >= 0 and key == str(number):
                return self.offsets[number], self.sizes[number]
        return self.named.get(key)


class TorchArchive:
    """Where a ``torch.save`` archive's pickle, byte order and storages lie.

    Attributes:
        prefix: The archive's top folder (``"archive"`` or the saved file's stem).
        pickle: ``(offset, size)`` of ``<prefix>/data.pkl``.
        byteorder: ``(offset, size)`` of ``<prefix>/byteorder``, or :obj:`None`.
        storages: The ``<prefix>/data/<key>`` records.
        crcs: The CRC-32 the directory states for each storage record, by key (only
            when asked for).
    """

    def __init__(self, prefix: str, pickle: tuple[int, int],
                 byteorder: tuple[int, int] | None, storages: StorageTable,
                 crcs: dict[str, int] | None = None) -> None:
        self.prefix = prefix
        self.pickle = pickle
        self.byteorder = byteorder
        self.storages = storages
        self.crcs = crcs


def _end_of_directory(view: memoryview) -> tuple[int, int]:
    """``(entry count, central directory offset)`` from the end records."""
    length = len(view)
    search_from = max(0, length - _END.size - _MAX_COMMENT)
    tail = bytes(view[search_from:])
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _END.size > len(tail):
        raise TorchZipError("no end-of-central-directory record (not a zip archive)")
    end_at = search_from + at
    _, _, _, _, count, _, directory, _ = _END.unpack_from(view, end_at)
    if count != 0xFFFF and directory != _FULL32:
        return count, directory
    locator_at = end_at - _ZIP64_LOCATOR.size
    if locator_at < 0:
        raise TorchZipError("zip64 sizes without a zip64 locator")
    signature, _, zip64_end_at, _ = _ZIP64_LOCATOR.unpack_from(view, locator_at)
    if signature != _ZIP64_LOCATOR_SIGNATURE or zip64_end_at + _ZIP64_END.size > length:
        raise TorchZipError("damaged zip64 end-of-directory locator")
    fields = _ZIP64_END.unpack_from(view, zip64_end_at)
    if fields[0] != _ZIP64_END_SIGNATURE:
        raise TorchZipError("damaged zip64 end-of-directory record")
    return fields[7], fields[9]


def _zip64_offset(extra: bytes, sizes_present: int) -> int:
    """The local header offset stored in a zip64 extra field."""
    at = 0
    while at + 4 <= len(extra):
        header_id, size = struct.unpack_from("<HH", extra, at)
        if header_id == _ZIP64_EXTRA_ID:
            position = at + 4 + 8 * sizes_present
            if position + 8 > at + 4 + size:
                break
            return struct.unpack_from("<Q", extra, position)[0]
        at += 4 + size
    raise TorchZipError("zip64 entry without its 64-bit offset")


def read_torch_archive(buffer: bytes | bytearray | memoryview, *,
                       with_crcs: bool = False) -> TorchArchive:
    """Locate the records of a ``torch.save`` zip archive inside its bytes.

    Args:
        buffer (bytes | bytearray | memoryview): The whole archive.
        with_crcs (bool, optional): Also collect the storage records' CRC-32s
            (:attr:`TorchArchive.crcs`). (default: :obj:`False`)

    Returns:
        Where its pickle, byte order record and storages are.

    Raises:
        TorchZipError: The bytes are not a single stored (uncompressed) ``torch.save``
            archive, or a record lies outside the buffer.
    """
    view = memoryview(buffer).cast("B")
    length = len(view)
    count, directory = _end_of_directory(view)
    storages = StorageTable()
    pickles: list[tuple[str, tuple[int, int]]] = []
    byteorders: dict[str, tuple[int, int]] = {}
    storage_prefixes: set[str] = set()
    crcs: dict[str, int] | None = {} if with_crcs else None
    at = directory
    central_unpack, local_unpack = _CENTRAL.unpack_from, _LOCAL.unpack_from
    for _ in range(count):
        if at + _CENTRAL.size > length:
            raise TorchZipError("central directory runs past the end of the archive")
        (signature, _, _, flags, method, _, _, crc, compressed, uncompressed, name_length,
         extra_length, comment_length, _, _, _, local_at) = central_unpack(view, at)
        if signature != _CENTRAL_SIGNATURE:
            raise TorchZipError(f"damaged central directory entry at byte {at}")
        name_at = at + _CENTRAL.size
        name = str(view[name_at:name_at + name_length], "utf-8", "replace")
        if local_at == _FULL32 or compressed == _FULL32 or uncompressed == _FULL32:
            extra = bytes(view[name_at + name_length:name_at + name_length + extra_length])
            sizes_present = (uncompressed == _FULL32) + (compressed == _FULL32)
            if local_at == _FULL32:
                local_at = _zip64_offset(extra, sizes_present)
            if uncompressed == _FULL32:
                raise TorchZipError(f"record {name} is larger than 4 GiB")
        if method != _STORED or flags & 0x1 or compressed != uncompressed:
            raise TorchZipError(f"record {name} is compressed or encrypted")
        if local_at + _LOCAL.size > length:
            raise TorchZipError(f"record {name} starts past the end of the archive")
        local = local_unpack(view, local_at)
        if local[0] != _LOCAL_SIGNATURE:
            raise TorchZipError(f"damaged local header of record {name}")
        data_at = local_at + _LOCAL.size + local[9] + local[10]
        if data_at + uncompressed > length:
            raise TorchZipError(f"record {name} runs past the end of the archive")
        at = name_at + name_length + extra_length + comment_length
        head, _, key = name.rpartition("/data/")
        if head and "/" not in key:
            storages.add(key, data_at, uncompressed)
            if crcs is not None:
                crcs[key] = crc
            storage_prefixes.add(head)
        elif name.endswith("/data.pkl"):
            pickles.append((name[: -len("/data.pkl")], (data_at, uncompressed)))
        elif name.endswith("/byteorder"):
            byteorders[name[: -len("/byteorder")]] = (data_at, uncompressed)
    if len(pickles) != 1:
        raise TorchZipError(f"expected one data.pkl record, found {len(pickles)}")
    prefix, pickle = pickles[0]
    if storage_prefixes - {prefix}:
        raise TorchZipError("storage records of more than one archive")
    return TorchArchive(prefix, pickle, byteorders.get(prefix), storages, crcs)


# ---------------------------------------------------------------- records as they arrive
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_DESCRIPTOR = struct.Struct("<III")  # crc, compressed size, size (after the signature)
_DESCRIPTOR64 = struct.Struct("<IQQ")  # the zip64 form
_LOCAL_CRC_AT = 14  # the CRC-32 field inside a local header
_CRC = struct.Struct("<I")
_NEXT_SIGNATURES = (b"PK\x03\x04", b"PK\x01\x02")  # a local header or the directory


class LocalRecord:
    """One record's local header, read before the central directory has arrived.

    Attributes:
        name: The record's name.
        header_at: Where its local header starts.
        data_at: Where its data starts.
        size: Its data size when the header states it, else :obj:`None` (the size
            follows the data, in a data descriptor: ``torch.save`` streams every
            record that way).
    """

    __slots__ = ("name", "header_at", "data_at", "size")

    def __init__(self, name: str, header_at: int, data_at: int, size: int | None) -> None:
        self.name = name
        self.header_at = header_at
        self.data_at = data_at
        self.size = size


def read_local_record(buffer: bytes | bytearray | memoryview, at: int,
                      arrived: int) -> LocalRecord | None:
    """The local header at ``at`` of an archive whose first ``arrived`` bytes are in.

    Args:
        buffer (bytes | bytearray | memoryview): The archive's buffer (only its first
            ``arrived`` bytes are read).
        at (int): Where the header starts.
        arrived (int): How many leading bytes of the buffer hold the archive.

    Returns:
        The record, or :obj:`None` while its header has not all arrived.

    Raises:
        TorchZipError: No local header at ``at``, or a compressed or encrypted record.
    """
    if at + _LOCAL.size > arrived:
        return None
    (signature, _, flags, method, _, _, _, compressed, uncompressed, name_length,
     extra_length) = _LOCAL.unpack_from(buffer, at)
    if signature != _LOCAL_SIGNATURE:
        raise TorchZipError(f"no local header at byte {at}")
    data_at = at + _LOCAL.size + name_length + extra_length
    if data_at > arrived:
        return None
    name = bytes(buffer[at + _LOCAL.size:at + _LOCAL.size + name_length]).decode(
        "utf-8", "replace")
    if method != _STORED or flags & 0x1:
        raise TorchZipError(f"record {name} is compressed or encrypted")
    size = None
    if not flags & 0x8:
        if compressed != uncompressed or compressed == _FULL32:
            raise TorchZipError(f"record {name} has sizes this reader does not take")
        size = compressed
    return LocalRecord(name, at, data_at, size)


def record_end(buffer: bytes | bytearray | memoryview, record: LocalRecord, size: int,
               arrived: int) -> int | None:
    """Where the record after ``record`` starts, given the size its data must have.

    For a record whose header states its size, that size must be ``size``; otherwise
    the data descriptor after ``size`` bytes of data must state it, and be followed by
    the next local header or the central directory.

    Args:
        buffer (bytes | bytearray | memoryview): The archive's buffer.
        record (LocalRecord): The record.
        size (int): The data size it must have.
        arrived (int): How many leading bytes of the buffer hold the archive.

    Returns:
        The offset of the next header, or :obj:`None` while the bytes that prove it
        have not arrived.

    Raises:
        TorchZipError: The record's data is not ``size`` bytes long.
    """
    end = record.data_at + size
    if record.size is not None:
        if record.size != size:
            raise TorchZipError(f"record {record.name} holds {record.size} bytes, "
                                f"not {size}")
        return end if end <= arrived else None
    for layout in (_DESCRIPTOR, _DESCRIPTOR64):
        after = end + 4 + layout.size
        if after + 4 > arrived:
            return None
        if bytes(buffer[end:end + 4]) != _DESCRIPTOR_SIGNATURE:
            break
        _, compressed, uncompressed = layout.unpack_from(buffer, end + 4)
        if compressed == uncompressed == size and bytes(buffer[after:after + 4]) \
                in _NEXT_SIGNATURES:
            return after
    raise TorchZipError(f"record {record.name} does not end after {size} bytes")


def find_record_end(buffer: bytes | bytearray | memoryview, record: LocalRecord,
                    arrived: int, *, search_from: int | None = None,
                    ends_with: bytes = b"", limit: int | None = None) -> tuple[int, int] | None:
    """Find where a record of unknown size ends, from its data descriptor.

    A candidate descriptor must state exactly the distance from the record's data, be
    preceded by ``ends_with`` and be followed by the next local header, so bytes of the
    data that happen to look like a descriptor are not taken for one.

    Args:
        buffer (bytes | bytearray | memoryview): The archive's buffer.
        record (LocalRecord): A record whose header does not state its size.
        arrived (int): How many leading bytes of the buffer hold the archive.
        search_from (int, optional): Where an earlier call stopped searching.
            (default: the record's data)
        ends_with (bytes, optional): What the data's last bytes must be.
            (default: anything)
        limit (int, optional): Largest data size accepted. (default: none)

    Returns:
        ``(size, next header offset)``, or :obj:`None` while no descriptor has been
        found in the arrived bytes.
    """
    start = record.data_at if search_from is None else max(search_from, record.data_at)
    view = memoryview(buffer).cast("B")
    stop = arrived - 4 - _DESCRIPTOR.size - 4  # room for the descriptor and what follows
    if limit is not None:
        stop = min(stop, record.data_at + limit)
    while start <= stop:
        found = bytes(view[start:stop + 4]).find(_DESCRIPTOR_SIGNATURE)
        if found < 0:
            return None
        at = start + found
        size = at - record.data_at
        _, compressed, uncompressed = _DESCRIPTOR.unpack_from(view, at + 4)
        after = at + 4 + _DESCRIPTOR.size
        if (compressed == uncompressed == size and bytes(view[after:after + 4])
                in _NEXT_SIGNATURES and bytes(view[at - len(ends_with):at]) == ends_with):
            return size, after
        start = at + 1
    return None


def data_crc(buffer: bytes | bytearray | memoryview, offset: int, size: int) -> int:
    """The CRC-32 of ``size`` bytes of ``buffer`` from ``offset`` (no copy; no view is
    left exported on the buffer).

    Args:
        buffer (bytes | bytearray | memoryview): The archive's buffer.
        offset (int): Where the bytes start.
        size (int): How many.

    Returns:
        int: The CRC-32, as zip archives store it.
    """
    with memoryview(buffer) as whole, whole.cast("B") as view, \
            view[offset:offset + size] as data:
        return zlib.crc32(data)


def crc_problem(buffer: bytes | bytearray | memoryview, record: LocalRecord,
                size: int) -> str | None:
    """Whether a record's data matches the CRC-32 its archive states for it.

    ``torch.save`` stores the CRC-32 of every record (in the data descriptor after the
    data; in the local header for records whose header states their size), unless it
    was told not to (``torch.utils.serialization.config.save.compute_crc32 = False``),
    when the field holds 0.

    Args:
        buffer (bytes | bytearray | memoryview): The archive's buffer.
        record (LocalRecord): A record whose end :func:`record_end` or
            :func:`find_record_end` found.
        size (int): Its data size.

    Returns:
        str | None: :obj:`None` when the data matches, else what is wrong: ``"no
        CRC-32"`` when the archive stores none, or a mismatch naming the record.
    """
    if record.size is not None:
        stated = _CRC.unpack_from(buffer, record.header_at + _LOCAL_CRC_AT)[0]
    else:
        stated = _CRC.unpack_from(buffer, record.data_at + size + 4)[0]
    actual = data_crc(buffer, record.data_at, size)
    if stated == actual:
        return None
    if stated == 0:
        return "no CRC-32"
    return f"record {record.name} does not match its CRC-32 ({actual:08x}, stored {stated:08x})"
