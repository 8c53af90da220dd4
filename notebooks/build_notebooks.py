"""Generate the tutorial notebooks (``notebooks/*.ipynb``) from the Python sources below.

The notebooks are written in a "percent" layout so that a change to a tutorial is
reviewed as a diff of plain text: a line ``# %%`` starts a code cell and a line
``# %% [markdown]`` starts a markdown cell (its lines are the markdown itself, not
comments). The generated ``.ipynb`` files carry no outputs and no execution counts;
``tests/test_notebooks.py`` executes them and checks that they match this script.

Usage::

    python notebooks/build_notebooks.py           # (re)write every notebook
    python notebooks/build_notebooks.py --check   # exit 1 if a notebook is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

NOTEBOOK_DIR = Path(__file__).resolve().parent

_CODE_MARK = "# %%"
_MARKDOWN_MARK = "# %% [markdown]"



def parse_cells(source: str) -> list[nbformat.NotebookNode]:
    """Split a percent-format source into notebook cells.

    Args:
        source: Text whose cells start with ``# %%`` (code) or ``# %% [markdown]``
            (markdown) lines. Text before the first marker is ignored.

    Returns:
        The cells, with leading and trailing blank lines removed from each.

    Raises:
        ValueError: If a cell is empty.
    """
    cells: list[nbformat.NotebookNode] = []
    kind: str | None = None
    lines: list[str] = []

    def close() -> None:
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        if not text.strip():
            raise ValueError(f"empty {kind} cell after cell {len(cells)}")
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cells.append(make(text))

    for line in source.splitlines():
        if line.strip() in (_CODE_MARK, _MARKDOWN_MARK):
            close()
            kind = "markdown" if line.strip() == _MARKDOWN_MARK else "code"
            lines = []
        else:
            lines.append(line)
    close()
    return cells


def build_notebook(source: str) -> nbformat.NotebookNode:
    """Build an output-free notebook for the project's Python kernel.

    Args:
        source: The percent-format source (see :func:`parse_cells`).

    Returns:
        A validated nbformat v4 notebook.
    """
    notebook = nbformat.v4.new_notebook()
    notebook.cells = parse_cells(source)
    # fixed cell ids keep regenerated notebooks byte-identical (nbformat draws random ones)
    for number, cell in enumerate(notebook.cells):
        cell.id = f"cell-{number:02d}"
    notebook.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    nbformat.validate(notebook)
    return notebook


def notebook_sources() -> dict[str, str]:
    """The tutorial sources by notebook file name (e.g. ``01_quickstart.ipynb``).

    Returns:
        ``{file name: percent-format source}`` in tutorial order.
    """
    return {
        "01_quickstart.ipynb": QUICKSTART,
        "02_formats.ipynb": FORMATS,
        "03_streaming.ipynb": STREAMING,
        "04_schnet_md17.ipynb": SCHNET_MD17,
    }


def render(notebook: nbformat.NotebookNode) -> str:
    """Serialise a notebook the way it is stored in git (one trailing newline)."""
    return nbformat.writes(notebook).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or check) every notebook.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 1 when ``--check`` finds a stale notebook.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report notebooks that differ from their source")
    args = parser.parse_args(argv)
    stale = []
    for name, source in notebook_sources().items():
        path = NOTEBOOK_DIR / name
        text = render(build_notebook(source))
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python notebooks/build_notebooks.py")
        return 1
    return 0


# ---------------------------------------------------------------------------- sources
# Each tutorial is one string; the cells are separated by the markers described above.

QUICKSTART = r'''
# %% [markdown]
# Quick start: from ASE structures to PyG mini-batches

This tutorial builds a small dataset of periodic crystals with ASE, stores it as an
Atompack `.atp` file, opens it as a PyTorch Geometric dataset and iterates over it
in mini-batches, as a training loop would. At the end we compare the batch-level
`AtompackLoader` with PyG's stock `DataLoader` over the same data.

Everything is written to a temporary directory and runs on a laptop CPU in a few seconds.

# %%
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from ase.build import bulk
from ase.calculators.emt import EMT
from torch_geometric.loader import DataLoader

from pyg_atompack import AtompackDataset, AtompackLoader, atp

WORK = Path(tempfile.mkdtemp(prefix="pyg_atompack-quickstart-"))
print("working in", WORK)

# %% [markdown]
## 1. A small dataset with ASE

We make 400 rattled fcc crystals of seven metals, some of them random binary alloys,
in cells of 4 to 32 atoms, and label them with ASE's EMT potential (energy in eV,
forces in eV/Å, stress in eV/Å³). EMT is a cheap toy potential, which is all a data
pipeline tutorial needs.

# %%
METALS = {"Al": 4.05, "Ni": 3.52, "Cu": 3.61, "Pd": 3.89, "Ag": 4.09, "Pt": 3.92, "Au": 4.08}
rng = np.random.default_rng(0)


def random_crystal(index: int):
    host, other = rng.choice(list(METALS), size=2, replace=False)
    atoms = bulk(host, "fcc", a=METALS[host], cubic=True)
    atoms = atoms.repeat(tuple(rng.integers(1, 3, size=3)))
    if index % 2:  # every other structure is an alloy
        swap = rng.random(len(atoms)) < 0.3
        atoms.symbols[swap] = other
    atoms.rattle(stdev=0.05, seed=index)
    atoms.calc = EMT()
    return atoms


structures = []
for index in range(400):
    atoms = random_crystal(index)
    structures.append({
        "atoms": atoms,
        "energy": atoms.get_potential_energy(),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(voigt=False),
    })
sizes = [len(s["atoms"]) for s in structures]
print(f"{len(structures)} structures, {sum(sizes)} atoms, {min(sizes)}-{max(sizes)} per cell")
print(structures[1]["atoms"])

# %% [markdown]
## 2. Write an `.atp` file

`atp.Writer` appends one structure per `add` call. Positions and atomic numbers are
required; every other field is optional and can differ between records. The file is
committed when the `with` block ends.

# %%
path = WORK / "crystals.atp"
with atp.Writer(path) as writer:
    for s in structures:
        atoms = s["atoms"]
        writer.add(
            atoms.positions, atoms.numbers,
            energy=s["energy"], forces=s["forces"], stress=s["stress"],
            cell=atoms.cell.array, pbc=atoms.pbc, name=atoms.get_chemical_formula(),
        )
print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")

with atp.open(path) as f:
    print(len(f), "records; fields:", ", ".join(f.fields))
    molecule = f[1]
    print(molecule.name, molecule.energy, molecule.forces.shape)

# %% [markdown]
## 3. Open it as a PyG dataset

`AtompackDataset` is a `torch_geometric.data.Dataset` over the memory-mapped file:
there is no processing step and no `root` directory, opening costs only the file's
index, and each item is a `Data` built from one record on demand. The attribute names
are the same for every data source of the project (`z`, `pos`, `energy`, `forces`,
`cell`, `stress`, `pbc`, `natoms`, `name`).

# %%
dataset = AtompackDataset(path)
print(dataset)
data = dataset[1]
print(data)
print("z      ", data.z.tolist())
print("energy ", data.energy, data.energy.dtype)
print("natoms ", data.natoms)
print("cell   ", tuple(data.cell.shape), " pbc", data.pbc.tolist())

# %% [markdown]
Two options worth knowing: `fields=` decodes only what the model needs (positions,
atomic numbers and `natoms` always come along) and `dtype=` casts floating-point
fields, e.g. to float32 for training. Indexing, slicing and `shuffle()` work as for
any PyG dataset.

# %%
lean = AtompackDataset(path, fields=["energy", "forces"], dtype=torch.float32)
print(lean[1])
print(lean[1].pos.dtype, "| a slice:", lean[10:20])

# %% [markdown]
## 4. Mini-batches with `AtompackLoader`

`AtompackLoader` takes the usual `DataLoader` arguments (`batch_size`, `shuffle`,
`num_workers`, a `sampler`, ...). Instead of building one `Data` per structure and
collating them, it reads all records of a batch with one `read_batch` call and
assembles the `Batch` straight from the concatenated arrays. The result is the same
`Batch` PyG's `DataLoader` makes, `batch` and `ptr` vectors included.

# %%
generator = torch.Generator().manual_seed(0)  # a reproducible shuffle
loader = AtompackLoader(dataset, batch_size=32, shuffle=True, generator=generator)
print(loader)
batch = next(iter(loader))
print(batch)
print("graphs in batch:", batch.num_graphs, "| atoms:", batch.num_nodes)
print("energy per atom of the first three:", (batch.energy / batch.natoms)[:3])

# %%
# Same indices through both loaders give the same batches, attribute by attribute.
order = list(range(64))
ours = next(iter(AtompackLoader(dataset, batch_size=64, sampler=order)))
stock = next(iter(DataLoader(dataset, batch_size=64)))
for key in ("z", "pos", "energy", "forces", "cell", "stress", "pbc", "natoms", "batch", "ptr"):
    assert torch.equal(ours[key], stock[key]), key
print("AtompackLoader and DataLoader agree on", ", ".join(ours.keys()))

# %% [markdown]
## 5. How fast is it?

We time full passes over the 400 structures (batch size 32, no workers) with both
loaders, alternating them so that both see the same machine load, and keep the best of
five passes. Absolute times depend on the machine; the ratio is what to look at.
`benchmarks/` holds the careful measurements.

# %%
def seconds_per_epoch(make_loader) -> float:
    started = time.perf_counter()
    for _ in make_loader():
        pass
    return time.perf_counter() - started


candidates = {
    "AtompackLoader": lambda: AtompackLoader(dataset, batch_size=32, shuffle=True),
    "PyG DataLoader": lambda: DataLoader(dataset, batch_size=32, shuffle=True),
}
timings = {name: [] for name in candidates}
for _ in range(5):
    for name, make_loader in candidates.items():
        timings[name].append(seconds_per_epoch(make_loader))
best = {name: min(values) for name, values in timings.items()}
reference = best["PyG DataLoader"]
print(f"{'loader':<16} {'s / epoch':>10} {'structures / s':>15} {'vs DataLoader':>14}")
for name, seconds in best.items():
    print(f"{name:<16} {seconds:>10.4f} {len(dataset) / seconds:>15.0f} "
          f"{reference / seconds:>13.2f}x")

# %%
fig, ax = plt.subplots(figsize=(5, 2.6))
names = list(best)
ax.barh(names, [len(dataset) / best[name] for name in names], color=["tab:blue", "tab:gray"])
ax.set_xlabel("structures per second (higher is better)")
ax.set_title("one pass over 400 crystals, batch size 32")
fig.tight_layout()
plt.show()

# %% [markdown]
## Where next

* `02_formats.ipynb`: converting extxyz, metatrain and other datasets to `.atp`, the
  `pyg-atompack` command line, shard directories and the Hugging Face Hub.
* `03_streaming.ipynb`: streaming shards from a remote server while training.
* `04_schnet_md17.ipynb`: a SchNet energy and force model trained from streamed shards.
'''

FORMATS = r'''
# %% [markdown]
# Formats: converting datasets to `.atp`, the command line, shards and the Hub

Most atomistic datasets arrive as extended XYZ files or in the layouts of a training
framework. This tutorial converts three of them to `.atp` with `pyg_atompack.convert`:

1. an **extxyz** file written by ASE,
2. a metatrain **`MemmapDataset`** directory,
3. a metatrain **`DiskDataset`** zip,

then inspects and checks the results with the `pyg-atompack` command line, cuts a
file into a **directory of shards**, and shows what happens when a dataset is opened
from the **Hugging Face Hub** (against a local stand-in server: no network is used).

# %%
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase.build import bulk
from ase.calculators.emt import EMT

import pyg_atompack
from pyg_atompack import AtompackDataset, MemmapDataset, convert

WORK = Path(tempfile.mkdtemp(prefix="pyg_atompack-formats-"))


def pyg_atompack_cli(*args) -> None:
    """Run the `pyg-atompack` command (as `python -m pyg_atompack.cli`) and show its output."""
    print("$ pyg-atompack", *[Path(a).name if str(a).startswith(str(WORK)) else a for a in args])
    result = subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                            capture_output=True, text=True)
    print(result.stdout + result.stderr + f"(exit status {result.returncode})")


print("formats known to the converter:")
for name, fmt in convert.formats().items():
    print(f"  {name:<12} {fmt.description}")

# %% [markdown]
## 1. Extended XYZ

We label 60 rattled copper and silver cells with ASE's EMT potential and write them
with `ase.io.write`. The extxyz header carries the lattice, the energy, the stress and
any extra `info` keys; per-atom columns carry positions and forces.

# %%
frames = []
for i in range(60):
    symbol, a = ("Cu", 3.61) if i % 3 else ("Ag", 4.09)
    atoms = bulk(symbol, "fcc", a=a, cubic=True).repeat((1, 1, 1 + i % 2))
    atoms.rattle(stdev=0.05, seed=i)
    atoms.calc = EMT()
    atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    atoms.info["config_type"] = "rattled"
    frames.append(atoms)
extxyz = WORK / "train.extxyz"
ase.io.write(extxyz, frames)
print(extxyz.read_text().splitlines()[1][:160], "...")

# %% [markdown]
`convert.convert(src, dst)` detects both formats from the paths, streams the
structures one at a time and only creates `dst` when everything succeeded. The
calculator's energy, forces and stress become the builtin `.atp` fields; other keys
(`config_type`, the per-atom `energies`, ...) are kept as custom properties.
`ReadOptions` renames keys (`energy_key="REF_energy"`, `key_map=...`) and converts
units; `WriteOptions` picks the codec and the shard size.

# %%
count = convert.convert(extxyz, WORK / "train.atp")
print(count, "structures written")
print(AtompackDataset(WORK / "train.atp")[0])

# %% [markdown]
## 2. Inspect and verify with the command line

`pyg-atompack info` reads only the header, schema and index; `verify` decodes every
record and checks it against the index. Both take a file or a shard directory.

# %%
pyg_atompack_cli("info", WORK / "train.atp")
pyg_atompack_cli("verify", WORK / "train.atp")
pyg_atompack_cli("head", WORK / "train.atp", "-n", "2")

# %% [markdown]
## 3. A metatrain `MemmapDataset` directory

metatrain's memmap layout is a directory of flat binary arrays: `ns.npy` (number of
structures), `na.npy` (atom offsets), `x.bin` (positions), `a.bin` (atomic types),
`c.bin` (cells) and one `.bin` file per target. Here we let `pyg_atompack` write one
from the extxyz file (a metatrain user already has it), read it directly with
`MemmapDataset`, and convert it to `.atp` with zstd compression.

# %%
convert.convert(extxyz, WORK / "memmap", dst_format="memmap")
print(sorted(p.name for p in (WORK / "memmap").iterdir()))

memmap = MemmapDataset(WORK / "memmap")
print(memmap, memmap[0], sep="\n")

convert.convert(WORK / "memmap", WORK / "from_memmap.atp",
                write_options=convert.WriteOptions(compression="zstd"))
pyg_atompack_cli("info", WORK / "from_memmap.atp")

# %% [markdown]
The memmap layout stores float32 only (note the warning above about the non-numeric
`config_type`, which it cannot hold), so the round trip matches to float32 precision:

# %%
a, b = AtompackDataset(WORK / "train.atp"), AtompackDataset(WORK / "from_memmap.atp")
print("max |Δforces| =", float((a[5].forces - b[5].forces.double()).abs().max()))
print("energies:", float(a[5].energy), float(b[5].energy))

# %% [markdown]
## 4. A metatrain `DiskDataset` zip

A `DiskDataset` is a zip with one folder per structure: `i/system.mta` (a zip of
`positions.npy`, `cell.npy`, `types.npy`, `pbc.npy`) and one metatensor `TensorMap`
per target, e.g. `i/energy.mts`, whose `positions` gradient is −F. metatrain's
`DiskDatasetWriter` writes these; to keep this tutorial free of the metatrain
dependency we write the same layout with `zipfile` and numpy.

# %%
def npz_bytes(arrays: dict) -> bytes:
    """A zip of `.npy` members, the container of `.mta` and `.mts` files."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in arrays.items():
            member = io.BytesIO()
            np.save(member, array)
            archive.writestr(f"{name}.npy", member.getvalue())
    return buffer.getvalue()


