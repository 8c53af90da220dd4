"""Fuzz the `.atp` reader with mutated valid files (hypothesis, deterministic).

Bases are golden files written by atompack-db (every codec, record formats 2 and
3, custom properties of every kind, a schema-less legacy file). Mutations know
the file's layout: bit flips and truncations anywhere, and "interesting" values
(0, 1, boundaries, file size, 2**32 - 1, 2**64 - 1, ...) written into header
fields (with the slot's Adler-32 recomputed so the mutation reaches past the
checksum), schema entries, index entries and the fields inside records (for
compressed files the record is decompressed, edited, recompressed and appended,
and its index entry pointed at it).

Every input must either read completely (open, every ``f[i]`` with every
attribute, ``read_batch`` of all records) or raise ``atp.AtpError``. Nothing
else may escape, no input may run longer than ``HANG_S`` (a SIGALRM watchdog
raising a ``BaseException`` the reader cannot swallow), and no phase may
allocate more than ``ALLOC_FACTOR`` times the file size plus what it returns
(``tracemalloc`` peak).

Budget: ``PYG_ATOMPACK_FUZZ_EXAMPLES`` inputs, each read through one of the three
access paths (mmap, pread, in-memory bytes); default 200, what ``make test`` runs;
``make fuzz`` sets it to 20000.
"""

from __future__ import annotations

import os
import signal
import struct
import time
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lz4.block
import numpy as np
import numpy.ma  # noqa: F401 - see `traced`
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyg_atompack import atp

GOLDEN = Path(__file__).resolve().parent / "data" / "atp"
BASE_FILES = (
    "one_atom.atp", "zero_atoms.atp", "builtins_none.atp", "builtins_lz4.atp",
    "builtins_zstd.atp", "custom_props_none.atp", "custom_props_zstd.atp",
    "sparse_builtins.atp", "f64_positions.atp", "batch_canonical_lz4.atp",
    "batch_v3_zstd.atp", "rf3_f32pos.atp", "append_reopen_zstd.atp", "legacy_noschema.atp",
    "unflushed_tail.atp", "empty.atp", "legacy/v021_none.atp", "legacy/v021_zstd.atp",
)
EXAMPLES = int(os.environ.get("PYG_ATOMPACK_FUZZ_EXAMPLES", "200"))
HANG_S = float(os.environ.get("PYG_ATOMPACK_FUZZ_HANG_S", "10"))
# pytest-timeout's limit for a fuzz test grows with the budget (make fuzz runs for minutes)
FUZZ_TIMEOUT_S = max(300.0, EXAMPLES * 0.5)
ALLOC_FACTOR = 4
ALLOC_SLACK = 1 << 20
SLOT = 4096
# (offset in a slot, struct format) of every header field after magic/version
HEADER_FIELDS = ((4, "<I"), (8, "<Q"), (16, "<Q"), (24, "<Q"), (32, "<Q"), (40, "<Q"),
                 (48, "<B"), (52, "<i"), (56, "<I"), (60, "<Q"), (68, "<Q"))
INDEX_FIELDS = ((0, "<Q"), (8, "<I"), (12, "<I"), (16, "<I"))


class FuzzHang(BaseException):
    """Raised by the watchdog; a BaseException so that no ``except Exception`` hides it."""


# ---------------------------------------------------------------------- base file layouts
@dataclass
class Base:
    """A valid file and the byte positions of its structures."""

    name: str
    data: bytes
    codec: int
    slot: int  # index (0 = A, 1 = B) of the committed slot
    schema: tuple[int, int]  # (offset, length), (0, 0) when absent
    schema_fields: list[tuple[int, str]] = field(default_factory=list)
    index_offset: int = 0
    count: int = 0
    records: list[tuple[int, int, int, int]] = field(default_factory=list)
    # per record: (offset inside the raw record, struct format) of its structural fields
    record_fields: list[list[tuple[int, str]]] = field(default_factory=list)
    raw_records: list[bytes] = field(default_factory=list)


def _schema_fields(data: bytes, offset: int, length: int) -> list[tuple[int, str]]:
    fields = [(offset, "<I"), (offset + 4, "<B"), (offset + 5, "<I")]
    pos, end = offset + 9, offset + length
    while pos + 13 <= end:
        fields += [(pos, "<B"), (pos + 1, "<B"), (pos + 2, "<B"), (pos + 3, "<H"),
                   (pos + 5, "<I"), (pos + 9, "<I")]
        pos += 13 + struct.unpack_from("<H", data, pos + 3)[0]
    return fields


