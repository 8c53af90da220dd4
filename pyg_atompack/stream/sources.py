"""Shard sources: where shard bytes come from.

A *source* lists its shards once and fetches one shard's bytes on demand. Anything that
implements the small :class:`Source` protocol can feed a
:class:`~pyg_atompack.stream.ShardStreamDataset`; the library ships :class:`LocalSource`,
:class:`~pyg_atompack.stream.HTTPSource`, :class:`~pyg_atompack.stream.HubSource` and
:class:`~pyg_atompack.stream.ObjectStoreSource` (``s3://``).

Writing your own source, e.g. for shards stored inside one zip archive::

    import zipfile
    from pyg_atompack.stream import ShardBuffer, ShardInfo

    class ZipSource:
        def __init__(self, archive: str):
            self.archive = archive  # only the path: workers open the archive themselves
            with zipfile.ZipFile(archive) as zf:
                self._shards = [ShardInfo(name=i.filename, size=i.file_size)
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
inherit it (:class:`~pyg_atompack.stream.ObjectStoreSource` makes its client lazily
in each process for that reason).

Returning the bytes in a :class:`~pyg_atompack.stream.ShardBuffer` (a memory map, or a
:class:`bytearray`) lets the dataset decode ``.pt`` lists of ``Data`` and ``.atp`` shards
in place, and the memory goes back to the operating system as soon as the shard is
dropped; plain ``bytes`` work too, at the cost of one copy.

A source that can also read byte ranges into a buffer, ``read_into(shard, buffer,
start, end, cancel, progress, pin=None)`` (``progress(offset)`` called as bytes ``[start,
offset)`` land; ``pin``, a :class:`~pyg_atompack.transport.http.VersionPin` shared by the
ranges of one download, refuses a range from another version of the file), lets
the dataset hand out a ``.pt`` shard's samples as its bytes arrive
(:mod:`pyg_atompack.stream.arriving`); the shipped remote sources do.

``list_shards`` is called once, in the process that builds the dataset; its result is
pickled into DataLoader workers, so remote listings are never repeated per worker or rank.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from pyg_atompack.remote import manifest
from pyg_atompack.stream.errors import ShardFetchError, StreamCancelled
from pyg_atompack.transport.buffers import ShardBuffer, WritableBuffer
from pyg_atompack.transport.http import Cancel

SHARD_SUFFIXES = (".pt", ".atp")
MANIFEST_NAME = manifest.MANIFEST_NAME


@dataclass(frozen=True)
class ShardInfo:
    """What a source knows about one shard before fetching it.

    Attributes:
        name: Identifier used in traces and error messages (usually the file name).
        size: Size in bytes, or ``None`` when unknown.
        sha256: Hex digest, or ``None`` when unknown (then only the size is verified).
        records: Number of samples in the shard, or ``None`` when unknown. Known counts
            let the dataset give every DDP rank exactly the same number of samples.
        location: Source-specific address (path, URL, path in repo).
        extra: Source-specific metadata (kept JSON-serialisable).
    """

    name: str
    size: int | None = None
    sha256: str | None = None
    records: int | None = None
    location: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict:
        """Plain dictionary (JSON-serialisable)."""
        return asdict(self)


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


def read_manifest_records(document: dict, origin: str) -> dict[str, dict]:
    """Parse the shard manifest written by the converter (see
    :func:`pyg_atompack.remote.manifest.read_manifest_records`).

    Args:
        document (dict): The parsed JSON document.
        origin (str): Where it came from, for error messages.

    Returns:
        ``{name: entry}`` for every listed shard.

    Raises:
        ShardFetchError: The manifest does not have the documented shape.
        RemoteNameError: A name or sha256 cannot safely name a file (``..``, an absolute
            path, a control character, ...; a :class:`~pyg_atompack.transport.TransportError`
            too): refused here, when the manifest is listed.
    """
    try:
        return manifest.read_manifest_records(document, origin)
    except manifest.ManifestError as error:
        raise ShardFetchError(str(error)) from error


def _atp_record_count(path: Path) -> int | None:
    # reading the header and index only; a file the format layer cannot open will fail
    # loudly later, when it is fetched and decoded, so here it just stays unknown
    try:
        from pyg_atompack import atp

        with atp.open(str(path)) as reader:
            return len(reader)
    except Exception:  # noqa: BLE001 - counting is an optimisation, never an error
        return None


class LocalSource:
    """Shards from a local directory or glob pattern.

    Args:
        directory_or_glob (str | os.PathLike): A directory (every ``*.pt`` / ``*.atp`` file in it,
            sorted) or a glob pattern such as ``"shards/train-*.pt"``.
        checksums (bool, optional): Compute each shard's sha256 while listing (reads every file
            once). (default: :obj:`False`; sizes are always verified)

    Record counts come from a ``manifest.json`` next to the shards when present, and
    otherwise from the index of ``.atp`` shards.
    """

    def __init__(self, directory_or_glob: str | os.PathLike, *, checksums: bool = False):
        self.pattern = str(directory_or_glob)
        root = Path(self.pattern)
        if root.is_dir():
            paths = sorted(p for p in root.iterdir() if p.suffix in SHARD_SUFFIXES)
            manifest_dir = root
        else:
            paths = sorted(Path(p) for p in glob.glob(self.pattern) if Path(p).is_file())
            manifest_dir = paths[0].parent if paths else root.parent
        if not paths:
            raise ShardFetchError(f"no .pt or .atp shards found at {self.pattern!r}")
        manifest = {}
        manifest_path = manifest_dir / MANIFEST_NAME
        if manifest_path.is_file():
            with open(manifest_path, encoding="utf-8") as handle:
                manifest = read_manifest_records(json.load(handle), str(manifest_path))
        shards = []
        for path in paths:
            entry = manifest.get(path.name, {})
            records = entry.get("records")
            if records is None and path.suffix == ".atp":
                records = _atp_record_count(path)
            digest = entry.get("sha256")
            if checksums:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            shards.append(
                ShardInfo(
                    name=path.name,
                    size=path.stat().st_size,
                    sha256=digest,
                    records=records,
                    location=str(path),
                )
            )
        self._shards = tuple(shards)

    def list_shards(self) -> Sequence[ShardInfo]:
        """Return the shards found at construction, sorted by path."""
        return self._shards

    def fetch(self, shard: ShardInfo, cancel: CancelToken) -> WritableBuffer:
        """Read one shard in 1 MiB chunks, stopping early when cancelled.

        Args:
            shard (ShardInfo): One entry of :meth:`list_shards`.
            cancel (CancelToken): Checked between chunks.

        Returns:
            The file's bytes, in an anonymous memory map of the file's size (see
            :mod:`pyg_atompack.transport.buffers`).

        Raises:
            ShardFetchError: The file cannot be read (the message names shard and path).
            StreamCancelled: ``cancel`` was cancelled during the read.
        """
        try:
            with open(shard.location, "rb") as handle:
                buffer = ShardBuffer(shard.name)
                buffer.restart(os.fstat(handle.fileno()).st_size)
                while chunk := handle.read(1 << 20):
                    cancel.raise_if_cancelled()
                    buffer.append(chunk)
                return buffer.take()
        except OSError as error:
            raise ShardFetchError(
                f"shard {shard.name}: cannot read {shard.location}: {error}"
            ) from error

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pattern!r}, shards={len(self._shards)})"