def labels(names, rows) -> np.ndarray:
    return np.array([tuple(row) for row in rows], dtype=[(n, "<i4") for n in names])


def energy_tensormap(index: int, energy: float, forces: np.ndarray) -> bytes:
    """The energy target with its positions gradient (-forces), as metatrain saves it."""
    n = len(forces)
    arrays = {
        "keys": labels(["_"], [[0]]),
        "blocks/0/values": np.array([[energy]]),
        "blocks/0/samples": labels(["system"], [[index]]),
        "blocks/0/properties": labels(["energy"], [[0]]),
        "blocks/0/gradients/positions/values": -forces[:, :, None],
        "blocks/0/gradients/positions/samples": labels(["sample", "atom"],
                                                       [[0, j] for j in range(n)]),
        "blocks/0/gradients/positions/components/0": labels(["xyz"], [[0], [1], [2]]),
    }
    member = io.BytesIO()  # metatrain stores the TensorMap buffer as an np.save'd uint8 array
    np.save(member, np.frombuffer(npz_bytes(arrays), dtype=np.uint8))
    return member.getvalue()


disk_zip = WORK / "train_disk.zip"
with zipfile.ZipFile(disk_zip, "w") as archive:
    for i, atoms in enumerate(frames[:20]):
        system = {"positions": atoms.positions, "cell": atoms.cell.array,
                  "types": atoms.numbers.astype(np.int32), "pbc": atoms.pbc}
        archive.writestr(f"{i}/system.mta", npz_bytes(system))
        archive.writestr(f"{i}/energy.mts", energy_tensormap(
            i, atoms.get_potential_energy(), atoms.get_forces()))
