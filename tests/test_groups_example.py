"""examples/adsorption_groups.py for real, reduced: EMT data, framed file with a grouping,
SchNet trained on E(adslab) - E(slab) - E(gas) through AtompackGroupDataset."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import adsorption_groups  # noqa: E402

from pyg_atompack import atp  # noqa: E402


def test_example_writes_groups_and_trains(tmp_path):
    config = adsorption_groups.Config(slabs=2, sites=2, epochs=6, batch_size=4, hidden=16,
                                      interactions=1, num_workers=2, out=str(tmp_path))
    metrics = adsorption_groups.run(config)
    assert metrics["groups"] == 2 * 4 * 2 and metrics["train_groups"] == 12
    assert all(math.isfinite(x) for x in metrics["losses"])
    assert metrics["losses"][-1] < metrics["losses"][0]  # seeded: the same run every time
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    with atp.open(tmp_path / "adsorption.atp") as reader:
        assert reader.header.framed
        ads = reader.groups["adsorption"]
        assert ads.roles == ["adslab", "slab", "gas"] and len(ads) == 16
        g = ads[5]
        # the stored target is the combination of the stored energies
        expected = g["adslab"].energy - g["slab"].energy - g["gas"].energy
        assert np.isclose(g.properties["e_ads"], expected)
