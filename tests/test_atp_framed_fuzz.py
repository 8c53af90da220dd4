"""Fuzz the reader with mutated framed files (hypothesis, deterministic).

The bases are golden 0.4.1 files turned into framed files by the independent encoder
of ``atp_framed.py`` (committed, with a kind-99 and a groups frame in the extensions
directory, and in the writing state with a torn last frame). Mutations: bit flips and
truncations anywhere, "interesting" values in the framed header fields (extensions
span, flags, data_end; the slot's Adler-32 recomputed), in frame headers (kind,
lengths, atom count, CRC) and in directory entries (kind, offset, length, entries
counts that claim more than the file holds). The harness is ``test_fuzz_atp.py``'s:
every input reads completely or raises ``atp.AtpError``, within ``HANG_S`` and the
allocation budget (nothing allocated for an inflated count or length).
"""

from __future__ import annotations

import struct
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyg_atompack import atp

sys.path.insert(0, str(Path(__file__).parent))
from atp_framed import GROUPS, Framed, boundaries, source_of  # noqa: E402
from test_fuzz_atp import (  # noqa: E402
    EXAMPLES,
    FUZZ_TIMEOUT_S,
    GOLDEN,
    HANG_S,
    SLOT,
    FuzzHang,
    _interesting,
    _put,
    _reseal,
    read_everything,
    watchdog,
)

BASE_FILES = ("builtins_none.atp", "builtins_lz4.atp", "custom_props_zstd.atp",
              "f64_positions.atp", "batch_canonical_lz4.atp", "zero_atoms.atp")
FRAMED_FIELDS = ((76, "<Q"), (84, "<Q"), (92, "<I"), (96, "<Q"), (24, "<Q"), (40, "<Q"))
FRAME_FIELDS = ((0, "<I"), (4, "<I"), (8, "<I"), (12, "<I"), (16, "<I"))


def _bases() -> list[tuple[str, bytes, list[int], int, int]]:
    """(name, bytes, frame starts, directory offset, directory length) per base."""
    out = []
    for name in BASE_FILES:
        source = source_of(GOLDEN / name)
        count = len(source.records)
        items = [("schema",)] + [("record", i) for i in range(count // 2)] + \
            [("meta", 99, b"a newer version"), ("meta", GROUPS, bytes(range(40)))] + \
            [("record", i) for i in range(count // 2, count)]
        framed = Framed(source, items)
        ends = boundaries(framed)
        starts = [8192] + ends[:-1]
        committed = framed.committed()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            header = atp.Reader.from_bytes(committed).header
        out.append((f"{name} framed", committed, starts, header.ext_offset, header.ext_len))
        writing = framed.writing()
        out.append((f"{name} writing, torn", writing[:-5], starts, 0, 0))
    return out


BASES = _bases()


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes, list[str]]:
    name, base, starts, ext_offset, ext_len = draw(st.sampled_from(BASES))
    data = bytearray(base)
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        size = len(data)
        kind = draw(st.sampled_from(["flip", "truncate", "header", "frame", "frame",
                                     "directory", "directory"]))
        if kind == "flip" and size:
            low = 8192 if size > 8192 and draw(st.booleans()) else 0
            at = draw(st.integers(low, size - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
            steps.append(f"flip {at}")
        elif kind == "truncate":
            cut = draw(st.one_of(st.sampled_from(starts), st.integers(0, max(size - 1, 0))))
            del data[min(cut, size):]
            steps.append(f"truncate {cut}")
        elif kind == "header":
            slot = draw(st.integers(0, 1))
            offset, fmt = draw(st.sampled_from(FRAMED_FIELDS))
            at = slot * SLOT + offset
            value = _interesting(draw, fmt, struct.unpack_from(fmt, base, at)[0], size)
            _put(data, at, fmt, value)
            _reseal(data, slot)
            steps.append(f"slot {slot} +{offset} = {value}")
        elif kind == "frame":
            start = draw(st.sampled_from(starts))
            rel, fmt = draw(st.sampled_from(FRAME_FIELDS))
            original = struct.unpack_from(fmt, base, start + rel)[0]
            value = _interesting(draw, fmt, original, size)
            _put(data, start + rel, fmt, value)
            steps.append(f"frame at {start} +{rel} = {value}")
        elif ext_len:  # directory entries, or a length that claims more entries
            if draw(st.booleans()):
                j = draw(st.integers(0, ext_len // 20 - 1))
                rel, fmt = draw(st.sampled_from(((0, "<I"), (4, "<Q"), (12, "<Q"))))
                at = ext_offset + 20 * j + rel
                value = _interesting(draw, fmt, struct.unpack_from(fmt, base, at)[0], size)
                _put(data, at, fmt, value)
                steps.append(f"directory entry {j} +{rel} = {value}")
            else:
                claim = draw(st.sampled_from([20 * 10**6, 2**40, 2**64 - 20, ext_len + 20,
                                              ext_len - 1]))
                for slot in (0, 1):
                    if struct.unpack_from("<I", base, slot * SLOT + 92)[0] == 1:
                        _put(data, slot * SLOT + 84, "<Q", claim)
                        _reseal(data, slot)
                steps.append(f"directory length {claim}")
    return name, bytes(data), steps


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("framed-fuzz") / "input.atp"


@pytest.fixture(scope="module", autouse=True)
def traced(fuzz_path: Path) -> Iterator[None]:
    import tracemalloc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, data, *_ in BASES:  # one-time costs are not an input's allocations
            fuzz_path.write_bytes(data)
            for access in ("mmap", "pread", "bytes"):
                read_everything(fuzz_path, data, access, name)
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def test_every_framed_base_reads_cleanly(fuzz_path: Path) -> None:
    for name, data, *_ in BASES:
        fuzz_path.write_bytes(data)
        for access in ("mmap", "pread", "bytes"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", atp.RecoveredWriteWarning)
                assert read_everything(fuzz_path, data, access, name) == "ok", (name, access)


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_mutated_framed_files_read_or_raise_atp_error(fuzz_path: Path) -> None:
    outcomes: Counter = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(mutated(), st.sampled_from(["mmap", "pread", "bytes"]))
    def fuzz(case: tuple[str, bytes, list[str]], access: str) -> None:
        name, data, steps = case
        what = f"{name} with {steps} ({access})"
        fuzz_path.write_bytes(data)
        with watchdog(HANG_S, what), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # recoveries and cut-short commits warn
            try:
                outcomes[read_everything(fuzz_path, data, access, what)] += 1
            except (AssertionError, FuzzHang):
                raise
            except Exception as error:  # the property under test: nothing else escapes
                raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error

    fuzz()
    print(f"framed fuzz outcomes: {dict(outcomes)}")
    total = sum(outcomes.values())
    assert outcomes["ok"] + outcomes["partial"] >= total // 5, outcomes
    assert total - outcomes["ok"] >= total // 5, outcomes
