"""One stream's retrieval and decoding in a child process, off the consumer's GIL.

A training loop that drives a GPU is a Python thread that holds the GIL nearly all the
time; the prefetch, read-ahead and batching threads of an in-process stream then wait
for it after every ``recv`` and every piece of decoding, and the consumer waits for them
in turn (``benchmarks/stream_overlap.py --consumer gil``: 1.53x sequential at D/C = 1,
where a pass that never waits is 2.16x). Here the whole iteration of one stream
(``ShardStreamDataset``'s own loop: downloads, decoding, sample order, transforms,
batching) runs in a child process forked when iteration starts, and the consumer's
thread only receives finished items:

* **Hand-off.** Each item is packed into one buffer (:mod:`pyg_atompack.pyg.handoff`),
  written into a shared-memory :class:`~pyg_atompack.pyg.arena.Arena` made before the
  fork (small items travel in the pipe), and announced by one short message on a pipe.
  The consumer unpickles the message and rebuilds the item as views of the arena's
  chunks (~0.1 ms for a batch of 32 molecules); the chunks go back to the child when the
  item dies. No thread of the consumer's process takes part: it receives on ``next()``.
* **Chunks of samples.** Unbatched samples go up to ``CHUNK_SAMPLES`` (or
  ``CHUNK_BYTES``) a message, packed as columns (:mod:`~pyg_atompack.stream.samplechunks`):
  one message per sample cost the consumer ~110 µs a sample (a pipe read, an unpickling
  and a rebuild each) and made the default 1.5-1.6x slower than in-process retrieval
  on a fast consumer (``benchmarks/remote_paired.py``). The loop that builds samples
  sends a chunk when it is full; a flusher thread sends the samples it holds as soon as
  that loop has added none for ``FLUSH_IDLE_S`` (it waits for a shard, or for room
  ahead), so a sample ready in the child never waits for later ones.
* **Depth.** The child's prefetcher runs one shard deeper than ``prefetch``: its own
  consumer (the loop that builds items) is done with a shard once the shard's items are
  built, and with one job slot more a shard downloads while the previous one decodes
  (the prefetcher has a thread more than connections). With one connection, downloads
  then follow each other without a gap (``benchmarks/stream_overlap.py --consumer gil``
  at D/C = 1: the consumer no longer waits at every shard's start). The cost: up to
  ``prefetch + 2`` decoded shards in the child (one more than in-process) while the
  consumer is slower than retrieval.
* **Bound.** At most :data:`AHEAD_ITEMS` batches (:data:`AHEAD_SAMPLES` samples) are
  built ahead of the consumer (a semaphore the consumer releases per item handed out),
  on top of the stream's own ``prefetch + 1`` decoded shards in the child.
* **Order and resume.** The child runs the stream of the same (rank, worker) slot, so
  items and their order are those of in-process iteration. Every message carries the
  samples each of its items hands out (and the shards it completes); the consumer's
  process replays them item by item on its own
  :class:`~pyg_atompack.stream.progress.StreamProgress`, so
  ``state_dict()`` describes the items the consumer received, not those built ahead.
* **Tuning.** The child's autotuner (:mod:`~pyg_atompack.stream.autotune`) sets its
  connections from ``D1 / C``. The child builds up to :data:`AHEAD_SAMPLES` samples
  ahead, several shards of small ones, so its own takes would time the building and make
  ``C`` tiny (8-16 connections where one is right): the consumer's process reports each
  shard it starts, and the seconds it waited since the previous one, on a pipe of its
  own, and only those reports time ``C``.
* **Traces.** The consumer's process times consumption and the consumer's steps (the
  wait meter); the child's per-shard download and decoding times arrive with its last
  message and are merged onto the same clock when the iteration ends or is closed.
* **Failure.** An error in the child (a shard that cannot be fetched or decoded) is sent
  and raised in the consumer as it is (it names the shard); a child that dies raises
  :class:`~pyg_atompack.stream.errors.RetrievalProcessError` naming its exit status.
  Closing the iteration (end, ``break``, an exception, the iterator garbage-collected)
  stops the child: a watcher thread in it sends the trace so far and ends the process
  at once, wherever its stream waits (a download in flight included); the consumer waits
  up to :data:`STOP_WAIT_S` for that and kills the child after. The watcher also ends
  the child within :data:`WATCH_S` of its parent's death. Nothing is named in
  ``/dev/shm``: the arena is anonymous memory.

Used where :func:`use_child_process` says so (the ``retrieval`` option of
``ShardStreamDataset``): by default when the stream is iterated in a main process (not
a DataLoader worker, already a process of its own) with ``prefetch >= 1`` on Linux,
whose ``fork`` the hand-off needs. Items then must be picklable, and ``transform`` runs
in the child, on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pyg_atompack.pyg.arena import Arena
from pyg_atompack.pyg.handoff import use_arena
from pyg_atompack.stream.errors import RetrievalProcessError
from pyg_atompack.stream.progress import StreamProgress
from pyg_atompack.stream.samplechunks import CHUNK_SAMPLES, Chunker, unpack_items
from pyg_atompack.stream.trace import StepWaitMeter, TraceRecorder

if TYPE_CHECKING:
    from pyg_atompack.stream.dataset import ShardStreamDataset

#: Values of ``SourceOptions(retrieval=)``.
RETRIEVAL_CHOICES = ("auto", "process", "threads")
#: Batches the child builds ahead of the consumer.
AHEAD_ITEMS = 8
#: Samples it builds ahead when the stream yields samples.
AHEAD_SAMPLES = 128
#: Address space of the child's arena (only the chunks in use become resident).
ARENA_BYTES = 256 << 20
#: A take the consumer's process reports to the child: shard position, seconds waited
#: since the previous take, :func:`time.monotonic` of the take.
_TAKE = struct.Struct("<qdd")
#: Seconds a closing iteration waits for the child to stop before killing it.
STOP_WAIT_S = 2.0
#: How often the child checks that its parent is alive.
WATCH_S = 1.0

_ITEM, _END, _ERROR, _LOG = b"I", b"E", b"X", b"L"


def use_child_process(retrieval: str, prefetch: int, in_worker: bool) -> bool:
    """Whether an iteration runs its retrieval in a child process.

    Args:
        retrieval (str): ``"process"``, ``"threads"`` or ``"auto"`` (a child process where
            one can be forked and there is retrieval to move: ``prefetch >= 1``, not
            inside a DataLoader worker or a daemonic process, Linux).
        prefetch (int): The stream's ``prefetch``.
        in_worker (bool): Whether this process is a DataLoader worker.

    Returns:
        :obj:`True` for a child process.
    """
    if retrieval not in RETRIEVAL_CHOICES:
        raise ValueError(f"retrieval must be one of {RETRIEVAL_CHOICES}, got {retrieval!r}")
    if retrieval == "threads":
        return False
    can_fork = (sys.platform.startswith("linux") and hasattr(os, "fork")
                and not multiprocessing.current_process().daemon)
    if retrieval == "process":
        if not can_fork:
            raise RuntimeError("retrieval='process' needs Linux's fork outside a daemonic "
                               "process (a DataLoader worker is one)")
        return True
    return can_fork and prefetch > 0 and not in_worker


class _LoggedProgress(StreamProgress):
    """The child's progress, also noting each mark for the message of the next item."""

    log: list

    def mark_sample(self, position: int, sample: int) -> None:
        super().mark_sample(position, sample)
        self.log.append((position, sample))

    def mark_complete(self, position: int) -> None:
        super().mark_complete(position)
        self.log.append((position, None))


