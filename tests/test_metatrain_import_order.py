"""The import-order trap next to metatrain (docs/guides/converting.md, "Using it next to
metatrain").

torch_geometric 2.8 replaces ``torch.index_select`` on import; metatensor's
TorchScript functions compiled afterwards fail. Each case runs in a fresh
interpreter, because this test process has imported torch_geometric long ago.
"""

from __future__ import annotations

import subprocess
import sys

_READ_TARGETS = """
import ase.io
from ase import Atoms
from omegaconf import OmegaConf
ase.io.write("t.xyz", [Atoms("H2", positions=[[0, 0, 0], [0, 0, 0.7]], info={"e": 1.5})])
conf = {"energy": {"quantity": "energy", "read_from": "t.xyz", "reader": None, "key": "e",
                   "unit": "eV", "type": "scalar", "per_atom": False, "num_subtargets": 1,
                   "forces": False, "stress": False, "virial": False}}
targets, _ = read_targets(OmegaConf.create(conf))
assert float(targets["energy"][0].block().values) == 1.5
print("metatrain read the targets")
"""

# The converters of metatrain's formats do not import torch_geometric, so converting
# a memmap directory and a DiskDataset zip and then using metatrain in the same process
# works; the workaround for everything else (the datasets) is importing metatrain first.
_PROJECT_THEN_METATRAIN = """
import sys
import numpy as np
from pyg_atompack import convert
from pyg_atompack.convert import Structure, open_writer

structures = [Structure(positions=np.zeros((2, 3)) + i, atomic_numbers=np.array([1, 1]),
                        energy=float(i)) for i in range(3)]
with open_writer("mm", "memmap") as writer:
    for structure in structures:
        writer.add(structure)
assert convert.convert("mm", "mm.atp") == 3
assert [s.energy for s in convert.open_reader("mm")] == [0.0, 1.0, 2.0]
assert "torch_geometric" not in sys.modules, "a metatrain-format converter imported PyG"

from metatrain.utils.data import read_targets
import pyg_atompack
assert len(pyg_atompack.AtompackDataset("mm.atp")) == 3  # PyG imported after metatrain
""" + _READ_TARGETS

_PYG_FIRST = """
import torch_geometric
from metatrain.utils.data import read_targets
""" + _READ_TARGETS


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_converters_leave_metatrain_working_and_metatrain_first_is_the_workaround(tmp_path):
    result = _python(_PROJECT_THEN_METATRAIN, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "metatrain read the targets" in result.stdout


def test_torch_geometric_first_breaks_metatrain_readers_as_the_readme_says(tmp_path):
    result = _python(_PYG_FIRST, tmp_path)
    assert result.returncode != 0
    assert "Expected a value of type 'int' for argument 'dim'" in result.stderr
