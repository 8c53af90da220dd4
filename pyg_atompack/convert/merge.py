"""Combine the parts of a partitioned conversion into one shard directory.

Each part (``pyg-atompack convert ... --part I/N``) is a shard directory whose
manifest carries a ``"part"`` entry (its index, the part count, its first global
shard number, the shard size and the source's record count). Merging checks that
the parts are exactly parts ``0 .. N-1`` of one conversion with contiguous shard
numbers, verifies every shard against its part's manifest (size and sha256),
and publishes a directory with every shard (hard links where the file system
allows, copies otherwise; the parts stay as they are) and one manifest in global
order: the directory a single conversion would have written.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .base import _publish, _remove
from .errors import ConvertError
from .shards import MANIFEST_FORMAT, MANIFEST_NAME, check_manifest, read_manifest

# manifest fields that describe one part, not the merged whole
_PER_PART = ("format", "shards", "total_records", "created_at_utc", "part")
# fields every part must agree on
_SHARED = ("count", "shard_size", "source_records")


def _load_part(directory: Path) -> dict[str, Any]:
    manifest = read_manifest(directory)
    if manifest is None:
        raise ConvertError(directory, f"no {MANIFEST_FORMAT} manifest: not a converted part")
    part = manifest.get("part")
    if not isinstance(part, dict):
        raise ConvertError(directory / MANIFEST_NAME,
                           "has no 'part' entry: not written by convert --part I/N")
    problems = check_manifest(directory)
    if problems:
        raise ConvertError(directory, "; ".join(problems))
    return manifest


def merge_parts(out: str | os.PathLike, part_dirs: list[str | os.PathLike], *,
                overwrite: bool = False) -> int:
    """Merge converted parts into one shard directory with one manifest.

    Args:
        out: The merged directory (must not exist unless ``overwrite``).
        part_dirs: The part directories, in any order.
        overwrite: Replace an existing ``out``. (default: :obj:`False`)

    Returns:
        int: The number of records in the merged directory.

    Raises:
        ConvertError: If a part is missing, repeated, damaged (a shard differs from
            its manifest), from a different conversion, or not contiguous with the
            others; the message names the directory.
    """
    out = Path(out)
    if not part_dirs:
        raise ConvertError(out, "no part directories to merge")
    parts = sorted(((Path(d), _load_part(Path(d))) for d in part_dirs),
                   key=lambda item: item[1]["part"]["index"])
    first_dir, first = parts[0]
    count = first["part"]["count"]
    for directory, manifest in parts:
        for key in _SHARED:
            if manifest["part"].get(key) != first["part"].get(key):
                raise ConvertError(directory, f"part {key} {manifest['part'].get(key)!r} "
                                              f"differs from {first_dir}'s "
                                              f"{first['part'].get(key)!r}: another conversion")
    indices = [manifest["part"]["index"] for _, manifest in parts]
    missing = sorted(set(range(count)) - set(indices))
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if missing or repeated:
        what = [f"missing part(s) {', '.join(f'{i}/{count}' for i in missing)}"] if missing else []
        what += [f"part(s) {', '.join(map(str, repeated))} given twice"] if repeated else []
        raise ConvertError(out, "cannot merge: " + "; ".join(what))
    entries: list[dict[str, Any]] = []
    for directory, manifest in parts:
        if manifest["part"]["first_shard"] != len(entries):
            raise ConvertError(directory, f"starts at shard {manifest['part']['first_shard']}, "
                                          f"the parts before it end at {len(entries)}")
        entries += [(directory, shard) for shard in manifest["shards"]]
    total = sum(int(shard["records"]) for _, shard in entries)
    if total != first["part"]["source_records"]:
        raise ConvertError(out, f"the parts hold {total} records, the source "
                                f"{first['part']['source_records']}")

    if out.exists() and not overwrite:
        raise ConvertError(out, "destination already exists (use overwrite to replace)")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _remove(tmp)
    try:
        tmp.mkdir()
        for directory, shard in entries:
            source, target = directory / shard["name"], tmp / shard["name"]
            try:
                os.link(source, target)
            except OSError:  # another file system, or no hard links there
                shutil.copyfile(source, target)
        manifest = {
            "format": MANIFEST_FORMAT,
            "shards": [shard for _, shard in entries],
            "total_records": total,
            **{k: v for k, v in first.items() if k not in _PER_PART},
            "created_at_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        # the same key order as a single conversion's manifest
        ordered = {"format": manifest.pop("format"), "shards": manifest.pop("shards"),
                   "total_records": manifest.pop("total_records"),
                   "shard_format": manifest.pop("shard_format", None),
                   "created_at_utc": manifest.pop("created_at_utc"), **manifest}
        text = json.dumps(ordered, indent=1, ensure_ascii=False) + "\n"
        (tmp / MANIFEST_NAME).write_text(text, encoding="utf-8")
    except BaseException:
        _remove(tmp)
        raise
    _publish(tmp, out)
    return total
