"""Parallel and partitioned reading: a source's structures, in order, from N processes.

A layer around the per-structure pipeline, not a second pipeline: the source is
cut into ranges of structure indices, worker processes run the ordinary reader
(key mapping, units) over their ranges, and the main process receives the
structures range by range *in source order* and hands them to the ordinary
writer. The output is therefore the one a single process writes (same records,
same order, same shard boundaries; byte-identical for codec none).

* **Ranges.** An extended-XYZ file is indexed once (the byte offset of every
  frame, found by the same frame walk ASE does before it parses anything), so a
  worker reads and parses only its own frames. Any other source is read by each
  worker from the start, skipping the structures of other ranges: correct for
  every format, but only faster where reading is cheap next to the rest of the
  work (an ``.atp`` source).
* **Workers.** Ranges are dealt round-robin; each worker hands its parsed ranges
  back through its own bounded queue (a few ranges ahead), so memory stays
  bounded and the main process can take the ranges in order. The standard
  library's ``multiprocessing`` does the plumbing; a process pool's unordered
  ``imap`` would need the same reordering buffer and could not bound it.
* **Failures.** A worker that meets a bad structure sends the
  :class:`~pyg_atompack.convert.ConvertError` (file and structure index of the
  source) and stops; the main process stops every worker and raises it, so the
  writer is aborted and nothing is left behind. Ctrl-C stops all of them alike,
  also one that comes while the workers start; a worker whose main process was
  killed outright notices that its parent has changed and leaves.
* **Parts.** :func:`plan_part` cuts a source into ``N`` parts at shard
  boundaries; part ``I`` numbers its shards from its first global shard, so the
  parts of a job array never collide and :func:`~.merge.merge_parts` can lay
  them side by side under one manifest.
"""

from __future__ import annotations

import array
import io
import itertools
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .ase_io import AseReader
from .errors import ConvertError
from .options import ReadOptions
from .registry import detect_source_format, open_reader
from .structure import Structure

