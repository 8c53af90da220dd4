"""Each package's public API is its ``__all__``; a name that moved lives in one place only.

Nothing has been released, so a name that leaves a package is moved with its users:
no module ``__getattr__`` resolves old names, no module re-exports another's, and no
keyword is kept under an old name.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from pyg_atompack.transport import RetryPolicy

PACKAGE = Path(__file__).resolve().parents[1] / "pyg_atompack"
PACKAGES = ["pyg_atompack", "pyg_atompack.atp", "pyg_atompack.convert", "pyg_atompack.data",
            "pyg_atompack.graph", "pyg_atompack.hub", "pyg_atompack.pyg",
            "pyg_atompack.stream", "pyg_atompack.transport"]

# names that left a package's list, and the one module they live in
MOVED = [
    ("pyg_atompack.hub", "fetch_bytes", "pyg_atompack.hub.transfer"),
    ("pyg_atompack.hub", "fetch_range", "pyg_atompack.hub.transfer"),
    ("pyg_atompack.hub", "is_commit_sha", "pyg_atompack.hub.remote"),
    ("pyg_atompack.hub", "RemoteFile", "pyg_atompack.remote"),
    ("pyg_atompack.convert", "FORMATS", "pyg_atompack.convert.registry"),
    ("pyg_atompack.convert", "MANIFEST_FORMAT", "pyg_atompack.convert.shards"),
    ("pyg_atompack.graph", "plan_blocks", "pyg_atompack.graph._blocks"),
    ("pyg_atompack.transport", "RangeReader", "pyg_atompack.remote.ranges"),
    ("pyg_atompack.stream", "PYG_SAFE_GLOBALS", "pyg_atompack.pyg"),
    ("pyg_atompack.stream", "RetryPolicy", "pyg_atompack.transport"),
    ("pyg_atompack.atp", "select_header", "pyg_atompack.atp.header"),
    ("pyg_atompack.atp", "schema_block_fields", "pyg_atompack.atp.fields"),
]


@pytest.mark.parametrize(("package", "name", "home"), MOVED)
def test_a_moved_name_lives_in_its_home_only(package, name, home):
    module = importlib.import_module(package)
    assert name not in getattr(module, "__all__", ())
    with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
        getattr(module, name)
    assert hasattr(importlib.import_module(home), name)


@pytest.mark.parametrize("gone", ["pyg_atompack._moved", "pyg_atompack.stream.retry",
                                  "pyg_atompack.data.memmap_layout",
                                  # one remote layer: one backend per scheme, one source
                                  "pyg_atompack.remote.urls", "pyg_atompack.hub.url_files",
                                  "pyg_atompack.stream.http", "pyg_atompack.stream.hub_source",
                                  "pyg_atompack.stream.objectstore_source"])
def test_old_module_locations_are_gone(gone):
    # looked up in this checkout: an editable install of another one may still serve it
    spec = importlib.util.find_spec(gone)
    assert spec is None or not Path(spec.origin).is_relative_to(PACKAGE)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_listed_name_resolves_and_a_lazy_package_resolves_no_other(package):
    module = importlib.import_module(package)
    assert not {name for name in module.__all__ if not hasattr(module, name)}
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    lazy = [node for node in tree.body if isinstance(node, ast.FunctionDef)
            and node.name == "__getattr__"]
    # the only module __getattr__ allowed imports torch-backed names on first use
    assert not any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "__getattr__" in
                   ast.unparse(node).split("=")[0] for node in tree.body)
    if lazy:
        for name in ("fetch_bytes", "RetryPolicy", "memmap_layout_old", "no_such_thing"):
            with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
                getattr(module, name)


def test_nothing_in_the_package_warns_about_deprecation():
    found = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
             if "DeprecationWarning" in path.read_text(encoding="utf-8")]
    assert found == []


def test_keywords_are_taken_under_their_one_name():
    from pyg_atompack.remote.objectstore import ObjectStore
    from pyg_atompack.stream import ShardStreamDataset, SourceOptions

    assert "split_first" not in inspect.signature(ShardStreamDataset).parameters
    # per-source options live on SourceOptions only, not beside it on the dataset
    assert "split_shards" not in inspect.signature(ShardStreamDataset).parameters
    assert "split_shards" in inspect.signature(SourceOptions).parameters
    # retries and timeouts come from the one RetryPolicy: no keyword is read as one of them
    store = ObjectStore("s3://bucket/prefix/", retries=1)
    assert store.retry == RetryPolicy()


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
        "ShardStreamDataset", "SourceOptions", "open_source", "Source", "ShardInfo",
        "CancelToken", "ShardBuffer", "LocalSource", "RemoteSource", "decode_shard",
        "ShardFormat", "register_shard_format", "StreamError",
        "ShardFetchError", "ShardIntegrityError",
        "ShardDecodeError", "UnsafePayloadError"}
    # reading, writing and checking files, what readers return, the errors and warnings
    assert {"open", "Reader", "ShardedReader", "RecordReader", "Writer", "Molecule", "Header",
            "FieldInfo", "describe", "verify", "find_shards", "AtpError"} <= set(atp.__all__)
    assert not {name for name in atp.__all__ if not hasattr(atp, name)}
    assert all(name.endswith(("Error", "Warning")) for name in set(atp.__all__) - {
        "open", "Reader", "ShardedReader", "RecordReader", "Writer", "Molecule", "Header",
        "FieldInfo", "describe", "verify", "find_shards"})
