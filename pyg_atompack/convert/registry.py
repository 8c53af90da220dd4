"""One table of formats, whose data picks the format of a path.

A :class:`Format` says what its files look like (extensions, name patterns,
leading bytes, what a directory of it contains) and where its reader and writer
classes are; detection walks the table in registration order and asks nothing
else. Other packages add formats through the ``pyg_atompack.formats``
entry-point group (ASE's ``ase.io`` registry and its ``ase.ioformats`` group are
the model)::

    # pyproject.toml of a plugin package
    [project.entry-points."pyg_atompack.formats"]
    myfmt = "my_package.atp_format:FORMAT"   # a Format whose name is "myfmt"

Detection of a source: a directory with a ``manifest.json`` of shards is read by
the format whose extensions name the shards; another directory by the first
format whose :attr:`Format.contains` patterns all match; a file by name
pattern, then extension, then leading bytes, then the formats' own
:attr:`Format.detect` predicates. Detection of a destination: the first format
with a writer that lists the suffix in :attr:`Format.write_extensions` and
whose :attr:`Format.sharded` flag matches whether a shard size was given (with a
shard size and no sharded format for the suffix, the one-file format).
"""

from __future__ import annotations

import fnmatch
import importlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .base import StructureReader, StructureWriter
from .errors import ConvertError
from .options import ReadOptions, WriteOptions

#: The entry-point group other packages register formats in.
ENTRY_POINT_GROUP = "pyg_atompack.formats"

# bytes read from a file to compare with the formats' magic prefixes
_MAGIC_BYTES = 64


@dataclass(frozen=True)
class Format:
    """A format the converters know, with the facts that recognise its paths.

    A class or predicate given as text is imported on first use, so listing the
    formats never imports torch or ASE: ``"package.module:Name"`` names any
    module, ``"module.Name"`` (no colon) a module of :mod:`pyg_atompack.convert`.

    Args:
        name (str): Registry name (``--from``/``--to`` on the command line).
        description (str): One line for ``--help`` and error messages.
        reader (str or type, optional): The :class:`StructureReader` subclass.
            (default: :obj:`None`)
        writer (str or type, optional): The :class:`StructureWriter` subclass.
            (default: :obj:`None`)
        extensions (tuple[str, ...], optional): Suffixes of a source file of this
            format, lower case without the dot (``("pt", "pth")``).
            (default: :obj:`()`)
        globs (tuple[str, ...], optional): ``fnmatch`` patterns of a source file's
            name, tried before extensions (``("OUTCAR*",)``). (default: :obj:`()`)
        magic (tuple[bytes, ...], optional): Prefixes of a source file's first bytes,
            tried when neither a pattern nor the extension decides. (default: :obj:`()`)
        contains (tuple[str, ...], optional): Glob patterns (``Path.glob``) that all
            match inside a source directory of this format (``("ns.npy", "na.npy")``).
            (default: :obj:`()`)
        detect (str or callable, optional): A predicate ``(Path) -> bool`` for rules
            another library owns (the ASE bridge asks ASE's own table); tried last.
            (default: :obj:`None`)
        write_extensions (tuple[str, ...], optional): Suffixes of a destination
            written in this format; ``""`` is a name without a suffix.
            (default: :obj:`()`)
        sharded (bool, optional): Whether the writer writes a shard directory, so that
            destination detection picks it only when a shard size is given; a
            sharded format is never detected as a source (its directories are read
            by the format of their shards). (default: :obj:`False`)
    """

    name: str
    description: str
    reader: str | type | None = None
    writer: str | type | None = None
    extensions: tuple[str, ...] = ()
    globs: tuple[str, ...] = ()
    magic: tuple[bytes, ...] = ()
    contains: tuple[str, ...] = ()
    detect: str | Callable[[Path], bool] | None = None
    write_extensions: tuple[str, ...] = ()
    sharded: bool = False

    def reader_class(self) -> type[StructureReader]:
        """Returns the reader class (imported lazily: torch only loads when needed)."""
        if self.reader is None:
            raise ValueError(f"format {self.name!r} cannot be used as a source")
        return _resolve(self.reader)

    def writer_class(self) -> type[StructureWriter]:
        """Returns the writer class (imported lazily)."""
        if self.writer is None:
            raise ValueError(f"format {self.name!r} cannot be used as a destination")
        return _resolve(self.writer)

    def matches_file(self, path: Path, head: bytes | None = None) -> str | None:
        """Tells how this format recognises a source file, if it does.

        Args:
            path (Path): The file.
            head (bytes, optional): Its first bytes; :obj:`None` skips the magic
                test. (default: :obj:`None`)

        Returns:
            str or None: ``"glob"``, ``"extension"`` or ``"magic"``, or :obj:`None`.
        """
        name = path.name.lower()
        if any(fnmatch.fnmatch(name, pattern.lower()) for pattern in self.globs):
            return "glob"
        if path.suffix.lower().lstrip(".") in self.extensions and path.suffix:
            return "extension"
        if head is not None and any(head.startswith(prefix) for prefix in self.magic):
            return "magic"
        return None

    def matches_directory(self, path: Path) -> bool:
        """Whether every :attr:`contains` pattern matches inside the directory ``path``.

        Args:
            path (Path): The directory.
        """
        return bool(self.contains) and all(
            next(iter(path.glob(pattern)), None) is not None for pattern in self.contains
        )


