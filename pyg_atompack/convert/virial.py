"""Virials into stress, with ASE's sign convention: ``stress = -virial / volume``.

ASE (and the extxyz files of metatrain's carbon set) define the virial as
``W = -σ V``, with σ the stress tensor in eV/Å³ as ``atoms.get_stress()``
returns it and ``V`` the cell volume.
The volume needs a three-dimensional periodic cell, so only structures with
``pbc`` on all three axes and a cell of non-zero volume qualify.
"""

from __future__ import annotations

import numpy as np

from .errors import ConvertError
from .structure import Structure, as_stress_matrix


def virial_to_stress(structure: Structure, key: str, index: int, source: str) -> Structure:
    """Move the custom value ``key`` into ``structure.stress`` as ``-virial / volume``.

    Args:
        structure (Structure): A structure in the source's units (the stress ends up in
            source energy / source length³, converted with the other fields).
        key (str): The custom key holding the virial (Voigt-6 or 3×3).
        index (int): The structure's index in the source, for errors.
        source (str): The source path, for errors.

    Returns:
        The same structure, the key removed and ``stress`` set.

    Raises:
        ConvertError: The key is missing, the structure is not periodic, the
            cell has no volume, or the structure already has a stress.
    """
    if key in structure.properties:
        virial = structure.properties.pop(key)
    elif key in structure.atom_properties:
        raise ConvertError(source, f"virial key {key!r} holds a per-atom value", index)
    else:
        raise ConvertError(source, f"virial key {key!r} is not present", index)
    if structure.stress is not None:
        raise ConvertError(
            source, f"has both a stress and a virial ({key!r}); choose one with --stress-key "
            "or --virial-key", index)
    pbc = None if structure.pbc is None else np.asarray(structure.pbc, dtype=bool)
    if structure.cell is None or pbc is None or not pbc.all():
        raise ConvertError(
            source, f"virial {key!r} needs a periodic structure (pbc on all three axes) to "
            "become a stress; this one is not periodic", index)
    volume = abs(float(np.linalg.det(np.asarray(structure.cell, dtype=np.float64))))
    if volume == 0.0:
        raise ConvertError(source, f"virial {key!r}: the cell has zero volume", index)
    try:
        matrix = as_stress_matrix(np.asarray(virial, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise ConvertError(source, f"virial {key!r}: {exc}", index) from exc
    structure.stress = -matrix / volume
    return structure
