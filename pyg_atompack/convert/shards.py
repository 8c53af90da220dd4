"""Sharded outputs: a directory of shard files plus ``manifest.json``.

The manifest shape is shared with the streaming layer (``stream.RemoteSource``
reads it)::

    {"format": "pyg_atompack-shards/1",
     "shards": [{"name": "shard_00000.atp", "records": 1000,
                 "bytes": 123456, "sha256": "..."}, ...],
     "total_records": N,
     ...informative fields (shard_format, compression, created_at_utc, ...)}
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import abstractmethod
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .base import StructureWriter
from .errors import ConvertError
from .options import WriteOptions
from .structure import Structure

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "pyg_atompack-shards/1"
DEFAULT_SHARD_SIZE = 1000


def sha256_of(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """Load and check ``manifest.json`` of a shard directory.

    Args:
        directory (str | os.PathLike): The shard directory.

    Returns:
        The manifest dict, or ``None`` when the directory has no manifest or
        the manifest is not a ``pyg_atompack-shards/1`` one (other tools write
        informative manifests of their own).

    Raises:
        ConvertError: If a ``pyg_atompack-shards/1`` manifest is malformed.
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(path, f"unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise ConvertError(path, "'shards' must be a list")
    for position, shard in enumerate(shards):
        missing = [k for k in ("name", "records", "bytes", "sha256") if k not in shard]
        if missing:
            raise ConvertError(path, f"shard entry {position} lacks {', '.join(missing)}")
    return manifest


def check_manifest(directory: str | os.PathLike) -> list[str]:
    """Compare every shard on disk with its manifest entry.

    Args:
        directory (str | os.PathLike): A shard directory with a ``pyg_atompack-shards/1`` manifest.

    Returns:
        One line per problem (missing shard, size or checksum mismatch, wrong
        total); empty when everything matches.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return [f"{directory / MANIFEST_NAME}: no pyg_atompack-shards/1 manifest"]
    problems = []
    total = 0
    for shard in manifest["shards"]:
        path = directory / shard["name"]
        total += int(shard["records"])
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
            continue
        size = path.stat().st_size
        if size != shard["bytes"]:
            problems.append(f"{path}: {size} bytes, manifest says {shard['bytes']}")
            continue
        digest = sha256_of(path)
        if digest != shard["sha256"]:
            problems.append(f"{path}: sha256 {digest} differs from manifest {shard['sha256']}")
    if manifest.get("total_records", total) != total:
        problems.append(
            f"{directory / MANIFEST_NAME}: total_records {manifest['total_records']} "
            f"but the shards add up to {total}"
        )
    return problems


class ShardedWriter(StructureWriter):
    """Writes fixed-size shards into a directory and a manifest at the end.

    Subclasses open, fill and close one shard file at a time.

    Args:
        path (str | os.PathLike): The destination directory.
        options (WriteOptions, optional): ``shard_size`` records per shard (default: 1000).
    """

    shard_extension = ".bin"
    shard_format = "?"

    def __init__(self, path: str | os.PathLike, options: WriteOptions | None = None) -> None:
        super().__init__(path, options)
        self.shard_size = self.options.shard_size or DEFAULT_SHARD_SIZE
        self.tmp_path.mkdir()
        self._entries: list[dict[str, Any]] = []
        self._in_shard = 0
        self._shard_open = False

    def _shard_name(self, number: int) -> str:
        # numbered from first_shard: the parts of a partitioned conversion never collide
        return f"shard_{self.options.first_shard + number:05d}{self.shard_extension}"

    def _add(self, structure: Structure) -> None:
        if not self._shard_open:
            self._open_shard(self.tmp_path / self._shard_name(len(self._entries)))
            self._shard_open = True
        self._add_to_shard(structure)
        self._in_shard += 1
        if self._in_shard >= self.shard_size:
            self._seal_shard()

    def _seal_shard(self) -> None:
        name = self._shard_name(len(self._entries))
        self._close_shard()
        self._shard_open = False
        path = self.tmp_path / name
        self._entries.append(
            {
                "name": name,
                "records": self._in_shard,
                "bytes": path.stat().st_size,
                "sha256": sha256_of(path),
            }
        )
        self._in_shard = 0

    def _finish(self) -> None:
        if self._shard_open:
            self._seal_shard()
        manifest = {
            "format": MANIFEST_FORMAT,
            "shards": self._entries,
            "total_records": sum(entry["records"] for entry in self._entries),
            "shard_format": self.shard_format,
            "created_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **self._manifest_extras(),
            **({"part": dict(self.options.part)} if self.options.part else {}),
        }
        text = json.dumps(manifest, indent=1, ensure_ascii=False) + "\n"
        (self.tmp_path / MANIFEST_NAME).write_text(text, encoding="utf-8")

    def _discard(self) -> None:
        if self._shard_open:
            self._abandon_shard()
            self._shard_open = False

    def _manifest_extras(self) -> dict[str, Any]:
        """Informative manifest fields of the subclass."""
        return {}

    @abstractmethod
    def _open_shard(self, path: Path) -> None:
        """Start a new shard file at ``path``."""

    @abstractmethod
    def _add_to_shard(self, structure: Structure) -> None:
        """Append one structure to the open shard."""

    @abstractmethod
    def _close_shard(self) -> None:
        """Complete the open shard file."""

    def _abandon_shard(self) -> None:
        """Release the open shard without completing it (default: close it)."""
        self._close_shard()
