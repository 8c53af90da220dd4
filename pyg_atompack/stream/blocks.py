"""Record blocks: big `.atp` shards streamed as runs of consecutive records.

A multi-GB `.atp` shard is never held whole. Its metadata (header, schema, index) is
read once by range requests and cached on disk (:mod:`pyg_atompack.remote.atp_meta`),
and its records are cut into *blocks* of consecutive records spanning at most
``block_bytes`` of the file (:func:`pyg_atompack.atp.images.plan_blocks`). A block is
fetched with one range request straight into its own buffer, wrapped into a small
`.atp` image and decoded in place like a whole shard (no pickle). Blocks are the unit of
everything the dataset does with shards: order, prefetch, traces, retries, resume.

Splitting an epoch (:func:`plan_block_stream`): the blocks of all files are put in one
order (permuted per epoch with a generator seeded by ``(seed, epoch)`` when shuffling),
their records are concatenated, and the ``N`` records are cut into ``world_size`` equal
stretches of ``N // world_size`` records, each split between the rank's DataLoader
workers. Block boundaries that fall inside a stretch are cut there, at record
granularity, so every record is read exactly once per epoch and every rank gets the
same count. Only the ``N % world_size`` records at the end of the epoch's order are
dropped (none when the count divides; a different few each epoch when shuffling).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pyg_atompack import atp
from pyg_atompack.atp.header import HEADER_SIZE
from pyg_atompack.atp.images import FileMeta, block_span, complete_block, plan_blocks
from pyg_atompack.remote.atp_meta import load_meta
from pyg_atompack.remote.ranges import RangeReader
from pyg_atompack.stream.errors import (
    ShardDecodeError,
    ShardFetchError,
    ShardIntegrityError,
    StreamCancelled,
    StreamError,
)
from pyg_atompack.stream.loading import LoadedShard, check_on_error, traced_load
from pyg_atompack.stream.payloads import _decode_atp
from pyg_atompack.stream.progress import EpochConsumed
from pyg_atompack.stream.sources import CancelToken, ShardInfo, Source
from pyg_atompack.stream.splitting import StreamSlot
from pyg_atompack.stream.trace import TraceRecorder
from pyg_atompack.transport.buffers import allocate
from pyg_atompack.transport.errors import RemoteIntegrityError
from pyg_atompack.transport.transfers import part_count

logger = logging.getLogger(__name__)

#: Default largest file span of one block (one range request).
DEFAULT_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class Block:
    """Records ``first:stop`` of shard ``shard`` (the unit of one range request).

    Attributes:
        shard: Index of the shard in the source listing.
        first: First record in the shard.
        stop: One past the last record.
        global_first: Index of ``first`` among all records of the source.
    """

    shard: int
    first: int
    stop: int
    global_first: int

    @property
    def records(self) -> int:
        """Number of records."""
        return self.stop - self.first


@dataclass(frozen=True)
class BlockPlan:
    """What one stream reads in one epoch, in block mode.

    Attributes:
        blocks: The pieces to read, in order (blocks, some cut at the stream's ends).
        shards: For traces, the number of every piece's whole block in the epoch's table.
        sample_quota: Always :obj:`None`: the pieces hold exactly the stream's records.
        dropped_records: Records nobody reads this epoch (``N % world_size``).
        handed: Per position, the records of the piece (numbered from its first) that
            other streams handed out before an elastic resume (they are skipped).
    """

    blocks: tuple[Block, ...]
    shards: tuple[int, ...]
    sample_quota: None = None
    dropped_records: int = 0
    handed: Mapping[int, frozenset[int]] = field(default_factory=dict)


def range_reader(source: Source, info: ShardInfo) -> RangeReader | None:
    """A range reader for one shard of ``source``, or None when it has none.

    The shipped sources (:class:`~pyg_atompack.stream.RemoteSource`,
    :class:`~pyg_atompack.stream.LocalSource`) offer ``range_reader(info)`` through their
    backend; a source of your own may too. A size is needed (from the listing).

    Args:
        source (Source): The dataset's source.
        info (ShardInfo): One of its shards.

    Returns:
        The reader, or :obj:`None`.
    """
    own = getattr(source, "range_reader", None)
    return own(info) if callable(own) else None


def wants_blocks(source: Source, shards: Sequence[ShardInfo], block_bytes: int,
                 blocks: bool | None) -> bool:
    """Whether a dataset streams record blocks rather than whole shards.

    Args:
        source (Source): The dataset's source.
        shards (Sequence[ShardInfo]): Its listing.
        block_bytes (int): Largest block span.
        blocks (bool | None): :obj:`True` / :obj:`False` to force; :obj:`None` (auto) chooses blocks
            when every shard is an ``.atp`` file of known size that the source can read
            by range (:func:`range_reader`) and at least one is larger than
            ``block_bytes`` (so a dataset of small shards keeps whole-file reads).

    Returns:
        The decision.
    """
    if blocks is not None:
        return blocks
    atp_known = all(s.name.endswith(".atp") and s.size is not None for s in shards)
    return (atp_known and any(s.size > block_bytes for s in shards)
            and all(range_reader(source, s) is not None for s in shards))


def plan_source_blocks(source: Source, shards: Sequence[ShardInfo], block_bytes: int,
                       cache_dir: str | Path | None) -> list[Block]:
    """Every block of every shard, in source order (fetches or reuses cached metadata).

    Args:
        source (Source): The dataset's source.
        shards (Sequence[ShardInfo]): Its listing.
        block_bytes (int): Largest block span.
        cache_dir (str | Path | None): Metadata cache root.

    Returns:
        The blocks.

    Raises:
        ShardFetchError: A shard has no range reads, or its metadata cannot be fetched.
        ShardDecodeError: Its metadata is not valid `.atp` metadata.
    """
    blocks: list[Block] = []
    offset = 0
    for number, info in enumerate(shards):
        reader = range_reader(source, info)
        if reader is None or not info.name.endswith(".atp"):
            raise ShardFetchError(f"shard {info.name}: record blocks need an .atp shard of "
                                  f"known size from a source with range reads")
        meta = _meta(reader, cache_dir, info)
        bounds = plan_blocks(meta, block_bytes).tolist()
        blocks.extend(Block(number, a, b, offset + a) for a, b in zip(bounds[:-1], bounds[1:]))
        offset += len(meta)
    return blocks


def _meta(reader: RangeReader, cache_dir: str | Path | None, info: ShardInfo) -> FileMeta:
    try:
        return load_meta(reader, cache_dir)
    except atp.AtpError as error:
        raise ShardDecodeError(f"shard {info.name}: {error}") from error
    except StreamError:
        raise
    except OSError as error:
        raise ShardFetchError(f"shard {info.name}: metadata: {error}") from error


def plan_block_stream(blocks: Sequence[Block], slot: StreamSlot, *, shuffle: bool, seed: int,
                      epoch: int, consumed: EpochConsumed | None = None) -> BlockPlan:
    """The pieces of ``slot`` this epoch (see the module docstring for the split).

    After an elastic resume (``consumed``) the records left are cut the same way: a
    piece then spans the records it is given, and skips those handed out before
    (:attr:`BlockPlan.handed`).

    Args:
        blocks (Sequence[Block]): Every block of the source.
        slot (StreamSlot): The stream being planned.
        shuffle (bool): Permute the block order per epoch.
        seed (int): Shared seed.
        epoch (int): Epoch number.
        consumed (EpochConsumed, optional): What all streams had handed out of this epoch
            before an elastic resume. (default: :obj:`None`)

    Returns:
        The :class:`BlockPlan`.
    """
    if shuffle:
        order = np.random.default_rng([seed, epoch, 0xB10C]).permutation(len(blocks))
    else:
        order = np.arange(len(blocks))

    def left(block: Block) -> int:
        taken = 0 if consumed is None else consumed.count(block.shard, block.first, block.stop)
        return block.records - taken

    counts = np.asarray([left(blocks[i]) for i in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    total = int(starts[-1])
    per_rank = total // slot.world_size
    rank_start = slot.rank * per_rank
    lo = rank_start + per_rank * slot.worker // slot.num_workers
    hi = rank_start + per_rank * (slot.worker + 1) // slot.num_workers
    pieces: list[Block] = []
    numbers: list[int] = []
    handed: dict[int, frozenset[int]] = {}
    first = int(np.searchsorted(starts, lo, side="right")) - 1
    for position in range(max(first, 0), len(order)):
        a, b = int(starts[position]), int(starts[position + 1])
        if a >= hi:
            break
        cut_a, cut_b = max(a, lo) - a, min(b, hi) - a
        if cut_b <= cut_a:
            continue
        block = blocks[int(order[position])]
        taken = set() if consumed is None else consumed.taken(block.shard, block.first,
                                                              block.stop)
        if taken:  # the records left, numbered in the shard; the piece spans its share
            rest = [r for r in range(block.first, block.stop) if r not in taken]
            start, stop = rest[cut_a], rest[cut_b - 1] + 1
            skipped = frozenset(r - start for r in taken if start <= r < stop)
            if skipped:
                handed[len(pieces)] = skipped
        else:
            start, stop = block.first + cut_a, block.first + cut_b
        pieces.append(Block(block.shard, start, stop, block.global_first + start - block.first))
        numbers.append(int(order[position]))
    return BlockPlan(tuple(pieces), tuple(numbers), None, total - per_rank * slot.world_size,
                     handed)


class BlockLoader:
    """Fetches and decodes the pieces of a :class:`BlockPlan` (one job per piece).

    Args:
        source (Source): The dataset's source.
        shards (Sequence[ShardInfo]): Its listing.
        plan (BlockPlan): The stream's plan; job ``position`` is ``plan.blocks[position]``.
        cache_dir (str | Path | None): Metadata cache root.
        on_error (str): ``"raise"`` or ``"skip"``.
        metas_kept (int, optional): Shard metadata kept in memory (most recently used).
            (default: :obj:`4`)
        block_bytes (int, optional): The plan's block size (what :meth:`connections` splits).
            (default: :data:`DEFAULT_BLOCK_BYTES`)
    """

    def __init__(self, source: Source, shards: Sequence[ShardInfo], plan: BlockPlan, *,
                 cache_dir: str | Path | None, on_error: str, metas_kept: int = 4,
                 block_bytes: int = DEFAULT_BLOCK_BYTES):
        self.source = source
        self.shards = shards
        self.plan = plan
        self.cache_dir = cache_dir
        self.on_error = check_on_error(on_error)
        self.block_bytes = block_bytes
        self._metas: OrderedDict[int, tuple[RangeReader, FileMeta]] = OrderedDict()
        self._metas_kept = metas_kept

    def connections(self, budget: int) -> int:
        """The most connections a block's download can use: one per :data:`MIN_PART_BYTES`.

        Args:
            budget (int): The connections of this stream (``concurrency``).

        Returns:
            At most ``budget``, at least 1.
        """
        return part_count(self.block_bytes, budget, MIN_PART_BYTES)

    def _shard(self, number: int) -> tuple[RangeReader, FileMeta]:
        found = self._metas.get(number)
        if found is None:
            info = self.shards[number]
            reader = range_reader(self.source, info)
            if reader is None:
                raise ShardFetchError(f"shard {info.name}: the source offers no range reads")
            found = (reader, _meta(reader, self.cache_dir, info))
            self._metas[number] = found
            while len(self._metas) > self._metas_kept:
                self._metas.popitem(last=False)
        self._metas.move_to_end(number)
        return found

    def load(self, position: int, number: int, cancel: CancelToken, recorder: TraceRecorder,
             parts: int = 1, downloaded: Callable[[], None] | None = None) -> LoadedShard:
        """Fetch piece ``position`` with one range request and decode it in place.

        Args:
            position (int): Position of the piece in the stream.
            number (int): Its block's number (for the trace).
            cancel (CancelToken): Cancellation of the iteration.
            recorder (TraceRecorder): Receives the download / decode times.
            parts (int, optional): Range requests the block is fetched over at once (the
                connections the prefetcher leased it). (default: :obj:`1`)
            downloaded (Callable[[], None], optional): Called once the block's bytes are in,
                before decoding. (default: :obj:`None`)

        Returns:
            The decoded piece (no samples when it failed and ``on_error="skip"``).
        """
        piece = self.plan.blocks[position]
        info = self.shards[piece.shard]
        name = f"{info.name}[{piece.first}:{piece.stop}]"
        meta = None

        def fetch() -> tuple[bytearray, int]:
            nonlocal meta
            reader, meta = self._shard(piece.shard)
            span_start, span_len, size = block_span(meta, piece.first, piece.stop)
            image = allocate(size)
            view = memoryview(image)
            try:
                _read_in_parts(reader, span_start, view[HEADER_SIZE:HEADER_SIZE + span_len],
                               cancel, parts)
            except StreamError:
                raise
            except OSError as error:
                # an object changed since it was listed stays an integrity error
                kind = (ShardIntegrityError if isinstance(error, RemoteIntegrityError)
                        else ShardFetchError)
                raise kind(f"shard {name}: {error}") from error
            finally:
                view.release()
            return image, span_len

        def prepare(image: bytearray) -> bytearray:
            complete_block(image, meta, piece.first, piece.stop)
            return image

        return traced_load(recorder, position, number, info, name, cancel=cancel,
                           on_error=self.on_error, index=piece.global_first, unit="block",
                           fetch=fetch, prepare=prepare,
                           decode=lambda image: _decode_atp(image, name), downloaded=downloaded)


#: Smallest part worth its own connection when a block is fetched in parts.
MIN_PART_BYTES = 1 << 20


def _read_in_parts(reader: RangeReader, start: int, out: memoryview, cancel: CancelToken,
                   parts: int) -> None:
    """``reader.read_into(start, out)`` over up to ``parts`` concurrent range requests."""
    parts = part_count(len(out), parts, MIN_PART_BYTES)
    if parts == 1:
        reader.read_into(start, out, cancel)
        return
    from concurrent.futures import ThreadPoolExecutor

    bounds = [len(out) * n // parts for n in range(parts + 1)]
    # one failed part stops its siblings; closing the iteration stops them all
    siblings = CancelToken()
    unregister = cancel.on_cancel(siblings.cancel)

    def run(a: int, b: int) -> None:
        try:
            reader.read_into(start + a, out[a:b], siblings)
        except BaseException:
            siblings.cancel()
            raise

    try:
        with ThreadPoolExecutor(max_workers=parts,
                                thread_name_prefix="pyg_atompack-block") as pool:
            futures = [pool.submit(run, a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        cancel.raise_if_cancelled()
        errors = [f.exception() for f in futures if f.exception() is not None]
        real = [e for e in errors if not isinstance(e, StreamCancelled)]
        if real or errors:
            raise (real or errors)[0]
    finally:
        unregister()


def describe_blocks(blocks: Sequence[Block]) -> dict[str, Any]:
    """Counts for ``repr`` and stats: blocks and records."""
    return {"blocks": len(blocks), "records": int(sum(b.records for b in blocks))}