print(zipfile.ZipFile(disk_zip).namelist()[:4], "...")

count = convert.convert(disk_zip, WORK / "from_disk.atp")
from_disk = AtompackDataset(WORK / "from_disk.atp")
print(count, "structures;", from_disk[3])
assert torch.allclose(from_disk[3].forces, torch.from_numpy(frames[3].get_forces()))

# %% [markdown]
## 5. A directory of shards

Large datasets are stored as many `.atp` shards in one directory, with a
`manifest.json` listing their names, record counts, sizes and sha256 checksums. The
converter writes one when given a shard size (`--shard-size` on the command line).
Any tool here opens the directory as one dataset, shards ordered by path.

# %%
pyg_atompack_cli("convert", WORK / "train.atp", WORK / "shards", "--shard-size", "16", "-q")
print(sorted(p.name for p in (WORK / "shards").iterdir()))
pyg_atompack_cli("verify", WORK / "shards")

sharded = AtompackDataset(WORK / "shards")
single = AtompackDataset(WORK / "train.atp")
print(sharded)
assert len(sharded) == len(single)
assert torch.equal(sharded[40].forces, single[40].forces)  # record 40 lives in the third shard

# %% [markdown]
## 6. The Hugging Face Hub path

`AtompackDataset("hf://datasets/{repo_id}@{revision}/{path}")` (or
`AtompackDataset.from_hub(repo_id, path, revision=...)`) opens `.atp` shards stored in a
Hub dataset repository:

