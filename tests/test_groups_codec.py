"""The groups frame payload: upstream's bytes, its checks and its Python forms.

The expected bytes are built here field by field from upstream's ``extensions.rs``
(LeMaterial/atompack at 90da9bd35904a3625ab143eeb5cdd8d532a22c78), independently of
the encoder under test; the cases follow upstream's Rust and Python tests.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pyg_atompack.atp import AtpError
from pyg_atompack.atp.add_groups import GroupsState, parse_grouping
from pyg_atompack.atp.groups import (
    Grouping,
    GroupsError,
    decode_groups,
    encode_groups,
    merge_chunks,
    shift_chunk,
)


def adsorption() -> Grouping:
    # g0 = {adslab: 1, slab: 0}, g1 = {adslab: 2, slab: 0, gas: 3}
    return Grouping(
        roles=["adslab", "slab", "gas"],
        offsets=np.array([0, 2, 5]),
        records=np.array([1, 0, 2, 0, 3]),
        member_roles=np.array([0, 1, 0, 1, 2], np.uint16),
        properties={"e_ads": np.array([-1.5, -0.25]), "id": ["a", "b"]},
    )


def ordered() -> Grouping:
    return Grouping(offsets=np.array([0, 3]), records=np.array([3, 1, 2]),
                    properties={"n": np.array([3])})


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<I", len(raw)) + raw


def expected_payload() -> bytes:
    a = (s("a") + struct.pack("<I", 3) + s("adslab") + s("slab") + s("gas")
         + struct.pack("<QQ", 2, 5) + struct.pack("<3Q", 0, 2, 5)
         + struct.pack("<5Q", 1, 0, 2, 0, 3) + struct.pack("<5H", 0, 1, 0, 1, 2)
         + struct.pack("<I", 2) + s("e_ads") + b"\x00" + struct.pack("<2d", -1.5, -0.25)
         + s("id") + b"\x02" + s("a") + s("b"))
    o = (s("o") + struct.pack("<I", 0) + struct.pack("<QQ", 1, 3) + struct.pack("<2Q", 0, 3)
         + struct.pack("<3Q", 3, 1, 2) + struct.pack("<I", 1) + s("n") + b"\x01"
         + struct.pack("<q", 3))
    return struct.pack("<II", 1, 2) + a + o


def test_payload_is_upstreams_bytes_and_decodes_back():
    payload = encode_groups([("a", adsorption()), ("o", ordered())])
    assert payload == expected_payload()
    decoded = decode_groups(payload, 4, "f.atp: groups frame")
    assert [name for name, _ in decoded] == ["a", "o"]
    assert decoded[0][1] == adsorption() and decoded[1][1] == ordered()
    assert decoded[0][1].properties["e_ads"].dtype == np.float64
    assert decoded[1][1].properties["n"].dtype == np.int64


def test_damaged_payloads_fail_cleanly():
    payload = expected_payload()
    with pytest.raises(GroupsError, match=r"f\.atp.*'a'.*member record 3 is out of range"):
        decode_groups(payload, 3, "f.atp")  # records must exist
    for cut in range(len(payload)):
        with pytest.raises(GroupsError, match="f.atp"):
            decode_groups(payload[:cut], 4, "f.atp")
    with pytest.raises(GroupsError, match="trailing"):
        decode_groups(payload + b"\x00", 4, "f.atp")
    # an inflated count is refused before anything is allocated
    huge = bytearray(payload)
    n_groups_at = 8 + (4 + 1) + 4 + (4 + 6) + (4 + 4) + (4 + 3)
    huge[n_groups_at:n_groups_at + 8] = struct.pack("<Q", 2**64 - 1)
    with pytest.raises(GroupsError, match="truncated in grouping 'a' offsets"):
        decode_groups(bytes(huge), 4, "f.atp")
    bad_version = struct.pack("<I", 2) + payload[4:]
    with pytest.raises(GroupsError, match="unsupported groups version 2"):
        decode_groups(bad_version, 4, "f.atp")
    bad_tag = payload.replace(s("e_ads") + b"\x00", s("e_ads") + b"\x07")
    with pytest.raises(GroupsError, match="column 'e_ads': unsupported type tag 7"):
        decode_groups(bad_tag, 4, "f.atp")
    twice = struct.pack("<II", 1, 2) + expected_payload()[8:].replace(s("o"), s("a"), 1)
    with pytest.raises(GroupsError, match="duplicate grouping 'a'"):
        decode_groups(twice, 4, "f.atp")
    assert issubclass(GroupsError, AtpError) and issubclass(GroupsError, ValueError)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda g: setattr(g, "offsets", np.array([0, 5, 2])), r"group 1 has no members.*"
         r"offsets\[1\] = 5"),  # offsets out of order
        (lambda g: setattr(g, "offsets", np.array([1, 2, 5])), "offsets must start at 0"),
        (lambda g: setattr(g, "offsets", np.array([0, 2, 4])), "offsets end at 4 but there "
         "are 5"),
        (lambda g: setattr(g, "records", np.array([1, 0, 2, 0, 9])), "group 1: member record "
         "9 is out of range"),
        (lambda g: g.properties.update(e_ads=np.array([1.0])), "column 'e_ads' has 1 values "
         "for 2 groups"),
        (lambda g: setattr(g, "member_roles", np.array([0, 0, 0, 1, 2], np.uint16)),
         "group 0 has role 'adslab' more than once"),
        (lambda g: setattr(g, "member_roles", np.array([0, 1, 0, 1, 7], np.uint16)),
         "role id 7 is out of range"),
        (lambda g: setattr(g, "member_roles", np.array([0, 1], np.uint16)),
         "every member needs a role"),
        (lambda g: setattr(g, "roles", ["adslab", "slab", "slab"]), "duplicate role 'slab'"),
    ],
)
def test_validate_names_file_grouping_and_field(change, message):
    g = adsorption()
    change(g)
    with pytest.raises(GroupsError, match=r"^data\.atp: grouping 'ads': (.*: )?" + message):
        g.validate(4, "data.atp: grouping 'ads'")
    # a file holding such groups is refused too (as truncated where the counts disagree)
    payload = encode_groups([("ads", g)])
    with pytest.raises(GroupsError, match=r"^data\.atp: "):
        decode_groups(payload, 4, "data.atp")


def test_chunks_concatenate_and_remap_roles():
    more = Grouping(roles=["gas", "adslab"], offsets=np.array([0, 2]), records=np.array([4, 2]),
                    member_roles=np.array([0, 1], np.uint16),
                    properties={"id": ["c"], "e_ads": np.array([0.5])})
    merged = merge_chunks([("f.atp: frame 1", encode_groups([("adsorption", adsorption())])),
                           ("f.atp: frame 2", encode_groups([("ordered", ordered())])),
                           ("f.atp: frame 3", encode_groups([("adsorption", more)]))], 5)
    assert list(merged) == ["adsorption", "ordered"]
    g = merged["adsorption"]
    assert len(g) == 3 and g.offsets.tolist() == [0, 2, 5, 7]
    assert g.records[5:].tolist() == [4, 2]
    assert g.member_roles[5:].tolist() == [2, 0]  # gas, adslab in the existing role table
    assert g.properties["e_ads"].tolist() == [-1.5, -0.25, 0.5]
    assert g.properties["id"] == ["a", "b", "c"]
    other = encode_groups([("adsorption", ordered())])
    with pytest.raises(GroupsError, match=r"f\.atp: frame 2: grouping 'adsorption': cannot mix"):
        merge_chunks([("f.atp: frame 1", encode_groups([("adsorption", adsorption())])),
                      ("f.atp: frame 2", other)], 5)


def test_upstream_python_forms():
    g = parse_grouping([{"adslab": 1, "slab": 0}, {"adslab": 2, "slab": 0, "gas": 3}],
                       {"e_ads": [-1.5, -0.25], "id": ["a", "b"], "n": np.array([2, 3])})
    assert g.roles == ["adslab", "slab", "gas"]
    assert g.offsets.tolist() == [0, 2, 5] and g.records.tolist() == [1, 0, 2, 0, 3]
    assert g.member_roles.tolist() == [0, 1, 0, 1, 2]
    assert g.properties["e_ads"].dtype == np.float64 and g.properties["n"].dtype == np.int64
    assert g.properties["id"] == ["a", "b"]
    rows = parse_grouping(np.array([[4, -1, 2], [3, 1, -1]]), {"y": np.array([2.0, 3.0])},
                          roles=["a", "c", "b"])
    assert rows.roles == ["a", "c", "b"] and rows.records.tolist() == [4, 2, 3, 1]
    assert rows.member_roles.tolist() == [0, 2, 0, 1] and rows.offsets.tolist() == [0, 2, 4]
    plain = parse_grouping([[3, 1, 2]])
    assert plain.roles == [] and len(plain.member_roles) == 0 and plain.records.tolist() == [
        3, 1, 2]
    assert parse_grouping([[0]], {"x": [1, 2.5]}).properties["x"].dtype == np.float64


@pytest.mark.parametrize(
    ("members", "properties", "roles", "error", "message"),
    [
        ([[0, 4]], None, None, GroupsError, "member record 4 is out of range"),
        ([[0, -2]], None, None, GroupsError, "record index -2 is negative"),
        ([[]], None, None, GroupsError, "group 0 has no members"),
        ([{"a": 0}, [1]], None, None, TypeError, "all dicts"),
        ([[0], [1]], {"y": [1.0]}, None, GroupsError, "column 'y' has 1 values for 2 groups"),
        ([[0]], {"y": [{"x": 1}]}, None, TypeError, "property 'y'.*dict"),
        ([[0, 1]], None, ["a"], GroupsError, "needs 1 entries"),
        ([[0.5]], None, None, TypeError, "integers"),
    ],
)
def test_invalid_add_groups_leave_no_trace(members, properties, roles, error, message):
    state = GroupsState(lambda: {})
    with pytest.raises(error, match=message):
        state.prepare("g", members, properties, roles, 4, "bad.atp")
    assert state.groupings == {}


def test_appending_to_a_grouping_checks_its_columns():
    state = GroupsState(lambda: {})
    grouping, payload = state.prepare("g", [[0, 1]], {"y": [1.0]}, None, 4, "f.atp")
    assert payload == encode_groups([("g", grouping)])
    state.push("g", grouping)
    with pytest.raises(GroupsError, match=r"f\.atp: add_groups\('g'\): group properties "
                       r"\(z: float64\) do not match the existing grouping's \(y: float64\)"):
        state.prepare("g", [[2]], {"z": [1.0]}, None, 4, "f.atp")
    with pytest.raises(GroupsError, match="properties"):
        state.prepare("g", [[2]], {"y": [1]}, None, 4, "f.atp")  # int64, not float64
    with pytest.raises(GroupsError, match="cannot mix"):
        state.prepare("g", [{"a": 2}], {"y": [1.0]}, None, 4, "f.atp")
    second, _ = state.prepare("g", [[2, 3]], {"y": [2.0]}, None, 4, "f.atp")
    state.push("g", second)
    assert state.groupings["g"].offsets.tolist() == [0, 2, 4]


def test_shift_chunk_renumbers_records_for_a_merge():
    payload = encode_groups([("a", adsorption()), ("o", ordered())])
    shifted = decode_groups(shift_chunk(payload, 10, 4, "in.atp"), 14, "out.atp")
    assert shifted[0][1].records.tolist() == [11, 10, 12, 10, 13]
    assert shifted[1][1].records.tolist() == [13, 11, 12]
    assert shifted[0][1].properties["id"] == ["a", "b"]
    with pytest.raises(GroupsError, match=r"in\.atp: .*out of range"):
        shift_chunk(payload, 10, 3, "in.atp")
