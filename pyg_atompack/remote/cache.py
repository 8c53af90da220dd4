"""The one download cache: where remote files land on local disk, and how they get there.

**One root.** ``$PYG_ATOMPACK_CACHE`` (default ``~/.cache/pyg_atompack``); every ``cache_dir=``
argument of the library names this root. Below it, one folder per kind::

    {root}/hub/{repo_type}s--{owner}--{name}/   Hub repositories (and their listings/, refs/)
    {root}/http/{host}--{hash of the URL's directory}/   files of http(s) URLs
    {root}/objectstore/{scheme}--{bucket}/      objects

and in each such folder, for every backend, the one layout of :func:`cached_path`::

    blobs/sha256-{digest}/{file name}           verified against the listed sha256
    blobs/git-{blob id}/{file name}             verified against a Hub git blob id
    versions/{version key}/{name}               pinned to the listed version (commit, ETag, ...)
    unversioned/{name}                          no version named: never reused
    {root}/atp-meta/                            header, schema and index of remote .atp files
    {root}/pages/                               the bounded page cache of by-record reads

**What a listing can do to it.** A server, a manifest or a bucket listing is untrusted, so
nothing it says becomes a path unchecked:

* :func:`local_name` is the one way a listed name (a manifest entry, a bucket key, a Hub
  path) becomes a relative path. It refuses absolute names, ``..`` and ``.`` components,
  empty components (``a//b``, a trailing ``/``), NUL and other control characters,
  backslashes, drive letters (``C:``), components over 255 bytes (UTF-8) and names over
  1024 bytes, with a :class:`RemoteNameError` naming the (redacted) URL and the name.
  Listers call it when they list, so a hostile name fails there, not in a download.
* A sha256 is exactly 64 hexadecimal digits (:func:`check_sha256`, lower-cased), checked
  when a manifest or listing is parsed.
* Versions a server names (ETag, Last-Modified, a GCS generation) are hashed into one
  path component (:func:`version_key`), never used raw.
* Every path written below the root (folders, ``.lock`` files, temporary ``.incomplete``
  files, the file itself) must stay inside the root after resolving symlinks
  (:func:`check_inside`): a symlink inside the cache that leads out of it is a
  :class:`CachePathError`, never followed by a write. (The root itself may be a symlink:
  that is the user's choice. Someone racing the library inside the cache directory is
  not in scope: the cache belongs to its users.)

**Versions.** A cached file is reused only at the version the listing names: with a
sha256, by content (``blobs/``, verified before it is renamed into place); else by the
version its server names (``versions/{key}/``: ETag, else Last-Modified for http(s); the
ETag or generation of an object), and the download is pinned to that version, so a file
rewritten at the same size is fetched again and never spliced. A file whose server names
no version at all is downloaded again by every open (nothing says the copy is current).

**Read-only caches** (a shared, pre-filled cache mounted read-only on a cluster): a hit
is served without any write (no lock file, no modification time, no listing written).
On a miss, a whole-file download (``prefetch_shards=True``, ``pyg-atompack head`` /
``verify``) raises :class:`CacheReadOnlyError` naming the read-only directory; metadata
and pages of by-record reads are fetched into memory and not stored, so those reads keep
working; listings and refs are simply not stored. Whether the cache is writable is
learnt by trying (``EROFS``, ``EACCES``, ``EPERM``), never guessed from permission bits.

This module is torch-free and imports only the transport's error family.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import re
import unicodedata
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from pyg_atompack.transport.errors import TransportError
from pyg_atompack.transport.redact import redact_url

if TYPE_CHECKING:
    from pyg_atompack.remote.files import RemoteFile

__all__ = [
    "CACHE_ENV",
    "HTTP",
    "HUB",
    "META",
    "OBJECTSTORE",
    "PAGES",
    "CachePathError",
    "CacheReadOnlyError",
    "RemoteNameError",
    "cache_root",
    "cached_file",
    "cached_path",
    "check_digest",
    "check_inside",
    "check_sha256",
    "file_lock",
    "folder_of",
    "kind_folder",
    "local_component",
    "local_name",
    "make_folder",
    "read_only",
    "version_key",
    "write_atomically",
    "writes_to",
]

#: The one environment variable naming the cache root.
CACHE_ENV = "PYG_ATOMPACK_CACHE"
#: Folders below the root, one per kind of cached data.
HUB, HTTP, OBJECTSTORE, META, PAGES = "hub", "http", "objectstore", "atp-meta", "pages"
#: Longest path component (bytes of UTF-8): what common file systems allow.
MAX_COMPONENT_BYTES = 255
#: Longest listed name (bytes of UTF-8), so a cache path stays well below ``PATH_MAX``.
MAX_NAME_BYTES = 1024
_READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_DRIVE = re.compile(r"[A-Za-z]:")
_HEX = re.compile(r"[0-9a-fA-F]+")


class RemoteNameError(TransportError, ValueError):
    """A name, digest or version a remote party listed cannot safely become a local path.

    The message names the (redacted) URL and the offending value (``repr``, so control
    characters are visible).
    """


class CacheReadOnlyError(TransportError, PermissionError):
    """The cache cannot be written (a read-only mount or permissions) and the file is not
    in it; the message names the directory."""


class CachePathError(TransportError):
    """A path in the cache leads outside the cache root (a symlink planted inside it)."""


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir`` if given, else ``$PYG_ATOMPACK_CACHE``, else
    ``~/.cache/pyg_atompack``.

    Args:
        cache_dir (str | os.PathLike, optional): An explicit root. (default: :obj:`None`)

    Returns:
        The root path (not created).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pyg_atompack"


def kind_folder(kind: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder of one kind of cached data (:data:`HUB`, :data:`HTTP`, ...) under the root.

    Args:
        kind (str): One of :data:`HUB`, :data:`HTTP`, :data:`OBJECTSTORE`, :data:`META`,
            :data:`PAGES`.
        cache_dir (str | os.PathLike, optional): The root (default: :func:`cache_root`).

    Returns:
        ``{root}/{kind}``.
    """
    if kind not in (HUB, HTTP, OBJECTSTORE, META, PAGES):
        raise ValueError(f"unknown cache kind {kind!r}")
    return cache_root(cache_dir) / kind


