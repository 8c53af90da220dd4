"""The converter's shard manifest (``manifest.json``), read the same way by every source."""

from __future__ import annotations

from pyg_atompack.transport.errors import TransportError

MANIFEST_NAME = "manifest.json"


class ManifestError(TransportError, ValueError):
    """A ``manifest.json`` does not have the documented shape."""


def read_manifest_records(document: dict, origin: str) -> dict[str, dict]:
    """Parse the shard manifest written by the converter.

    The manifest shape is ``{"shards": [{"name": str, "records": int, "bytes": int,
    "sha256": str}, ...]}``; ``name`` is relative to the manifest's directory. Documents
    without a ``"shards"`` list (e.g. atompack's own ``{"output_files": [...]}``) give
    an empty mapping.

    Args:
        document (dict): The parsed JSON document.
        origin (str): Where it came from, for error messages.

    Returns:
        ``{name: entry}`` for every listed shard.
    """
    shards = document.get("shards") if isinstance(document, dict) else None
    if shards is None:
        return {}
    if not isinstance(shards, list):
        raise ManifestError(f"{origin}: 'shards' must be a list")
    entries: dict[str, dict] = {}
    for position, entry in enumerate(shards):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ManifestError(f"{origin}: shards[{position}] needs a string 'name'")
        for key, kind in (("records", int), ("bytes", int), ("sha256", str)):
            value = entry.get(key)
            if value is not None and not isinstance(value, kind):
                raise ManifestError(
                    f"{origin}: shards[{position}] ({entry['name']}): '{key}' must be "
                    f"{kind.__name__}, got {value!r}"
                )
        entries[entry["name"]] = entry
    return entries
