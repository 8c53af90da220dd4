"""Multi-hundred-MB `.atp` files for the record-block and remote random-access tests.

Records are molecules of 600-900 atoms (about 17 KB stored) whose ``energy`` is their
record index, so a test can tell every record apart. Positions are quantised to 1/64
so that zstd has something to compress.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pyg_atompack import atp

BATCH = 64


def write_big_atp(path: Path, records: int, *, compression: str = "none",
                  seed: int = 0, start: int = 0) -> int:
    """Write about ``records`` records (a multiple of 64, ~17 KB each); returns the count.

    Record ``i`` has energy ``start + i``.
    """
    rng = np.random.default_rng(seed)
    written = 0
    with atp.Writer(path, compression=compression) as writer:
        while written < records:
            n = int(rng.integers(600, 900))
            pos = np.round(rng.normal(size=(BATCH, n, 3)) * 64).astype(np.float32) / 64
            z = rng.integers(1, 90, (BATCH, n)).astype(np.uint8)
            forces = np.round(rng.normal(size=(BATCH, n, 3)) * 16).astype(np.float32) / 16
            energy = np.arange(start + written, start + written + BATCH, dtype=np.float64)
            writer.add_batch(pos, z, energy=energy, forces=forces)
            written += BATCH
    return written


def write_manifest(root: Path, names: list[str], records: list[int]) -> Path:
    """The converter's ``manifest.json``, hashing each file in chunks."""
    shards = []
    for name, count in zip(names, records):
        digest = hashlib.sha256()
        with open(root / name, "rb") as handle:
            while chunk := handle.read(8 << 20):
                digest.update(chunk)
        shards.append({"name": name, "records": count, "bytes": (root / name).stat().st_size,
                       "sha256": digest.hexdigest()})
    path = root / "manifest.json"
    path.write_text(json.dumps({"shards": shards}), encoding="utf-8")
    return path