1. the revision (a branch or tag) is resolved **once** to a commit, so every
   DataLoader worker and every epoch reads the same files even if the branch moves;
2. the shards under `path` are listed with **one** request, with their sizes and
   sha256 checksums;
3. the length and field list come from small range reads of each shard's header,
   schema and index; no shard is downloaded;
4. a record is read by a range request of the pages holding it, into a disk page
   cache bounded by `cache_bytes`; with `prefetch_shards=True` a shard is instead
   downloaded into the Hub cache the first time a record inside it is read, and
   checked against the listed size and checksum.

To show this without the internet, the test suite's fake Hub (`tests/servers/fake_hub.py`,
a small HTTP server that answers the Hub's API routes) stands in for huggingface.co. We
commit the shard directory to it and pass its URL as `endpoint=`; huggingface_hub's own
client does the talking.

# %%
sys.path.insert(0, str(Path(pyg_atompack.__file__).resolve().parents[1] / "tests"))
from servers.fake_hub import FakeHub  # noqa: E402  (the stand-in; not part of the library)

hub_server = FakeHub().start()
commit = hub_server.commit("demo-org/emt-crystals", {
    f"train/{p.name}": p.read_bytes() for p in sorted((WORK / "shards").iterdir())
})
print("stand-in Hub at", hub_server.endpoint, "| commit", commit[:12])

