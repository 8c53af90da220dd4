"""The converter's shard manifest (``manifest.json``): the one parser every lister uses.

A manifest is untrusted input: its names and digests are checked here, when it is read,
so a hostile entry fails at listing with a clear error instead of deep in a download.
A ``name`` is either relative to the manifest (checked by
:func:`pyg_atompack.remote.cache.local_name`: no absolute path, ``..``, empty component,
control character, backslash or drive letter) or an absolute ``http(s)://`` URL (a
mirror), whose last path component, URL-decoded, must be a safe file name: that is its
local name in the cache. A ``sha256`` is 64 hex digits (lower-cased here).
"""

from __future__ import annotations

import posixpath
from urllib.parse import unquote, urlsplit

from pyg_atompack.remote import cache as remote_cache
from pyg_atompack.transport.errors import TransportError
from pyg_atompack.transport.redact import redact_url

MANIFEST_NAME = "manifest.json"


class ManifestError(TransportError, ValueError):
    """A ``manifest.json`` does not have the documented shape."""


def check_entry_name(name: str, origin: str) -> str:
    """Check one manifest entry name (see the module docstring).

    Args:
        name (str): The listed name.
        origin (str): Where the manifest came from, for messages.

    Returns:
        ``name``.

    Raises:
        RemoteNameError: The name cannot safely name a file (a
            :class:`~pyg_atompack.transport.TransportError` and :class:`ValueError`).
    """
    def refuse(why: str) -> remote_cache.RemoteNameError:
        where = redact_url(origin)
        return remote_cache.RemoteNameError(
            f"{where}: refusing the remote name {name!r}: {why}", url=where)

    try:
        parts = urlsplit(name)
    except ValueError:
        raise refuse("not a valid URL") from None
    if parts.scheme in ("http", "https") and parts.netloc:
        # a mirror: the whole URL must be clean, and its file name is its local name
        if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\\" in name:
            raise refuse("a NUL, control character or backslash in a URL")
        remote_cache.local_component(unquote(posixpath.basename(parts.path)), url=origin,
                                     field=f"file name of {name!r}")
        return name
    if len(parts.scheme) > 1:  # (one letter is a drive letter: local_name says so)
        raise refuse("a URL that is not http(s) (names are relative to the manifest, or "
                     "http(s) URLs)")
    remote_cache.local_name(name, url=origin)
    if unquote(name) != name:  # what the server will decode it to must be safe too
        remote_cache.local_name(unquote(name), url=origin, field=f"decoded name of {name!r}")
    return name


def read_manifest_records(document: dict, origin: str) -> dict[str, dict]:
    """Parse the shard manifest written by the converter.

    The manifest shape is ``{"shards": [{"name": str, "records": int, "bytes": int,
    "sha256": str}, ...]}``; ``name`` is relative to the manifest's directory (or an
    absolute ``http(s)://`` URL). Documents without a ``"shards"`` list (e.g. atompack's
    own ``{"output_files": [...]}``) give an empty mapping.

    Args:
        document (dict): The parsed JSON document.
        origin (str): Where it came from, for error messages (redacted there).

    Returns:
        ``{name: entry}`` for every listed shard, ``sha256`` lower-cased.

    Raises:
        ManifestError: The document does not have the documented shape.
        RemoteNameError: A name or sha256 cannot be used safely (see the module docstring).
    """
    where = redact_url(origin)
    shards = document.get("shards") if isinstance(document, dict) else None
    if shards is None:
        return {}
    if not isinstance(shards, list):
        raise ManifestError(f"{where}: 'shards' must be a list", url=where)
    entries: dict[str, dict] = {}
    for position, entry in enumerate(shards):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ManifestError(f"{where}: shards[{position}] needs a string 'name'", url=where)
        name = check_entry_name(entry["name"], origin)
        for key, kind in (("records", int), ("bytes", int), ("sha256", str)):
            value = entry.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ManifestError(
                    f"{where}: shards[{position}] ({name}): '{key}' must be "
                    f"{kind.__name__}, got {value!r}", url=where)
        for key in ("records", "bytes"):
            if entry.get(key) is not None and entry[key] < 0:
                raise ManifestError(f"{where}: shards[{position}] ({name}): '{key}' must "
                                    f"not be negative, got {entry[key]}", url=where)
        sha256 = remote_cache.check_sha256(entry.get("sha256"), url=origin,
                                           field=f"sha256 of {name!r}")
        entries[name] = {**entry, "sha256": sha256} if sha256 is not None else entry
    return entries