def _trace_state(dataset: ShardStreamDataset) -> dict | None:
    recorder = dataset._recorder
    if recorder is None:
        return None
    with recorder._lock:
        records = {position: vars(record).copy()
                   for position, record in recorder._records.items()}
    return {"origin": recorder.origin, "wait_s": recorder.wait_s,
            "peak_live_shards": recorder.peak_live_shards, "records": records,
            "autotune": None if recorder.tuner is None else recorder.tuner.report()}


class _Sender:
    """The child's end of the pipe: whole messages, from any of its threads."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.lock = threading.Lock()

    def send(self, kind: bytes, body: bytes) -> None:
        with self.lock:
            self.connection.send_bytes(kind + body)


class _ForwardLogs(logging.Handler):
    """Sends the child's log records to the parent, which hands them to its loggers."""

    def __init__(self, sender: _Sender) -> None:
        super().__init__()
        self.sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None  # arguments may not pickle
            if record.exc_info:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            self.sender.send(_LOG, pickle.dumps(record))
        except Exception:  # noqa: BLE001 - logging must never break the stream
            self.handleError(record)


def _watch(dataset: ShardStreamDataset, sender: _Sender, stop: int, stopping: threading.Event,
           parent: int) -> None:
    # a stop or the parent's death ends the child at once, wherever its stream waits (a
    # download in flight included): the trace so far goes first, then the process. (A
    # pipe, not a multiprocessing.Event: setting one waits for every process that waited
    # on it to wake, and a child that exited mid-wait never does.)
    while not select.select([stop], [], [], WATCH_S)[0]:
        if os.getppid() != parent:
            os._exit(0)
    stopping.set()
    with contextlib.suppress(OSError):
        sender.send(_END, pickle.dumps((False, _trace_state(dataset))))
    os._exit(0)