remote = AtompackDataset.from_hub("demo-org/emt-crystals", "train", revision="main",
                                  endpoint=hub_server.endpoint, cache_dir=WORK / "hf-cache",
                                  cache_bytes=64 << 20)
print(remote)
sample = remote[40]
assert torch.equal(sample.forces, single[40].forces)
pages = list((WORK / "hf-cache" / "pages").rglob("*.page"))
print("downloaded shards after reading record 40:", remote.reader.downloaded_shards(),
      f"| cached pages: {len(pages)}")

whole = AtompackDataset.from_hub("demo-org/emt-crystals", "train", revision="main",
                                 endpoint=hub_server.endpoint, cache_dir=WORK / "hf-cache",
                                 prefetch_shards=True)
assert torch.equal(whole[40].forces, single[40].forces)
print("prefetch_shards=True, downloaded shards after reading record 40:",
      whole.reader.downloaded_shards())

# %%
print("requests the client made:")
for request in hub_server.requests:
    byte_range = request.headers.get("range") or request.headers.get("Range") or ""
    path = request.path.replace(commit, commit[:8])
    print(f"  {request.method:4} {request.status} {path} {byte_range}")
hub_server.stop()

# %% [markdown]
Against the real Hub, the same code needs no `endpoint=`:

```python
dataset = AtompackDataset("hf://datasets/your-org/your-dataset@main/train")
# or, with an explicit cache and token:
dataset = AtompackDataset.from_hub("your-org/your-dataset", "train", revision="v1.0",
                                   cache_dir="/scratch/hf", token=None)  # None: saved login
```

Publish a shard directory with huggingface_hub:

```python
from huggingface_hub import HfApi
HfApi().upload_folder(repo_id="your-org/your-dataset", repo_type="dataset",
                      folder_path="shards", path_in_repo="train")
```

A pinned revision that was read once opens offline from the cache. For scripts started
in a separate process, set `HF_ENDPOINT` in their environment to use a mirror.
`03_streaming.ipynb` shows the other way to consume remote shards: streaming them
through a bounded prefetch queue instead of caching them on disk.
'''

STREAMING = r'''
# %% [markdown]
# Streaming shards from a remote server while training

When a dataset lives on a remote store (an object store, a web server, the Hugging
Face Hub), `ShardStreamDataset` downloads and decodes shards on background threads
while the model trains on the current one. This tutorial streams `.atp` shards from
an HTTP server on `127.0.0.1` that simulates a slow remote store, compares sequential
loading with prefetching, draws the per-shard timeline, and shows what happens when
the server misbehaves.

**The timing model.** With download times D<sub>i</sub> and compute times C<sub>i</sub> per shard,
loading each shard only when it is needed costs

<p align="center">
T<sub>sequential</sub> ≈ Σ<sub>i</sub> D<sub>i</sub> + Σ<sub>i</sub> C<sub>i</sub> ,
</p>

while a one-stage pipeline that fetches shard <i>i</i>+1 during the computation on shard <i>i</i>
costs

<p align="center">
T<sub>pipelined</sub> ≈ D<sub>0</sub> + Σ<sub>i</sub> max(D<sub>i+1</sub>, C<sub>i</sub>)
+ C<sub>last</sub> ,
</p>

so at best the smaller of the two sums disappears behind the larger.

# %%
import logging
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
from ase.build import bulk
from ase.calculators.emt import EMT

import pyg_atompack
from pyg_atompack import ShardStreamDataset, atp, convert, stream, transport

# Show the library's warnings (retries, skipped shards) in the notebook output.
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, force=True,
                    format="%(levelname)s %(name)s: %(message)s")
WORK = Path(tempfile.mkdtemp(prefix="pyg_atompack-streaming-"))

