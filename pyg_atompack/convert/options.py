"""Options shared by every reader and writer: key mapping, units, codecs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .units import UnitConversion

# Builtin fields a source key can be mapped onto.
MAPPABLE_BUILTINS = ("energy", "forces", "stress", "charges", "velocities", "name")


@dataclass(frozen=True)
class ReadOptions:
    """How to interpret the values of a source.

    Args:
        energy_key: Source key holding the energy; ``None`` takes the format's
            default (an ASE calculator's energy, ``energy.bin``, ``energy.mts``).
            A key given explicitly must exist in every structure.
        forces_key: Source key holding the forces (same rules).
        stress_key: Source key holding the stress, Voigt-6 or 3×3 (same rules).
        key_map: Further ``source key -> destination name`` renames. A
            destination that is a builtin name (``charges``, ``velocities``,
            ...) fills that builtin; anything else renames a custom property.
        units: Units of the source (default: eV and Å, nothing converted).
    """

    energy_key: str | None = None
    forces_key: str | None = None
    stress_key: str | None = None
    key_map: Mapping[str, str] = field(default_factory=dict)
    units: UnitConversion = field(default_factory=UnitConversion)

    def explicit_builtin_keys(self) -> dict[str, str]:
        """``builtin -> source key`` for every builtin the user pinned to a key."""
        pinned = {dest: src for src, dest in self.key_map.items() if dest in MAPPABLE_BUILTINS}
        for builtin, key in (
            ("energy", self.energy_key),
            ("forces", self.forces_key),
            ("stress", self.stress_key),
        ):
            if key is not None:
                pinned[builtin] = key
        return pinned

    def custom_renames(self) -> dict[str, str]:
        """``source key -> new custom name`` for renames that are not builtins."""
        return {src: dest for src, dest in self.key_map.items() if dest not in MAPPABLE_BUILTINS}


@dataclass(frozen=True)
class WriteOptions:
    """How to write a destination.

    Args:
        compression: `.atp` codec, ``"none"``, ``"lz4"`` or ``"zstd"``
            (default: ``"none"``).
        level: zstd level (default: ``3``).
        shard_size: Records per shard for sharded outputs; ``None`` writes a
            single `.atp` file (default: ``None``).
        overwrite: Replace an existing destination (default: ``False``).
    """

    compression: str = "none"
    level: int = 3
    shard_size: int | None = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        if self.compression not in ("none", "lz4", "zstd"):
            raise ValueError(
                f"compression must be 'none', 'lz4' or 'zstd', got {self.compression!r}"
            )
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be a positive number, got {self.shard_size}")


def parse_key_map(pairs: list[str] | str | None) -> dict[str, str]:
    """Parse ``SRC=DST`` pairs (comma-separated or repeated) into a dict.

    Args:
        pairs: Strings such as ``"REF_energy=energy,REF_force=forces"``.

    Returns:
        The ``source -> destination`` mapping.

    Raises:
        ValueError: On a pair without ``=`` or with an empty side.
    """
    if not pairs:
        return {}
    if isinstance(pairs, str):
        pairs = [pairs]
    mapping: dict[str, str] = {}
    for chunk in pairs:
        for pair in chunk.split(","):
            if not pair.strip():
                continue
            src, sep, dst = pair.partition("=")
            if not sep or not src.strip() or not dst.strip():
                raise ValueError(f"key map entry {pair!r} is not of the form SRC=DST")
            mapping[src.strip()] = dst.strip()
    return mapping