def _record_fields(rec: bytes, pos_bytes: int) -> list[tuple[int, str]]:
    """Structural fields of one raw record: counts, section headers, tensor ranks/dims."""
    n = struct.unpack_from("<I", rec, 0)[0]
    fields = [(0, "<I")]
    pos = 4 + n * pos_bytes + n
    fields.append((pos, "<H"))
    sections = struct.unpack_from("<H", rec, pos)[0]
    pos += 2
    for _ in range(sections):
        key_len = rec[pos + 1]
        tag_at = pos + 2 + key_len
        fields += [(pos, "<B"), (pos + 1, "<B"), (tag_at, "<B"), (tag_at + 1, "<I")]
        payload_len = struct.unpack_from("<I", rec, tag_at + 1)[0]
        payload = tag_at + 5
        if rec[tag_at] in (14, 15, 16, 17) and payload_len:
            rank = rec[payload]
            fields += [(payload, "<B")] + [(payload + 1 + 4 * d, "<I") for d in range(rank)]
        pos = payload + payload_len
    return fields


def _load_base(name: str) -> Base:
    data = (GOLDEN / name).read_bytes()
    with atp.Reader(GOLDEN / name, access="pread") as reader:
        header = reader.header
        base = Base(name, data, header.codec, 0 if header.slot == "A" else 1,
                    (header.schema_offset, header.schema_len))
        if header.schema_len:
            base.schema_fields = _schema_fields(data, header.schema_offset, header.schema_len)
        base.index_offset, base.count = header.index_offset, len(reader)
        pos_bytes = 12 if reader.positions_dtype == np.float32 else 24
        for i, entry in enumerate(reader.index):
            base.records.append(tuple(int(v) for v in entry))
            raw = reader.raw_record(i)
            base.raw_records.append(raw)
            base.record_fields.append(_record_fields(raw, pos_bytes))
    return base


BASES = [_load_base(name) for name in BASE_FILES]


# ---------------------------------------------------------------------- mutations
def _interesting(draw: st.DrawFn, fmt: str, original: int, size: int) -> int:
    bits = struct.calcsize(fmt) * 8
    signed = fmt[-1] in "bhiq"
    candidates = [0, 1, 2, 3, 7, 8, 13, 20, 255, 256, 4095, 4096, 8191, 8192, 8200,
                  size - 1, size, size + 1, size // 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
                  2**63 - 1, 2**63, 2**64 - 1, original - 1, original + 1, original * 2,
                  original * 1000, original + 20]
    value = draw(st.one_of(st.sampled_from(candidates), st.integers(0, 2**bits - 1)))
    value %= 2**bits
    if signed and value >= 2 ** (bits - 1):
        value -= 2**bits
    return value


def _put(data: bytearray, offset: int, fmt: str, value: int) -> None:
    if fmt[-1] not in "bhiq":
        value %= 2 ** (8 * struct.calcsize(fmt))
    if offset >= 0 and offset + struct.calcsize(fmt) <= len(data):
        struct.pack_into(fmt, data, offset, value)


def _reseal(data: bytearray, slot: int) -> None:
    """Recompute the Adler-32 of a slot so that the mutation passes the checksum."""
    start = slot * SLOT
    if len(data) >= start + SLOT:
        struct.pack_into("<I", data, start + SLOT - 4,
                         zlib.adler32(bytes(data[start:start + SLOT - 4])))


def _compress(codec: int, raw: bytes) -> bytes:
    if codec == 1:
        return lz4.block.compress(raw, store_size=False)
    return zstandard.ZstdCompressor(level=3).compress(raw)