# %% [markdown]
## 1. Shards to serve

480 rattled copper cells with EMT labels, written as eight `.atp` shards of 60
structures plus the `manifest.json` that lists each shard's record count, size and
sha256 checksum.

# %%
with atp.Writer(WORK / "all.atp") as writer:
    for i in range(480):
        atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 1 + i % 2))
        atoms.rattle(stdev=0.05, seed=i)
        atoms.calc = EMT()
        writer.add(atoms.positions, atoms.numbers, energy=atoms.get_potential_energy(),
                   forces=atoms.get_forces(), cell=atoms.cell.array, pbc=atoms.pbc)

served = WORK / "www"
convert.convert(WORK / "all.atp", served, dst_format="atp-shards",
                write_options=convert.WriteOptions(shard_size=60))
print(sorted(p.name for p in served.iterdir()))
print((served / "manifest.json").read_text()[:260], "...")

# %% [markdown]
## 2. A slow server on loopback

The project's test suite has a small HTTP file server with simulated latency,
bandwidth and injected faults (`tests/servers/http_server.py`); it stands in for a
remote store here. Every response waits 50 ms before its first byte and bodies flow at
400 kB/s per connection, so one shard takes about a quarter of a second to download.

`RemoteSource` reads the manifest once; each shard's size and checksum are verified
after download.

# %%
sys.path.insert(0, str(Path(pyg_atompack.__file__).resolve().parents[1] / "tests"))
from servers.http_server import ShardServer  # noqa: E402  (a stand-in, not part of the library)

server = ShardServer(served, ttfb_s=0.05, bandwidth=400e3).start()
source = stream.RemoteSource(server.url("manifest.json"))
print(source)
print(source.list_shards()[0])

# %% [markdown]
## 3. Sequential versus prefetch

The "training step" is a stand-in: it sleeps 80 ms per batch of 20 structures, about
as long as a shard's download per shard, like a GPU step that leaves the CPU free.
`prefetch=0` loads each shard in the consumer's thread when it is needed;
`prefetch=1` keeps one shard downloading ahead; `prefetch=2, concurrency=2` keeps two
downloads in flight. `stats()` sums the per-shard trace of the last pass.

# %%
STEP_S = 0.08


def train_one_pass(dataset: ShardStreamDataset) -> float:
    started = time.perf_counter()
    for _batch in dataset:
        time.sleep(STEP_S)  # the model's forward/backward on _batch would run here
    return time.perf_counter() - started


runs = {}
for prefetch, concurrency in [(0, 1), (1, 1), (2, 2)]:
    dataset = ShardStreamDataset(source, prefetch=prefetch, concurrency=concurrency,
                                 batch_size=20)
    seconds = train_one_pass(dataset)
    runs[f"prefetch={prefetch}, concurrency={concurrency}"] = (seconds, dataset.stats(),
                                                                dataset.trace)

print(f"{'configuration':<28}{'wall s':>8}{'download s':>12}{'compute s':>11}"
      f"{'waited s':>10}{'hidden s':>10}")
for name, (seconds, stats, _) in runs.items():
    print(f"{name:<28}{seconds:>8.2f}{stats['io_s']:>12.2f}{stats['consume_s']:>11.2f}"
          f"{stats['wait_s']:>10.2f}{stats['overlap_s']:>10.2f}")

# %% [markdown]
Check the model against the sequential run's own per-shard times: the one-stage
formula predicts the `prefetch=1` wall time from the measured D<sub>i</sub> and C<sub>i</sub>.

# %%
_, _, sequential_trace = runs["prefetch=0, concurrency=1"]
records = sorted(sequential_trace, key=lambda r: r["download_start_s"])
D = [r["deserialize_finish_s"] - r["download_start_s"] for r in records]
C = [r["consume_finish_s"] - r["consume_start_s"] for r in records]
predicted_sequential = sum(D) + sum(C)
predicted_pipelined = D[0] + sum(max(d, c) for d, c in zip(D[1:], C[:-1])) + C[-1]
print(f"sequential: predicted {predicted_sequential:.2f} s, "
      f"measured {runs['prefetch=0, concurrency=1'][0]:.2f} s")
print(f"prefetch=1: predicted {predicted_pipelined:.2f} s, "
      f"measured {runs['prefetch=1, concurrency=1'][0]:.2f} s")

# %% [markdown]
## 4. The per-shard timeline

Each row is a shard: the upper bar is its download (blue) and decoding (orange), the
lower bar the time the training loop spent on it (green). Sequentially, the bars
never overlap; with prefetching, the next download runs under the current shard's
training.

