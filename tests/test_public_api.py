"""Names dropped from a package's public API keep working for one release, with a warning."""

from __future__ import annotations

import importlib

import pytest

MOVED = [
    ("pyg_atompack.hub", "fetch_bytes", "pyg_atompack.hub.transfer"),
    ("pyg_atompack.hub", "fetch_range", "pyg_atompack.hub.transfer"),
    ("pyg_atompack.hub", "is_commit_sha", "pyg_atompack.hub.remote"),
    ("pyg_atompack.convert", "FORMATS", "pyg_atompack.convert.registry"),
    ("pyg_atompack.convert", "MANIFEST_FORMAT", "pyg_atompack.convert.shards"),
    ("pyg_atompack.graph", "plan_blocks", "pyg_atompack.graph._blocks"),
    ("pyg_atompack.transport", "RangeReader", "pyg_atompack.transport.ranges"),
    ("pyg_atompack.data.memmap_layout", "MemmapLayout", "pyg_atompack.memmap_layout"),
    ("pyg_atompack.stream", "PYG_SAFE_GLOBALS", "pyg_atompack.pyg"),
    ("pyg_atompack.stream", "RetryPolicy", "pyg_atompack.transport"),
    ("pyg_atompack.atp", "select_header", "pyg_atompack.atp.header"),
    ("pyg_atompack.atp", "index_n_atoms", "pyg_atompack.atp.index"),
    ("pyg_atompack.atp", "schema_block_fields", "pyg_atompack.atp.fields"),
]


@pytest.mark.parametrize(("package", "name", "home"), MOVED)
def test_moved_names_warn_and_still_resolve(package, name, home):
    module = importlib.import_module(package)
    assert name not in getattr(module, "__all__", ())
    with pytest.warns(DeprecationWarning, match=f"{package}.{name} .* import it from {home}"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home), name)


def test_unknown_names_are_still_attribute_errors():
    from pyg_atompack import convert, hub

    with pytest.raises(AttributeError, match="no attribute 'fetch_everything'"):
        hub.fetch_everything  # noqa: B018
    assert not hasattr(convert, "no_such_thing")
    from pyg_atompack.transport import http  # a submodule is still importable by name

    assert http.__name__ == "pyg_atompack.transport.http"


def test_stream_and_atp_list_what_users_need():
    from pyg_atompack import atp, stream

    # a shard stream, its sources (and what a custom one needs), its errors
    assert set(stream.__all__) == {
        "ShardStreamDataset", "open_source", "Source", "ShardInfo", "CancelToken",
        "ShardBuffer", "LocalSource", "HTTPSource", "HubSource", "ObjectStoreSource",
        "decode_shard", "StreamError", "ShardFetchError", "ShardIntegrityError",
        "ShardDecodeError", "UnsafePayloadError"}
    # reading, writing and checking files, what readers return, the errors and warnings
    assert {"open", "Reader", "ShardedReader", "Writer", "Molecule", "Header", "FieldInfo",
            "describe", "verify", "find_shards", "AtpError"} <= set(atp.__all__)
    assert not {name for name in atp.__all__ if not hasattr(atp, name)}
    assert all(name.endswith(("Error", "Warning")) for name in set(atp.__all__) - {
        "open", "Reader", "ShardedReader", "Writer", "Molecule", "Header", "FieldInfo",
        "describe", "verify", "find_shards"})
