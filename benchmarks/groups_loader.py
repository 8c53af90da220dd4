"""What a mini-batch of groups costs: ``AtompackLoader`` over ``AtompackGroupDataset``
against the per-molecule path a user of the upstream-style API would write.

The data: ``--slabs`` clean slabs of ``--slab-atoms`` atoms, ``--groups`` adsorbate+slab
structures (the slab plus 1-3 atoms) and 4 gas references; the grouping
``adsorption`` ties each adsorbate+slab record to its slab and gas (3 members a
group, the slabs shared by many groups). Two arms build the same batches of
``--batch`` groups (same group positions, shuffled), in one process, interleaved in
alternating repetitions:

* ``group loader``: ``AtompackLoader(AtompackGroupDataset(...))``: one ``read_batch``
  of the batch's distinct records, then one ``Batch`` of all members with ``role``,
  ``group`` and the group column;
* ``per molecule``: ``reader.groups["adsorption"][positions]`` (each shared record
  decoded once, as upstream's ``db.groups[name][...]``), one ``Data`` per member
  (``pyg.record_to_data``), ``Batch.from_data_list``, then the same ``role`` / ``group``
  / column tensors.

It prints the median time per batch of each arm and their ratio.

Usage::

    python benchmarks/groups_loader.py [--groups 4000] [--slabs 64] [--slab-atoms 48]
        [--batch 32] [--codecs none zstd] [--reps 5] [--out benchmarks/results/groups_loader.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch_geometric.data import Batch

from pyg_atompack import atp
from pyg_atompack.data import AtompackGroupDataset, AtompackLoader
from pyg_atompack.pyg import record_to_data

ROLES = ("adslab", "slab", "gas")


def write(path: Path, codec: str, groups: int, slabs: int, slab_atoms: int) -> None:
    rng = np.random.default_rng(0)

    def add(w: atp.Writer, n: int) -> None:
        w.add(rng.normal(size=(n, 3)) * 4, rng.integers(1, 80, n), energy=float(rng.normal()),
              forces=rng.normal(size=(n, 3)).astype(np.float32))

    with atp.Writer(path, compression=codec, framed=True, overwrite=True) as w:
        for _ in range(4):
            add(w, 1)
        for _ in range(slabs):
            add(w, slab_atoms)
        members, e_ads = [], []
        for g in range(groups):
            slab = 4 + int(rng.integers(slabs))
            record = len(w)
            add(w, slab_atoms + 1 + g % 3)
            members.append({"adslab": record, "slab": slab, "gas": g % 4})
            e_ads.append(float(rng.normal()))
        w.add_groups("adsorption", members, {"e_ads": e_ads})


def per_molecule(reader: atp.Reader, positions: list[int]) -> Batch:
    groups = reader.groups["adsorption"][positions]
    data, role, group = [], [], []
    for k, g in enumerate(groups):
        for name, mol in g.members.items():
            data.append(record_to_data(mol, ("energy", "forces")))
            role.append(ROLES.index(name))
            group.append(k)
    batch = Batch.from_data_list(data)
    batch.role = torch.tensor(role)
    batch.group = torch.tensor(group)
    batch.e_ads = torch.tensor([g.properties["e_ads"] for g in groups])
    return batch


def measure(path: Path, batch: int, reps: int) -> dict[str, list[float]]:
    ds = AtompackGroupDataset(path, "adsorption", fields=["energy", "forces"])
    order = np.random.default_rng(1).permutation(len(ds)).tolist()
    batches = [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]
    times: dict[str, list[float]] = {"group loader": [], "per molecule": []}
    for rep in range(reps):
        arms = list(times) if rep % 2 == 0 else list(times)[::-1]
        for arm in arms:
            if arm == "group loader":
                loader = AtompackLoader(ds, batch_size=batch, sampler=order)
                start = time.perf_counter()
                count = sum(1 for _ in loader)
            else:
                reader = atp.open(path)
                start = time.perf_counter()
                count = sum(1 for b in batches if per_molecule(reader, b) is not None)
            times[arm].append((time.perf_counter() - start) / count * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4000)
    parser.add_argument("--slabs", type=int, default=64)
    parser.add_argument("--slab-atoms", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--codecs", nargs="+", default=["none", "zstd"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lines = ["| codec | groups/batch | members/batch | group loader ms/batch | "
             "per molecule ms/batch | ratio |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as scratch:
        for codec in args.codecs:
            path = Path(scratch) / f"{codec}.atp"
            write(path, codec, args.groups, args.slabs, args.slab_atoms)
            times = measure(path, args.batch, args.reps)
            fast, slow = (statistics.median(times[k]) for k in ("group loader", "per molecule"))
            lines.append(f"| {codec} | {args.batch} | {3 * args.batch} | {fast:.2f} | "
                         f"{slow:.2f} | {slow / fast:.1f}x |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
