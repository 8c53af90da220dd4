"""Groups served to PyG: the read API on framed files, the group dataset and loader.

Framed files are made by ``groups_fixtures`` (an encoder independent of the package that
follows upstream's writer) from 0.4.1 records written by ``atp.Writer``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from groups_fixtures import plain_file, write_framed
from servers.http_server import serve_directory

from pyg_atompack import atp
from pyg_atompack.atp.groups import Grouping, GroupsError, encode_groups
from pyg_atompack.data import AtompackGroupDataset, AtompackLoader

ROLES = ["adslab", "slab", "gas"]
# g0 = {adslab 1, slab 0}, g1 = {adslab 2, slab 0, gas 3}, g2 = {adslab 4, slab 5, gas 3},
# g3 = {adslab 6, slab 5}
ADSORPTION = Grouping(
    roles=ROLES, offsets=np.array([0, 2, 5, 8, 10]),
    records=np.array([1, 0, 2, 0, 3, 4, 5, 3, 6, 5]),
    member_roles=np.array([0, 1, 0, 1, 2, 0, 1, 2, 0, 1], np.uint16),
    properties={"e_ads": np.array([-1.5, -0.25, 0.5, 1.0]), "id": ["a", "b", "c", "d"],
                "n": np.array([2, 3, 3, 2])})
ORDERED = Grouping(offsets=np.array([0, 3]), records=np.array([3, 1, 2]),
                   properties={"k": np.array([7])})


@pytest.fixture
def framed(tmp_path):
    source = plain_file(tmp_path / "plain.atp", 7)
    path = tmp_path / "groups.atp"
    # two chunks of "adsorption" (as two add_groups calls write them) and one "ordered"
    first = Grouping(ROLES[:2], np.array([0, 2]), np.array([1, 0]), np.array([0, 1], np.uint16),
                     {"e_ads": np.array([-1.5]), "id": ["a"], "n": np.array([2])})
    rest = Grouping(["gas", "adslab", "slab"], np.array([0, 3, 6, 8]),
                    np.array([2, 0, 3, 4, 5, 3, 6, 5]),
                    np.array([1, 2, 0, 1, 2, 0, 1, 2], np.uint16),
                    {"id": ["b", "c", "d"], "n": np.array([3, 3, 2]),
                     "e_ads": np.array([-0.25, 0.5, 1.0])})
    write_framed(path, source, [encode_groups([("adsorption", first)]),
                                encode_groups([("ordered", ORDERED)]),
                                encode_groups([("adsorption", rest)])],
                 extra=[(99, b"from a newer version")])
    return path


def test_upstream_read_api(framed):
    reader = atp.open(framed)
    groups = reader.groups
    assert list(groups) == ["adsorption", "ordered"] and len(groups) == 2
    assert "adsorption" in groups and "missing" not in groups
    with pytest.raises(KeyError, match="no grouping named 'missing'"):
        groups["missing"]
    ads = groups["adsorption"]
    assert (ads.name, len(ads), ads.roles) == ("adsorption", 4, ROLES)
    assert ads.grouping == ADSORPTION  # chunks concatenated, roles remapped
    np.testing.assert_array_equal(ads.properties["e_ads"], [-1.5, -0.25, 0.5, 1.0])
    assert ads.properties["n"].dtype == np.int64 and ads.properties["id"] == list("abcd")
    g = ads[1]
    assert g.indices == {"adslab": 2, "slab": 0, "gas": 3}
    assert g.properties == {"e_ads": -0.25, "id": "b", "n": 3}
    assert g["gas"].energy == 3.0 and "slab" in g and len(g) == 3
    assert list(g) == ["adslab", "slab", "gas"] and ads[-3].indices == g.indices
    for batch in (ads[[0, 1]], ads[:2], ads[np.array([0, 1])]):
        assert [grp["slab"].energy for grp in batch] == [0.0, 0.0]
    assert [grp.properties["id"] for grp in ads] == list("abcd")
    for bad in (4, -5, [0, 4]):
        with pytest.raises(IndexError, match="out of range for 4 groups"):
            ads[bad]
    ordered = groups["ordered"][0]
    assert ordered.indices == [3, 1, 2] and [m.energy for m in ordered] == [3.0, 1.0, 2.0]


def test_item_is_one_group_as_a_batch(framed):
    ds = AtompackGroupDataset(framed, "adsorption", fields=["energy"],
                              dtype=torch.float32)
    assert len(ds) == 4 and ds.roles == ROLES
    b = ds[2]
    assert b.num_graphs == 3 and b.num_groups == 1
    assert b.record.tolist() == [4, 5, 3] and b.role.tolist() == [0, 1, 2]
    assert b.group.tolist() == [0, 0, 0] and b.group_id.tolist() == [2]
    assert b.energy.tolist() == [4.0, 5.0, 3.0]
    assert b.e_ads.dtype == torch.float32 and b.e_ads.tolist() == [0.5]
    assert b.n.tolist() == [3] and b.id == ["c"]
    # the members are whole graphs: to_data_list() gives each record's Data
    members = b.to_data_list()
    assert [int(m.natoms) for m in members] == [2, 3, 1]
    assert [int(m.role) for m in members] == [0, 1, 2]
    with pytest.raises(IndexError, match="group 4 is out of range"):
        ds[4]
    with pytest.raises(KeyError, match=r"no grouping named 'nope' \(groupings: \['adsorption'"):
        AtompackGroupDataset(framed, "nope")


def test_combine_gives_the_adsorption_energy(framed):
    ds = AtompackGroupDataset(framed, "adsorption", fields=["energy"])
    batch = ds.__getitems__([0, 1, 2, 3])
    assert batch.record.tolist() == [1, 0, 2, 0, 3, 4, 5, 3, 6, 5]  # slab 0 decoded once
    assert batch.group.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    e = ds.combine(batch.energy, batch, {"adslab": 1, "slab": -1, "gas": -1})
    assert e.tolist() == [1 - 0, 2 - 0 - 3, 4 - 5 - 3, 6 - 5]
    assert ds.combine(batch.energy, batch).tolist() == [1, 5, 12, 11]
    with pytest.raises(KeyError, match=r"weights miss \['gas'\]"):
        ds.combine(batch.energy, batch, {"adslab": 1, "slab": -1})
    ordered = AtompackGroupDataset(framed, "ordered", fields=["energy"])
    b = ordered[0]
    assert b.role.tolist() == [0, 1, 2] and b.k.tolist() == [7]
    assert ordered.combine(b.energy, b).tolist() == [6.0]


class EnergyModel(torch.nn.Module):
    """A per-structure energy: a learned value per element, summed over atoms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 1)

    def forward(self, z: torch.Tensor, batch: torch.Tensor, num_graphs: int) -> torch.Tensor:
        per_atom = self.embed(z).view(-1)
        return torch.zeros(num_graphs).index_add(0, batch, per_atom)


