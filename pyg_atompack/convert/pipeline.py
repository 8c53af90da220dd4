"""Whole conversions: one reader streamed into one writer."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from pyg_atompack.atp.frames import FRAME_GROUPS

from .atp_io import CarriedMetadata
from .coercion import Coercer, Kind, Widened, kinds_to_json
from .errors import note
from .options import ReadOptions, WriteOptions
from .parallel import Part, open_structures, part_write_options
from .registry import open_writer
from .shards import DEFAULT_SHARD_SIZE

#: ``progress(total)`` returns an object with ``update(n)`` and ``close()`` (a tqdm).
ProgressFactory = Callable[[int | None], Any]


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    read_options: ReadOptions | None = None,
    write_options: WriteOptions | None = None,
    progress: ProgressFactory | None = None,
    workers: int = 1,
    part: Part | None = None,
) -> int:
    """Convert a dataset from one format into another.

    Structures are streamed one at a time; the destination appears only when
    the conversion succeeded (nothing is left behind on failure). Every custom
    key gets one type for the whole output (:mod:`.coercion`): a key that later
    structures widen (integer -> float, ...) is promoted, with one
    :class:`~pyg_atompack.convert.ConversionNote` warning per key, after
    reading the source again when structures were already written narrower.
    With ``workers > 1`` the source is read and parsed by that many processes
    and written in order by this one (:mod:`.parallel`): the output is the same.

    Args:
        src (str | os.PathLike): Source file or directory.
        dst (str | os.PathLike): Destination file or directory.
        src_format (str, optional): Source format name; ``None`` detects it (default: :obj:`None`).
        dst_format (str, optional): Destination format name; ``None`` picks it from ``dst``
            (default: :obj:`None`).
        read_options (ReadOptions, optional): Key mapping and units of the source.
            (default: :obj:`None`)
        write_options (WriteOptions, optional): Codec, shard size and overwrite of the destination.
            (default: :obj:`None`)
        progress (ProgressFactory, optional): Factory of a progress bar, called with the total (or
            ``None``). (default: :obj:`None`)
        workers (int, optional): Processes reading the source (default: :obj:`1`).
        part (Part, optional): Convert only this part of the source into a shard directory whose
            shards carry their global numbers, for :func:`~.merge.merge_parts`
            (default: ``None``, everything).

    Returns:
        The number of structures written.

    Raises:
        ConvertError: For any problem with the source or destination.

    Example:
        >>> from pyg_atompack.convert import convert, ReadOptions, UnitConversion
        >>> convert("md17.xyz", "md17.atp",  # doctest: +SKIP
        ...         read_options=ReadOptions(units=UnitConversion("kcal/mol")))
    """
    read_options = read_options if read_options is not None else ReadOptions()
    write_options = write_options if write_options is not None else WriteOptions()
    coercer = Coercer(read_options, src, dst)
    while True:
        try:
            count = _convert_once(src, dst, src_format, dst_format, read_options,
                                  write_options, progress, coercer, workers, part)
        except Widened:
            coercer.restart()  # the writer was aborted: nothing of the last pass remains
            continue
        for line in coercer.notes():
            note(line)
        return count


def _convert_once(src, dst, src_format, dst_format, read_options, write_options,
                  progress, coercer: Coercer, workers: int = 1, part: Part | None = None) -> int:
    with open_structures(src, src_format, read_options, workers=workers, part=part,
                         shard_size=write_options.shard_size or DEFAULT_SHARD_SIZE) as reader:
        if part is not None:
            write_options = part_write_options(reader, dst, dst_format, write_options)
        bar = progress(reader.length) if progress is not None else None
        metadata = _source_metadata(src, src_format)
        try:
            with open_writer(dst, dst_format, write_options) as writer:
                if metadata is not None:
                    _carry(metadata, writer, dst, getattr(reader, "first_index", 0),
                           reader.length)
                # indices in the source: a part starts at its first structure
                for index, structure in enumerate(reader, getattr(reader, 'first_index', 0)):
                    writer.add(coercer(structure, index))
                    if bar is not None:
                        bar.update(1)
                if write_options.part is not None:
                    # the types this part settled on, for merge to reconcile with the
                    # other parts' (the manifest is written when the writer closes)
                    write_options.part["kinds"] = kinds_to_json(coercer.kinds)
                return writer.count
        finally:
            if bar is not None:
                bar.close()


def _source_metadata(src: str | os.PathLike, src_format: str | None
                     ) -> CarriedMetadata | None:
    """The metadata frames of an `.atp` source (groups, kinds of newer versions), or
    :obj:`None` for other formats and `.atp` sources without any."""
    from .registry import detect_source_format

    if (src_format or detect_source_format(src)) not in ("atp", "atp-shards"):
        return None
    metadata = CarriedMetadata.of_source(src)
    return metadata if metadata else None


def _carry(metadata: CarriedMetadata, writer: Any, dst: str | os.PathLike, first: int,
           count: int) -> None:
    """Hand the source's metadata frames to an `.atp` writer; say so for other formats."""
    carry = getattr(writer, "carry", None)
    if carry is not None:
        carry(metadata, first, count)
        return
    kinds = ", ".join("groups" if k == FRAME_GROUPS else f"kind {k}" for k in metadata.kinds())
    note(f"{metadata.name}: its metadata frames ({kinds}) are not written to {dst}: "
         f"{writer.format_name} has no place for them; convert to an .atp file or .atp "
         f"shard directory to keep them")


def reencode(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dst_format: str,
    write_options: WriteOptions,
    kinds: dict[tuple[str, str], Kind],
) -> int:
    """Write a converted shard directory again with wider types for some keys.

    How :func:`~.merge.merge_parts` gives every part the types a single conversion
    would have chosen: each value is converted up to ``kinds`` (an integer key
    that another part stores as a float, float32 forces next to float64 ones).

    Args:
        src (str or os.PathLike): The part's shard directory.
        dst (str or os.PathLike): A new shard directory.
        dst_format (str): ``"atp-shards"`` or ``"pt-shards"``.
        write_options (WriteOptions): The part's codec, shard size and first shard.
        kinds (dict[tuple[str, str], Kind]): The types to write.

    Returns:
        int: The number of structures written.
    """
    coercer = Coercer(ReadOptions(), src, dst, kinds=kinds)
    return _convert_once(src, dst, None, dst_format, ReadOptions(), write_options, None,
                         coercer)


def shard(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    shard_size: int,
    *,
    overwrite: bool = False,
    progress: ProgressFactory | None = None,
) -> int:
    """Cut any readable dataset (typically `.atp`) into ``.pt`` shards for streaming.

    Args:
        src (str | os.PathLike): The source (an `.atp` file or shard directory, or any other
            format).
        out_dir (str | os.PathLike): The destination directory (``shard_00000.pt``, ... and
            ``manifest.json``).
        shard_size (int): Structures per shard.
        overwrite (bool, optional): Replace an existing ``out_dir`` (default: :obj:`False`).
        progress (ProgressFactory, optional): Factory of a progress bar. (default: :obj:`None`)

    Returns:
        The number of structures written.
    """
    return convert(
        src,
        out_dir,
        dst_format="pt-shards",
        write_options=WriteOptions(shard_size=shard_size, overwrite=overwrite),
        progress=progress,
    )
