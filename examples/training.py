"""SchNet energy+force training pieces shared by the example and the paired benchmark.

The model predicts one energy per graph; forces are its negative gradient with respect
to the positions, kept in the autograd graph (``create_graph=True``) so that the force
error trains the weights. The loss is ``MSE(energy) + force_weight * MSE(forces)`` in
the data's units (eV and eV/Å for aspirin).

Energies of a molecular trajectory sit far from zero with a small spread, so the model's
per-atom output is rescaled by the energy standard deviation and shifted by the mean
energy per atom, both measured on the first training shard (SchNet's own ``mean`` /
``std`` hooks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch_geometric.nn.models import SchNet

FORCE_WEIGHT = 10.0


@dataclass(frozen=True)
class ModelConfig:
    """SchNet hyper-parameters (defaults: the MD17 reference workload).

    Attributes:
        hidden_channels: Width of the atom embeddings.
        num_filters: Width of the continuous filters.
        num_interactions: Number of interaction blocks.
        num_gaussians: Radial basis functions.
        cutoff: Interaction cutoff in Å.
    """

    hidden_channels: int = 128
    num_filters: int = 128
    num_interactions: int = 6
    num_gaussians: int = 50
    cutoff: float = 10.0


def build_model(
    config: ModelConfig,
    interaction_graph: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    *,
    seed: int = 0,
) -> SchNet:
    """Create a SchNet with deterministic initial weights.

    Args:
        config: Model size.
        interaction_graph: Callable ``(pos, batch) -> (edge_index, edge_weight)`` used
            instead of ``torch_cluster``'s radius graph.
        seed: Seed of the weight initialisation (both arms of a paired benchmark use the
            same one). (default: :obj:`0`)

    Returns:
        The model, with energy normalisation still unset.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SchNet(
            hidden_channels=config.hidden_channels,
            num_filters=config.num_filters,
            num_interactions=config.num_interactions,
            num_gaussians=config.num_gaussians,
            cutoff=config.cutoff,
            interaction_graph=interaction_graph,
        )


def energy_statistics(samples: Iterable) -> tuple[float, float]:
    """Mean energy per atom and standard deviation of the total energy.

    Args:
        samples: ``Data`` objects (or batches) with ``energy`` and ``z``.

    Returns:
        ``(mean_per_atom, std)``; ``std`` falls back to 1 when the spread is zero.
    """
    energies, atoms = [], []
    for sample in samples:
        energy = sample.energy.detach().double().view(-1)
        counts = _atoms_per_graph(sample, energy.numel())
        energies.append(energy)
        atoms.append(counts.double())
    if not energies:
        raise ValueError("energy_statistics: no samples to normalise on")
    energy = torch.cat(energies)
    counts = torch.cat(atoms)
    std = float(energy.std()) if energy.numel() > 1 else 0.0
    if not math.isfinite(std) or std <= 1e-12:
        std = 1.0
    return float((energy / counts).mean()), std


def _atoms_per_graph(sample, graphs: int) -> torch.Tensor:
    if getattr(sample, "batch", None) is not None:
        return torch.bincount(sample.batch, minlength=graphs)
    return torch.tensor([sample.z.numel()])


def set_energy_normalisation(model: SchNet, mean_per_atom: float, std: float) -> None:
    """Make the model output ``std * sum(h) + n_atoms * mean_per_atom``.

    Args:
        model: The SchNet to configure.
        mean_per_atom: Mean energy divided by the number of atoms.
        std: Standard deviation of the energy.
    """
    model.mean = float(mean_per_atom)
    model.std = float(std)


def energy_and_forces(
    model: SchNet, batch, *, create_graph: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predict energies ``[B]`` and forces ``[N, 3]`` (forces = -dE/dpos).

    Args:
        model: The SchNet.
        batch: A PyG ``Batch`` with ``z``, ``pos`` and ``batch``.
        create_graph: Keep the force computation differentiable (needed for training).

    Returns:
        ``(energy, forces)``.
    """
    pos = batch.pos.detach().requires_grad_(True)
    energy = model(batch.z, pos, batch.batch).view(-1)
    (gradient,) = torch.autograd.grad(energy.sum(), pos, create_graph=create_graph)
    return energy, -gradient


def train_step(
    model: SchNet, optimizer: torch.optim.Optimizer, batch, *, force_weight: float = FORCE_WEIGHT
) -> float:
    """One optimisation step on ``MSE(E) + force_weight * MSE(F)``.

    Args:
        model: The SchNet (in train mode).
        optimizer: Its optimizer.
        batch: A PyG ``Batch`` with ``energy`` ``[B]`` and ``forces`` ``[N, 3]`` targets.
        force_weight: Weight of the force term. (default: :obj:`10.0`)

    Returns:
        The loss value before the step.
    """
    energy, forces = energy_and_forces(model, batch, create_graph=True)
    target_energy = batch.energy.view(-1).to(energy.dtype)
    target_forces = batch.forces.to(forces.dtype)
    loss = torch.nn.functional.mse_loss(energy, target_energy)
    loss = loss + force_weight * torch.nn.functional.mse_loss(forces, target_forces)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@dataclass
class ErrorMeter:
    """Running mean absolute errors of energies and forces.

    Also tracks the errors of two trivial predictors, so that "the model learned" can be
    checked: zero forces, and the mean energy of the evaluated frames.
    """

    energy_abs: float = 0.0
    force_abs: float = 0.0
    zero_force_abs: float = 0.0
    graphs: int = 0
    force_components: int = 0
    _energies: list | None = None

    def update(self, predicted_energy, predicted_forces, batch) -> None:
        """Add one batch of predictions."""
        target_energy = batch.energy.view(-1).double()
        target_forces = batch.forces.double()
        self.energy_abs += float((predicted_energy.double() - target_energy).abs().sum())
        self.force_abs += float((predicted_forces.double() - target_forces).abs().sum())
        self.zero_force_abs += float(target_forces.abs().sum())
        self.graphs += target_energy.numel()
        self.force_components += target_forces.numel()
        self._energies = (self._energies or []) + [target_energy.cpu()]

    def result(self) -> dict[str, float]:
        """MAEs of the model and of the trivial predictors."""
        if not self.graphs:
            raise ValueError("ErrorMeter: no batch was evaluated")
        energies = torch.cat(self._energies)
        return {
            "structures": self.graphs,
            "energy_mae": self.energy_abs / self.graphs,
            "force_mae": self.force_abs / self.force_components,
            "zero_force_mae": self.zero_force_abs / self.force_components,
            "mean_energy_mae": float((energies - energies.mean()).abs().mean()),
        }


def evaluate(model: SchNet, batches: Iterable, device: torch.device) -> dict[str, float]:
    """Energy and force MAE of ``model`` over ``batches`` (weights unchanged).

    Args:
        model: The trained SchNet.
        batches: PyG batches with ``energy`` and ``forces`` targets.
        device: Where the model lives.

    Returns:
        ``structures``, ``energy_mae``, ``force_mae`` and the baselines
        ``zero_force_mae`` / ``mean_energy_mae``.
    """
    was_training = model.training
    model.eval()
    meter = ErrorMeter()
    try:
        for batch in batches:
            batch = batch.to(device)
            energy, forces = energy_and_forces(model, batch, create_graph=False)
            meter.update(energy.detach(), forces.detach(), batch)
    finally:
        model.train(was_training)
    return meter.result()