# %%
def plot_timeline(ax, trace, title):
    records = sorted(trace, key=lambda r: r["download_start_s"])
    for row, r in enumerate(records):
        ax.barh(row - 0.2, r["download_finish_s"] - r["download_start_s"],
                left=r["download_start_s"], height=0.38, color="tab:blue",
                label="download" if row == 0 else None)
        ax.barh(row - 0.2, r["deserialize_finish_s"] - r["download_finish_s"],
                left=r["download_finish_s"], height=0.38, color="tab:orange",
                label="decode" if row == 0 else None)
        ax.barh(row + 0.2, r["consume_finish_s"] - r["consume_start_s"],
                left=r["consume_start_s"], height=0.38, color="tab:green",
                label="train" if row == 0 else None)
    ax.set_yticks(range(len(records)), [r["identifier"] for r in records], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("seconds since the start of the pass")


names = ["prefetch=0, concurrency=1", "prefetch=1, concurrency=1"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharex=True)
for ax, name in zip(axes, names):
    plot_timeline(ax, runs[name][2], name)
axes[0].legend(loc="lower right", fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
## 5. When the server misbehaves

Remote stores fail now and then. Transient failures (timeouts, dropped connections,
HTTP 429 and 5xx) are retried with exponential backoff, honouring the server's
`Retry-After`; a transfer cut short resumes with a `Range` request instead of starting
over. We make the server answer the next request for shard 2 with
`503 Service Unavailable` and `Retry-After: 1` (so the retry waits a full second
instead of the 0.1 s backoff) and drop the connection when 90% of shard 5 has been sent. Both
retries appear in the log (the second one resumes from the bytes already received),
and the pass still yields all 480 structures.

# %%
server.add_fault("shard_00002.atp", "503", retry_after=1)
server.add_fault("shard_00005.atp", "reset", at_fraction=0.9)
patient = stream.RemoteSource(server.url("manifest.json"),
                            retry=transport.RetryPolicy(retries=3, backoff=0.1))
dataset = ShardStreamDataset(patient, prefetch=1)
print("structures:", sum(1 for _ in dataset))
for name in ("shard_00002.atp", "shard_00005.atp"):
    answers = [(r.status, r.range, r.fault) for r in server.requests_for(name)][-2:]
    print(name, "last two requests (status, range, fault):", answers)

# %% [markdown]
A shard that keeps failing ends the pass with a `ShardFetchError` that names the shard
and the URL, after the configured retries, unless the dataset is told to skip it
(`on_error="skip"`), in which case a warning is logged and the other shards are used.

# %%
server.add_fault("shard_00003.atp", "503", times=10)
impatient = stream.RemoteSource(server.url("manifest.json"),
                              retry=transport.RetryPolicy(retries=1, backoff=0.05))
try:
    sum(1 for _ in ShardStreamDataset(impatient, prefetch=1))
except stream.ShardFetchError as error:
    print("ShardFetchError:", error)

skipping = ShardStreamDataset(impatient, prefetch=1, on_error="skip")
print("structures with on_error='skip':", sum(1 for _ in skipping),
      "| skipped shards:", skipping.stats()["skipped"])
server.stop()

# %% [markdown]
## Notes

* Use `ShardStreamDataset` inside `torch_geometric.loader.DataLoader(dataset,
  batch_size=..., num_workers=...)` to decode in several processes; shards are split
  between workers and DDP ranks so each is read once per epoch, and `set_epoch(epoch)`
  reshuffles the shard order.
* `RemoteSource("hf://...")` streams shards from a Hub dataset repository and `LocalSource`
  from a directory; any object with `list_shards()` and `fetch(shard, cancel)` works.
* A `.pt` shard holding a list of `Data` is not unpickled: it is indexed in place and
  each sample is built when taken, so a shard in memory costs about its file size.
  Other `.pt` layouts are loaded by `torch.load` through a restricted unpickler that
  only rebuilds tensors and PyG's own classes (the `weights_only=True` contract, at
  full speed); `trusted=True` allows arbitrary pickles and must only be used for
  sources you trust. `.atp` shards contain no code at all.
'''

SCHNET_MD17 = r'''
# %% [markdown]
# SchNet on energies and forces, streamed from shards

`examples/schnet_md17.py` trains a SchNet model (Schütt et al., 2017) on the energies
and forces of an aspirin trajectory, the MD17 workload (Chmiela et al., 2017), while
the shards stream from a throttled HTTP server: shard <i>i</i>+1 downloads while the model
trains on shard <i>i</i>. Here we call its importable `run()` in a configuration small
enough for a CPU in well under a minute, then plot the loss curve, the force parity
on the held-out shard, and the per-shard overlap table.

Without MD17 on disk, the example generates its own aspirin trajectory with ASE's EMT
potential (Langevin dynamics at 500 K). EMT is not quantum chemistry, so the numbers
say nothing about SchNet's accuracy on MD17; run the script with `--md17 ROOT` for
that.

# %%
import sys
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import pyg_atompack
from pyg_atompack import ShardStreamDataset, stream

# The example and its helper modules live next to the package in a source checkout.
sys.path.insert(0, str(Path(pyg_atompack.__file__).resolve().parents[1] / "examples"))
import aspirin  # noqa: E402
import schnet_md17  # noqa: E402
import training  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="pyg_atompack-schnet-"))

