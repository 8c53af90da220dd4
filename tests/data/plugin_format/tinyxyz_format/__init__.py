"""The ``tinyxyz`` format: one structure per block, for the registry's plugin test.

    TINYXYZ <n_atoms> <energy>
    <Z> <x> <y> <z>        (n_atoms lines)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from pyg_atompack.convert import Format, Structure, StructureReader, StructureWriter


class TinyReader(StructureReader):
    format_name = "tinyxyz"

    def _iter_raw(self) -> Iterator[Structure]:
        lines = self.path.read_text(encoding="ascii").splitlines()
        at = 0
        while at < len(lines):
            tag, count, energy = lines[at].split()
            if tag != "TINYXYZ":
                raise self.error(f"line {at + 1}: expected TINYXYZ")
            rows = [line.split() for line in lines[at + 1:at + 1 + int(count)]]
            yield Structure(positions=np.array([r[1:] for r in rows], dtype=np.float64),
                            atomic_numbers=np.array([r[0] for r in rows], dtype=np.int64),
                            energy=float(energy))
            at += 1 + int(count)


class TinyWriter(StructureWriter):
    format_name = "tinyxyz"

    def __init__(self, path, options=None) -> None:
        super().__init__(path, options)
        self._handle = open(self.tmp_path, "w", encoding="ascii")  # noqa: SIM115

    def _add(self, structure: Structure) -> None:
        self._handle.write(f"TINYXYZ {structure.n_atoms} {structure.energy!r}\n")
        for z, (x, y, w) in zip(structure.atomic_numbers, structure.positions):
            self._handle.write(f"{int(z)} {float(x)!r} {float(y)!r} {float(w)!r}\n")

    def _finish(self) -> None:
        self._handle.close()

    def _discard(self) -> None:
        self._handle.close()


FORMAT = Format("tinyxyz", "a tiny text format (plugin test)",
                reader="tinyxyz_format:TinyReader", writer="tinyxyz_format:TinyWriter",
                extensions=("tinyxyz",), magic=(b"TINYXYZ ",), write_extensions=("tinyxyz",))