def _hear_takes(tuner: Any, pace: int) -> None:
    # the consumer's process reports each shard it starts (_TAKE records) until it closes
    # its end; the tuner times consumption from them (StreamTuner.takes_reported_elsewhere)
    with os.fdopen(pace, "rb", buffering=0) as reader:
        while len(raw := reader.read(_TAKE.size)) == _TAKE.size:
            position, wait_s, now = _TAKE.unpack(raw)
            tuner.taken(position, wait_s, now=now, elsewhere=True)


def _child_main(dataset: ShardStreamDataset, connection: Any, ahead: Any,
                stop_pipe: tuple[int, int], pace_pipe: tuple[int, int], arena: Arena,
                parent: int) -> None:
    """The child: iterate the stream here and send every item to the parent."""
    use_arena(arena)  # large buffers go into the shared arena
    sender = _Sender(connection)
    logger = logging.getLogger("pyg_atompack")
    logger.handlers, logger.propagate = [_ForwardLogs(sender)], False  # logged by the parent
    stop, writer = stop_pipe
    os.close(writer)
    pace, pace_writer = pace_pipe
    os.close(pace_writer)
    stopping = threading.Event()
    threading.Thread(target=_watch, args=(dataset, sender, stop, stopping, parent),
                     daemon=True, name="pyg_atompack-stream-watch").start()
    iterator = None
    # the shard being batched here is released once its items are built (the consumer
    # holds packed items, not the shard): one more shard may download while the next
    # one decodes, which one connection needs to keep downloading (see the module doc)
    dataset.prefetch += 1
    dataset.device_feed = None  # the parent moves items to the device (CUDA never forks)
    batches = dataset.batch_size is not None or dataset.max_atoms is not None
    chunker = Chunker(lambda body: sender.send(_ITEM, body),
                      1 if batches else CHUNK_SAMPLES, arena)
    try:
        iterator = dataset._iterate_here()
        tuner = dataset._recorder.tuner
        if tuner is not None:  # built above; nothing is taken before the first next()
            tuner.takes_reported_elsewhere()
            threading.Thread(target=_hear_takes, args=(tuner, pace), daemon=True,
                             name="pyg_atompack-stream-pace").start()
        progress = dataset._progress
        progress.__class__ = _LoggedProgress  # same fields; marks are now noted too
        progress.log = []
        for item in iterator:
            while not ahead.acquire(timeout=0.25):  # the consumer is far enough behind
                if stopping.is_set():
                    break
                if os.getppid() != parent:  # orphaned: nobody will read
                    return
            if stopping.is_set():
                break
            marks, progress.log = progress.log, []
            chunker.add(marks, item)
            del item
        else:
            iterator = None  # ran to its end (its finally has run)
        if stopping.is_set():
            return
        chunker.close()
    except BaseException as error:  # noqa: BLE001 - every failure goes to the consumer
        if stopping.is_set():
            return
        with contextlib.suppress(BaseException):  # what failed may be the sending itself
            chunker.close()  # the items built before the failure come first
        with contextlib.suppress(OSError):
            sender.send(_ERROR, _pickled_error(error))
        return
    finally:
        if iterator is not None:
            iterator.close()  # stops downloads; the stream's own finally runs here
    with contextlib.suppress(OSError):  # unless the parent stopped listening
        sender.send(_END, pickle.dumps((dataset._progress.finished, _trace_state(dataset))))


