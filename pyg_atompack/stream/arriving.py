"""``.pt`` shards handed out sample by sample as their bytes arrive.

Nothing overlaps the first download of an iteration: with whole shards, the first
sample waits for a whole file and its index (and, when downloads are slower than
training, the last shard is trained on only after it has all arrived).
:class:`ArrivingShard` downloads a shard in file order over the connections it may use
into one buffer of the listed size, and feeds the filled prefix to the in-place indexer
(:class:`~pyg_atompack.pyg.pt_arriving.ArrivingPt`): ``torch.save`` writes the pickle first
and the storages after it in sample order, so the shard's samples are indexed once its
pickle has arrived and each one can be built once its storages have.
``SourceOptions(stream_shards=)`` picks the shards: the first of each iteration
(the default), all, or none.

The rules (see ``docs/architecture.md``, "The first shard as it arrives"):

* **integrity** (``verify_before_use``, :func:`streams_as_it_arrives`): by default
  (``"records"``, with ``verify`` on) a sample is made ready only once every archive
  record it is built from matched the CRC-32 that ``torch.save`` stores for it, and the
  whole file is checked against the listing's size and sha256 once it is in; an archive
  without CRC-32s is hashed whole before its first sample. ``True`` hands out no sample
  of a shard whose sha256 is listed before that hash is checked (such a shard does not
  stream); ``False`` checks nothing before use. A shard that turns out short, damaged or
  of another hash raises :class:`ShardFetchError`, :class:`ShardDecodeError` or
  :class:`ShardIntegrityError` naming it, at the next sample asked for or, at the
  latest, when the consumer reaches the shard's end; a sample is built only from
  records that have all arrived and were checked against the pickle, never from half a
  record;
* **shuffle**: samples that have not arrived cannot be drawn, so the shard's order is a
  shuffle buffer of :data:`ARRIVAL_WINDOW` samples over the arrival order
  (:func:`arrival_order`): the same for a given seed and epoch whatever the timing;
* layouts the indexer does not stream (collated, shared storages, anything it declines)
  are decoded whole once they have arrived, as any other shard.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from pyg_atompack.pyg.errors import PtPayloadError
from pyg_atompack.pyg.pt_arriving import ArrivingPt, ArrivingPtSamples
from pyg_atompack.pyg.pt_pickle import NotLazyLayout
from pyg_atompack.stream.errors import (
    ShardDecodeError,
    ShardFetchError,
    ShardIntegrityError,
    StreamError,
)
from pyg_atompack.stream.prefetch import THREAD_NAME_PREFIX
from pyg_atompack.stream.sources import CancelToken, ShardInfo
from pyg_atompack.transport.buffers import RangeIgnoredError, allocate
from pyg_atompack.transport.integrity import bytes_problem
from pyg_atompack.transport.transfers import VersionPin

__all__ = ["ARRIVAL_WINDOW", "ArrivingShard", "arrival_order", "check_verify_before_use",
           "streams_as_it_arrives"]

#: Samples of the shuffle buffer over an arriving shard: its first sample is drawn from
#: the first 64 samples to arrive, the ``k``-th from the first ``64 + k``.
ARRIVAL_WINDOW = 64
#: First byte ranges of an arriving shard fetched over several connections (each
#: request costs a round trip; bytes are reported as they land within a range).
MIN_CHUNK_BYTES = 64 << 10


def check_verify_before_use(value: Any) -> bool | str:
    """``value`` if it is a ``verify_before_use`` choice: ``"records"`` (every archive
    record against its CRC-32 before use, the sha256 once the shard is in), :obj:`True`
    (the whole file's sha256 before use) or :obj:`False` (nothing before use).

    Args:
        value (Any): A ``verify_before_use`` argument.

    Returns:
        bool | str: The value.

    Raises:
        ValueError: Any other value.
    """
    if value is True or value is False or isinstance(value, str) and value == "records":
        return value
    raise ValueError(f"verify_before_use must be 'records', True or False, got {value!r}")


def streams_as_it_arrives(source: Any, info: ShardInfo, *, verify: bool,
                          verify_before_use: bool | str) -> bool:
    """Whether a shard may be handed out as its bytes arrive.

    Args:
        source (Any): The shard's source; it must read byte ranges into a buffer
            (``read_into(shard, buffer, start, end, cancel)``).
        info (ShardInfo): The listing entry; its size must be known.
        verify (bool): Whether shards are checked against the listing.
        verify_before_use (bool | str): What is checked before a sample is handed out
            (:func:`check_verify_before_use`); with :obj:`True` a known sha256 must be checked
            first.

    Returns:
        :obj:`True` when the shard is a ``.pt`` candidate of known size read by range,
        and no known hash has to be checked first.
    """
    return (not info.name.endswith(".atp") and bool(info.size)
            and callable(getattr(source, "read_into", None))
            and not (verify and info.sha256 and verify_before_use is True))


def arrival_order(count: int, *, shuffle: bool, seed: int, epoch: int,
                  shard_index: int, window: int = ARRIVAL_WINDOW) -> list[int] | range:
    """The order in which an arriving shard's samples are handed out this epoch.

    A shuffle buffer over the samples in the order they arrive: it starts with the
    first ``window`` samples, and each draw takes one of the buffer at random and puts
    the next sample to arrive in its place. The ``k``-th sample handed out is thus one
    of the first ``window + k`` of the file (instead of any sample of the shard, as for
    a shard decoded whole), and the order depends only on the seed, the epoch and the
    shard, never on when bytes arrive.

    Args:
        count (int): Samples in the shard.
        shuffle (bool): Shuffle (else the stored order).
        seed (int): Base seed of the dataset.
        epoch (int): Current epoch.
        shard_index (int): The shard's index in the listing.
        window (int, optional): Size of the shuffle buffer. (default: :data:`ARRIVAL_WINDOW`)

    Returns:
        A permutation of ``range(count)``.
    """
    if not shuffle:
        return range(count)
    draws = np.random.default_rng([seed, epoch, shard_index, 7, 1]).random(count).tolist()
    pool = list(range(min(window, count)))
    following = len(pool)
    order = []
    for draw in draws:
        pick = int(draw * len(pool))
        order.append(pool[pick])
        if following < count:
            pool[pick] = following
            following += 1
        else:
            pool[pick] = pool[-1]
            pool.pop()
    return order


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    """The byte ranges of an arriving shard, in file order.

    One connection reads the file as one range. Several take ranges that start at
    :data:`MIN_CHUNK_BYTES` and double every ``parts`` ranges up to a ``2 * parts``-th
    of the file: the first bytes (the pickle, the first samples) then arrive at the
    speed of every connection together, later ones with fewer requests.
    """
    if parts == 1:
        return [(0, size)]
    largest = max(MIN_CHUNK_BYTES, -(-size // (2 * parts)))
    ranges, start, length = [], 0, MIN_CHUNK_BYTES
    while start < size:
        for _ in range(parts):
            if start >= size:
                break
            ranges.append((start, min(start + length, size)))
            start += length
        length = min(2 * length, largest)
    return ranges


class ArrivingShard:
    """One shard downloaded as consecutive byte ranges and indexed while it arrives.

    The download starts at once, on ``parts`` threads that take the next range in file
    order (one range for the whole file over one connection, else growing ranges, see
    :func:`_ranges`), each reporting its bytes as they land, so the file fills front
    to back. Whoever waits for the shard (the prefetch thread until the samples
    are published, then the consumer or the read-ahead thread waiting for a sample,
    and the prefetcher waiting for the end of the download) feeds the grown prefix to
    the indexer, so the download threads never stop receiving to index. Once the whole
    file is in, it is checked against the listing (size and, when ``verify``, sha256)
    and against its zip directory.

    Args:
        source (Any): Reads byte ranges: ``source.read_into(info, buffer, start, end,
            cancel, progress, pin=pin)``.
        info (ShardInfo): The shard; its size must be known.
        parts (int): Concurrent range requests.
        cancel (CancelToken): Cancellation of the iteration; stops every request.
        verify (bool): Check the whole file against the listing's size and sha256.
        check_crc (bool, optional): Make a sample ready only once the archive records
            it is built from matched their CRC-32s (an archive without them is decoded
            whole once it is in and checked). (default: :obj:`False`)
        on_done (Callable[[], None], optional): Called once the file is in and checked
            (or the download failed). (default: :obj:`None`)
    """

    def __init__(self, source: Any, info: ShardInfo, parts: int, cancel: CancelToken, *,
                 verify: bool, check_crc: bool = False,
                 on_done: Callable[[], None] | None = None) -> None:
        self.info = info
        self.size = int(info.size)
        self.buffer = allocate(self.size)
        # every range of this download comes from one version of the file
        self._pin = VersionPin()
        self.samples: ArrivingPtSamples | None = None  # once published
        self.declined = False  # the indexer does not stream this layout
        self.done = False  # every byte arrived and was checked, or the download failed
        self.error: BaseException | None = None
        self._source = source
        self._verify = verify
        self._on_done = on_done
        self._indexer = ArrivingPt(self.buffer, check_crc=check_crc)
        self._condition = threading.Condition(threading.Lock())
        parts = max(1, parts)
        self._chunks = _ranges(self.size, parts)
        self._filled = [start for start, _ in self._chunks]  # each range's end so far
        self._complete = 0  # ranges 0 .. _complete - 1 are all in
        self._prefix = 0  # bytes in from the file's start
        self._fed = 0  # the prefix the indexer has seen
        self._feeding = False  # a waiter is feeding the indexer
        self._next_chunk = 0
        self._cancel = CancelToken()  # one failed range stops the others
        self._unregister = cancel.on_cancel(self._cancel.cancel)
        self._threads = [threading.Thread(target=self._download, daemon=True,
                                          name=f"{THREAD_NAME_PREFIX}-range-{number}")
                         for number in range(min(parts, len(self._chunks)))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ consumer side
    def wait_published(self) -> None:
        """Wait until the samples are published, the layout declined, or the file is in."""
        self._drive(lambda: (self.samples is not None or self.declined or self.done
                             or self.error is not None))

    def wait_ready(self, index: int) -> None:
        """Wait until sample ``index`` has arrived.

        Args:
            index (int): The sample.

        Raises:
            StreamError: The download failed, was cancelled, or the shard turned out
                damaged or different from its listing (no further sample is handed out).
        """
        samples = self.samples
        if self.error is None and samples.ready > index:
            return
        # the whole file's check (hash, directory) is left to the prefetch thread
        # waiting for the download's end: not on the consumer's path
        self._drive(lambda: self.error is not None or samples.ready > index or self.done,
                    whole=False)
        if self.error is not None:
            raise self.error
        if samples.ready <= index:  # cannot happen: complete() makes every sample ready
            raise ShardDecodeError(f"shard {self.info.name}: sample {index} never arrived")

    def wait_done(self) -> None:
        """Wait until the file is in and checked, or its download failed."""
        self._drive(lambda: self.done)

    def settle(self) -> None:
        """Wait for the end of the download and raise what went wrong with it, if anything.

        Raises:
            StreamError: As for :meth:`wait_ready`.
        """
        # the prefetch thread that loaded the shard waits for its end (wait_done) and
        # runs the whole file's check; the consumer only waits for its outcome
        self._drive(lambda: self.done, whole=False)
        if self.error is not None:
            raise self.error

    def _drive(self, until: Callable[[], bool], whole: bool = True) -> None:
        """Wait until ``until()``, feeding the indexer whatever has arrived meanwhile
        (up to the file's last byte, which starts the whole file's check, if ``whole``)."""
        condition = self._condition
        limit = self.size if whole else self.size - 1
        with condition:
            while not until():
                if (min(self._prefix, limit) > self._fed and not self._feeding
                        and not self.done):
                    prefix, self._feeding = min(self._prefix, limit), True
                    condition.release()
                    try:
                        self._feed(prefix)
                    finally:
                        condition.acquire()
                        self._feeding, self._fed = False, prefix
                        condition.notify_all()
                    continue
                condition.wait()

    # ------------------------------------------------------------------ download side
    def _download(self) -> None:
        while True:
            with self._condition:
                if self.error is not None or self._next_chunk >= len(self._chunks):
                    return
                number = self._next_chunk
                self._next_chunk += 1
            start, end = self._chunks[number]
            try:
                self._source.read_into(self.info, self.buffer, start, end, self._cancel,
                                       lambda offset, number=number: self._land(number, offset),
                                       pin=self._pin)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer
                if isinstance(error, OSError) and not isinstance(error, StreamError) or (
                        isinstance(error, RangeIgnoredError) and self.samples is not None):
                    # as ShardLoader.fetch_verified names plain I/O errors; a server
                    # ignoring ranges is left to the caller while nothing is published
                    error = ShardFetchError(f"shard {self.info.name}: {error}")
                self._finish(error)
                return
            self._land(number, end)

    def _land(self, number: int, offset: int) -> None:
        """Range ``number`` holds its bytes up to ``offset``."""
        with self._condition:
            if offset <= self._filled[number]:
                return  # a restarted range rewriting bytes that were in
            self._filled[number] = offset
            complete, chunks, filled = self._complete, self._chunks, self._filled
            while complete < len(chunks) and filled[complete] == chunks[complete][1]:
                complete += 1
            self._complete = complete
            prefix = self.size if complete == len(chunks) else filled[complete]
            if prefix > self._prefix:
                self._prefix = prefix
                self._condition.notify_all()

    def _feed(self, prefix: int) -> None:
        """Index the first ``prefix`` bytes; check the whole file once it is in."""
        whole = prefix >= self.size
        try:
            if whole and self._verify:
                problem = bytes_problem(self.buffer, size=self.info.size,
                                        sha256=self.info.sha256)
                if problem is not None:
                    raise ShardIntegrityError(
                        f"shard {self.info.name}: {problem}; the source may be corrupt "
                        f"or have changed since it was listed")
            if not self.declined:
                try:
                    samples = self._indexer.complete() if whole else self._indexer.feed(prefix)
                except NotLazyLayout:
                    with self._condition:
                        self.declined = True  # decoded whole once it is in
                else:
                    if samples is not None and self.samples is None:
                        with self._condition:
                            self.samples = samples
        except PtPayloadError as error:
            self._finish(ShardDecodeError(f"shard {self.info.name}: {error}"))
            return
        except StreamError as error:
            self._finish(error)
            return
        except Exception as error:  # noqa: BLE001 - every waiter (the prefetcher's
            # included, which must not die waiting) meets it as the shard's error
            self._finish(ShardDecodeError(f"shard {self.info.name}: {type(error).__name__}: "
                                          f"{error}"))
            return
        if whole:
            self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        with self._condition:
            if self.done:
                return
            if error is not None:
                self.error = error
                self._cancel.cancel()
            self.done = True
            self._condition.notify_all()
        self._unregister()
        if self._on_done is not None:
            self._on_done()
