"""Shard sources: where shard bytes come from.

A *source* lists its shards once and fetches one shard's bytes on demand. Anything that
implements the small :class:`Source` protocol can feed a
:class:`~pyg_atompack.stream.ShardStreamDataset`; the library ships one,
:class:`RemoteSource`, over the backend a URL's scheme names
(:mod:`pyg_atompack.remote.backends`: ``http(s)://``, ``hf://``, object stores, local
paths, schemes other packages register), and :class:`LocalSource`, its local files read
whole.

Writing your own source, e.g. for shards stored inside one zip archive::

    import zipfile
    from pyg_atompack.remote import RemoteFile
    from pyg_atompack.stream import ShardBuffer, ShardInfo

    class ZipSource:
        def __init__(self, archive: str):
            self.archive = archive  # only the path: workers open the archive themselves
            with zipfile.ZipFile(archive) as zf:
                self._shards = [ShardInfo(RemoteFile(i.filename, size=i.file_size))
                                for i in sorted(zf.infolist(), key=lambda i: i.filename)
                                if i.filename.endswith((".pt", ".atp"))]

        def list_shards(self):
            return self._shards

        def fetch(self, shard, cancel):
            buffer = ShardBuffer(shard.name)
            buffer.restart(shard.size)  # an anonymous memory map of exactly that size
            with zipfile.ZipFile(self.archive) as zf, zf.open(shard.name) as handle:
                while chunk := handle.read(1 << 20):
                    cancel.raise_if_cancelled()   # lets closing the iterator stop the read
                    buffer.append(chunk)
            return buffer.take()

Keep no open client, socket or file in a source across ``fork``: DataLoader workers
inherit it (the object stores' backend makes its client lazily in each process for that
reason).

Returning the bytes in a :class:`~pyg_atompack.stream.ShardBuffer` (a memory map, or a
:class:`bytearray`) lets the dataset decode ``.pt`` lists of ``Data`` and ``.atp`` shards
in place, and the memory goes back to the operating system as soon as the shard is
dropped; plain ``bytes`` work too, at the cost of one copy.

A source that can also read byte ranges into a buffer, ``read_into(shard, buffer,
start, end, cancel, progress, pin=None)`` (``progress(offset)`` called as bytes ``[start,
offset)`` land; ``pin``, a :class:`~pyg_atompack.transport.transfers.VersionPin` shared by the
ranges of one download, refuses a range from another version of the file), lets
the dataset hand out a ``.pt`` shard's samples as its bytes arrive
(:mod:`pyg_atompack.stream.arriving`); the shipped remote sources do.

``list_shards`` is called once, in the process that builds the dataset; its result is
pickled into DataLoader workers, so remote listings are never repeated per worker or rank.

A source may carry its :class:`~pyg_atompack.stream.SourceOptions` as an ``options``
attribute (the shipped ones do when given ``options=``); the dataset then uses those and
refuses options of its own. A source without it takes the dataset's ``options=``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pyg_atompack.remote import manifest
from pyg_atompack.remote.files import SHARD_SUFFIXES, RemoteFile
from pyg_atompack.stream.errors import ShardFetchError, ShardIntegrityError, StreamCancelled
from pyg_atompack.transport.buffers import WritableBuffer, allocate
from pyg_atompack.transport.errors import (
    RemoteIntegrityError,
    RemoteTooLargeError,
    TransportError,
)
from pyg_atompack.transport.http import Cancel
from pyg_atompack.transport.retry import RetryPolicy

if TYPE_CHECKING:  # options.py imports this module
    from pyg_atompack.stream.options import SourceOptions

MANIFEST_NAME = manifest.MANIFEST_NAME


@dataclass(frozen=True)
class ShardInfo:
    """What a source knows about one shard before fetching it: the listed file, and
    what only a stream needs.

    Attributes:
        file: The listed :class:`~pyg_atompack.remote.RemoteFile` (name, size, sha256,
            version, URL); its name identifies the shard in traces and messages. A
            size of ``None`` is unknown; without a sha256 only the size is verified.
        records: Number of samples in the shard, or ``None`` when unknown. Known counts
            let the dataset give every DDP rank exactly the same number of samples.
        name: How traces and messages name the shard: relative to what the source
            listed (default: the file's name).
    """

    file: RemoteFile
    records: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:  # a frozen dataclass: the default is set once, here
            object.__setattr__(self, "name", self.file.name)

    @property
    def size(self) -> int | None:
        """The listed size in bytes, or ``None``."""
        return self.file.size

    @property
    def sha256(self) -> str | None:
        """The listed sha256, or ``None``."""
        return self.file.sha256


class CancelToken(Cancel):
    """A thread-safe cancellation flag that can also interrupt blocking I/O.

    The implementation of :class:`~pyg_atompack.transport.http.Cancel`, the one
    cancellation type the transport and the remote layer accept. Background fetches
    check it between chunks; blocking calls (a socket ``recv``) register a callback with
    :meth:`on_cancel` that unblocks them, e.g. by shutting the socket down, so closing an
    iterator never waits for a download to finish.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next_id = 0

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._event.is_set()

    def cancel(self) -> None:
        """Set the flag and run every registered callback once."""
        with self._lock:
            self._event.set()
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            # the socket may already be closed; cancelling must never fail
            with contextlib.suppress(OSError):
                callback()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Register ``callback`` to run on cancellation (at once if already cancelled).

        Args:
            callback (Callable[[], None]): Function without arguments.

        Returns:
            A function that unregisters the callback.
        """
        with self._lock:
            if not self._event.is_set():
                key = self._next_id
                self._next_id += 1
                self._callbacks[key] = callback
                return lambda: self._callbacks.pop(key, None)
        callback()
        return lambda: None

    def raise_if_cancelled(self) -> None:
        """Raise :class:`StreamCancelled` when cancelled."""
        if self._event.is_set():
            raise StreamCancelled("iteration was closed")

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking (and raising) as soon as cancellation happens.

        Sources use it for retry backoff, so that closing an iteration never waits for a
        backoff to run out.

        Args:
            seconds (float): How long to wait; negative values are treated as zero.

        Raises:
            StreamCancelled: The token was (or becomes) cancelled during the wait.
        """
        if self._event.wait(max(0.0, seconds)):
            raise StreamCancelled("iteration was closed")


@runtime_checkable
class Source(Protocol):
    """The protocol every shard source implements.

    ``list_shards()`` returns the shards in their canonical order (the dataset shuffles
    a copy). It is called once per dataset; cache the answer if listing costs a request.
    ``fetch(shard, cancel)`` returns the complete bytes of one shard. It runs on a
    background thread, should check ``cancel`` regularly (or register an interrupt with
    ``cancel.on_cancel``), and raises :class:`~pyg_atompack.stream.ShardFetchError` on
    permanent failure. Verification against ``size`` / ``sha256`` is done by the dataset.
    """

    def list_shards(self) -> Sequence[ShardInfo]:
        """Return every shard once, in canonical order."""
        ...

    def fetch(self, shard: ShardInfo, cancel: CancelToken) -> bytes | WritableBuffer:
        """Return the complete bytes of ``shard``.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Cancellation of the iteration that asked for the shard; check it
                between chunks, or register an interrupt with :meth:`CancelToken.on_cancel`.

        Returns:
            The shard's bytes. A writable buffer (what :meth:`ShardBuffer.take
            <pyg_atompack.stream.ShardBuffer.take>` returns: an anonymous memory map or a
            :class:`bytearray`) is decoded in place and handed over: do not modify it
            afterwards. Plain ``bytes`` cost one copy.

        Raises:
            ShardFetchError: The shard cannot be retrieved (after any retries).
            StreamCancelled: ``cancel`` was cancelled during the transfer.
        """
        ...


def shard_error(name: str, error: TransportError) -> ShardFetchError:
    """The streaming error for a failed transfer of shard ``name``.

    Args:
        name (str): The shard.
        error (TransportError): What the backend raised (its message names the redacted URL).

    Returns:
        A :class:`ShardFetchError` with the error's ``url`` and ``status`` (a
        :class:`ShardIntegrityError` for bytes that do not match the listing).
    """
    if isinstance(error, ShardFetchError):
        return error
    kind = ShardIntegrityError if isinstance(error, RemoteIntegrityError) else ShardFetchError
    return kind(f"shard {name}: {error}", url=error.url, status=error.status)


class RemoteSource:
    """The shards a URL names, listed once by its backend (the one source over every
    backend of :mod:`pyg_atompack.remote.backends`).

    Args:
        url (str | Sequence[str] | Backend): ``http(s)://.../manifest.json``, a directory URL
            ending in ``/`` (its ``manifest.json``), one ``.pt`` / ``.atp`` file URL or a list
            of them; ``hf://datasets/{repo}[@{revision}]/{path}`` (a directory or one file);
            an object-store URL (``s3://bucket/prefix/``, ``gs://``, ``az://``, or a
            ``manifest.json`` there); a scheme another package registered; or a backend
            already opened.
        suffixes (tuple[str, ...], optional): Keep only files ending in one of these.
            (default: :obj:`(".pt", ".atp")`)
        options (SourceOptions, optional): How a stream fetches, checks and decodes these
            shards; its ``retries`` replaces those of the backend's retry policy here.
            A :class:`~pyg_atompack.stream.ShardStreamDataset` over this source uses
            them and refuses options of its own. (default: :obj:`None`, the dataset's)
        **storage_options (optional): The backend's options: ``retry`` (a
            :class:`~pyg_atompack.transport.RetryPolicy`) for all; ``headers`` for
            http(s) (credentials bound to the origins of ``url``, never sent to another
            host a manifest names); ``token``, ``endpoint``, ``pattern`` for ``hf://``;
            ``anon``, ``profile``, ``endpoint_url`` and fsspec options (secrets never
            pickled) for object stores.

    Sizes, sha256 and record counts come from the one listing (a manifest, the Hub's tree
    at a pinned commit, a bucket listing); files listed without a size are asked for it
    once, here, so every transfer is bounded by it and big ``.atp`` files can be read by
    record blocks. Every read goes through the backend: retried, resumed, pinned to the
    listed version, and failures are :class:`ShardFetchError` naming the shard. The
    listing is pickled into DataLoader workers; clients are made in each process.
    """

    def __init__(self, url: str | Sequence[str] | Any, *,
                 suffixes: tuple[str, ...] = SHARD_SUFFIXES,
                 options: SourceOptions | None = None, **storage_options: Any) -> None:
        from pyg_atompack.remote.backends import backend_class, open_backend
        from pyg_atompack.stream.options import SourceOptions

        if options is not None and not isinstance(options, SourceOptions):
            raise TypeError(f"options must be a SourceOptions, got {type(options).__name__}")
        self.options = options
        if isinstance(url, (list, tuple)):
            if not url:
                raise ShardFetchError("RemoteSource needs at least one URL")
            self.backend = backend_class(url[0])(list(url), **storage_options)
        elif isinstance(url, (str, os.PathLike)):
            self.backend = open_backend(url, **storage_options)
        else:
            self.backend = url
        if (options is not None and options.retries is not None
                and isinstance(getattr(self.backend, "retry", None), RetryPolicy)):
            self.backend = self.backend.with_retry(
                dataclasses.replace(self.backend.retry, retries=options.retries))
        # a failed listing raises the backend's error (the transport family; the Hub's
        # for hf://): it names the URL, and no shard yet
        files = self.backend.list(suffixes)
        relative = getattr(self.backend, "relative", lambda file: file.name)
        self._shards = tuple(
            ShardInfo(file, self.backend.manifest.get(relative(file), {}).get("records"),
                      name=relative(file)) for file in files)
        self._readers: dict[str, Any] = {}

    @property
    def retry(self) -> Any:
        """The retry policy of every request (``SourceOptions(retries=)`` sets its retries)."""
        return self.backend.retry

    @retry.setter
    def retry(self, policy: Any) -> None:
        # a backend of its own, so a shallow copy of this source never changes the original
        self.backend, self._readers = self.backend.with_retry(policy), {}

    def list_shards(self) -> Sequence[ShardInfo]:
        """Return the shards, in the order they were listed at construction."""
        return self._shards

    def fetch(self, shard: ShardInfo, cancel: CancelToken) -> WritableBuffer:
        """Download one shard into an anonymous memory map of its listed size.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Stops the transfer, and any backoff wait, when cancelled.

        Returns:
            The shard's bytes.

        Raises:
            ShardFetchError: A permanent error, or transient errors outlasting every
                retry (the message names the shard and the URL).
            StreamCancelled: ``cancel`` was cancelled during the transfer.
        """
        try:
            return self.backend.read_all(shard.file, cancel)
        except TransportError as error:
            raise shard_error(shard.name, error) from error
        except OSError as error:  # a local file
            raise ShardFetchError(f"shard {shard.name}: cannot read {shard.file.url}: "
                                  f"{error}") from error

    def _allocate(self, shard: ShardInfo) -> WritableBuffer:
        where = shard.file.describe()
        if shard.size is None:
            raise ShardFetchError(f"shard {shard.name}: {where} has no known size (the server "
                                  f"told none)", url=where)
        try:
            return allocate(shard.size)
        except (OverflowError, MemoryError, ValueError, OSError) as error:
            too_large = RemoteTooLargeError(f"{where}: {shard.size} bytes cannot be held in "
                                            f"memory ({error})", url=where)
            raise shard_error(shard.name, too_large) from too_large

    def _read(self, shard: ShardInfo, buffer: WritableBuffer, start: int, end: int,
              cancel: CancelToken, progress: Callable[[int], None] | None = None,
              pin: Any = None) -> None:
        view = memoryview(buffer).cast("B")[start:end]
        try:
            self.backend.read_into(shard.file, view, start, cancel, progress, pin)
        except TransportError as error:
            raise shard_error(shard.name, error) from error
        except OSError as error:  # a local file
            raise ShardFetchError(f"shard {shard.name}: cannot read {shard.file.url}: "
                                  f"{error}") from error
        finally:
            view.release()

    def read_into(self, shard: ShardInfo, buffer: WritableBuffer, start: int, end: int,
                  cancel: CancelToken, progress: Callable[[int], None] | None = None,
                  pin: Any = None) -> None:
        """Download bytes ``[start, end)`` of one shard into ``buffer[start:end]``.

        One range request, retried and resumed like :meth:`fetch`; used to hand out the
        first shard's samples as its bytes arrive
        (:class:`~pyg_atompack.stream.arriving.ArrivingShard`).

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            buffer (WritableBuffer): The whole shard's buffer.
            start (int): First byte.
            end (int): One past the last byte.
            cancel (CancelToken): Stops the transfer, and any backoff wait, when cancelled.
            progress (Callable[[int], None], optional): Called as bytes land with the offset
                one past the last byte in. (default: :obj:`None`)
            pin (VersionPin, optional): Shared by the ranges of one download: a range from
                another version of the file is refused. (default: :obj:`None`)

        Raises:
            ShardFetchError: As for :meth:`fetch`.
            RangeIgnoredError: The server answered with the whole body.
        """
        self._read(shard, buffer, start, end, cancel, progress, pin)

    def fetch_in_parts(self, shard: ShardInfo, cancel: CancelToken,
                       parts: int) -> WritableBuffer:
        """Download one shard over ``parts`` concurrent range requests into one buffer.

        Used for every shard a download can split over free connections
        (``SourceOptions(split_shards=)``): servers and stores cap the bandwidth of
        each connection. Each part resumes on its own; one failed part cancels the others.
        Parts are at least :data:`~pyg_atompack.transport.transfers.MIN_PART_BYTES`.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Stops every part when cancelled.
            parts (int): Concurrent requests.

        Returns:
            The shard's bytes.
        """
        from pyg_atompack.transport.buffers import RangeIgnoredError
        from pyg_atompack.transport.transfers import VersionPin, part_count

        parts = 1 if shard.size is None else part_count(shard.size, parts)
        if parts == 1:
            return self.fetch(shard, cancel)
        buffer = self._allocate(shard)
        bounds = [shard.size * n // parts for n in range(parts + 1)]
        siblings = CancelToken()
        unregister = cancel.on_cancel(siblings.cancel)
        errors: list[BaseException] = []
        pin = VersionPin()  # the parts come from one version of the file

        def run(number: int) -> None:
            try:
                self._read(shard, buffer, bounds[number], bounds[number + 1], siblings,
                           pin=pin)
            except BaseException as error:  # noqa: BLE001 - re-raised on the caller
                errors.append(error)
                siblings.cancel()

        helpers = [threading.Thread(target=run, args=(n,), daemon=True,
                                    name=f"pyg_atompack-part-{n}") for n in range(1, parts)]
        try:
            for helper in helpers:
                helper.start()
            run(0)
        finally:
            for helper in helpers:
                helper.join()
            unregister()
        cancel.raise_if_cancelled()
        failures = [e for e in errors if not isinstance(e, StreamCancelled)]
        if any(isinstance(error, RangeIgnoredError) for error in failures):
            return self.fetch(shard, cancel)  # a server that ignores ranges: one download
        if failures:
            raise failures[0]
        return buffer

    def range_reader(self, shard: ShardInfo) -> Any:
        """Range reads of one shard (record blocks of ``.atp`` shards use them); one reader
        per shard for the source's life, so the version it learns on first use travels
        with the source to the workers and to later epochs.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.

        Returns:
            The backend's :class:`~pyg_atompack.remote.ranges.RangeReader`, or :obj:`None`
            for a shard of unknown size.
        """
        if shard.size is None:
            return None
        if shard.name not in self._readers:
            self._readers[shard.name] = self.backend.range_reader(shard.file)
        return self._readers[shard.name]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, shards={len(self._shards)})"


class LocalSource(RemoteSource):
    """Shards from a local directory (every ``*.pt`` / ``*.atp`` file in it, sorted) or a
    glob pattern such as ``"shards/train-*.pt"`` (the ``file`` backend).

    Record counts come from a ``manifest.json`` next to the shards when present, and
    otherwise from the index of ``.atp`` shards. Shards are read whole: a local file has
    nothing to gain from concurrent ranges or from being handed out as it arrives.

    Args:
        directory_or_glob (str | os.PathLike): The directory or pattern.
        checksums (bool, optional): Compute each shard's sha256 while listing (reads every
            file once). (default: :obj:`False`; sizes are always verified)
        options (SourceOptions, optional): How a stream fetches, checks and decodes these
            shards (see :class:`RemoteSource`). (default: :obj:`None`, the dataset's)
    """

    read_into = None  # type: ignore[assignment]
    fetch_in_parts = None  # type: ignore[assignment]

    def __init__(self, directory_or_glob: str | os.PathLike, *, checksums: bool = False,
                 options: SourceOptions | None = None):
        from pyg_atompack.remote.http_backend import FileBackend

        super().__init__(FileBackend(os.fspath(directory_or_glob), checksums=checksums),
                         options=options)