def test_loader_with_two_workers_trains_one_step(framed):
    ds = AtompackGroupDataset(framed, "adsorption", fields=["energy"],
                              dtype=torch.float32)
    loader = AtompackLoader(ds, batch_size=2, shuffle=True, seed=3, num_workers=2)
    seen = []
    model = EnergyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights = {"adslab": 1.0, "slab": -1.0, "gas": -1.0}
    before = model.embed.weight.detach().clone()
    for batch in loader:
        assert batch.num_groups == len(batch.group_id) == 2
        seen += batch.group_id.tolist()
        for k, gid in enumerate(batch.group_id.tolist()):
            members = batch.record[batch.group == k].tolist()
            a, b = ADSORPTION.offsets[gid], ADSORPTION.offsets[gid + 1]
            assert members == ADSORPTION.records[a:b].tolist()
            assert batch.id[k] == ADSORPTION.properties["id"][gid]
        energy = model(batch.z, batch.batch, batch.num_graphs)
        loss = (ds.combine(energy, batch, weights) - batch.e_ads).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert torch.isfinite(loss)
    assert sorted(seen) == [0, 1, 2, 3]
    assert not torch.equal(model.embed.weight, before)
    model.eval()
    with torch.no_grad():
        batch = next(iter(AtompackLoader(ds, batch_size=4)))
        err = ds.combine(model(batch.z, batch.batch, batch.num_graphs), batch, weights)
        assert err.shape == (4,)


