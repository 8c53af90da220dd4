"""Embedded aspirin data: an equilibrium geometry and an EMT molecular-dynamics generator.

MD17 aspirin (C9H8O4, 21 atoms) is the reference workload for SchNet energy+force
training. Its DFT trajectory needs a download, so the example ships a stand-in that runs
anywhere: the molecule is heated with Langevin dynamics under ASE's EMT calculator and
frames are written as shards (see :mod:`shards`).

EMT is an effective-medium potential made for metals; it covers H, C, N and O but gives
**no quantum-chemistry energies**. The frames have the shape and the physics of an MD17
trajectory (energies and consistent forces, -dE/dx) and are meant for testing the data
path and showing that a model learns, not for chemistry.

Frames are cached under a data folder keyed by every generator setting, so a second run
with the same settings reuses them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import shards

NOT_QUANTUM_CHEMISTRY = (
    "note: embedded aspirin frames come from ASE's EMT potential (Langevin MD), "
    "not from quantum chemistry; use --md17 ROOT for the DFT reference data"
)

# Aspirin (acetylsalicylic acid), heavy atoms first. Coordinates in Å, centred on the
# origin: an MMFF94 energy minimum computed once for this file (idealised equilibrium,
# not a crystal structure). Order: methyl C, ester C=O, ester O, ring C6, carboxyl C(=O)O,
# then the eight hydrogens (methyl x3, ring x4, acid OH).
ASPIRIN_SYMBOLS = "CCOOCCCCCCCOOHHHHHHHH"
ASPIRIN_POSITIONS = np.array(
    [
        [3.4038, 0.5543, -0.0406],
        [2.0439, 0.1391, 0.4355],
        [1.6894, 0.1441, 1.6074],
        [1.2884, -0.2659, -0.6593],
        [-0.0284, -0.5847, -0.3147],
        [-0.3282, -1.9424, -0.1631],
        [-1.6290, -2.3304, 0.1520],
        [-2.6259, -1.3671, 0.3025],
        [-2.3267, -0.0114, 0.1315],
        [-1.0220, 0.3968, -0.1871],
        [-0.7032, 1.8334, -0.3988],
        [0.3609, 2.3052, -0.7547],
        [-1.7563, 2.6373, -0.1549],
        [3.9239, -0.3054, -0.4698],
        [3.9844, 0.9300, 0.8068],
        [3.3109, 1.3562, -0.7774],
        [0.4490, -2.6922, -0.2815],
        [-1.8659, -3.3836, 0.2824],
        [-3.6405, -1.6701, 0.5512],
        [-3.1244, 0.7190, 0.2471],
        [-1.4037, 3.5378, -0.3146],
    ]
)


def aspirin_atoms():
    """The embedded aspirin geometry as an :class:`ase.Atoms` (no cell, no PBC).

    Returns:
        A fresh ``ase.Atoms`` with 21 atoms (C9H8O4).
    """
    from ase import Atoms

    return Atoms(ASPIRIN_SYMBOLS, positions=ASPIRIN_POSITIONS.copy())


@dataclass(frozen=True)
class TrajectoryConfig:
    """Settings of the EMT Langevin trajectory (all of them key the cache).

    Attributes:
        frames: Frames to keep, including the held-out shard.
        shard_size: Frames per shard.
        temperature_k: Thermostat temperature in K.
        timestep_fs: MD time step in fs.
        stride: MD steps between two kept frames (decorrelates neighbours).
        equilibration_steps: Steps run and discarded before the first kept frame.
        friction: Langevin friction in 1/fs.
        seed: Seed of the initial velocities and the thermostat noise.
    """

    frames: int = 1792
    shard_size: int = 256
    temperature_k: float = 500.0
    timestep_fs: float = 0.5
    stride: int = 5
    equilibration_steps: int = 1000
    friction: float = 0.02
    seed: int = 0

    def cache_key(self) -> str:
        """Folder name that identifies these settings."""
        return (
            f"aspirin-emt-n{self.frames}-s{self.shard_size}-T{self.temperature_k:g}"
            f"-dt{self.timestep_fs:g}-k{self.stride}-eq{self.equilibration_steps}"
            f"-g{self.friction:g}-seed{self.seed}"
        )


def generate_trajectory(config: TrajectoryConfig) -> dict[str, np.ndarray]:
    """Run Langevin MD of aspirin with EMT and keep every ``stride``-th frame.

    Args:
        config: Trajectory settings.

    Returns:
        ``atomic_numbers`` ``(21,)``, ``positions`` ``(F, 21, 3)`` float32 (Å),
        ``energy`` ``(F,)`` float64 (eV) and ``forces`` ``(F, 21, 3)`` float32 (eV/Å).
    """
    from ase import units
    from ase.calculators.emt import EMT
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    if config.frames < 1 or config.stride < 1:
        raise ValueError(f"generate_trajectory: frames and stride must be >= 1, got {config}")
    atoms = aspirin_atoms()
    atoms.calc = EMT()
    rng = np.random.default_rng(config.seed)
    MaxwellBoltzmannDistribution(atoms, temperature_K=config.temperature_k, rng=rng)
    Stationary(atoms)  # no centre-of-mass drift, so frames stay near the origin
    dynamics = Langevin(
        atoms,
        timestep=config.timestep_fs * units.fs,
        temperature_K=config.temperature_k,
        friction=config.friction / units.fs,
        fixcm=False,
        rng=rng,
    )
    if config.equilibration_steps:
        dynamics.run(config.equilibration_steps)
    count = len(atoms)
    positions = np.empty((config.frames, count, 3), dtype=np.float32)
    forces = np.empty((config.frames, count, 3), dtype=np.float32)
    energy = np.empty(config.frames, dtype=np.float64)
    for frame in range(config.frames):
        dynamics.run(config.stride)
        positions[frame] = atoms.get_positions()
        energy[frame] = atoms.get_potential_energy()
        forces[frame] = atoms.get_forces()
    return {
        "atomic_numbers": atoms.get_atomic_numbers().astype(np.int64),
        "positions": positions,
        "energy": energy,
        "forces": forces,
    }


def training_order(frames: int, held_out: int, seed: int) -> np.ndarray:
    """Frame order for the shards: shuffled training frames, then the held-out tail.

    Consecutive MD frames are strongly correlated, so training shards mix frames from the
    whole run (like the random splits used with MD17) while the last ``held_out`` frames,
    later in time than everything trained on, stay together as the final shard.

    Args:
        frames: Number of frames.
        held_out: Frames at the end kept in order as the held-out shard.
        seed: Seed of the permutation.

    Returns:
        A permutation of ``range(frames)``.
    """
    train = np.random.default_rng(seed).permutation(frames - held_out)
    return np.concatenate([train, np.arange(frames - held_out, frames)])


def prepare_aspirin_shards(
    data_dir: str | os.PathLike,
    config: TrajectoryConfig | None = None,
    *,
    log=print,
) -> Path:
    """Generate (or reuse) the embedded aspirin shards in both formats.

    The last shard is the held-out shard: its frames come after every training frame in
    simulation time.

    Args:
        data_dir: Cache root; the shards go to ``data_dir/<config.cache_key()>/{pt,atp}``.
        config: Trajectory settings. (default: :class:`TrajectoryConfig`)
        log: Callable used for progress messages. (default: :func:`print`)

    Returns:
        The folder holding ``pt/`` and ``atp/``.
    """
    config = config or TrajectoryConfig()
    root = Path(data_dir) / config.cache_key()
    manifests = [root / fmt / shards.MANIFEST_NAME for fmt in shards.SHARD_FORMATS]
    if all(shards.manifest_is_intact(path) for path in manifests):
        log(f"using cached aspirin shards in {root}")
        return root
    log(f"generating {config.frames} aspirin frames with ASE EMT Langevin MD -> {root}")
    trajectory = generate_trajectory(config)
    if config.frames <= config.shard_size:
        raise ValueError(
            f"prepare_aspirin_shards: need at least two shards (frames > shard_size), "
            f"got frames={config.frames}, shard_size={config.shard_size}"
        )
    # the held-out tail is exactly the last (possibly shorter) shard
    held_out = config.frames - config.shard_size * ((config.frames - 1) // config.shard_size)
    order = training_order(config.frames, held_out, config.seed)
    root.mkdir(parents=True, exist_ok=True)
    shards.write_shards(
        root,
        trajectory["atomic_numbers"],
        trajectory["positions"][order],
        trajectory["energy"][order],
        trajectory["forces"][order],
        shard_size=config.shard_size,
    )
    (root / "generator.json").write_text(
        json.dumps({"generator": "ase-emt-langevin", **asdict(config)}, indent=1),
        encoding="utf-8",
    )
    return root