# %% [markdown]
## 1. A reduced configuration

The defaults (1792 frames, 6 interaction blocks of width 128, cutoff 10 Å) are meant
for a GPU. We keep 320 frames in five shards of 64 (four for training, the last one
held out), a SchNet of width 32 with two interaction blocks and a 5 Å cutoff, and six
epochs. The loopback server adds 20 ms of latency per request and serves 2 MB/s.

# %%
config = schnet_md17.RunConfig(
    data_dir=str(WORK / "data"),
    trajectory=aspirin.TrajectoryConfig(frames=320, shard_size=64, equilibration_steps=200),
    model=training.ModelConfig(hidden_channels=32, num_filters=32, num_interactions=2,
                               cutoff=5.0),
    epochs=6,
    lr=3e-3,
    batch_size=32,
    prefetch=1,
    latency_s=0.02,
    bandwidth_bps=2e6,
    out=None,          # keep the results in memory instead of writing trace/metrics files
    progress=False,    # no live progress bar in a notebook that is also run by CI
)

# %% [markdown]
## 2. Train

`run()` generates and caches the trajectory, writes the shards, serves them on
loopback, trains with `ShardStreamDataset(prefetch=1)` and evaluates on the held-out
shard. Its log ends with the per-shard table and a summary.

# %%
metrics = schnet_md17.run(config)
model = metrics["model"]  # the trained SchNet, for the parity plot below

# %% [markdown]
## 3. Loss curve

The training loss is MSE(E) + w · MSE(F) on normalised energies,
averaged over the steps of each epoch.

# %%
epochs = [epoch["epoch"] for epoch in metrics["epochs"]]
losses = [epoch["mean_loss"] for epoch in metrics["epochs"]]
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(epochs, losses, marker="o")
ax.set_xlabel("epoch")
ax.set_ylabel("mean training loss")
ax.set_yscale("log")
ax.set_title("SchNet on streamed aspirin shards")
fig.tight_layout()
plt.show()

# %% [markdown]
## 4. Force parity on the held-out shard

The last shard was never trained on. We stream it from the cached shard directory
with `LocalSource`, predict forces as −∂E/∂<b>r</b> and plot them
against the reference, one point per force component.

# %%
shard_dir = Path(config.data_dir) / config.trajectory.cache_key() / config.shard_format
held_out_name = metrics["held_out_shard"]
source = stream.LocalSource(shard_dir / held_out_name)
predicted, reference = [], []
model.eval()
for batch in ShardStreamDataset(source, prefetch=0, batch_size=32):
    _, forces = training.energy_and_forces(model, batch, create_graph=False)
    predicted.append(forces.detach().flatten())
    reference.append(batch.forces.flatten())
predicted, reference = torch.cat(predicted), torch.cat(reference)
mae = (predicted - reference).abs().mean().item()
print(f"{held_out_name}: force MAE {mae:.3f} eV/Å over {reference.numel()} components; "
      f"run() reported {metrics['held_out']['force_mae']:.3f} eV/Å")

fig, ax = plt.subplots(figsize=(4, 4))
ax.scatter(reference, predicted, s=2, alpha=0.3)
limit = float(reference.abs().max()) * 1.05
ax.plot([-limit, limit], [-limit, limit], color="black", linewidth=0.8)
ax.set_xlim(-limit, limit)
ax.set_ylim(-limit, limit)
ax.set_xlabel("reference force component (eV/Å)")
ax.set_ylabel("predicted (eV/Å)")
ax.set_title(f"held-out shard, MAE {mae:.3f} eV/Å")
fig.tight_layout()
plt.show()

# %% [markdown]
A model this small trained for a few seconds only begins to learn the forces: compare
its MAE with the zero-force baseline in the summary above. The point of the example is
the data path; give it more frames, epochs and width (or a GPU) for a useful model.

## 5. The overlap table

The table printed by `run()` above has one row per epoch and shard: how long the
shard's download and decoding took, how long the model trained on it, how long the
training loop waited for it, and how much of its download was hidden behind training
on the previous shard. The first shard of every epoch cannot be hidden (nothing trains
before it); every later one can, when training on a shard takes longer than fetching
the next. The same rows are in `metrics["shards"]`; summed per epoch:

# %%
print(f"{'epoch':>5} {'download s':>11} {'train s':>8} {'waited s':>9} {'hidden s':>9} "
      f"{'hidden %':>9}")
for epoch in epochs:
    rows = [row for row in metrics["shards"] if row["epoch"] == epoch]
    download = sum(row["download_s"] for row in rows)
    hidden = sum(row["overlap_s"] for row in rows)
    print(f"{epoch:>5} {download:>11.2f} {sum(row['train_s'] for row in rows):>8.2f} "
          f"{sum(row['wait_s'] for row in rows):>9.2f} {hidden:>9.2f} "
          f"{100 * hidden / download:>8.0f}%")
'''


if __name__ == "__main__":
    sys.exit(main())