def _resolve(target: str | type | Callable) -> type | Callable:
    """Import a ``"package.module:Name"`` (or ``"convert_module.Name"``) reference."""
    if not isinstance(target, str):
        return target
    if ":" in target:
        module_name, _, attribute = target.partition(":")
    else:
        module_name, _, attribute = target.rpartition(".")
        module_name = f"pyg_atompack.convert.{module_name}"
    value = importlib.import_module(module_name)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


FORMATS: dict[str, Format] = {}
_BUILTIN_NAMES: set[str] = set()
_plugins_loaded = False


def register(fmt: Format) -> None:
    """Adds a format to the registry (a later registration replaces one of the same name).

    Args:
        fmt (Format): The format; its :attr:`Format.name` becomes a valid ``--from`` /
            ``--to`` value and a format name accepted by :func:`open_reader` /
            :func:`open_writer`, and its facts take part in detection.
    """
    FORMATS[fmt.name] = fmt


def formats() -> dict[str, Format]:
    """Returns the registry, with the formats of installed plugins loaded.

    Plugins are the ``pyg_atompack.formats`` entry points; each loads to a
    :class:`Format` named like the entry point. One that fails to load, or that
    names a builtin format, is skipped with a :class:`RuntimeWarning` naming its
    distribution: a broken plugin never stops the builtin formats.

    Returns:
        dict[str, Format]: Name -> format, in detection order.
    """
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        _load_plugins()
    return FORMATS


def _load_plugins() -> None:
    from importlib.metadata import entry_points

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        origin = f"entry point {entry.name!r} ({entry.value})"
        if entry.dist is not None:
            origin += f" of {entry.dist.name}"
        try:
            fmt = entry.load()
        except Exception as exc:  # any error of foreign code: skip it, say so
            warnings.warn(f"{ENTRY_POINT_GROUP}: {origin} failed to load: {exc!r}",
                          RuntimeWarning, stacklevel=3)
            continue
        if not isinstance(fmt, Format) or fmt.name != entry.name:
            warnings.warn(f"{ENTRY_POINT_GROUP}: {origin} is not a Format named "
                          f"{entry.name!r}; skipped", RuntimeWarning, stacklevel=3)
        elif entry.name in _BUILTIN_NAMES:
            warnings.warn(f"{ENTRY_POINT_GROUP}: {origin} would replace the builtin format "
                          f"{entry.name!r}; skipped", RuntimeWarning, stacklevel=3)
        else:
            register(fmt)


def _builtin(fmt: Format) -> None:
    register(fmt)
    _BUILTIN_NAMES.add(fmt.name)


_builtin(Format("atp", "an .atp file, or a directory of .atp shards (read)",
                "atp_io.AtpReader", "atp_io.AtpWriter", extensions=("atp",),
                magic=(b"ATPK",), contains=("**/*.atp",), write_extensions=("atp",)))
_builtin(Format("atp-shards", "a directory of .atp shards + manifest.json",
                "atp_io.AtpReader", "atp_io.AtpShardWriter", write_extensions=("atp", ""),
                sharded=True))
_builtin(Format("pt", "a PyG .pt file (list of Data or InMemoryDataset) or .pt shards",
                "pt.PtReader", "pt.PtShardWriter", extensions=("pt", "pth")))
_builtin(Format("pt-shards", "a directory of .pt shards (list[Data]) + manifest.json",
                "pt.PtReader", "pt.PtShardWriter", sharded=True))
_builtin(Format("memmap", "a metatrain MemmapDataset directory (ns.npy, na.npy, x.bin, a.bin)",
                "memmap.MemmapReader", "memmap.MemmapWriter", contains=("ns.npy", "na.npy")))
_builtin(Format("diskdataset", "a metatrain DiskDataset .zip", "diskdataset.DiskDatasetReader",
                extensions=("zip",)))
_builtin(Format("ase", "any ASE-readable file or ASE database (.xyz, .extxyz, .traj, .db, ...)",
                "ase_io.AseReader", "ase_io.ExtxyzWriter", detect="ase_io.is_ase_path"))
_builtin(Format("extxyz", "an extended-XYZ file", "ase_io.AseReader", "ase_io.ExtxyzWriter",
                write_extensions=("xyz", "extxyz")))


def _check_name(name: str) -> Format:
    known = formats()
    if name not in known:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(known)}")
    return known[name]