@st.composite
def _mutation(draw: st.DrawFn, base: Base, data: bytearray, only: str | None = None) -> str:
    """Apply one mutation (of kind ``only`` if given) to ``data`` in place; returns a
    description."""
    size = len(data)
    kinds = ["flip", "truncate", "header", "consistent_count", "splice", "append"]
    if base.schema_fields:
        kinds.append("schema")
    if base.count:
        kinds += ["index", "record", "record"]
    if base.count and base.codec:
        kinds += ["claim", "claim"]
    kind = only or draw(st.sampled_from(kinds))
    if kind == "flip" and size:
        region = draw(st.sampled_from(["slot", "schema", "index", "records", "any"]))
        lo, hi = {
            "slot": (base.slot * SLOT, base.slot * SLOT + SLOT),
            "schema": (base.schema[0], base.schema[0] + base.schema[1]),
            "index": (base.index_offset, base.index_offset + 8 + 20 * base.count),
            "records": (8192, base.index_offset or size),
        }.get(region, (0, size))
        hi = min(hi, size)
        if hi <= lo:
            lo, hi = 0, size
        at = draw(st.integers(lo, hi - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
        if region == "slot" and draw(st.booleans()):
            _reseal(data, base.slot)
        return f"flip byte {at} ({region})"
    if kind == "truncate":
        marks = [0, 7, 8, 4096, 8191, 8192, base.index_offset, base.schema[0], size - 1,
                 size - 20, base.index_offset + 8]
        cut = draw(st.one_of(st.sampled_from(marks), st.integers(0, max(size - 1, 0))))
        cut = max(0, min(cut, size - 1))
        del data[cut:]
        return f"truncate to {cut}"
    if kind == "header":
        slot = draw(st.sampled_from([base.slot, 1 - base.slot]))
        offset, fmt = draw(st.sampled_from(HEADER_FIELDS))
        at = slot * SLOT + offset
        original = struct.unpack_from(fmt, base.data, at)[0]
        value = _interesting(draw, fmt, original, size)
        _put(data, at, fmt, value)
        _reseal(data, slot)
        return f"header slot {slot} +{offset} = {value}"
    if kind == "consistent_count":
        # a count that agrees with index_len (and the index prefix) passes slot validation
        count = draw(st.sampled_from([0, 1, base.count + 1, base.count * 7 + 3,
                                      (size - base.index_offset) // 20, 2**32]))
        at = base.slot * SLOT
        _put(data, at + 40, "<Q", count)
        _put(data, at + 32, "<Q", 8 + 20 * count)
        if base.index_offset:
            _put(data, base.index_offset, "<Q", count)
        _reseal(data, base.slot)
        return f"consistent count {count}"
    if kind == "schema":
        at, fmt = draw(st.sampled_from(base.schema_fields))
        value = _interesting(draw, fmt, struct.unpack_from(fmt, base.data, at)[0], size)
        _put(data, at, fmt, value)
        return f"schema byte {at} = {value}"
    if kind == "index":
        i = draw(st.integers(-1, base.count - 1))
        if i < 0:
            at, fmt = base.index_offset, "<Q"
        else:
            rel, fmt = draw(st.sampled_from(INDEX_FIELDS))
            at = base.index_offset + 8 + 20 * i + rel
        value = _interesting(draw, fmt, struct.unpack_from(fmt, base.data, at)[0], size)
        _put(data, at, fmt, value)
        return f"index byte {at} = {value}"
    if kind == "record":
        i = draw(st.integers(0, base.count - 1))
        raw = bytearray(base.raw_records[i])
        rel, fmt = draw(st.sampled_from(base.record_fields[i]))
        value = _interesting(draw, fmt, struct.unpack_from(fmt, raw, rel)[0], len(raw))
        _put(raw, rel, fmt, value)
        entry = base.index_offset + 8 + 20 * i
        if base.codec == 0:
            offset = base.records[i][0]
            data[offset:offset + len(raw)] = raw
        else:  # recompress the edited record at the end of the file and point at it
            stored = _compress(base.codec, bytes(raw))
            if entry + 16 <= len(data):  # an earlier truncation may have cut the index
                struct.pack_into("<QII", data, entry, len(data), len(stored), len(raw))
            data += stored
        return f"record {i} +{rel} = {value}"
    if kind == "claim":
        # a record's declared size and atom count against real frames: zeros (what a
        # compression bomb is), the record padded with zeros, or the record itself
        i = draw(st.integers(0, base.count - 1))
        original = base.raw_records[i]
        claim = draw(st.sampled_from([len(original), len(original) * 1000, (1 << 20) + 1,
                                      2 << 20, 90 << 20, 2**32 - 1]))
        n_atoms = draw(st.sampled_from([base.records[i][3], base.records[i][3] * 1000,
                                        1 << 22, 2**32 - 1]))
        content = draw(st.sampled_from(["zeros", "padded", "original"]))
        made = min(claim, 96 << 20)
        raw = bytes(made) if content == "zeros" else \
            (original + bytes(max(made - len(original), 0)) if content == "padded"
             else original)
        stored = _compress(base.codec, raw)
        entry = base.index_offset + 8 + 20 * i
        if entry + 20 <= len(data):
            struct.pack_into("<QIII", data, entry, len(data), len(stored), claim, n_atoms)
        data += stored
        return f"claim record {i}: {claim} bytes, {n_atoms} atoms, {content}"
    if kind == "splice" and size > 8192:
        src = draw(st.integers(8192, size - 1))
        dst = draw(st.integers(8192, size - 1))
        length = draw(st.integers(1, 64))
        chunk = bytes(data[src:src + length])
        data[dst:dst + len(chunk)] = chunk
        return f"splice {length}B {src}->{dst}"
    tail = draw(st.binary(min_size=1, max_size=64))
    data += tail
    return f"append {len(tail)}B"


@st.composite
def mutated_files(draw: st.DrawFn) -> tuple[str, bytes, list[str]]:
    base = draw(st.sampled_from(BASES))
    data = bytearray(base.data)
    steps = [draw(_mutation(base, data)) for _ in range(draw(st.integers(1, 3)))]
    return base.name, bytes(data), steps


@st.composite
def claimed_files(draw: st.DrawFn) -> tuple[str, bytes, list[str]]:
    """Compressed files with one or two records claiming sizes and atom counts."""
    base = draw(st.sampled_from([b for b in BASES if b.codec and b.count]))
    data = bytearray(base.data)
    steps = [draw(_mutation(base, data, "claim")) for _ in range(draw(st.integers(1, 2)))]
    return base.name, bytes(data), steps


# ---------------------------------------------------------------------- harness
@contextmanager
def watchdog(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`FuzzHang` in this (main) thread after ``seconds``.

    pytest-timeout also uses SIGALRM; its handler and remaining time are restored.
    """
    def fire(signum: int, frame: Any) -> None:
        raise FuzzHang(f"{what}: still running after {seconds}s")

    previous_handler = signal.signal(signal.SIGALRM, fire)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay:
            left = max(previous_delay - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def _nbytes(value: Any) -> int:
    """Bytes a returned value legitimately holds (arrays, strings, containers)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, atp.Molecule):
        return sum(_nbytes(getattr(value, name)) for name in (
            "positions", "atomic_numbers", "forces", "charges", "velocities", "cell",
            "stress", "name", "properties", "atom_properties"))
    return 0


class Budget:
    """Checks the ``tracemalloc`` peak of one phase against the file size (plus
    ``extra``: what a record whose declared size the schema allows may cost)."""

    def __init__(self, file_size: int, what: str, extra: int = 0) -> None:
        self.file_size = file_size
        self.what = what
        self.extra = extra

    @contextmanager
    def phase(self, name: str) -> Iterator[list[Any]]:
        produced: list[Any] = []
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        try:
            yield produced
        finally:
            peak = tracemalloc.get_traced_memory()[1] - before
            limit = ALLOC_FACTOR * (self.file_size + _nbytes(produced)) + ALLOC_SLACK + \
                self.extra
            assert peak <= limit, (f"{self.what}: {name} allocated {peak} bytes, more than "
                                   f"{limit} for a {self.file_size}-byte file")


def _touch(mol: atp.Molecule) -> None:
    """Read every attribute of a molecule, including the lazily decoded ones."""
    for name in ("positions", "atomic_numbers", "energy", "forces", "charges", "velocities",
                 "cell", "stress", "pbc", "name", "n_atoms"):
        getattr(mol, name)
    for scope in (mol.properties, mol.atom_properties):
        for value in scope.values():
            if isinstance(value, np.ndarray):
                value.sum()


def claim_allowance(name: str, file_size: int) -> int:
    """What a record claiming a size may cost beyond the file (issue #33): nothing when
    the base's schema fixes every section's size (the bound is then the record's size);
    else its strings and tensors may hold ``VARIABLE_FLOOR + VARIABLE_RATIO x stored``
    bytes, held twice (frame and record)."""
    from pyg_atompack.atp.codecs import VARIABLE_FLOOR, VARIABLE_RATIO, RecordBound

    with atp.Reader(GOLDEN / name, access="pread") as reader:
        st = reader._state()
        if not RecordBound(st.schema, st.pos_dtype.itemsize).variable:
            return 0
    return 2 * (VARIABLE_FLOOR + VARIABLE_RATIO * file_size)


def read_everything(path: Path, data: bytes, access: str, what: str, extra: int = 0) -> str:
    """Read one input completely; returns ``"ok"`` or the AtpError class name."""
    budget = Budget(len(data), what, extra)
    try:
        with budget.phase("open"):
            reader = (atp.Reader.from_bytes(data, name=path.name) if access == "bytes"
                      else atp.open(path, access=access))
        with reader:
            with budget.phase("index") as out:
                out += [reader.n_atoms, len(reader)]
                fields = reader.fields
            failed = False
            for i in range(len(reader)):
                try:
                    with budget.phase(f"record {i}") as out:
                        mol = reader[i]
                        out.append(mol)
                        _touch(mol)
                except atp.AtpError:
                    failed = True
            with budget.phase("read_batch") as out:
                try:
                    out.append(reader.read_batch(np.arange(len(reader))))
                except atp.AtpError:
                    failed = True
            del fields
        return "partial" if failed else "ok"
    except atp.AtpError as error:
        return type(error).__name__


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "input.atp"


@pytest.fixture(scope="module", autouse=True)
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # one-time costs (lazy imports such as numpy.ma on the reader's error paths, regex
    # caches) are not allocations of an input: pay them before tracing starts
    warm = tmp_path_factory.mktemp("warm") / "warm.atp"
    for base in BASES:
        warm.write_bytes(base.data)
        for access in ("mmap", "pread", "bytes"):
            read_everything(warm, base.data, access, base.name)
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_mutated_files_read_or_raise_atp_error(fuzz_path: Path) -> None:
    outcomes: Counter = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(mutated_files(), st.sampled_from(["mmap", "pread", "bytes"]))
    def fuzz(case: tuple[str, bytes, list[str]], access: str) -> None:
        name, data, steps = case
        what = f"{name} with {steps} ({access})"
        fuzz_path.write_bytes(data)
        extra = claim_allowance(name, len(data)) if any(s.startswith("claim")
                                                         for s in steps) else 0
        with watchdog(HANG_S, what):
            try:
                outcomes[read_everything(fuzz_path, data, access, what, extra)] += 1
            except (AssertionError, FuzzHang):
                raise
            except Exception as error:  # the property under test: nothing else escapes
                raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error

    fuzz()
    print(f"fuzz outcomes: {dict(outcomes)}")
    total = sum(outcomes.values())
    # the mutations must reach past the header: many inputs open, many are rejected
    assert outcomes["ok"] + outcomes["partial"] >= total // 5, outcomes
    assert total - outcomes["ok"] >= total // 5, outcomes


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_size_claims_read_or_raise_within_budget(fuzz_path: Path) -> None:
    """Declared sizes and atom counts against real frames (zeros up to 96 MiB): every
    read stays within the budget (the record bound's allowance, none for a schema of
    fixed-size sections) and finishes within HANG_S (issue #33)."""
    outcomes: Counter = Counter()

    @settings(max_examples=max(EXAMPLES // 2, 50), derandomize=True, deadline=None,
              database=None, suppress_health_check=list(HealthCheck), print_blob=True)
    @given(claimed_files(), st.sampled_from(["mmap", "pread", "bytes"]))
    def fuzz(case: tuple[str, bytes, list[str]], access: str) -> None:
        name, data, steps = case
        what = f"{name} with {steps} ({access})"
        fuzz_path.write_bytes(data)
        with watchdog(HANG_S, what):
            try:
                outcomes[read_everything(fuzz_path, data, access, what,
                                         claim_allowance(name, len(data)))] += 1
            except (AssertionError, FuzzHang):
                raise
            except Exception as error:
                raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error

    fuzz()
    print(f"claim fuzz outcomes: {dict(outcomes)}")
    assert outcomes["partial"] > 0, outcomes


def test_every_base_file_reads_cleanly(fuzz_path: Path) -> None:
    for base in BASES:
        fuzz_path.write_bytes(base.data)
        for access in ("mmap", "pread", "bytes"):
            assert read_everything(fuzz_path, base.data, access, base.name) in ("ok",), base.name


def test_watchdog_interrupts_a_hang() -> None:
    with pytest.raises(FuzzHang), watchdog(0.05, "busy loop"):
        while True:
            pass


def test_allocation_budget_catches_an_oversized_allocation() -> None:
    with pytest.raises(AssertionError, match="allocated"), \
            Budget(1000, "probe").phase("probe"):
        blob = bytearray(8 * ALLOC_SLACK)
        del blob