#: Ranges each worker may have parsed ahead of the writer.
RANGES_AHEAD = 4
#: Structures per range when the source is split between workers.
RANGE_SIZE = 256
#: How often a waiting main process checks that its workers are alive (seconds).
POLL_S = 0.5
_EXTXYZ_SUFFIXES = (".xyz", ".extxyz")


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` of a partitioned conversion (``--part I/N``).

    Args:
        index (int): The part, ``0 <= index < count``.
        count (int): The number of parts.
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"part {self.index}/{self.count}: need 0 <= I < N")

    @classmethod
    def parse(cls, text: str) -> Part:
        """Parse ``"I/N"``.

        Args:
            text (str): The part, e.g. ``"0/3"``.

        Returns:
            Part: The parsed part.

        Raises:
            ValueError: If the text is not ``I/N`` with ``0 <= I < N``.
        """
        index, sep, count = text.partition("/")
        try:
            if not sep:
                raise ValueError
            return cls(int(index), int(count))
        except ValueError:
            raise ValueError(f"--part {text!r}: expected I/N with 0 <= I < N, e.g. 0/4") from None


def plan_part(total: int, part: Part, shard_size: int) -> tuple[int, int, int]:
    """The structures and the first shard number of one part.

    The ``ceil(total / shard_size)`` shards of a whole conversion are split into
    ``part.count`` contiguous runs as evenly as possible; a part holds whole
    shards only, so the parts' shards are exactly the whole conversion's.

    Args:
        total (int): Structures in the source.
        part (Part): The part.
        shard_size (int): Structures per shard.

    Returns:
        tuple[int, int, int]: ``(start, stop, first_shard)``: the part converts
        structures ``start:stop`` into shards numbered from ``first_shard``.
    """
    shards = -(-total // shard_size)
    first = part.index * shards // part.count
    last = (part.index + 1) * shards // part.count
    return first * shard_size, min(last * shard_size, total), first


# ----------------------------------------------------------------------------- ranges


class _ChunkAseReader(AseReader):
    """The ordinary ASE reader over a slice of an extxyz file's text."""

    def __init__(self, path: Path, options: ReadOptions, text: str, start: int) -> None:
        super().__init__(path, options, format="extxyz")
        self._text = text
        self._start = start

    def _iter_raw(self) -> Iterator[Structure]:
        import ase.io

        frames = ase.io.iread(io.StringIO(self._text), index=":", format="extxyz")
        # indices in errors are the structure's position in the whole file
        index = self._start
        while True:
            try:
                atoms = next(frames)
            except StopIteration:
                return
            except Exception as exc:  # ASE raises many kinds for unparsable frames
                raise self.error(f"ASE cannot read it: {exc}", index) from exc
            yield self.structure_from_atoms(atoms, index)
            index += 1


class SourceRanges:
    """Reads given ranges of a source's structures (picklable, for worker processes).

    Args:
        path (Path): The source.
        format (str): Its registry format name.
        options (ReadOptions): Key mapping and units.
        total (int): Number of structures.
    """

    def __init__(self, path: Path, format: str, options: ReadOptions, total: int) -> None:
        self.path, self.format, self.options, self.total = path, format, options, total

    def read(self, ranges: Sequence[tuple[int, int]]) -> Iterator[list[Structure]]:
        """The structures of each range in turn (ranges in increasing order).

        Args:
            ranges (Sequence[tuple[int, int]]): ``(start, stop)`` index ranges, increasing and
                disjoint.

        Yields:
            list[Structure]: One list per range.
        """
        with open_reader(self.path, self.format, self.options) as reader:
            structures = iter(reader)
            position = 0
            for start, stop in ranges:
                # skip the structures of other ranges (they are read, not kept)
                next(itertools.islice(structures, start - position, start - position), None)
                yield list(itertools.islice(structures, stop - start))
                position = stop


class ExtxyzRanges(SourceRanges):
    """Ranges of an extended-XYZ file, each read and parsed on its own.

    Args:
        path (Path): The source.
        format (str): Its registry format name.
        options (ReadOptions): Key mapping and units.
        offsets (np.ndarray): Byte offset of every frame, plus the end of the last one.
    """

    def __init__(self, path: Path, format: str, options: ReadOptions,
                 offsets: np.ndarray) -> None:
        super().__init__(path, format, options, len(offsets) - 1)
        self.offsets = offsets

    def read(self, ranges: Sequence[tuple[int, int]]) -> Iterator[list[Structure]]:
        with open(self.path, "rb") as handle:
            for start, stop in ranges:
                handle.seek(int(self.offsets[start]))
                data = handle.read(int(self.offsets[stop] - self.offsets[start]))
                text = data.decode("utf-8", errors="replace")
                yield list(_ChunkAseReader(self.path, self.options, text, start))


def index_extxyz(path: str | os.PathLike) -> np.ndarray | None:
    """Byte offsets of the frames of an (extended) XYZ file.

    Walks the frames the way ASE's extxyz reader does before parsing (a count
    line, a comment line, that many atom lines, up to three ``VEC`` lines; a
    blank line ends the file), without parsing them.

    Args:
        path (str | os.PathLike): The file.

    Returns:
        np.ndarray or None: int64 offsets of every frame followed by the end of the
        last one; :obj:`None` when a count line is not a number (ASE then reports
        the problem when it reads the file).
    """
    offsets = array.array("q", [0])  # 8 bytes a frame, not a Python int each
    with open(path, "rb") as handle:
        readline = handle.readline
        while True:
            line = readline()
            if not line.strip():
                break
            try:
                natoms = int(line)
            except ValueError:
                return None
            readline()
            for _ in range(natoms):
                readline()
            end = handle.tell()
            for _ in range(3):
                if not readline().lstrip().startswith(b"VEC"):
                    break
                end = handle.tell()
            handle.seek(end)
            offsets.append(end)
    return np.frombuffer(offsets, dtype=np.int64)


def source_ranges(path: str | os.PathLike, format: str | None,
                  options: ReadOptions | None) -> SourceRanges:
    """Index a source so that ranges of it can be read on their own.

    Args:
        path (str | os.PathLike): The source.
        format (str | None): Its registry format; :obj:`None` detects it.
        options (ReadOptions | None): Key mapping and units.

    Returns:
        SourceRanges: The source's ranges (an :class:`ExtxyzRanges` for extxyz files).
    """
    path = Path(path)
    options = options if options is not None else ReadOptions()
    format = format or detect_source_format(path)
    if format in ("ase", "extxyz") and path.suffix.lower() in _EXTXYZ_SUFFIXES:
        offsets = index_extxyz(path)
        if offsets is not None:
            return ExtxyzRanges(path, format, options, offsets)
    with open_reader(path, format, options) as reader:
        total = reader.length
        if total is None:  # formats that cannot tell their length: count once
            total = sum(1 for _ in reader)
    return SourceRanges(path, format, options, total)


# ----------------------------------------------------------------------------- workers


def _worker(ranges: SourceRanges, mine: list[tuple[int, int]], out: Any, parent: int) -> None:
    # Ctrl-C is the main process's to handle (it terminates the workers); a worker
    # starts with SIGINT blocked (see OrderedStructures) and ignores it from here on
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        for structures in ranges.read(mine):
            if not _put(out, ("ok", structures), parent):
                return
    except KeyboardInterrupt:
        return  # the main process was interrupted too and stops everything
    except ConvertError as exc:
        _put(out, ("convert_error", (exc.path, exc.problem, exc.index)), parent)
    except BaseException:
        _put(out, ("error", traceback.format_exc()), parent)


def _put(out: Any, message: tuple[str, Any], parent: int) -> bool:
    """Hand ``message`` to the main process; :obj:`False` once it is gone.

    A main process killed outright (``SIGKILL``, the out-of-memory killer, a
    scheduler's time limit) cannot stop its workers, and a worker waiting on a
    full queue would wait for ever, holding the terminal's or the job's output
    open. It therefore looks up its parent between waits and leaves when the
    parent has changed.
    """
    while True:
        try:
            out.put(message, timeout=POLL_S)
            return True
        except queue.Full:
            if os.getppid() != parent:
                out.cancel_join_thread()  # nobody reads: exit without flushing
                return False


class OrderedStructures:
    """A source's structures ``start:stop``, read by ``workers`` processes, in order.

    Iterate it once inside a ``with`` block (leaving the block stops the workers).

    Args:
        ranges (SourceRanges): The indexed source.
        start (int, optional): First structure. (default: :obj:`0`)
        stop (int, optional): End of the structures; :obj:`None` for all. (default: :obj:`None`)
        workers (int, optional): Reading processes; ``1`` reads in this process. (default: :obj:`1`)
        range_size (int, optional): Structures per range dealt to a worker.
            (default: :data:`RANGE_SIZE`)
    """

    def __init__(self, ranges: SourceRanges, start: int = 0, stop: int | None = None,
                 workers: int = 1, range_size: int = RANGE_SIZE) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        stop = ranges.total if stop is None else stop
        self.ranges = ranges
        self.length = stop - start
        self.first_index = start
        self.workers = workers
        self._spans = [(lo, min(lo + range_size, stop)) for lo in range(start, stop, range_size)]
        self._processes: list[Any] = []

    def __iter__(self) -> Iterator[Structure]:
        if self.workers == 1 or len(self._spans) <= 1:
            for structures in self.ranges.read(self._spans):
                yield from structures
            return
        context = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        count = min(self.workers, len(self._spans))
        queues = [context.Queue(maxsize=RANGES_AHEAD) for _ in range(count)]
        self._processes = [
            context.Process(target=_worker,
                            args=(self.ranges, self._spans[w::count], queues[w], os.getpid()),
                            name=f"pyg-atompack-convert-{w}", daemon=True)
            for w in range(count)
        ]
        # A Ctrl-C while the workers start must not leave one behind. The signal
        # is blocked in this thread, but another thread of the process (a
        # progress bar's monitor) may take it, and then Python runs the handler in
        # this thread anyway, at the first instruction after fork(): a
        # KeyboardInterrupt there leaves a started worker that Process never
        # recorded, which nobody stops. So the handler only remembers an
        # interrupt while workers start, and it is raised once all are recorded.
        self._catch_interrupts()
        masking = hasattr(signal, "pthread_sigmask")
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if masking else None
        self._starting = True
        try:
            for process in self._processes:
                process.start()
        finally:
            self._starting = False
            if masking:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        self._check_interrupted()
        for number in range(len(self._spans)):
            worker = number % count
            structures = self._receive(queues[worker], worker)
            self._check_interrupted()
            yield from structures

    def _catch_interrupts(self) -> None:
        # Remember every Ctrl-C: one that lands while Python runs an at-fork hook
        # raises KeyboardInterrupt inside the hook, which swallows it; one that
        # lands while workers start is held back (see __iter__)
        self._interrupted = False
        self._starting = False
        self._previous_handler = None
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            def on_interrupt(signum: int, frame: Any) -> None:
                self._interrupted = True
                if not self._starting:
                    raise KeyboardInterrupt

            self._previous_handler = signal.signal(signal.SIGINT, on_interrupt)

    def _check_interrupted(self) -> None:
        if getattr(self, "_interrupted", False):
            raise KeyboardInterrupt

    def _receive(self, source: Any, worker: int) -> list[Structure]:
        process = self._processes[worker]
        while True:
            self._check_interrupted()
            try:
                kind, payload = source.get(timeout=POLL_S)
                break
            except queue.Empty:
                if process.exitcode is not None and source.empty():
                    raise RuntimeError(
                        f"conversion worker {worker} of {self.ranges.path} ended with exit "
                        f"code {process.exitcode} before sending its structures") from None
        if kind == "ok":
            return payload
        if kind == "convert_error":
            raise ConvertError(*payload)
        raise RuntimeError(f"conversion worker {worker} of {self.ranges.path} failed:\n{payload}")

    def close(self) -> None:
        """Stop the workers (they hold no output: nothing is left to clean up)."""
        if getattr(self, "_previous_handler", None) is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        for process in self._processes:
            if process.pid is not None:  # an interrupt may come before all have started
                process.join()
        self._processes = []

    def __enter__(self) -> OrderedStructures:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- entry points


def open_structures(src: str | os.PathLike, src_format: str | None = None,
                    read_options: ReadOptions | None = None, *, workers: int = 1,
                    part: Part | None = None, shard_size: int = 1000) -> Any:
    """Open a source's structures for a conversion, in order.

    Args:
        src (str | os.PathLike): The source.
        src_format (str, optional): Its registry format; :obj:`None` detects it.
            (default: :obj:`None`)
        read_options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)
        workers (int, optional): Reading processes. (default: :obj:`1`)
        part (Part, optional): Only this part of the source (see :func:`plan_part`).
            (default: :obj:`None`)
        shard_size (int, optional): Structures per shard of the destination, which parts are cut at.
            (default: :obj:`1000`)

    Returns:
        A context manager, iterable once, with ``length``: the plain reader for one
        process and the whole source, else an :class:`OrderedStructures` with
        ``part_info`` (the manifest's ``"part"`` entry, or :obj:`None`).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers == 1 and part is None:
        return open_reader(src, src_format, read_options)
    ranges = source_ranges(src, src_format, read_options)
    start, stop, info = 0, ranges.total, None
    if part is not None:
        start, stop, first = plan_part(ranges.total, part, shard_size)
        info = {"index": part.index, "count": part.count, "first_shard": first,
                "shard_size": shard_size, "source_records": ranges.total}
    structures = OrderedStructures(ranges, start, stop, workers)
    structures.part_info = info
    return structures


def part_write_options(structures: Any, dst: str | os.PathLike, dst_format: str | None,
                       options: Any) -> Any:
    """The write options of one part: global shard numbers and the manifest's part entry.

    Args:
        structures (Any): What :func:`open_structures` returned for the part.
        dst (str | os.PathLike): The part's destination directory.
        dst_format (str | None): Its format; :obj:`None` picks it from the path and shard size.
        options (Any): The conversion's write options.

    Returns:
        WriteOptions: ``options`` with ``first_shard`` and ``part`` set.

    Raises:
        ConvertError: If the destination is not a shard directory.
    """
    import dataclasses

    from .registry import detect_destination_format

    fmt = dst_format or detect_destination_format(dst, options.shard_size)
    if fmt not in ("atp-shards", "pt-shards"):
        raise ConvertError(dst, "a part (--part) is written as a shard directory: give "
                                "--shard-size, or --to atp-shards / pt-shards")
    info = structures.part_info
    return dataclasses.replace(options, shard_size=info["shard_size"],
                               first_shard=info["first_shard"], part=info)
