"""The layering of docs/architecture.md stays true: what each layer never loads.

Each layer is imported, with every one of its modules, in a fresh interpreter, and
``sys.modules`` is checked against :data:`NEVER_LOADS`. The torch-free layers are also
made to do their typical work there (read a file, read a remote `.atp` by record over a
loopback HTTP server, list and read an S3 bucket on moto, list and read a repository on
the loopback Hub, open an object-store URL), since a lazy import inside a function is
as much a dependency as one at the top of a module. ``docs/architecture.md`` states the
same table; the last test checks that it does.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from servers.fake_hub import serve_fake_hub, write_reference_shard
from servers.http_server import serve_directory
from servers.stores import use_store

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pyg_atompack"

_TORCH = ("torch", "torch_geometric")

#: Layer -> the packages and modules it never loads (nor anything below them), whether
#: imported or at work. The one source of truth: docs/architecture.md states this table.
NEVER_LOADS: dict[str, tuple[str, ...]] = {
    "pyg_atompack": _TORCH,
    "pyg_atompack.atp": (*_TORCH, "pyg_atompack.transport", "pyg_atompack.hub",
                         "pyg_atompack.remote", "pyg_atompack.stream", "pyg_atompack.data",
                         "pyg_atompack.convert", "pyg_atompack.pyg", "pyg_atompack.graph"),
    "pyg_atompack.memmap_layout": (*_TORCH, "pyg_atompack.transport", "pyg_atompack.hub",
                                   "pyg_atompack.remote", "pyg_atompack.stream",
                                   "pyg_atompack.data", "pyg_atompack.convert",
                                   "pyg_atompack.pyg", "pyg_atompack.graph"),
    "pyg_atompack.transport": (*_TORCH, "pyg_atompack.hub", "pyg_atompack.remote",
                               "pyg_atompack.stream", "pyg_atompack.data",
                               "pyg_atompack.convert", "pyg_atompack.pyg",
                               "pyg_atompack.graph"),
    "pyg_atompack.remote": (*_TORCH, "pyg_atompack.hub", "pyg_atompack.stream",
                            "pyg_atompack.data", "pyg_atompack.convert", "pyg_atompack.pyg",
                            "pyg_atompack.graph"),
    "pyg_atompack.hub": (*_TORCH, "pyg_atompack.stream", "pyg_atompack.data",
                         "pyg_atompack.pyg", "pyg_atompack.graph"),
    "pyg_atompack.data": ("pyg_atompack.stream",),
    "pyg_atompack.stream": ("pyg_atompack.data",),
    "pyg_atompack.convert": ("pyg_atompack.stream",),
    "pyg_atompack.pyg": ("pyg_atompack.data", "pyg_atompack.stream", "pyg_atompack.convert"),
}


def _layers() -> list[str]:
    # a layer that does not exist (yet) is no layer to check
    return [layer for layer in NEVER_LOADS
            if (ROOT / (layer.replace(".", "/") + ".py")).is_file()
            or (ROOT / layer.replace(".", "/") / "__init__.py").is_file()]


def _loaded_by(code: str, env: dict[str, str] | None = None) -> list[str]:
    """Every module name in ``sys.modules`` of a fresh interpreter after ``code`` ran."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    environment = dict(os.environ if env is None else env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [environment.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _broken(layer: str, modules: list[str]) -> list[str]:
    """The modules of ``modules`` that ``layer`` must never load."""
    return [module for module in modules for banned in NEVER_LOADS[layer]
            if module == banned or module.startswith(banned + ".")]


def _check(layer: str, modules: list[str]) -> None:
    broken = _broken(layer, modules)
    # the culprits of a violation are the project's own modules loaded along with it
    assert not broken, (f"{layer} loaded {len(broken)} modules it must not: {broken[:8]}; "
                        f"project modules loaded: "
                        f"{[m for m in modules if m.startswith('pyg_atompack')]}")


def _import_everything(layer: str) -> str:
    if layer == "pyg_atompack":  # the top level: its lazy names stay lazy
        return "import pyg_atompack"
    return f"""
        import importlib, pkgutil
        package = importlib.import_module({layer!r})
        for module in pkgutil.walk_packages(getattr(package, "__path__", []), {layer + "."!r}):
            importlib.import_module(module.name)
    """


def test_the_rule_table_checks_what_it_says():
    # a module under a banned package is caught, a sibling with a longer name is not
    assert _broken("pyg_atompack.atp", ["torch", "torch.nn", "pyg_atompack.hub.remote"]) == [
        "torch", "torch.nn", "pyg_atompack.hub.remote"]
    assert _broken("pyg_atompack.transport", ["torchvision_like", "pyg_atompack.hubs"]) == []
    assert {"pyg_atompack", "pyg_atompack.atp", "pyg_atompack.transport",
            "pyg_atompack.hub"} <= set(_layers())
    # the child does see what the code imports
    assert "torch" in _loaded_by("import pyg_atompack.data.dataset")


@pytest.mark.parametrize("layer", _layers())
def test_importing_a_layer_loads_nothing_it_must_not(layer):
    _check(layer, _loaded_by(_import_everything(layer)))


