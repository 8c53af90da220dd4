"""Options shared by every reader and writer: key mapping, units, codecs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pyg_atompack.atp.types import BUILTINS

from .units import UnitConversion

#: dtypes a custom key can be cast to (``--cast KEY=DTYPE``).
CAST_DTYPES = ("float64", "float32", "int64", "int32")

# Builtin fields a source key can be mapped onto: the labels, not the geometry.
MAPPABLE_BUILTINS = tuple(name for name, field in BUILTINS.items() if not field.geometry)


@dataclass(frozen=True)
class ReadOptions:
    """How to interpret the values of a source.

    Args:
        energy_key (str, optional): Source key holding the energy; ``None`` takes the format's
            default (an ASE calculator's energy, ``energy.bin``, ``energy.mts``). A key given
            explicitly must exist in every structure. (default: :obj:`None`)
        forces_key (str, optional): Source key holding the forces (same rules).
            (default: :obj:`None`)
        stress_key (str, optional): Source key holding the stress, Voigt-6 or 3×3 (same rules).
            (default: :obj:`None`)
        key_map (Mapping[str, str], optional): Further ``source key -> destination name`` renames.
            A destination that is a builtin name (``charges``, ``velocities``, ...) fills that
            builtin; anything else renames a custom property. (default: :obj:`{}`)
        units (UnitConversion, optional): Units of the source
            (default: eV and Å, nothing converted).
        virial_key (str, optional): Source key holding the virial (Voigt-6 or 3×3, energy units);
            it becomes ``stress = -virial / volume`` (ASE's sign). Periodic structures only.
            (default: :obj:`None`)
        drop_keys (tuple[str, ...], optional): Custom keys left out of the output on purpose, after
            reading (default: :obj:`()`).
        casts (Mapping[str, str], optional): ``key -> dtype`` (``float64``, ``float32``, ``int64``,
            ``int32``) applied to custom keys before type promotion (default: :obj:`{}`).
        skip_targets (tuple[str, ...], optional): Targets of a DiskDataset zip, or file stems of a
            memmap directory, that are not read at all (e.g. a multi-block spherical target);
            elsewhere the same as ``drop_keys`` (default: :obj:`()`).
    """

    energy_key: str | None = None
    forces_key: str | None = None
    stress_key: str | None = None
    key_map: Mapping[str, str] = field(default_factory=dict)
    units: UnitConversion = field(default_factory=UnitConversion)
    virial_key: str | None = None
    drop_keys: tuple[str, ...] = ()
    casts: Mapping[str, str] = field(default_factory=dict)
    skip_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "drop_keys", tuple(self.drop_keys))
        object.__setattr__(self, "skip_targets", tuple(self.skip_targets))
        for key, dtype in self.casts.items():
            if dtype not in CAST_DTYPES:
                raise ValueError(
                    f"cast {key}={dtype}: the dtype must be one of {', '.join(CAST_DTYPES)}"
                )
        if self.virial_key is not None and self.stress_key is not None:
            raise ValueError("give either a stress key or a virial key, not both")

    def has_key_options(self) -> bool:
        """Whether the user named any source key (formats with fixed names then read only those)."""
        return bool(self.explicit_builtin_keys() or self.custom_renames() or self.virial_key)

    def left_out(self) -> frozenset[str]:
        """Keys and targets the user chose to leave out (``drop_keys`` and ``skip_targets``)."""
        return frozenset(self.drop_keys) | frozenset(self.skip_targets)

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
        compression (str, optional): `.atp` codec, ``"none"``, ``"lz4"`` or ``"zstd"``
            (default: :obj:`"none"`).
        level (int, optional): zstd level (default: :obj:`3`).
        shard_size (int, optional): Records per shard for sharded outputs; ``None`` writes a single
            `.atp` file (default: :obj:`None`).
        overwrite (bool, optional): Replace an existing destination (default: :obj:`False`).
        first_shard (int, optional): Number of the first shard a sharded writer writes
            (``shard_{first_shard:05d}...``), so that the parts of a partitioned conversion never
            share a shard name (default: :obj:`0`).
        part (Mapping[str, int], optional): Written into a sharded output's manifest as ``"part"``:
            which part of a partitioned conversion it holds (see :mod:`.parallel`)
            (default: :obj:`None`).
    """

    compression: str = "none"
    level: int = 3
    shard_size: int | None = None
    overwrite: bool = False
    first_shard: int = 0
    part: Mapping[str, int] | None = None

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
        pairs (list[str] or str): Strings such as
            ``"REF_energy=energy,REF_force=forces"``.

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


def parse_casts(pairs: list[str] | str | None) -> dict[str, str]:
    """Parse ``KEY=DTYPE`` pairs (comma-separated or repeated) of ``--cast``.

    Args:
        pairs (list[str] or str): Strings such as ``"mu=float64,alpha=float32"``.

    Returns:
        The ``key -> dtype`` mapping.

    Raises:
        ValueError: On a malformed pair or an unknown dtype.
    """
    casts = parse_key_map(pairs)
    for key, dtype in casts.items():
        if dtype not in CAST_DTYPES:
            known = ", ".join(CAST_DTYPES)
            raise ValueError(f"cast {key}={dtype}: the dtype must be one of {known}")
    return casts