# ---------------------------------------------------------------------- names
def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:160]}...' ({len(text)} characters)"


def _refuse(value: object, url: str, *, why: str, field: str = "name") -> RemoteNameError:
    where = redact_url(url)
    return RemoteNameError(f"{where}: refusing the remote {field} {_shown(value)}: {why}",
                           url=where)


def local_name(name: str, *, url: str, field: str = "name") -> str:
    """The relative local path of a name a remote party listed: the one check.

    Args:
        name (str): A POSIX name relative to a listed directory (``"train/shard_0.atp"``).
        url (str): Where the name was listed, for the message (redacted there).
        field (str, optional): What the value is, for the message. (default: :obj:`"name"`)

    Returns:
        ``name`` itself, now known to be a safe relative path of non-empty components.

    Raises:
        RemoteNameError: The name is absolute, has a ``..``, ``.`` or empty component, a NUL
            or other control character, a backslash or a drive letter, or is too long.
    """
    def refuse(why: str) -> RemoteNameError:
        return _refuse(name, url, field=field, why=why)

    if not isinstance(name, str) or not name:
        raise refuse("an empty or non-string name")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise refuse("not valid UTF-8") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise refuse(f"{len(encoded)} bytes, longer than {MAX_NAME_BYTES}")
    if any(unicodedata.category(c) == "Cc" for c in name):
        raise refuse("a NUL or control character")
    if "\\" in name:
        raise refuse("a backslash")
    if name.startswith("/"):
        raise refuse("an absolute path")
    for part in name.split("/"):
        if not part:
            raise refuse("an empty path component ('//' or a trailing '/')")
        if part in (".", ".."):
            raise refuse(f"a {part!r} path component")
        if _DRIVE.match(part):
            raise refuse("a drive letter")
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise refuse(f"a path component longer than {MAX_COMPONENT_BYTES} bytes")
    return name


