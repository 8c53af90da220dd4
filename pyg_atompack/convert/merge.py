"""Combine the parts of a partitioned conversion into one shard directory.

Each part (``pyg-atompack convert ... --part I/N``) is a shard directory whose
manifest carries a ``"part"`` entry (its index, the part count, its first global
shard number, the shard size and the source's record count). Merging checks that
the parts are exactly parts ``0 .. N-1`` of one conversion with contiguous shard
numbers, verifies every shard against its part's manifest (size and sha256),
re-encodes the shards of parts whose key types are narrower than another
part's (an integer key that a later part stores as a float: the type a single
conversion would have promoted every structure to), and publishes a directory
with every shard (hard links where the file system allows, copies otherwise;
the parts stay as they are) and one manifest in global order: the directory a
single conversion would have written. Metadata frames (groups, kinds of newer
versions) live inside the shards, already in their shard's numbering
(:class:`~.atp_io.CarriedMetadata`), so linked shards keep them as they are and
re-encoded ones carry them through :func:`~.pipeline.reencode`.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .base import _publish, _remove
from .coercion import Kind, kinds_from_json, promote
from .errors import ConvertError, note
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


def _part_kinds(manifest: dict[str, Any]) -> dict[tuple[str, str], Kind]:
    return kinds_from_json(manifest["part"].get("kinds") or {})


def _merged_kinds(parts: list[tuple[Path, dict[str, Any]]]) -> dict[tuple[str, str], Kind]:
    """The type of every key over all parts: what one conversion would have chosen."""
    merged: dict[tuple[str, str], Kind] = {}
    where: dict[tuple[str, str], Path] = {}
    for directory, manifest in parts:
        for slot, kind in _part_kinds(manifest).items():
            old = merged.get(slot)
            wider = kind if old is None else promote(old, kind)
            if wider is None:
                per_atom = slot[0] == "atom_properties"
                raise ConvertError(directory, f"key {slot[1]!r} is {kind.words(per_atom)} "
                                              f"here and {old.words(per_atom)} in "
                                              f"{where[slot]}: no common type; convert the "
                                              f"parts with --cast {slot[1]}=DTYPE or "
                                              f"--drop-key {slot[1]}")
            if wider != old:
                merged[slot], where[slot] = wider, directory
    return merged


def _numbered(entries: list[tuple[Path, dict[str, Any]]]):
    """``(directory, (position within its part, shard))`` for every shard."""
    seen: dict[Path, int] = {}
    for directory, shard in entries:
        position = seen.get(directory, 0)
        seen[directory] = position + 1
        yield directory, (position, shard)


def _reencode(directory: Path, manifest: dict[str, Any], kinds: dict[tuple[str, str], Kind],
              tmp: Path) -> list[dict[str, Any]]:
    """Write one part's shards into ``tmp`` with the merged types; their manifest entries."""
    from .options import WriteOptions
    from .pipeline import reencode

    part = manifest["part"]
    fmt = manifest.get("shard_format", "atp")
    options = WriteOptions(compression=manifest.get("compression", "none"),
                           level=int(manifest.get("compression_level", 3)),
                           shard_size=int(part["shard_size"]),
                           first_shard=int(part["first_shard"]))
    staging = tmp / f".part-{part['index']}"
    reencode(directory, staging, f"{fmt}-shards", options, kinds)
    shards = read_manifest(staging)["shards"]
    for shard in shards:
        os.replace(staging / shard["name"], tmp / shard["name"])
    _remove(staging)
    for (slot, kind) in kinds.items():
        old = _part_kinds(manifest).get(slot)
        if old is not None and old != kind:
            per_atom = slot[0] == "atom_properties"
            note(f"{directory}: key {slot[1]!r} re-encoded from {old.words(per_atom)} to "
                 f"{kind.words(per_atom)}, the type the other parts need")
    return shards


def merge_parts(out: str | os.PathLike, part_dirs: list[str | os.PathLike], *,
                overwrite: bool = False) -> int:
    """Merge converted parts into one shard directory with one manifest.

    Args:
        out (str | os.PathLike): The merged directory (must not exist unless ``overwrite``).
        part_dirs (list[str | os.PathLike]): The part directories, in any order.
        overwrite (bool, optional): Replace an existing ``out``. (default: :obj:`False`)

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
    kinds = _merged_kinds(parts)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _remove(tmp)
    try:
        tmp.mkdir()
        narrower = [(d, m) for d, m in parts
                    if any(kinds[slot] != kind for slot, kind in _part_kinds(m).items())]
        rewritten = {d: _reencode(d, m, kinds, tmp) for d, m in narrower}
        entries = [(d, rewritten[d][i] if d in rewritten else shard)
                   for d, (i, shard) in _numbered(entries)]
        for directory, shard in entries:
            if directory in rewritten:
                continue  # already written into tmp with the merged types
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