def test_groups_over_http_by_record(framed, tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    (root / "groups.atp").write_bytes(framed.read_bytes())
    for server in serve_directory(root):
        url = server.url("groups.atp")
        ds = AtompackGroupDataset(url, "adsorption", fields=["energy"],
                                  cache_dir=tmp_path / "cache")
        assert len(ds) == 4 and ds.roles == ROLES
        batch = next(iter(AtompackLoader(ds, batch_size=4)))
        assert batch.record.tolist() == ADSORPTION.records.tolist()
        e = ds.combine(batch.energy, batch, {"adslab": 1, "slab": -1, "gas": -1})
        assert e.tolist() == [1.0, -1.0, -4.0, 1.0]
        assert batch.id == list("abcd") and batch.e_ads.dtype == torch.float64
        assert all(r.status in (200, 206) for r in server.requests)


def test_remote_groups_fetch_only_metadata_and_members(tmp_path):
    from pyg_atompack.remote.record_reader import open_remote_atp, range_readers

    root = tmp_path / "www"
    root.mkdir()
    source = tmp_path / "big.atp"
    rng = np.random.default_rng(0)
    with atp.Writer(source) as w:  # 300 records of ~1 KiB, uncompressed
        for i in range(300):
            w.add(rng.normal(size=(40, 3)).astype(np.float32), np.full(40, 6), energy=float(i),
                  forces=rng.normal(size=(40, 3)).astype(np.float32))
    members = np.array([10, 150, 290])
    grouping = Grouping(offsets=np.array([0, 3]), records=members)
    write_framed(root / "big.atp", source, [encode_groups([("far", grouping)])])
    size = (root / "big.atp").stat().st_size
    for server in serve_directory(root):
        reader = open_remote_atp(range_readers(server.url("big.atp")),
                                 cache_dir=tmp_path / "cache", page_bytes=4096)
        ds = AtompackGroupDataset(reader, "far", fields=["energy"])
        batch = ds[0]
        assert batch.energy.tolist() == [10.0, 150.0, 290.0]
        fetched = sum(r.body_bytes for r in server.requests)
        # header, index, schema, directory and groups frame, plus the three members' pages
        assert fetched < size / 4, (fetched, size)
        index = atp.open(root / "big.atp").index
        far_away = int(index["offset"][100])  # a record of no group: never fetched
        for r in server.requests:
            start, stop = (int(x) for x in r.range.split("=")[1].split("-"))
            assert not start <= far_away <= stop


def test_group_loader_resumes_mid_epoch(framed):
    ds = AtompackGroupDataset(framed, "adsorption", fields=["energy"])

    def loader() -> AtompackLoader:
        return AtompackLoader(ds, batch_size=1, shuffle=True, seed=11)

    first = loader()
    it = iter(first)
    seen = [next(it).group_id.tolist()]
    state = first.state_dict()
    rest = [b.group_id.tolist() for b in it]
    again = loader()
    again.load_state_dict(state)
    assert [b.group_id.tolist() for b in again] == rest
    assert sorted(g for (g,) in seen + rest) == [0, 1, 2, 3]


def test_groups_of_a_sharded_dataset_use_global_record_numbers(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    first = Grouping(ROLES[:2], np.array([0, 2]), np.array([1, 0]), np.array([0, 1], np.uint16),
                     {"e_ads": np.array([-1.5])})
    second = Grouping(["gas", "adslab", "slab"], np.array([0, 3]), np.array([2, 0, 1]),
                      np.array([0, 1, 2], np.uint16), {"e_ads": np.array([0.5])})
    for name, grouping, n in (("a.atp", first, 4), ("b.atp", second, 3)):
        write_framed(shards / name, plain_file(tmp_path / f"plain_{name}", n),
                     [encode_groups([("adsorption", grouping)])])
    reader = atp.open(shards)
    ads = reader.groups["adsorption"]
    assert ads.roles == ROLES and len(ads) == 2
    assert ads[1].indices == {"gas": 6, "adslab": 4, "slab": 5}  # b.atp starts at record 4
    assert ads[1]["gas"].energy == 2.0  # record 2 of b.atp
    ds = AtompackGroupDataset(shards, "adsorption", fields=["energy"])
    batch = ds.__getitems__([0, 1])
    assert batch.record.tolist() == [1, 0, 6, 4, 5]
    assert batch.energy.tolist() == [1.0, 0.0, 2.0, 0.0, 1.0]
    assert batch.role.tolist() == [0, 1, 2, 0, 1]
    # the same files over HTTP, one dataset of two remote files read by record
    for server in serve_directory(shards):
        urls = [server.url("a.atp"), server.url("b.atp")]
        remote = AtompackGroupDataset(urls, "adsorption", fields=["energy"],
                                      cache_dir=tmp_path / "cache")
        assert remote.__getitems__([0, 1]).record.tolist() == [1, 0, 6, 4, 5]
    ordered = Grouping(offsets=np.array([0, 1]), records=np.array([0]))
    write_framed(shards / "c.atp", plain_file(tmp_path / "plain_c.atp", 2),
                 [encode_groups([("adsorption", ordered)])])
    with pytest.raises(GroupsError, match=r"c\.atp: groups frame at byte \d+: grouping "
                       "'adsorption': cannot mix named-role and ordered groups"):
        _ = atp.open(shards).groups


@pytest.mark.parametrize("prefetch_shards", [None, True])
def test_groups_from_the_loopback_hub(tmp_path, prefetch_shards):
    from servers.fake_hub import serve_fake_hub

    from pyg_atompack import AtompackDataset

    root = tmp_path / "repo"
    (root / "train").mkdir(parents=True)
    pairs = Grouping(offsets=np.array([0, 2]), records=np.array([0, 2]))
    for name, n in (("part_0.atp", 3), ("part_1.atp", 4)):
        write_framed(root / "train" / name, plain_file(tmp_path / f"plain_{name}", n),
                     [encode_groups([("pairs", pairs)])])
    for hub_server in serve_fake_hub():
        hub_server.commit("org/groups", root)
        records = AtompackDataset.from_hub("org/groups", "train", cache_dir=tmp_path / "cache",
                                           endpoint=hub_server.endpoint, fields=["energy"],
                                           prefetch_shards=prefetch_shards)
        ds = AtompackGroupDataset(records, "pairs")
        batch = next(iter(AtompackLoader(ds, batch_size=2)))
        assert batch.record.tolist() == [0, 2, 3, 5]  # part_1 starts at record 3
        assert batch.energy.tolist() == [0.0, 2.0, 0.0, 2.0]


def test_group_batches_follow_names_exclusions_and_follow_batch(framed):
    ds = AtompackGroupDataset(framed, "adsorption", names="pyg-md17")
    loader = AtompackLoader(ds, batch_size=2, exclude_keys=["force"], follow_batch=["pos"])
    batch = next(iter(loader))
    assert "force" not in batch and "forces" not in batch
    assert batch.energy.dtype == torch.float32  # the preset's energy
    assert batch.pos_batch.tolist() == batch.batch.tolist()
    assert batch.group.tolist() == [0, 0, 1, 1, 1]


def test_atom_budget_packs_whole_groups(framed):
    ds = AtompackGroupDataset(framed, "adsorption", fields=["energy"])
    sizes = (ADSORPTION.records % 3) + 1  # plain_file: record i has i % 3 + 1 atoms
    counts = np.add.reduceat(sizes, ADSORPTION.offsets[:-1])
    assert ds.atom_counts().tolist() == counts.tolist() == [3, 5, 6, 4]
    loader = AtompackLoader(ds, max_atoms=10)
    batches = list(loader)
    assert all(int(b.natoms.sum()) <= 10 for b in batches)
    assert sorted(g for b in batches for g in b.group_id.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="group 2 of grouping 'adsorption'"):
        AtompackLoader(ds, max_atoms=5)
