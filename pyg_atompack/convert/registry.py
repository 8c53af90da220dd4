"""One table of formats, and the rules that pick a format for a path.

Adding a format is adding a module with a reader and/or a writer class and one
:func:`register` call below (ASE's ``ase.io`` is the model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .base import StructureReader, StructureWriter
from .errors import ConvertError
from .options import ReadOptions, WriteOptions


@dataclass(frozen=True)
class Format:
    """A format the converters know.

    Args:
        name: Registry name (``--from``/``--to`` on the command line).
        description: One line for ``--help``.
        reader: Module-qualified reader class, imported on first use.
        writer: Module-qualified writer class, imported on first use.
    """

    name: str
    description: str
    reader: str | None = None
    writer: str | None = None

    def _load(self, qualified: str | None, role: str) -> type:
        if qualified is None:
            raise ValueError(f"format {self.name!r} cannot be used as a {role}")
        module_name, _, class_name = qualified.rpartition(".")
        import importlib

        module = importlib.import_module(f"pyg_atompack.convert.{module_name}")
        return getattr(module, class_name)

    def reader_class(self) -> type[StructureReader]:
        """The reader class (imported lazily: torch only loads when needed)."""
        return self._load(self.reader, "source")

    def writer_class(self) -> type[StructureWriter]:
        """The writer class (imported lazily)."""
        return self._load(self.writer, "destination")


FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> None:
    """Add a format to the registry (a later registration replaces one of the same name).

    Args:
        fmt: The format; its :attr:`Format.name` becomes a valid ``--from`` / ``--to``
            value and a format name accepted by :func:`open_reader` / :func:`open_writer`.
    """
    FORMATS[fmt.name] = fmt


register(Format("atp", "an .atp file, or a directory of .atp shards (read)",
                "atp_io.AtpReader", "atp_io.AtpWriter"))
register(Format("atp-shards", "a directory of .atp shards + manifest.json",
                "atp_io.AtpReader", "atp_io.AtpShardWriter"))
register(Format("pt", "a PyG .pt file (list of Data or InMemoryDataset) or .pt shards",
                "pt.PtReader", "pt.PtShardWriter"))
register(Format("pt-shards", "a directory of .pt shards (list[Data]) + manifest.json",
                "pt.PtReader", "pt.PtShardWriter"))
register(Format("memmap", "a metatrain MemmapDataset directory",
                "memmap.MemmapReader", "memmap.MemmapWriter"))
register(Format("diskdataset", "a metatrain DiskDataset .zip", "diskdataset.DiskDatasetReader"))
register(Format("ase", "any ASE-readable file or ASE database (.xyz, .extxyz, .traj, .db, ...)",
                "ase_io.AseReader", "ase_io.ExtxyzWriter"))
register(Format("extxyz", "an extended-XYZ file", "ase_io.AseReader", "ase_io.ExtxyzWriter"))


def _check_name(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    return FORMATS[name]


def detect_source_format(path: str | os.PathLike) -> str:
    """Tell the format of an existing source from its suffix or directory content.

    Args:
        path: The source.

    Returns:
        A registry name.

    Raises:
        ConvertError: If the path does not exist or its format is unknown.
    """
    from .ase_io import ase_extensions
    from .shards import read_manifest

    path = Path(path)
    if not path.exists():
        raise ConvertError(path, "no such file or directory")
    if path.is_dir():
        manifest = read_manifest(path)
        if manifest is not None:
            names = [shard["name"] for shard in manifest["shards"]]
            if manifest.get("shard_format") == "pt" or any(n.endswith(".pt") for n in names):
                return "pt"
            return "atp"
        if (path / "ns.npy").is_file() and (path / "na.npy").is_file():
            return "memmap"
        if any(path.rglob("*.atp")):
            return "atp"
        raise ConvertError(
            path,
            "directory is neither a shard directory (.atp files, or .pt shards with "
            "manifest.json) nor a metatrain memmap layout (ns.npy, na.npy, x.bin, a.bin)",
        )
    suffix = path.suffix.lower()
    if suffix == ".atp":
        return "atp"
    if suffix in (".pt", ".pth"):
        return "pt"
    if suffix == ".zip":
        return "diskdataset"
    if suffix in ase_extensions():
        return "ase"
    raise ConvertError(
        path,
        f"unknown extension {suffix or '(none)'!r}: expected .atp, .pt, .zip (DiskDataset), "
        "an ASE format (.xyz, .extxyz, .traj, .db, ...) or a directory",
    )


def detect_destination_format(path: str | os.PathLike, shard_size: int | None = None) -> str:
    """Pick the output format of a destination path.

    ``.atp`` gives one file (a shard directory when ``shard_size`` is set),
    ``.xyz``/``.extxyz`` an extended-XYZ file, and a name without suffix a
    directory of `.atp` shards when ``shard_size`` is set.

    Args:
        path: The destination.
        shard_size: The requested shard size, if any.

    Returns:
        A registry name.

    Raises:
        ConvertError: If the suffix names no writable format.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".atp":
        return "atp-shards" if shard_size else "atp"
    if suffix in (".xyz", ".extxyz"):
        return "extxyz"
    if not suffix and shard_size:
        return "atp-shards"
    raise ConvertError(
        path,
        f"unknown extension {suffix or '(none)'!r} for an output: name it .atp (or .xyz), "
        "give a shard size for a shard directory, or choose the format explicitly "
        f"({', '.join(name for name, fmt in FORMATS.items() if fmt.writer)})",
    )


def open_reader(
    path: str | os.PathLike,
    format: str | None = None,
    options: ReadOptions | None = None,
) -> StructureReader:
    """Open a source for streaming.

    Args:
        path: The source file or directory.
        format: A registry name; ``None`` detects it.
        options: Key mapping and units.

    Returns:
        An iterable reader of :class:`~pyg_atompack.convert.Structure`.
    """
    name = format or detect_source_format(path)
    return _check_name(name).reader_class()(path, options)


def open_writer(
    path: str | os.PathLike,
    format: str | None = None,
    options: WriteOptions | None = None,
) -> StructureWriter:
    """Open a destination; nothing appears at ``path`` until the writer is closed.

    Args:
        path: The destination file or directory.
        format: A registry name; ``None`` picks one from the path.
        options: Codec, shard size, overwrite.

    Returns:
        A writer (a context manager).
    """
    options = options if options is not None else WriteOptions()
    name = format or detect_destination_format(path, options.shard_size)
    return _check_name(name).writer_class()(path, options)