def _pickled_error(error: BaseException) -> bytes:
    detail = "".join(traceback.format_exception(error))
    try:
        raw = pickle.dumps(error)
        pickle.loads(raw)  # an exception that cannot be rebuilt goes as text
        return pickle.dumps((raw, detail))
    except Exception:  # noqa: BLE001
        return pickle.dumps((None, detail))


def _log(body: memoryview) -> None:
    record = pickle.loads(body)
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


class ChildStream:
    """The consumer's end of one iteration whose retrieval runs in a child process.

    Args:
        dataset (ShardStreamDataset): The stream; its state at this moment (epoch,
            resume state) is what the child iterates.
    """

    def __init__(self, dataset: ShardStreamDataset) -> None:
        context = multiprocessing.get_context("fork")
        self.name = repr(dataset)
        self.arena = Arena(ARENA_BYTES)
        self._receive, send = context.Pipe(duplex=False)
        # batches are bounded by bytes, samples (much smaller) by the consumer's pace
        batches = dataset.batch_size is not None or dataset.max_atoms is not None
        self._ahead = context.Semaphore(AHEAD_ITEMS if batches else AHEAD_SAMPLES)
        self._stop = os.pipe()  # the parent writes a byte to stop the child
        pace = os.pipe()  # the parent reports the consumer's takes (_TAKE) to the child
        self.process = context.Process(
            target=_child_main, name="pyg_atompack-stream",
            args=(dataset, send, self._ahead, self._stop, pace, self.arena, os.getpid()),
            daemon=True)
        self.process.start()
        send.close()  # the child holds the only writer: its death reads as end of file
        os.close(self._stop[0])
        os.close(pace[0])
        self._pace = pace[1]
        os.set_blocking(self._pace, False)  # the consumer never waits on a report
        self.finished = False
        self.trace: dict | None = None
        self._closed = False

    def receive(self) -> tuple[list[list], list] | None:
        """The next chunk of items and the progress marks of each; :obj:`None` at the end."""
        while True:
            try:
                raw = self._receive.recv_bytes()
            except (EOFError, OSError):
                self.process.join(STOP_WAIT_S)
                raise RetrievalProcessError(
                    f"the retrieval process (pid {self.process.pid}) of {self.name} "
                    f"{_describe_exit(self.process.exitcode)} before the stream ended"
                ) from None
            kind, body = raw[:1], memoryview(raw)[1:]
            if kind == _ITEM:
                marks, columnar, packed = pickle.loads(body)
                return marks, unpack_items(columnar, packed)
            if kind == _LOG:
                _log(body)
                continue
            if kind == _END:
                self.finished, self.trace = pickle.loads(body)
                return None
            raw_error, detail = pickle.loads(body)
            if raw_error is None:
                raise RetrievalProcessError(
                    f"the retrieval process of {self.name} failed:\n{detail}")
            error = pickle.loads(raw_error)
            error.add_note(f"(raised in the retrieval process of {self.name})")
            raise error

    def handed_out(self) -> None:
        """One item left for the consumer: the child may build one more."""
        self._ahead.release()

    def took(self, position: int, wait_s: float) -> None:
        """The consumer started shard ``position`` after waiting ``wait_s`` seconds in
        all since it started the previous one: the child's tuner times consumption."""
        # CLOCK_MONOTONIC is one clock for every process of the machine
        with contextlib.suppress(OSError):  # a full pipe or a child gone: no report
            os.write(self._pace, _TAKE.pack(position, wait_s, time.monotonic()))

    def close(self) -> None:
        """Stop the child (if still running), collect its trace, release the pipe."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            os.write(self._stop[1], b"x")
        os.close(self._stop[1])
        os.close(self._pace)
        self._ahead.release()  # wake it if it waits for room
        deadline = time.monotonic() + STOP_WAIT_S
        try:
            while self.trace is None and time.monotonic() < deadline:
                if not self._receive.poll(max(0.0, deadline - time.monotonic())):
                    break
                raw = self._receive.recv_bytes()  # items built ahead are dropped unread
                if raw[:1] == _END:
                    self.finished, self.trace = pickle.loads(memoryview(raw)[1:])
                elif raw[:1] == _LOG:
                    _log(memoryview(raw)[1:])
        except (EOFError, OSError):
            pass
        self.process.join(max(0.0, deadline - time.monotonic()))
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._receive.close()


class _TunerReport:
    """The child's autotuner report, standing in for the tuner in this process's trace."""

    def __init__(self, report: dict) -> None:
        self._report = report

    def report(self) -> dict:
        return self._report


def _merge_child_trace(recorder: TraceRecorder, trace: dict | None) -> None:
    # the child's downloads and decoding, onto the consumer's clock (both monotonic)
    if trace is None:
        return
    shift = trace["origin"] - recorder.origin
    for position, fields in trace["records"].items():
        record = recorder.record(position, fields["shard_index"], fields["identifier"])
        record.identifier = fields["identifier"]
        for key in ("download_start_s", "download_finish_s", "deserialize_finish_s"):
            if fields[key] is not None:
                setattr(record, key, fields[key] + shift)
        record.bytes, record.structures = fields["bytes"], fields["structures"]
        record.status = fields["status"]
    if trace.get("autotune") is not None:  # what the child's tuner chose, for stats()
        recorder.tuner = _TunerReport(trace["autotune"])
    recorder.wait_s = trace["wait_s"]
    recorder.peak_live_shards = trace["peak_live_shards"]


def iterate_in_child(dataset: ShardStreamDataset) -> Iterator[Any]:
    """Iterate ``dataset`` with its retrieval in a child process (see the module doc).

    Args:
        dataset (ShardStreamDataset): The stream.

    Returns:
        An iterator over the same items, in the same order, as in-process iteration.
    """
    slot = dataset.slot()
    # the child is forked before the resume state is taken here: both start from it
    channel = ChildStream(dataset)
    try:
        plan = dataset.plan(slot)
        progress = dataset._start_progress(slot, plan)
    except BaseException:
        channel.close()
        raise
    recorder = TraceRecorder(slot.rank, slot.worker)
    recorder.meter = StepWaitMeter("auto")
    dataset._recorder, dataset._progress = recorder, progress
    items = _consume(dataset, channel, progress, recorder)
    weakref.finalize(items, channel.close)
    if dataset.device_feed is not None:  # items go to the device here, never in the child
        return dataset.device_feed.wrap(items, snapshot=dataset._state)
    return items


def _consume(dataset: ShardStreamDataset, channel: ChildStream, progress: StreamProgress,
             recorder: TraceRecorder) -> Iterator[Any]:
    meter = recorder.meter
    plan = dataset.plan(progress.slot)
    started: set[int] = set()
    waited = 0.0  # seconds spent waiting for items since the latest shard started
    try:
        if meter is not None:
            meter.asked()
        while True:
            asked = time.monotonic()
            received = channel.receive()
            waited += time.monotonic() - asked
            if received is None:
                break
            chunk_marks, items = received
            del received
            items.reverse()  # handed out from the end: each leaves the list as it goes
            for marks in chunk_marks:
                item = items.pop()
                finishing = []
                for position, sample in marks:
                    if sample is None:
                        progress.mark_complete(position)
                        finishing.append(position)
                        continue
                    if position not in started:  # its first sample: consuming it starts
                        started.add(position)
                        channel.took(position, waited)
                        waited = 0.0
                        recorder.consumption_started(position, plan.shards[position])
                    progress.mark_sample(position, sample)
                last = marks[-1][0] if marks else None
                del marks
                channel.handed_out()
                if meter is not None:
                    meter.received(last)
                yield item
                del item
                if meter is not None:
                    meter.asked()
                if finishing:
                    now = recorder.now()
                    for position in finishing:
                        recorder.record(position, plan.shards[position], "").consume_finish_s = now
        progress.finished = channel.finished
    finally:
        channel.close()
        _merge_child_trace(recorder, channel.trace)
        recorder.cut_short()  # shards cut short by a break or error
