"""Fetching, verifying and decoding one shard: the work a prefetch thread does per job."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch_geometric.data.data import BaseData

from pyg_atompack.stream.arriving import ArrivingShard, streams_as_it_arrives
from pyg_atompack.stream.errors import (
    ShardFetchError,
    ShardIntegrityError,
    StreamCancelled,
    StreamError,
)
from pyg_atompack.stream.payloads import decode_shard, shard_format
from pyg_atompack.stream.sources import CancelToken, ShardInfo, Source
from pyg_atompack.stream.trace import TraceRecorder
from pyg_atompack.transport.buffers import RangeIgnoredError
from pyg_atompack.transport.integrity import bytes_problem
from pyg_atompack.transport.transfers import part_count

logger = logging.getLogger(__name__)

ON_ERROR_CHOICES = ("raise", "skip")


def check_on_error(on_error: str) -> str:
    """Return ``on_error`` if it is one of :data:`ON_ERROR_CHOICES`.

    Args:
        on_error (str): The requested failure policy.

    Returns:
        The same value.

    Raises:
        ValueError: It is not a known policy.
    """
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")
    return on_error


class LoadedShard:
    """A decoded shard held by the pipeline; its lifetime is counted in the trace.

    Args:
        position (int): Position in the stream's shard list.
        index (int): Index of the shard in the source listing.
        info (ShardInfo): The shard's listing entry.
        samples (Sequence[BaseData]): Decoded samples (empty for a skipped shard).
        recorder (TraceRecorder): Trace recorder counting live shards.
        arriving (ArrivingShard, optional): The download still filling ``samples``, for a
            shard handed out as its bytes arrive. (default: :obj:`None`)
    """

    def __init__(self, position: int, index: int, info: ShardInfo,
                 samples: Sequence[BaseData], recorder: TraceRecorder,
                 arriving: ArrivingShard | None = None):
        self.position = position
        self.index = index
        self.info = info
        self.samples = samples
        #: The download of a shard handed out as it arrives (:mod:`.arriving`), else None.
        self.arriving = arriving
        if len(samples):
            recorder.shard_alive(+1)
            weakref.finalize(self, recorder.shard_alive, -1)


def integrity_problem(info: ShardInfo, data: bytes | bytearray) -> str | None:
    """What is wrong with a shard's bytes given its listing entry, or None if nothing.

    Args:
        info (ShardInfo): The listing entry; its ``size`` and ``sha256`` are checked when known.
        data (bytes | bytearray): The fetched bytes.

    Returns:
        A short description of the first mismatch, or :obj:`None`.
    """
    return bytes_problem(data, size=info.size, sha256=info.sha256)


class ShardLoader:
    """Fetches, verifies and decodes shards of one source, recording each step.

    Args:
        source (Source): Where the bytes come from.
        shards (Sequence[ShardInfo]): The source's listing; jobs refer to shards by their index in
            it.
        trusted (bool): Allow arbitrary pickles in ``.pt`` shards.
        verify (bool): Check size and sha256 against the listing (one re-download on mismatch).
        on_error (str): ``"raise"`` or ``"skip"`` (a failed shard becomes an empty one).
        lazy_decode (bool, optional): Index ``.pt`` shards in place
            (:mod:`pyg_atompack.pyg.pt_index`) instead of unpickling them. (default: :obj:`True`)
        verify_before_use (bool | str, optional): What an arriving shard's samples are
            checked against before they are handed out (see :meth:`load`'s
            ``arriving`` and :mod:`pyg_atompack.stream.arriving`): ``"records"``, each
            archive record's CRC-32; :obj:`True`, the listed sha256 of the whole file;
            :obj:`False`, nothing. (default: :obj:`"records"`)
    """

    def __init__(self, source: Source, shards: Sequence[ShardInfo], *, trusted: bool,
                 verify: bool, on_error: str, lazy_decode: bool = True,
                 verify_before_use: bool | str = "records"):
        self.source = source
        self.shards = shards
        self.trusted = trusted
        self.lazy_decode = lazy_decode
        self.verify = verify
        self.verify_before_use = verify_before_use
        self.on_error = check_on_error(on_error)

    def connections(self, shard_index: int, budget: int) -> int:
        """The most connections a download of the shard can use at once: one per part.

        Args:
            shard_index (int): Index of the shard in the listing.
            budget (int): The connections of this stream (``concurrency``).

        Returns:
            One per ``MIN_PART_BYTES`` (32 KiB) of its listed size, at most ``budget``;
            1 for a source without ``fetch_in_parts`` or a shard of unknown size (one
            plain download).
        """
        size = self.shards[shard_index].size
        if budget <= 1 or size is None or getattr(self.source, "fetch_in_parts", None) is None:
            return 1
        return part_count(size, budget)  # the ranges fetch_in_parts will open

    def streams_as_it_arrives(self, shard_index: int) -> bool:
        """Whether :meth:`load` with ``arriving=True`` may hand out shard samples early.

        Args:
            shard_index (int): Index of the shard in the listing.

        Returns:
            :obj:`True` for ``.pt`` candidates of known size from a source that reads
            byte ranges, decoded lazily, with ``on_error="raise"`` (a shard of which
            samples were handed out cannot be skipped any more), and no listed sha256
            to check first (``verify_before_use=True``).
        """
        return (self.lazy_decode and self.on_error == "raise"
                and streams_as_it_arrives(self.source, self.shards[shard_index],
                                          verify=self.verify,
                                          verify_before_use=self.verify_before_use))

    def fetch_verified(self, info: ShardInfo, cancel: CancelToken,
                       parts: int = 1) -> bytes | bytearray:
        """Fetch one shard, downloading it once more if it fails verification.

        Args:
            info (ShardInfo): The shard.
            cancel (CancelToken): Cancellation of the iteration.
            parts (int, optional): Concurrent range requests, for sources that offer
                ``fetch_in_parts``. (default: :obj:`1`)

        Returns:
            The shard's bytes.

        Raises:
            ShardFetchError: The source cannot deliver the shard.
            ShardIntegrityError: Both downloads disagree with the listing.
        """
        problem = None
        in_parts = getattr(self.source, "fetch_in_parts", None) if parts > 1 else None
        for attempt in range(2):
            try:
                if in_parts is not None:
                    data = in_parts(info, cancel, parts)
                else:
                    data = self.source.fetch(info, cancel)
            except StreamError:
                raise
            except OSError as error:  # custom sources may raise plain I/O errors
                raise ShardFetchError(f"shard {info.name}: {error}") from error
            problem = integrity_problem(info, data) if self.verify else None
            if problem is None:
                return data
            del data
            if attempt == 0:
                logger.warning("shard %s: %s; downloading it once more", info.name, problem)
        raise ShardIntegrityError(
            f"shard {info.name}: {problem} (also after a second download); the source "
            f"may be corrupt or have changed since it was listed"
        )

    def load(self, position: int, shard_index: int, cancel: CancelToken,
             recorder: TraceRecorder, parts: int = 1, arriving: bool = False,
             downloaded: Callable[[], None] | None = None) -> LoadedShard:
        """Fetch and decode one shard; the pipeline drops its bytes once it is decoded.

        Args:
            position (int): Position of the shard in the stream's shard list.
            shard_index (int): Index of the shard in the listing.
            cancel (CancelToken): Cancellation of the iteration.
            recorder (TraceRecorder): Receives the download / deserialise times and the outcome.
            parts (int, optional): Concurrent range requests for the download (see
                :meth:`fetch_verified`). (default: :obj:`1`)
            arriving (bool, optional): Return as soon as the shard's samples are indexed,
                while its bytes are still arriving (:mod:`pyg_atompack.stream.arriving`),
                where :meth:`streams_as_it_arrives` allows it; the samples then carry
                :attr:`LoadedShard.arriving`. A layout that does not stream is decoded
                whole once it is in. (default: :obj:`False`)
            downloaded (Callable[[], None], optional): Called once the shard's bytes are in,
                before decoding (the prefetcher's :meth:`Lease.release`; not called
                for a shard returned while arriving, whose download ends later).
                (default: :obj:`None`)

        Returns:
            The decoded shard (no samples when it failed and ``on_error="skip"``).

        Raises:
            StreamCancelled: The iteration was closed meanwhile.
            StreamError: The shard cannot be fetched or decoded and ``on_error="raise"``.
        """
        info = self.shards[shard_index]
        shard = None
        if arriving and self.streams_as_it_arrives(shard_index):
            record = recorder.record(position, shard_index, info.name)
            record.download_start_s = started = recorder.now()

            def done() -> None:
                record.download_finish_s = record.deserialize_finish_s = recorder.now()

            shard = ArrivingShard(self.source, info, parts, cancel, verify=self.verify,
                                  check_crc=self.verify and self.verify_before_use is not False,
                                  on_done=done)
            shard.wait_published()
            if shard.samples is not None and shard.error is None:
                record.bytes = shard.size
                record.structures = len(shard.samples)
                return LoadedShard(position, shard_index, info, shard.samples, recorder,
                                   arriving=shard)

        def fetch() -> tuple[bytes | bytearray, int]:
            if shard is not None:  # a layout that does not stream, or a failed download
                shard.wait_done()
                record.download_start_s = started
                if shard.error is None:
                    return shard.buffer, shard.size
                if not isinstance(shard.error, (RangeIgnoredError, ShardIntegrityError)):
                    raise shard.error
                # a server that ignores ranges, or bytes that fail verification: the
                # whole-file download (which downloads a mismatching file once more)
            data = self.fetch_verified(info, cancel, parts)
            return data, len(data)

        return traced_load(
            recorder, position, shard_index, info, info.name, cancel=cancel,
            on_error=self.on_error, fetch=fetch, prepare=lambda data: self._prepare(info, data),
            decode=lambda data: decode_shard(data, info.name, trusted=self.trusted,
                                             lazy=self.lazy_decode),
            downloaded=downloaded)

    def _prepare(self, info: ShardInfo, data: bytes | bytearray) -> bytes | bytearray:
        return shard_format(info.name, data).prepare(data, self.lazy_decode)


def traced_load(recorder: TraceRecorder, position: int, key: int, info: ShardInfo, name: str,
                *, cancel: CancelToken, on_error: str, index: int | None = None,
                unit: str = "shard",
                fetch: Callable[[], tuple[Any, int]], prepare: Callable[[Any], Any],
                decode: Callable[[Any], Sequence[BaseData]],
                downloaded: Callable[[], None] | None = None) -> LoadedShard:
    """Run one prefetch job (fetch, prepare, decode), recording each step in the trace.

    The one way a job of the pipeline (a whole shard, or a record block of one) turns
    into a :class:`LoadedShard`, with its download and deserialise times, its size,
    and its outcome: cancelled, skipped (``on_error="skip"``) or loaded.

    Args:
        recorder (TraceRecorder): The iteration's trace.
        position (int): The job's position in the stream.
        key (int): What the trace calls the job: the shard's index in the listing, or
            the block's number.
        info (ShardInfo): The listing entry of the shard.
        name (str): How the trace and messages name the job.
        cancel (CancelToken): Cancellation of the iteration.
        on_error (str): ``"raise"`` or ``"skip"``.
        index (int, optional): :attr:`LoadedShard.index` (a block's first record in
            the whole dataset). (default: :obj:`key`)
        unit (str, optional): What messages call the job. (default: :obj:`"shard"`)
        fetch (Callable[[], tuple[Any, int]]): Downloads the job's bytes; returns them
            and the byte count to record.
        prepare (Callable[[Any], Any]): Turns the downloaded buffer into what ``decode``
            reads; the download is dropped before decoding starts.
        decode (Callable[[Any], Sequence[BaseData]]): Decodes the prepared bytes.
        downloaded (Callable[[], None], optional): Called when ``fetch`` has returned (the
            job's connections are free for the next download while it decodes).
            (default: :obj:`None`)

    Returns:
        LoadedShard: The decoded job (no samples when it failed and
        ``on_error="skip"``).

    Raises:
        StreamCancelled: The iteration was closed meanwhile.
        StreamError: The job cannot be fetched or decoded and ``on_error="raise"``.
    """
    index = key if index is None else index
    record = recorder.record(position, key, name)
    record.download_start_s = recorder.now()
    try:
        data, size = fetch()
        record.download_finish_s = recorder.now()
        if downloaded is not None:
            downloaded()
        record.bytes = size
        cancel.raise_if_cancelled()
        data = prepare(data)
        samples = decode(data)
        # lazily decoded .pt and .atp shards keep the buffer as their samples' storage
        del data
        record.deserialize_finish_s = recorder.now()
        record.structures = len(samples)
        return LoadedShard(position, index, info, samples, recorder)
    except StreamCancelled:
        record.status = "cancelled"
        raise
    except StreamError as error:
        if on_error != "skip":
            raise
        record.status = "skipped"
        logger.warning("skipping %s %s (on_error='skip'): %s", unit, name, error)
        return LoadedShard(position, index, info, [], recorder)