def _layer_files(layer: str) -> list[Path]:
    path = ROOT / layer.replace(".", "/")
    if layer == "pyg_atompack":
        return [PACKAGE / "__init__.py"]
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def _named_modules(file: Path) -> list[tuple[int, str]]:
    """Every module a file names for import: ``import``/``from`` statements anywhere (lazy
    ones inside functions too), and strings that are nothing but a module name (what
    ``importlib.import_module`` gets)."""
    module = file.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    names = []
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and re.fullmatch(r"(torch|torch_geometric|pyg_atompack)(\.\w+)*", node.value)):
            names.append((node.lineno, node.value))
    return names


@pytest.mark.parametrize("layer", _layers())
def test_no_module_of_a_layer_names_what_it_must_not_load(layer):
    # lazy imports are dependencies too: an import inside a function that no test calls
    # in a fresh interpreter is still caught here
    found = [f"{file.relative_to(ROOT)}:{line}: {name}" for file in _layer_files(layer)
             for line, name in _named_modules(file) if _broken(layer, [name])]
    assert not found, "\n".join(found)


def test_the_format_layer_at_work_is_numpy_only(tmp_path):
    write_reference_shard(tmp_path / "a.atp", 4, 3, seed=1)
    write_reference_shard(tmp_path / "b.atp", 3, 2, seed=2)
    loaded = _loaded_by(f"""
        from pyg_atompack import atp
        with atp.open({str(tmp_path)!r}) as dataset:
            assert len(dataset) == 7
            assert float(dataset[6].energy) == 202
            batch = dataset.read_batch([0, 5], fields=["energy", "forces"])
            assert list(batch["energy"]) == [100, 201]
        atp.verify({str(tmp_path / "a.atp")!r})
        atp.describe({str(tmp_path / "a.atp")!r})
    """)
    _check("pyg_atompack.atp", loaded)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("www")
    write_reference_shard(root / "part_0.atp", 3, 2, seed=1)
    write_reference_shard(root / "part_1.atp", 4, 3, seed=2)
    yield from serve_directory(root)


def test_remote_reads_a_remote_atp_by_record_without_torch(served, tmp_path):
    loaded = _loaded_by(f"""
        from pyg_atompack.remote.record_reader import open_remote_atp, range_readers
        readers = range_readers([{served.url("part_0.atp")!r}, {served.url("part_1.atp")!r}])
        with open_remote_atp(readers, cache_dir={str(tmp_path / "pages")!r}) as dataset:
            assert len(dataset) == 7
            assert float(dataset[4].energy) == 201
    """)
    _check("pyg_atompack.remote", loaded)


def test_hub_lists_and_reads_without_torch(served, tmp_path):
    for fake in serve_fake_hub():
        files = {"d/" + path.name: path.read_bytes() for path in served.root.glob("*.atp")}
        sha = fake.commit("org/layers", files)
        loaded = _loaded_by(f"""
            from pyg_atompack import hub
            assert hub.resolve_revision("org/layers", "main", token=False) == {sha!r}
            listed = hub.list_remote_files("org/layers", "d", revision={sha!r}, token=False)
            assert [f.name for f in listed] == ["d/part_0.atp", "d/part_1.atp"]
            hub.download(listed[0], {str(tmp_path / "downloads")!r}, token=False)
            with hub.open_hub_atp("org/layers", "d", revision="main", token=False,
                                  cache_dir={str(tmp_path / "cache")!r}) as dataset:
                assert float(dataset[6].energy) == 203
                paged = dataset.by_record(cache_dir={str(tmp_path / "pages")!r})
                assert float(paged[0].energy) == 100
            with hub.open_remote_atp({served.url("part_1.atp")!r},
                                     cache_dir={str(tmp_path / "url")!r}) as dataset:
                assert float(dataset[3].energy) == 203
        """, env=fake.subprocess_env())
        _check("pyg_atompack.hub", loaded)


def test_object_store_work_loads_no_torch(store_servers, monkeypatch, tmp_path):
    server = store_servers("s3")
    server.create_bucket("layers")
    write_reference_shard(tmp_path / "atp" / "part_0.atp", 3, 2, seed=1)
    server.upload_directory(tmp_path / "atp", "layers", "atp")
    use_store(monkeypatch, server)
    monkeypatch.setenv("PYG_ATOMPACK_CACHE", str(tmp_path / "objects"))
    url = "s3://layers/atp/"
    head = (tmp_path / "atp" / "part_0.atp").read_bytes()[:64]
    remote = _loaded_by(f"""
        from pyg_atompack.remote.backends import open_backend
        from pyg_atompack.remote.record_reader import open_remote_atp, range_readers
        store = open_backend({url!r})
        objects = store.list()
        assert [o.name for o in objects] == ["part_0.atp"]
        assert store.read_range(objects[0], 0, 64) == {head!r}
        store.download(objects[0])
        with open_remote_atp(range_readers({url!r}),
                             cache_dir={str(tmp_path / "pages")!r}) as dataset:
            assert float(dataset[2].energy) == 102
    """)
    _check("pyg_atompack.remote", remote)
    hub = _loaded_by(f"""
        from pyg_atompack import hub
        with hub.open_remote_atp({url!r}) as dataset:
            assert float(dataset[1].energy) == 101
    """)
    _check("pyg_atompack.hub", hub)


def _documented_rules() -> dict[str, tuple[str, ...]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("| layer | never loads |")
    rules = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        layer, banned = (cell.strip() for cell in line.strip("|").split("|"))
        rules[layer.strip("`")] = tuple(re.findall(r"`([\w.]+)`", banned))
    return rules


def test_docs_state_the_same_rules():
    assert _documented_rules() == NEVER_LOADS