def _read_head(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read(_MAGIC_BYTES)
    except OSError as exc:
        raise ConvertError(path, f"cannot read it: {exc.strerror or exc}") from exc


def detect_source_format(path: str | os.PathLike) -> str:
    """Tells the format of an existing source from the registry's facts.

    Args:
        path (str or os.PathLike): The source file or directory.

    Returns:
        str: A registry name.

    Raises:
        ConvertError: If the path does not exist or no format recognises it.
    """
    from .shards import read_manifest

    path = Path(path)
    if not path.exists():
        raise ConvertError(path, "no such file or directory")
    sources = [fmt for fmt in formats().values() if fmt.reader is not None and not fmt.sharded]
    if path.is_dir():
        manifest = read_manifest(path)
        if manifest is not None:
            return _shard_directory_format(path, manifest, sources)
        for fmt in sources:
            if fmt.matches_directory(path):
                return fmt.name
        layouts = "; ".join(f"{fmt.name}: {', '.join(fmt.contains)}"
                            for fmt in sources if fmt.contains)
        raise ConvertError(
            path,
            "directory is neither a shard directory (manifest.json) nor a layout a format "
            f"recognises ({layouts})",
        )
    for rule in ("glob", "extension"):
        for fmt in sources:
            if fmt.matches_file(path) == rule:
                return fmt.name
    if any(fmt.magic for fmt in sources):
        head = _read_head(path)
        for fmt in sources:
            if fmt.matches_file(path, head) == "magic":
                return fmt.name
    for fmt in sources:
        if fmt.detect is not None and _resolve(fmt.detect)(path):
            return fmt.name
    known = "; ".join(
        f"{fmt.name} ({', '.join(f'.{ext}' for ext in fmt.extensions)})" if fmt.extensions
        else f"{fmt.name} ({fmt.description})"
        for fmt in sources if fmt.extensions or fmt.detect is not None
    )
    raise ConvertError(
        path,
        f"unknown extension {path.suffix or '(none)'!r}: no format recognises the file "
        f"(formats: {known}; or a directory)",
    )


def _shard_directory_format(path: Path, manifest: dict, sources: list[Format]) -> str:
    """The format of a manifest's shards: its ``shard_format``, else the shards' suffix."""
    declared = manifest.get("shard_format")
    if declared is not None:
        for fmt in sources:
            if fmt.name == declared:
                return fmt.name
    for shard in manifest["shards"]:
        for fmt in sources:
            if fmt.matches_file(Path(shard["name"])) is not None:
                return fmt.name
    # a manifest naming no known shards: .atp was the only shard format before
    # shard_format existed
    return "atp"


def detect_destination_format(path: str | os.PathLike, shard_size: int | None = None) -> str:
    """Picks the output format of a destination path from the registry's facts.

    With the builtin formats ``.atp`` gives one file (a shard directory when
    ``shard_size`` is set), ``.xyz``/``.extxyz`` an extended-XYZ file, and a name
    without suffix a directory of `.atp` shards when ``shard_size`` is set.

    Args:
        path (str or os.PathLike): The destination.
        shard_size (int, optional): The requested shard size, if any.
            (default: :obj:`None`)

    Returns:
        str: A registry name.

    Raises:
        ConvertError: If no format writes such a destination.
    """
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    writers = [fmt for fmt in formats().values() if fmt.writer is not None]
    listing = [fmt for fmt in writers if suffix in fmt.write_extensions]
    for fmt in listing:
        if fmt.sharded == bool(shard_size):
            return fmt.name
    if shard_size and listing:
        # no sharded format writes this suffix: the one file it names (as before)
        return listing[0].name
    raise ConvertError(
        path,
        f"unknown extension {path.suffix or '(none)'!r} for an output: name it .atp (or .xyz), "
        "give a shard size for a shard directory, or choose the format explicitly "
        f"({', '.join(fmt.name for fmt in writers)})",
    )


def open_reader(
    path: str | os.PathLike,
    format: str | None = None,
    options: ReadOptions | None = None,
) -> StructureReader:
    """Opens a source for streaming.

    Args:
        path (str or os.PathLike): The source file or directory.
        format (str, optional): A registry name; :obj:`None` detects it.
            (default: :obj:`None`)
        options (ReadOptions, optional): Key mapping and units. (default: :obj:`None`)

    Returns:
        StructureReader: An iterable reader of :class:`~pyg_atompack.convert.Structure`.
    """
    name = format or detect_source_format(path)
    return _check_name(name).reader_class()(path, options)


def open_writer(
    path: str | os.PathLike,
    format: str | None = None,
    options: WriteOptions | None = None,
) -> StructureWriter:
    """Opens a destination; nothing appears at ``path`` until the writer is closed.

    Args:
        path (str or os.PathLike): The destination file or directory.
        format (str, optional): A registry name; :obj:`None` picks one from the path.
            (default: :obj:`None`)
        options (WriteOptions, optional): Codec, shard size, overwrite.
            (default: :obj:`None`)

    Returns:
        StructureWriter: A writer (a context manager).
    """
    options = options if options is not None else WriteOptions()
    name = format or detect_destination_format(path, options.shard_size)
    return _check_name(name).writer_class()(path, options)