def local_component(name: str, *, url: str, field: str = "name") -> str:
    """Like :func:`local_name`, for a value that must be one path component (no ``/``).

    Args:
        name (str): A file name, bucket, repository owner or name.
        url (str): Where it came from, for the message.
        field (str, optional): What the value is, for the message. (default: :obj:`"name"`)

    Returns:
        ``name``.

    Raises:
        RemoteNameError: As :func:`local_name`, or the value holds a ``/``.
    """
    if isinstance(name, str) and "/" in name:
        raise _refuse(name, url, field=field, why="a '/' in what must be one path component")
    return local_name(name, url=url, field=field)


def check_digest(value: object, *, url: str, field: str, lengths: tuple[int, ...]) -> str | None:
    """A hexadecimal digest a listing announced, lower-cased; :obj:`None` stays :obj:`None`.

    Args:
        value (object): The announced value.
        url (str): Where it was listed, for the message.
        field (str): Its name in the listing (``"sha256"``, ``"oid"``), for the message.
        lengths (tuple[int, ...]): The allowed numbers of hex digits.

    Returns:
        The digest in lower case, or :obj:`None`.

    Raises:
        RemoteNameError: Anything but a string of ``lengths`` hex digits.
    """
    if value is None:
        return None
    if not isinstance(value, str) or len(value) not in lengths or not _HEX.fullmatch(value):
        digits = " or ".join(str(n) for n in lengths)
        raise _refuse(value, url, field=field, why=f"must be {digits} hexadecimal digits")
    return value.lower()


def check_sha256(value: object, *, url: str, field: str = "sha256") -> str | None:
    """A listed sha256: exactly 64 hex digits, lower-cased (:obj:`None` stays :obj:`None`).

    Args:
        value (object): The announced value.
        url (str): Where it was listed, for the message.
        field (str, optional): Its name in the listing. (default: :obj:`"sha256"`)

    Returns:
        The digest in lower case, or :obj:`None`.

    Raises:
        RemoteNameError: Anything else (a path, a short or non-hex string, a number).
    """
    return check_digest(value, url=url, field=field, lengths=(64,))


def version_key(*parts: object) -> str:
    """One safe path component naming a version (ETag, Last-Modified, generation, size).

    Args:
        *parts (object): What identifies the version; hashed, never used raw.

    Returns:
        ``"v-"`` and 32 hex digits.
    """
    text = "\0".join(str(part) for part in parts)
    return "v-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


