"""Write energy/force frames as streamable shards: ``.pt`` and ``.atp`` plus a manifest.

Both layouts hold the same frames in the same order, one folder per format::

    root/pt/manifest.json   root/pt/shard_00000.pt ...
    root/atp/manifest.json  root/atp/shard_00000.atp ...

A ``.pt`` shard is a ``torch.save``-d list of :class:`torch_geometric.data.Data` whose
tensors each own their storage (so a shard never drags a whole trajectory along). An
``.atp`` shard is written with :class:`pyg_atompack.atp.Writer`. The manifest is what
:class:`pyg_atompack.stream.LocalSource` and ``RemoteSource`` read::

    {"format": "pyg_atompack-shards/1",
     "shards": [{"name": ..., "records": ..., "bytes": ..., "sha256": ...}, ...],
     "total_records": N}
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import Data

from pyg_atompack import atp

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "pyg_atompack-shards/1"
SHARD_FORMATS = ("pt", "atp")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def frames_to_data(
    atomic_numbers: np.ndarray,
    positions: np.ndarray,
    energy: np.ndarray,
    forces: np.ndarray,
) -> list[Data]:
    """Turn stacked frames of one molecule into PyG ``Data`` objects.

    Args:
        atomic_numbers: ``(n,)`` atomic numbers shared by every frame.
        positions: ``(F, n, 3)`` positions in Å.
        energy: ``(F,)`` energies in eV.
        forces: ``(F, n, 3)`` forces in eV/Å.

    Returns:
        ``F`` ``Data`` objects with ``z``, ``pos``, ``energy``, ``forces`` and ``natoms``
        (attribute names as in ``docs/architecture.md``), each tensor an owned copy.
    """
    z = torch.as_tensor(np.asarray(atomic_numbers), dtype=torch.long)
    frames = []
    for index in range(len(positions)):
        frames.append(
            Data(
                z=z.clone(),
                # torch.tensor copies: every Data owns exactly its own bytes
                pos=torch.tensor(positions[index], dtype=torch.float32),
                energy=torch.tensor([energy[index]], dtype=torch.float32),
                forces=torch.tensor(forces[index], dtype=torch.float32),
                natoms=torch.tensor([z.numel()], dtype=torch.long),
            )
        )
    return frames


def _write_pt(path: Path, atomic_numbers, positions, energy, forces) -> None:
    torch.save(frames_to_data(atomic_numbers, positions, energy, forces), path)


def _write_atp(path: Path, atomic_numbers, positions, energy, forces) -> None:
    count = len(positions)
    numbers = np.asarray(atomic_numbers, dtype=np.uint8)
    numbers = np.broadcast_to(numbers, (count, numbers.size))
    with atp.Writer(path, compression="none", overwrite=True) as writer:
        writer.add_batch(
            np.ascontiguousarray(positions, dtype=np.float32),
            np.ascontiguousarray(numbers),
            energy=np.asarray(energy, dtype=np.float64),
            forces=np.ascontiguousarray(forces, dtype=np.float32),
        )


_WRITERS = {"pt": _write_pt, "atp": _write_atp}


def write_manifest(directory: Path, shard_files: Sequence[Path], records: Sequence[int]) -> Path:
    """Describe ``shard_files`` in ``directory/manifest.json``.

    Args:
        directory: Folder that holds the shards (names are stored relative to it).
        shard_files: Shard paths in stream order.
        records: Number of frames in each shard.

    Returns:
        The path of the manifest.
    """
    entries = [
        {
            "name": path.name,
            "records": int(count),
            "bytes": path.stat().st_size,
            "sha256": _sha256(path),
        }
        for path, count in zip(shard_files, records)
    ]
    manifest = {
        "format": MANIFEST_FORMAT,
        "shards": entries,
        "total_records": int(sum(records)),
    }
    target = directory / MANIFEST_NAME
    partial = target.with_suffix(".json.partial")
    partial.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(partial, target)  # a reader never sees a half-written manifest
    return target


def write_shards(
    root: str | os.PathLike,
    atomic_numbers: np.ndarray,
    positions: np.ndarray,
    energy: np.ndarray,
    forces: np.ndarray,
    *,
    shard_size: int,
    formats: Sequence[str] = SHARD_FORMATS,
) -> dict[str, Path]:
    """Split frames into shards of ``shard_size`` and write each requested format.

    Args:
        root: Output folder; each format goes to ``root/<format>/``.
        atomic_numbers: ``(n,)`` atomic numbers.
        positions: ``(F, n, 3)`` positions (Å).
        energy: ``(F,)`` energies (eV).
        forces: ``(F, n, 3)`` forces (eV/Å).
        shard_size: Frames per shard (the last shard may be shorter).
        formats: Any of ``"pt"`` and ``"atp"``. (default: both)

    Returns:
        ``{format: manifest path}``.
    """
    if shard_size < 1:
        raise ValueError(f"write_shards: shard_size must be >= 1, got {shard_size}")
    unknown = set(formats) - set(SHARD_FORMATS)
    if unknown:
        raise ValueError(f"write_shards: unknown formats {sorted(unknown)}; use {SHARD_FORMATS}")
    count = len(positions)
    if not (len(energy) == len(forces) == count) or count == 0:
        raise ValueError(
            f"write_shards: positions, energy and forces must hold the same non-zero number "
            f"of frames, got {count}, {len(energy)}, {len(forces)}"
        )
    manifests = {}
    for shard_format in formats:
        directory = Path(root) / shard_format
        directory.mkdir(parents=True, exist_ok=True)
        files, records = [], []
        for shard_index, start in enumerate(range(0, count, shard_size)):
            stop = min(start + shard_size, count)
            path = directory / f"shard_{shard_index:05d}.{shard_format}"
            _WRITERS[shard_format](
                path, atomic_numbers, positions[start:stop], energy[start:stop], forces[start:stop]
            )
            files.append(path)
            records.append(stop - start)
        manifests[shard_format] = write_manifest(directory, files, records)
    return manifests


def manifest_is_intact(manifest_path: str | os.PathLike) -> bool:
    """Whether a manifest exists and every shard it lists has its recorded size and hash.

    Args:
        manifest_path: Path of a ``manifest.json``.

    Returns:
        :obj:`True` when the cached shards can be reused as they are.
    """
    path = Path(manifest_path)
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        for entry in manifest["shards"]:
            shard = path.parent / entry["name"]
            if shard.stat().st_size != entry["bytes"] or _sha256(shard) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return manifest.get("format") == MANIFEST_FORMAT
