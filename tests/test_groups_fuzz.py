"""Fuzz the groups frame payload decoder with mutated valid payloads (hypothesis).

Bases are payloads upstream's writer would produce (named roles with float, int and str
columns; ordered groups; several groupings in one chunk). Mutations: bit flips,
truncations, inserted bytes and "interesting" values (0, 1, 2**32 - 1, 2**64 - 1, the
payload size, ...) written as u16/u32/u64 anywhere. Every input must decode (and then
re-encode to the same bytes) or raise :class:`GroupsError`; nothing else may escape, and
no input may make the decoder allocate more than ``ALLOC_FACTOR`` times the payload
(``tracemalloc`` peak): counts are checked against the bytes left before allocating.

Budget: ``PYG_ATOMPACK_FUZZ_EXAMPLES`` inputs (default 200, what ``make test`` runs).
"""

from __future__ import annotations

import os
import struct
import tracemalloc

import numpy as np
import numpy.ma  # noqa: F401 - np.unique imports it on first use, which tracemalloc would count
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyg_atompack.atp.groups import Grouping, GroupsError, decode_groups, encode_groups

EXAMPLES = int(os.environ.get("PYG_ATOMPACK_FUZZ_EXAMPLES", "200"))
ALLOC_FACTOR = 8
ALLOC_SLACK = 64 << 10
NUM_RECORDS = 8

BASES = [
    encode_groups([("adsorption", Grouping(
        ["adslab", "slab", "gas"], np.array([0, 2, 5]), np.array([1, 0, 2, 0, 3]),
        np.array([0, 1, 0, 1, 2], np.uint16),
        {"e_ads": np.array([-1.5, -0.25]), "id": ["a", "b"], "n": np.array([2, 3])}))]),
    encode_groups([("ordered", Grouping([], np.array([0, 3, 4]), np.array([3, 1, 2, 7]),
                                        np.zeros(0, np.uint16), {"k": np.array([7, 8])}))]),
    encode_groups([("a", Grouping(["x"], np.array([0, 1]), np.array([5]),
                                  np.array([0], np.uint16), {})),
                   ("b", Grouping([], np.array([0, 2]), np.array([6, 6]),
                                  np.zeros(0, np.uint16), {"s": ["é"]}))]),
]
for _base in BASES:  # the first decode warms numpy's lazy imports up
    decode_groups(_base, NUM_RECORDS, "warm-up")
INTERESTING = [0, 1, 2, 3, 0xFF, 0xFFFF, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1,
               NUM_RECORDS, NUM_RECORDS - 1]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "value"]))
        at = draw(st.integers(0, len(data) - 1)) if data else 0
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=9))
        else:
            fmt = draw(st.sampled_from(["<H", "<I", "<Q"]))
            value = draw(st.sampled_from(INTERESTING + [len(data)]))
            raw = struct.pack(fmt, value % (1 << (8 * struct.calcsize(fmt))))
            data[at:at + len(raw)] = raw
    return bytes(data)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(payload=mutated())
def test_mutated_payloads_decode_or_fail_cleanly(payload: bytes) -> None:
    tracemalloc.start()
    try:
        decoded = decode_groups(payload, NUM_RECORDS, "fuzz.atp")
    except GroupsError as exc:
        assert str(exc).startswith("fuzz.atp: ")
        decoded = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= ALLOC_FACTOR * len(payload) + ALLOC_SLACK, peak
    if decoded is not None:  # whatever decodes is a valid chunk, encoded the same way
        assert encode_groups(decoded) == payload