# ---------------------------------------------------------------------- paths
def folder_of(file: RemoteFile, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder of the listing ``file`` belongs to.

    Args:
        file (RemoteFile): A listed file.
        cache_dir (str | os.PathLike, optional): The root (default: :func:`cache_root`).

    Returns:
        ``{root}/hub/{repo_type}s--{owner}--{name}`` for a Hub file,
        ``{root}/http/{host}--{hash of the URL's directory}`` for an http(s) file (one
        folder per directory, readable and made unique by the hash), else
        ``{root}/objectstore/{scheme}--{bucket}``.

    Raises:
        RemoteNameError: A part of the repository or bucket cannot safely name a folder.
    """
    if file.repo:
        where = f"hf://{file.repo}"
        parts = [local_component(part, url=where, field="repository id part")
                 for part in file.repo.split("/")]
        return kind_folder(HUB, cache_dir) / "--".join(parts)
    parts = urlsplit(file.url)
    if parts.scheme in ("http", "https"):
        directory = posixpath.dirname(parts.path)
        digest = hashlib.sha256(f"{parts.scheme}://{parts.netloc}{directory}".encode())
        host = re.sub(r"[^A-Za-z0-9.-]", "_", parts.hostname or "host")[:64]
        return kind_folder(HTTP, cache_dir) / f"{host}--{digest.hexdigest()[:16]}"
    bucket = local_component(parts.netloc, url=file.url, field="bucket")
    scheme = local_component(parts.scheme, url=file.url, field="scheme")
    return kind_folder(OBJECTSTORE, cache_dir) / f"{scheme}--{bucket}"


def cached_path(file: RemoteFile, cache_dir: str | os.PathLike | None = None, *,
                verified: bool = True) -> Path:
    """Where the cache keeps ``file``: the one layout of every backend (module docstring).

    By content when ``verified`` and the listing names a sha256 (or a Hub git blob id),
    else by the listed version, else in ``unversioned/`` (never reused). Every listed
    value is checked: the name through :func:`local_name` (an http(s) file's local name
    is the last component of its URL, decoded: an absolute manifest entry lands in the
    folder of its own origin and directory), the digests as hex, the version hashed.

    Args:
        file (RemoteFile): A listed file.
        cache_dir (str | os.PathLike, optional): The root (default: :func:`cache_root`).
        verified (bool, optional): The place of a copy checked against the listed hash,
            rather than of one checked only for its size. (default: :obj:`True`)

    Returns:
        The path (whether or not the file is there yet).

    Raises:
        RemoteNameError: A listed name, digest or folder part cannot safely name a file.
    """
    url = file.url or file.name
    folder = folder_of(file, cache_dir)
    if not file.repo and urlsplit(file.url).scheme in ("http", "https"):
        name = local_component(unquote(posixpath.basename(urlsplit(file.url).path)), url=url,
                               field="file name")
    else:
        name = local_name(file.name, url=url)
    if verified and file.sha256:
        return folder / "blobs" / f"sha256-{check_sha256(file.sha256, url=url)}" / \
            posixpath.basename(name)
    if verified and file.blob_id:
        blob = check_digest(file.blob_id, url=url, field="git blob id", lengths=(40, 64))
        return folder / "blobs" / f"git-{blob}" / posixpath.basename(name)
    if file.version is None:
        return folder / "unversioned" / name
    return folder / "versions" / version_key(file.version) / name


def check_inside(path: str | os.PathLike, root: str | os.PathLike, *,
                 url: str | None = None) -> Path:
    """``path``, after checking it stays inside ``root`` once symlinks are resolved.

    Args:
        path (str | os.PathLike): A path built below ``root`` (it need not exist yet).
        root (str | os.PathLike): The cache root.
        url (str, optional): The remote file concerned, for the message. (default: :obj:`None`)

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CachePathError: It resolves outside ``root`` (a symlink in the cache points out).
    """
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        where = redact_url(url) if url else None
        raise CachePathError(
            f"{where + ': ' if where else ''}the cache path {os.fspath(path)} leads outside "
            f"the cache {os.fspath(root)} (to {real}): a symlink in the cache points out of "
            f"it; remove it", url=where)
    return Path(path)


def read_only(error: BaseException) -> bool:
    """Whether ``error`` is a write refused because the cache is read-only.

    Args:
        error (BaseException): An error met writing below the cache root.

    Returns:
        :obj:`True` for an :class:`OSError` (not of the transport family) with ``errno``
        ``EROFS``, ``EACCES`` or ``EPERM``.
    """
    return (isinstance(error, OSError) and not isinstance(error, TransportError)
            and error.errno in _READ_ONLY_ERRNOS)


@contextlib.contextmanager
def writes_to(directory: str | os.PathLike, *, url: str | None = None) -> Iterator[None]:
    """Turn a write refused below ``directory`` into :class:`CacheReadOnlyError`.

    Args:
        directory (str | os.PathLike): Where the writes go (named by the message).
        url (str, optional): The remote file concerned, for the message. (default: :obj:`None`)

    Yields:
        Nothing; the ``with`` body does the writes.

    Raises:
        CacheReadOnlyError: A write was refused (``EROFS``, ``EACCES``, ``EPERM``).
    """
    try:
        yield
    except OSError as error:
        if not read_only(error):
            raise
        where = redact_url(url) if url else None
        raise CacheReadOnlyError(
            f"{where + ': ' if where else ''}not in the cache, and the cache directory "
            f"{os.fspath(directory)} is read-only ({error.strerror}); use a writable "
            f"cache_dir / ${CACHE_ENV}, or fill the shared cache first", url=where) from error


def make_folder(folder: str | os.PathLike, root: str | os.PathLike, *,
                url: str | None = None) -> Path:
    """Create ``folder`` (and its parents) below ``root``, checked before and after.

    Args:
        folder (str | os.PathLike): The folder.
        root (str | os.PathLike): The cache root.
        url (str, optional): The remote file concerned, for messages. (default: :obj:`None`)

    Returns:
        ``folder``.

    Raises:
        CachePathError: It resolves outside ``root``.
        CacheReadOnlyError: It does not exist and cannot be created.
    """
    folder = check_inside(folder, root, url=url)
    if not folder.is_dir():
        with writes_to(folder, url=url):
            folder.mkdir(parents=True, exist_ok=True)
        check_inside(folder, root, url=url)
    return folder


def file_lock(lock: str | os.PathLike, root: str | os.PathLike, *,
              url: str | None = None) -> Any:
    """An inter-process lock on the lock file ``lock`` below ``root``, checked.

    Args:
        lock (str | os.PathLike): The lock file (e.g. ``{guarded file}.lock``).
        root (str | os.PathLike): The cache root.
        url (str, optional): The remote file concerned, for messages. (default: :obj:`None`)

    Returns:
        A :class:`filelock.FileLock` (acquire it inside :func:`writes_to`, so that a
        read-only cache raises :class:`CacheReadOnlyError`).

    Raises:
        CachePathError: The lock file is a symlink or resolves outside ``root``.
    """
    from filelock import FileLock

    lock = Path(lock)
    if lock.is_symlink():  # opening it would truncate what it points to
        raise CachePathError(f"the cache lock file {lock} is a symlink; remove it",
                             url=redact_url(url) if url else None)
    check_inside(lock, root, url=url)
    return FileLock(str(lock))


def write_atomically(final: str | os.PathLike, root: str | os.PathLike,
                     write: Callable[[Path], None], *, url: str | None = None) -> Path:
    """Write ``final`` through a temporary ``.incomplete`` name next to it, then rename.

    Readers see the whole file or none. The temporary file is removed whatever happens.

    Args:
        final (str | os.PathLike): The destination, below ``root``.
        root (str | os.PathLike): The cache root.
        write (Callable[[Path], None]): Fills the temporary path (and checks it); an exception
            leaves nothing behind.
        url (str, optional): The remote file concerned, for messages. (default: :obj:`None`)

    Returns:
        ``final``.

    Raises:
        CachePathError: A path resolves outside ``root``.
        CacheReadOnlyError: The folder cannot be written.
    """
    final = check_inside(final, root, url=url)
    make_folder(final.parent, root, url=url)
    temp = final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.incomplete")
    check_inside(temp, root, url=url)
    try:
        with writes_to(final.parent, url=url):
            write(temp)
            check_inside(final, root, url=url)
            os.replace(temp, final)
    finally:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
    return final


def cached_file(final: str | os.PathLike, root: str | os.PathLike, *,
                complete: Callable[[Path], bool], write: Callable[[Path], None],
                url: str | None = None) -> Path:
    """The cached file ``final``, written by ``write`` unless ``complete`` says it is there.

    A hit writes nothing (no lock file, so a read-only cache serves it). A miss takes the
    lock ``{final}.lock`` (one process of a machine writes, the others wait and reuse),
    asks ``complete`` again, then :func:`write_atomically`.

    Args:
        final (str | os.PathLike): The destination, below ``root``.
        root (str | os.PathLike): The cache root.
        complete (Callable[[Path], bool]): Whether the file at the path is the one wanted.
        write (Callable[[Path], None]): Fills a temporary path with the verified content.
        url (str, optional): The remote file, for messages. (default: :obj:`None`)

    Returns:
        ``final``.

    Raises:
        CachePathError: A path resolves outside ``root``.
        CacheReadOnlyError: A miss in a cache that cannot be written.
    """
    final = check_inside(final, root, url=url)
    if complete(final):
        return final
    make_folder(final.parent, root, url=url)
    lock = file_lock(f"{os.fspath(final)}.lock", root, url=url)
    with writes_to(final.parent, url=url), lock:
        if complete(final):  # another process finished it while this one waited
            return final
        return write_atomically(final, root, write, url=url)
