"""``SourceOptions``: how one source's shards are fetched, checked and decoded.

What belongs to a source (retries, integrity checks, the metadata cache, record blocks,
how a shard is split over connections and decoded, where retrieval runs) lives in one
frozen object, apart from what belongs to an iteration (order, batching, prefetch depth,
ranks), which stays on :class:`~pyg_atompack.stream.ShardStreamDataset`. The split
follows MosaicML streaming's ``Stream`` / ``StreamingDataset``.

An options object has one home: the source it was given to
(:func:`~pyg_atompack.stream.open_source`, :class:`~pyg_atompack.stream.RemoteSource`,
:class:`~pyg_atompack.stream.LocalSource`, or a :class:`~pyg_atompack.stream.Source` of
your own with an ``options`` attribute), or the dataset when it is given a URL or a source
that carries none (:func:`source_options`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from pyg_atompack.pyg.names import resolve_names
from pyg_atompack.stream.arriving import check_verify_before_use
from pyg_atompack.stream.blocks import DEFAULT_BLOCK_BYTES
from pyg_atompack.stream.offproc import RETRIEVAL_CHOICES
from pyg_atompack.stream.readahead import DEFAULT_READ_AHEAD

#: Values of ``SourceOptions(stream_shards=)``.
STREAM_SHARDS_CHOICES = ("first", "all", "none")


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    r"""Per-source fetch and decode options of a shard stream, checked when made.

    Pass it to :func:`~pyg_atompack.stream.open_source` (or to
    :class:`~pyg_atompack.stream.RemoteSource` / :class:`~pyg_atompack.stream.LocalSource`),
    or as ``options=`` to :class:`~pyg_atompack.stream.ShardStreamDataset` with a URL:

    .. code-block:: python

        stream = ShardStreamDataset(
            "hf://datasets/org/name",
            options=SourceOptions(cache_dir="/scratch/cache", retries=8),
            shuffle=True, batch_size=32)

    Args:
        retries (int, optional): Retries of transient transfer failures (timeouts, resets, HTTP
            429/5xx); replaces the ``retries`` of the source's
            :class:`~pyg_atompack.transport.retry.RetryPolicy` when it has one.
            (default: :obj:`None`, the source's policy)
        verify (bool, optional): Check each shard's size and sha256 against the listing; a mismatch
            is retried once, then raises :class:`~pyg_atompack.stream.ShardIntegrityError`.
            (default: :obj:`True`)
        cache_dir (str | os.PathLike, optional): Where the metadata (header, schema, index) of
            block-streamed shards is cached, shared by workers, ranks and later runs. (default:
            ``$PYG_ATOMPACK_CACHE`` or ``~/.cache/pyg_atompack``)
        blocks (bool, optional): Stream ``.atp`` shards as *record blocks* of consecutive records
            instead of whole files (see :mod:`pyg_atompack.stream.blocks`): each block is one
            range request of at most ``block_bytes``, decoded in place, and blocks take
            the place of shards in ordering, prefetch (``prefetch`` and ``concurrency``
            count blocks), splitting (exact, at record granularity), traces, retries and
            resume, so memory is bounded by ``(prefetch + 1) * block_bytes`` whatever the
            shard size, and the first sample waits for one block. :obj:`None` (auto)
            uses blocks when every shard is an ``.atp`` file of known size that the
            source reads by range (local files, HTTP(S), the Hub, or a source with a
            ``range_reader(shard)`` method) and one is larger than ``block_bytes``;
            small shards keep whole-file reads. (default: :obj:`None`)
        block_bytes (int, optional): Largest file span of a block. (default: 64 MiB)
        split_shards (bool, optional): Fetch a shard over several connections at once, as
            byte ranges (sources with ``fetch_in_parts``, such as
            :class:`~pyg_atompack.stream.RemoteSource`; record blocks always): a download
            takes the connections of the dataset's ``concurrency`` that are free when it
            starts, as many as it has parts (of at least 32 KiB, 1 MiB for blocks; the
            first shard of an iteration finds them all free), and gives them back when
            its bytes are in. Servers often cap each connection's bandwidth: shards then
            arrive one after another, each up to ``concurrency`` times sooner, at the
            same total rate, so the first sample comes sooner and a download-bound
            stream ends with one shard to consume after its last byte instead of
            ``concurrency``. The cost is more requests per shard (mind request-rate
            limits with many small shards). :obj:`False`: one connection per shard.
            (default: :obj:`True`)
        stream_shards (str, optional): Which ``.pt`` shards hand out their samples as their
            bytes arrive instead of after the whole file
            (:mod:`pyg_atompack.stream.arriving`): ``"first"``, the first shard of each
            iteration (nothing can overlap its download); ``"all"``, every shard (when
            downloads are slower than training, each shard is then also trained on
            while it arrives, the last one included); ``"none"``. Such a shard is
            downloaded in file order over its connections and indexed while it
            arrives, each sample built once its storages are in and checked. Applies
            to a list of ``Data`` of known size from a source that reads byte ranges
            (HTTP(S), the Hub, object stores), with ``prefetch >= 1``,
            ``lazy_decode`` and ``on_error="raise"``, unless ``verify_before_use=True``
            asks for a listed sha256 first. Its samples cannot be shuffled over the
            whole shard: with ``shuffle`` they leave through a shuffle buffer of
            :data:`~pyg_atompack.stream.arriving.ARRIVAL_WINDOW` samples over the
            arrival order (the ``k``-th drawn from the first ``64 + k``), the same
            for a given seed and epoch. A shard found short or damaged once it is in
            raises :class:`~pyg_atompack.stream.ShardFetchError` or
            :class:`~pyg_atompack.stream.ShardDecodeError` naming it, no later than
            the end of that shard; other layouts are decoded whole.
            (default: :obj:`"first"`)
        verify_before_use (bool | str, optional): What a shard that ``stream_shards``
            hands out as it arrives is checked against before its samples are used
            (``verify`` on): ``"records"``, every archive record a sample is built
            from against the CRC-32 ``torch.save`` stores for it (a shard written
            without them is hashed whole first), and the whole file against the
            listing's size and sha256 once it is in; :obj:`True`, the sha256 before
            any sample (a shard whose listing has one then does not stream);
            :obj:`False`, nothing before use. A mismatch of the whole file's hash
            raises :class:`~pyg_atompack.stream.ShardIntegrityError` when the file is
            in, after some of its samples were handed out, and no later than the end
            of that shard. (default: :obj:`"records"`)
        read_ahead (int, optional): Samples of each lazily decoded shard being consumed
            that a background thread builds ahead of the consumer
            (:mod:`pyg_atompack.stream.readahead`), so that taking a sample costs the
            consumer no build, as with a loader that unpickles whole shards ahead.
            Bounded per shard: the lazy layout's memory is kept. ``0`` builds every
            sample in the consumer's thread when it is taken; with ``prefetch=0``
            nothing runs in the background either way. (default: :obj:`16`)
        interleave (int, optional): Shards (or blocks) consumed at once, each next sample drawn
            from one of them at random
            (:func:`~pyg_atompack.stream.ordering.interleave_shards`), before the
            dataset's ``shuffle_buffer``. Up to ``prefetch + interleave`` decoded shards
            are alive. (default: :obj:`1`)
        retrieval (str, optional): Where an iteration retrieves, decodes and batches:
            ``"threads"``, on background threads of the iterating process;
            ``"process"``, in a child process forked when iteration starts, which
            hands finished items over through shared memory
            (:mod:`pyg_atompack.stream.offproc`), so that none of that work needs the
            consumer's GIL (a training loop driving a GPU holds it nearly all the
            time); ``"auto"``, ``"process"`` when iterating in a main process (not a
            DataLoader worker) on Linux with ``prefetch >= 1``, else ``"threads"``.
            With a child process, items must be picklable and ``transform`` runs in
            the child, on the CPU. (default: :obj:`"auto"`)
        trusted (bool, optional): Allow arbitrary pickles in ``.pt`` shards (``torch.load`` with
            ``weights_only=False``). Only for sources you trust. The usual layouts
            are indexed without unpickling either way; the safe default reads any
            other layout with ``torch.load(weights_only=True)`` and the PyG allow-list
            (:func:`pyg_atompack.pyg.decode_pt`). (default: :obj:`False`)
        names (str, optional): A naming preset such as ``"pyg-md17"`` (``force``, float32
            ``energy``). (default: :obj:`None`)
        rename (Mapping[str, str], optional): Give sample attributes other names, e.g.
            ``{"forces": "force"}``, after ``names`` and before the dataset's
            ``transform`` and batching (see :class:`~pyg_atompack.AtompackDataset`).
            (default: :obj:`None`)
        lazy_decode (bool, optional): Decode a ``.pt`` shard without unpickling it when it holds a
            list of ``Data`` (tensors of their own, or views of storages the samples
            share: list slices of an ``InMemoryDataset``) or a collated
            ``(data, slices)`` tuple: :mod:`pyg_atompack.pyg.pt_index` indexes the
            downloaded bytes in place (on the prefetch thread, about three times faster
            than ``torch.load``) and each sample is built when it is taken, its tensors
            viewing the shard's buffer (~10 us a sample). A decoded shard then costs
            about its file size instead of ~3x. Samples that may outlive their shard
            (the last one of each shard, everything in a ``shuffle_buffer``) are copied
            out, so a consumer holding on to them never pins a whole shard. ``False``
            unpickles every ``.pt`` shard with ``torch.load(weights_only=True)``. Other
            layouts and ``.atp`` shards are not affected. (default: :obj:`True`)
        trim_memory (bool, optional): Hand freed heap memory back to the operating system (glibc
            ``malloc_trim``; a no-op elsewhere) after a consumed shard, once at least
            :data:`~pyg_atompack.stream.iteration.TRIM_AFTER_BYTES` of shards were consumed
            since the last trim. Without it the resident set keeps the high-water mark of
            the prefetch threads' malloc arenas, several shards above what is alive; see
            :mod:`pyg_atompack.stream.memory`. (default: :obj:`True`)

    Raises:
        ValueError: A value out of its range or not one of its choices.
        FieldSelectionError: An unknown ``names`` preset, or two attributes renamed onto
            one name.
    """

    retries: int | None = None
    verify: bool = True
    cache_dir: str | os.PathLike | None = None
    blocks: bool | None = None
    block_bytes: int = DEFAULT_BLOCK_BYTES
    split_shards: bool = True
    stream_shards: str = "first"
    verify_before_use: bool | str = "records"
    read_ahead: int = DEFAULT_READ_AHEAD
    interleave: int = 1
    retrieval: str = "auto"
    trusted: bool = False
    names: str | None = None
    rename: Mapping[str, str] | None = None
    lazy_decode: bool = True
    trim_memory: bool = True

    def __post_init__(self) -> None:
        if self.retries is not None and (not isinstance(self.retries, int)
                                         or self.retries < 0):
            raise ValueError(f"retries must be an int >= 0 or None, got {self.retries!r}")
        if not isinstance(self.block_bytes, int) or self.block_bytes < 1:
            raise ValueError(f"block_bytes must be a positive int, got {self.block_bytes!r}")
        if self.interleave < 1 or self.read_ahead < 0:
            raise ValueError(f"need interleave >= 1 and read_ahead >= 0, got "
                             f"interleave={self.interleave}, read_ahead={self.read_ahead}")
        if self.stream_shards not in STREAM_SHARDS_CHOICES:
            raise ValueError(f"stream_shards must be one of {STREAM_SHARDS_CHOICES}, got "
                             f"{self.stream_shards!r}")
        check_verify_before_use(self.verify_before_use)
        if self.retrieval not in RETRIEVAL_CHOICES:
            raise ValueError(f"retrieval must be one of {RETRIEVAL_CHOICES}, got "
                             f"{self.retrieval!r}")
        if self.rename is not None:
            # an owned copy: a caller's dict changed later must not change the options
            object.__setattr__(self, "rename", dict(self.rename))
        resolve_names(self.rename, self.names)  # an unknown preset fails here, not later

    def __hash__(self) -> int:
        # frozen options are values: hashable although ``rename`` is held as a dict
        values = (getattr(self, field.name) for field in dataclasses.fields(self))
        return hash(tuple(tuple(sorted(value.items())) if isinstance(value, dict) else value
                          for value in values))


def source_options(source: Any, options: SourceOptions | None) -> SourceOptions:
    """The options a stream over ``source`` uses: the source's own, or ``options``.

    A source that carries options (its ``options`` attribute is not :obj:`None`:
    one made by :func:`~pyg_atompack.stream.open_source` or given ``options=``)
    keeps them; giving the dataset options too would leave two places that disagree.

    Args:
        source (Any): The :class:`~pyg_atompack.stream.Source`.
        options (SourceOptions | None): The options given to the dataset, if any.

    Returns:
        SourceOptions: The options in force (defaults when neither has any).

    Raises:
        ValueError: Both the source and the dataset were given options.
        TypeError: ``options`` is not a :class:`SourceOptions`.
    """
    if options is not None and not isinstance(options, SourceOptions):
        raise TypeError(f"options must be a SourceOptions, got {type(options).__name__}")
    own = getattr(source, "options", None)
    if own is not None and options is not None:
        raise ValueError(f"{source!r} carries its own SourceOptions: pass options= to the "
                         "source (open_source(url, options), RemoteSource(..., options=)) "
                         "or to the dataset with a URL, not to both")
    if own is not None and not isinstance(own, SourceOptions):
        raise TypeError(f"{source!r}.options must be a SourceOptions, got "
                        f"{type(own).__name__}")
    return own if own is not None else options if options is not None else SourceOptions()


__all__ = ["SourceOptions", "source_options", "STREAM_SHARDS_CHOICES"]
