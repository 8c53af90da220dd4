"""Train an adsorption energy through groups: E(adsorbate+slab) - E(slab) - E(gas).

An adsorption energy is not a property of one structure but of three: the
adsorbate on the slab, the clean slab and the gas-phase reference. The `.atp` file
stores every structure once and a grouping ``"adsorption"`` ties them together (roles
``adslab``, ``slab``, ``gas``; one ``e_ads`` value per group). The model predicts a
total energy per structure; the loss is on the combination per group, so shared
references (one slab serves many adsorption sites) are computed once per batch.

The data are generated with ASE's EMT potential (not DFT): Cu(111) slabs, slightly
strained and rattled, with H, C, N or O adsorbed at random positions; the gas
references are isolated atoms. Run it::

    python examples/adsorption_groups.py             # writes to a temporary directory
    python examples/adsorption_groups.py --epochs 30 --out runs/ads

Also importable: ``run(Config(...))`` returns the metrics, ``main(argv)`` is the CLI.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import SubsetRandomSampler
from torch_geometric.nn.models import SchNet

from pyg_atompack import atp
from pyg_atompack.data import AtompackGroupDataset, AtompackLoader
from pyg_atompack.graph import InteractionGraph, SchNetWithGraph

ADSORBATES = ("H", "C", "N", "O")
WEIGHTS = {"adslab": 1.0, "slab": -1.0, "gas": -1.0}


@dataclass
class Config:
    """One run (the CLI flags map onto these fields).

    Attributes:
        slabs: Distinct clean slabs.
        sites: Adsorption structures per slab and adsorbate.
        epochs: Training epochs.
        batch_size: Groups per mini-batch.
        hidden: SchNet width.
        interactions: SchNet interaction blocks.
        cutoff: Interaction cutoff (Å).
        lr: Adam learning rate.
        num_workers: DataLoader workers.
        out: Output directory (a temporary one when :obj:`None`).
        seed: Seed of the data and of the weights.
    """

    slabs: int = 3
    sites: int = 4
    epochs: int = 20
    batch_size: int = 8
    hidden: int = 32
    interactions: int = 2
    cutoff: float = 4.0
    lr: float = 3e-3
    num_workers: int = 0
    out: str | None = None
    seed: int = 0


def write_dataset(path: Path, config: Config) -> int:
    """Generate the structures with EMT and write them plus the ``adsorption`` grouping.

    Returns:
        The number of groups.
    """
    from ase import Atoms
    from ase.build import add_adsorbate, fcc111
    from ase.calculators.emt import EMT

    rng = np.random.default_rng(config.seed)

    def labelled(atoms: Atoms) -> dict:
        atoms.calc = EMT()
        return dict(positions=atoms.get_positions(), atomic_numbers=atoms.numbers,
                    energy=float(atoms.get_potential_energy()),
                    cell=np.asarray(atoms.cell[:], float), pbc=tuple(atoms.pbc))

    structures, members, e_ads = [], [], []
    gas = {}
    for symbol in ADSORBATES:  # isolated atoms in a box, not periodic
        gas[symbol] = len(structures)
        structures.append(labelled(Atoms(symbol, positions=[[5.0, 5.0, 5.0]],
                                         cell=[10.0, 10.0, 10.0], pbc=False)))
    for _ in range(config.slabs):
        slab = fcc111("Cu", size=(2, 2, 3), vacuum=6.0, a=3.61 * rng.uniform(0.98, 1.02))
        slab.rattle(0.02, seed=int(rng.integers(1 << 31)))
        slab_record, slab_energy = len(structures), labelled(slab.copy())
        structures.append(slab_energy)
        for symbol in ADSORBATES:
            for _ in range(config.sites):
                adslab = slab.copy()
                add_adsorbate(adslab, symbol, height=rng.uniform(1.2, 2.2),
                              position=tuple(rng.uniform(0, 5.0, size=2)))
                record = labelled(adslab)
                members.append({"adslab": len(structures), "slab": slab_record,
                                "gas": gas[symbol]})
                e_ads.append(record["energy"] - slab_energy["energy"]
                             - structures[gas[symbol]]["energy"])
                structures.append(record)
    with atp.Writer(path, compression="zstd", framed=True, overwrite=True) as writer:
        for s in structures:
            writer.add(**s)
        writer.add_groups("adsorption", members, {"e_ads": e_ads})
    return len(members)


def run(config: Config) -> dict:
    """Write the data, train on 80% of the groups, report the held-out MAE of E_ads.

    Returns:
        ``groups``, ``train_groups``, ``test_mae_before``, ``test_mae_after`` (eV) and
        ``losses`` (mean training loss per epoch).
    """
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(config.out or scratch)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "adsorption.atp"
        n_groups = write_dataset(path, config)
        ds = AtompackGroupDataset(path, "adsorption", fields=["energy", "cell", "pbc"],
                                  dtype=torch.float32)
        order = np.random.default_rng(config.seed).permutation(n_groups)
        cut = int(0.8 * n_groups)
        train_ids, test_ids = order[:cut].tolist(), order[cut:].tolist()
        generator = torch.Generator().manual_seed(config.seed)
        train = AtompackLoader(ds, batch_size=config.batch_size,
                               sampler=SubsetRandomSampler(train_ids, generator=generator),
                               num_workers=config.num_workers)
        test = AtompackLoader(ds, batch_size=len(test_ids), sampler=test_ids)
        torch.manual_seed(config.seed)
        schnet = SchNet(hidden_channels=config.hidden, num_filters=config.hidden,
                        num_interactions=config.interactions, cutoff=config.cutoff,
                        interaction_graph=InteractionGraph(config.cutoff))
        model = SchNetWithGraph(schnet)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)

        def predict(batch) -> torch.Tensor:
            return ds.combine(model(batch).view(-1), batch, WEIGHTS)

        def test_mae() -> float:
            model.eval()
            with torch.no_grad():
                errors = [(predict(b) - b.e_ads).abs() for b in test]
            model.train()
            return float(torch.cat(errors).mean())

        before, losses = test_mae(), []
        for _ in range(config.epochs):
            total = []
            for batch in train:
                loss = (predict(batch) - batch.e_ads).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total.append(float(loss.detach()))
            losses.append(float(np.mean(total)))
        metrics = dict(groups=n_groups, train_groups=len(train_ids), test_mae_before=before,
                       test_mae_after=test_mae(), losses=losses)
        if config.out:
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics


def main(argv: list[str] | None = None) -> dict:
    """The command line: every :class:`Config` field as a ``--flag``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in asdict(Config()).items():
        kind = type(value) if value is not None else str
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    metrics = run(Config(**vars(parser.parse_args(argv))))
    print(f"{metrics['groups']} groups ({metrics['train_groups']} for training); held-out "
          f"MAE of E_ads: {metrics['test_mae_before']:.3f} eV before, "
          f"{metrics['test_mae_after']:.3f} eV after training")
    return metrics


if __name__ == "__main__":
    main()
