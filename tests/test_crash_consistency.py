"""Crash consistency of ``atp.Writer``: SIGKILL at random moments and inside ``flush()``.

A writer subprocess (``tests/crash_writer.py``) appends and flushes in a loop and
is killed again and again: at random moments by this process, and at exact
points of the commit protocol by itself (after the index is written but before
the header slot, halfway through the header slot, right after the header slot).
After every kill the file must open, hold exactly the molecules of the last
completed flush (a flush that was in progress may count as committed or not,
but nothing else), every molecule must equal what was written, and the next
writer must be able to append to it. The torn-header cases are also built by
hand: each slot corrupted in turn falls back to the other one; both -> AtpError.

Set ``PYG_ATOMPACK_CRASH_SEED`` to replay a particular sequence of kills.
"""

from __future__ import annotations

import os
import random
import select
import signal
import struct
import subprocess
import sys
from pathlib import Path

import atompack
import numpy as np
import pytest

from pyg_atompack import atp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crash_writer import SLOT_SIZE, expected_molecule  # noqa: E402

CRASH_WRITER = Path(__file__).resolve().parent / "crash_writer.py"
SEED = int(os.environ.get("PYG_ATOMPACK_CRASH_SEED", "20240607"))
RANDOM_KILLS = 30
# (kind, how many): self-kills at exact points of the commit protocol
PROTOCOL_KILLS = (("precommit", 8), ("torn", 10), ("committed", 4), ("write", 8))
CHILD_TIMEOUT_S = 60


# ---------------------------------------------------------------------- helpers
def _create(path: Path, compression: str, count: int = 0) -> None:
    with atp.Writer(path, compression=compression) as writer:
        for i in range(count):
            writer.add(**expected_molecule(i))


def _assert_molecule_equal(mol: atp.Molecule, i: int, where: str) -> None:
    want = expected_molecule(i)
    np.testing.assert_array_equal(mol.positions, want["positions"], err_msg=f"{where} pos")
    np.testing.assert_array_equal(mol.atomic_numbers, want["atomic_numbers"],
                                  err_msg=f"{where} numbers")
    np.testing.assert_array_equal(mol.forces, want["forces"], err_msg=f"{where} forces")
    assert mol.energy == want["energy"], where
    assert mol.name == want["name"], where
    assert mol.properties == want["properties"], where


def _check_contents(path: Path, allowed: set[int], where: str) -> int:
    """Open ``path``; assert its count is in ``allowed`` and every value is right."""
    with atp.open(path) as f:
        count = len(f)
        assert count in allowed, f"{where}: file holds {count} molecules, expected {allowed}"
        for i in range(count):
            _assert_molecule_equal(f[i], i, f"{where}, molecule {i}")
        if count:
            flat = f.read_batch(np.arange(count))
            wanted = [expected_molecule(i) for i in range(count)]
            np.testing.assert_array_equal(
                flat["positions"], np.concatenate([w["positions"] for w in wanted]))
            np.testing.assert_array_equal(flat["energy"], [w["energy"] for w in wanted])
    # a crash may leave an uncommitted tail and a torn (older) slot; nothing else
    problems = [p for p in atp.verify(path)
                if "uncommitted bytes" not in p and not p.startswith(f"{path}: slot ")]
    assert problems == [], f"{where}: atp.verify reports {problems}"
    # the reference implementation must agree on what was committed
    assert len(atompack.Database.open(str(path))) == count, where
    return count


def _allowed_counts(log: Path, start: int) -> tuple[int, int | None]:
    """(last completed flush, count of a flush in progress or None) from the child's log."""
    committed, pending = start, None
    for line in log.read_text().splitlines():
        word, _, value = line.partition(" ")
        if word == "done":
            committed, pending = int(value), None
        elif word == "begin":
            pending = int(value)
        elif word == "error":
            pytest.fail(f"crash writer: {line}")
    return committed, pending


def _wait_ready(process: subprocess.Popen, where: str) -> None:
    ready, _, _ = select.select([process.stdout], [], [], CHILD_TIMEOUT_S)
    line = process.stdout.readline() if ready else b""
    if line.strip() != b"ready":
        process.kill()
        process.wait()
        pytest.fail(f"{where}: writer did not start: {line!r} {process.stderr.read()!r}")


def _run_writer(path: Path, log: Path, start: int, *, die: str | None, delay: float | None,
                seed: int, where: str) -> None:
    """Run one writer until it is killed: by itself (``die``) or after ``delay`` seconds."""
    command = [sys.executable, str(CRASH_WRITER), str(path), str(log), str(start),
               "--seed", str(seed)]
    if die:
        command += ["--die", die]
    log.write_text("")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_ready(process, where)
        if delay is not None:
            try:
                process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGKILL)
        process.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stderr = process.stderr.read().decode(errors="replace")
        process.stdout.close()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL, \
        f"{where}: writer exited with {process.returncode}, not SIGKILL:\n{stderr}"


def _kill_schedule(rng: random.Random) -> list[tuple[str | None, float | None]]:
    """Mixed list of (self-kill spec, parent kill delay); exactly one of them is set."""
    schedule: list[tuple[str | None, float | None]] = [
        (None, rng.uniform(0.0, 0.25)) for _ in range(RANDOM_KILLS)]
    for kind, times in PROTOCOL_KILLS:
        for _ in range(times):
            flush = rng.randint(1, 4)
            if kind == "torn":
                spec = f"torn:{flush}:{rng.choice([1, 8, 12, 40, 64, 511, 2048, 4091, 4095])}"
            elif kind == "write":
                spec = f"write:{rng.randint(1, 12)}"
            else:
                spec = f"{kind}:{flush}"
            schedule.append((spec, None))
    rng.shuffle(schedule)
    return schedule


# ---------------------------------------------------------------------- SIGKILL loop
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_sigkill_during_append_and_flush_keeps_last_commit(tmp_path: Path,
                                                           compression: str) -> None:
    rng = random.Random(f"{SEED}-{compression}")
    path, log = tmp_path / "crash.atp", tmp_path / "progress.log"
    _create(path, compression, count=3)
    count = 3
    kinds_seen: dict[str, int] = {}
    schedule = _kill_schedule(rng)
    # half the schedule per codec keeps the run short; both halves together give >= 50 kills
    for round_number, (die, delay) in enumerate(schedule[: len(schedule) // 2 + 1]):
        where = (f"seed {SEED}, {compression}, round {round_number} "
                 f"({die or f'killed after {delay:.3f}s'})")
        _run_writer(path, log, count, die=die, delay=delay, seed=rng.randrange(2**31),
                    where=where)
        committed, pending = _allowed_counts(log, count)
        kind = (die or "random").split(":")[0]
        kinds_seen[kind] = kinds_seen.get(kind, 0) + 1
        if kind == "torn" and int(die.split(":")[2]) >= SLOT_SIZE - 4:
            # only checksum bytes are missing: when the stale ones happen to equal the new
            # checksum (1 in 256 for one byte) the slot is byte-identical to the complete
            # new header, so the flush may count; anything else must not
            assert pending is not None, where
            allowed = {committed, pending}
        elif kind in ("precommit", "torn"):
            # killed before the new header slot was complete: the flush must not count
            assert pending is not None, where
            allowed = {committed}
        elif kind == "committed":
            # the slot reached the kernel: the flush counts although fsync never ran
            assert pending is not None, where
            allowed = {pending}
        else:
            allowed = {committed} | ({pending} if pending is not None else set())
        count = _check_contents(path, allowed, where)
    assert set(kinds_seen) == {"random", "precommit", "torn", "committed", "write"}, kinds_seen
    assert count > 3

    # the survivor is appendable by this process too
    writer = atp.Writer.append_to(path)
    writer.add(**expected_molecule(count))
    writer.flush()
    writer.close()
    assert _check_contents(path, {count + 1}, "final append") == count + 1


def test_schedule_has_at_least_fifty_kills() -> None:
    schedule = _kill_schedule(random.Random(SEED))
    per_codec_run = len(schedule) // 2 + 1
    assert 2 * per_codec_run >= 50
    assert any(d is not None and d.startswith("torn") for d, _ in schedule)
    assert any(d is not None and d.startswith("precommit") for d, _ in schedule)


# ---------------------------------------------------------------------- torn slots by hand
def _flushes(path: Path, batches: list[int]) -> list[int]:
    """Create ``path`` and flush ``batches`` molecules at a time; return counts per commit."""
    counts, total = [], 0
    writer = atp.Writer(path)  # no context manager: its exit would flush once more
    for size in batches:
        for _ in range(size):
            writer.add(**expected_molecule(total))
            total += 1
        writer.flush()
        counts.append(total)
    writer.close()
    return counts


def _slot_generation(data: bytes, slot: int) -> int:
    return struct.unpack_from("<Q", data, slot * SLOT_SIZE + 8)[0]


@pytest.mark.parametrize("damage", ["bit_flip", "torn_prefix", "zeroed", "checksum"])
@pytest.mark.parametrize("newest", [True, False])
def test_one_damaged_slot_falls_back_to_the_other(tmp_path: Path, damage: str,
                                                  newest: bool) -> None:
    path = tmp_path / "two.atp"
    counts = _flushes(path, [2, 3, 4])  # generations 1, 2, 3: B=3 (newest), A=2
    data = bytearray(path.read_bytes())
    newest_slot = 0 if _slot_generation(data, 0) > _slot_generation(data, 1) else 1
    slot = newest_slot if newest else 1 - newest_slot
    start = slot * SLOT_SIZE
    if damage == "bit_flip":
        data[start + 40] ^= 0x01  # num_molecules
    elif damage == "torn_prefix":
        # the start of an older commit's slot over the current one, as a torn write leaves it
        older = bytearray(data[(1 - slot) * SLOT_SIZE:(2 - slot) * SLOT_SIZE])
        data[start:start + 512] = older[:512]
    elif damage == "zeroed":
        data[start:start + SLOT_SIZE] = bytes(SLOT_SIZE)
    else:
        data[start + SLOT_SIZE - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    expected = counts[-2] if newest else counts[-1]
    assert _check_contents_lenient(path, expected) == expected

    # appending after the fallback overwrites the damaged slot with a valid commit
    writer = atp.Writer.append_to(path)
    writer.add(**expected_molecule(expected))
    writer.flush()
    writer.close()
    assert _check_contents_lenient(path, expected + 1) == expected + 1


def _check_contents_lenient(path: Path, expected: int) -> int:
    """Like ``_check_contents`` without the reference cross-check (atompack refuses a file
    whose first 8 bytes are damaged even when slot B is valid, spec §2.2)."""
    with atp.open(path) as f:
        assert len(f) == expected
        for i in range(expected):
            _assert_molecule_equal(f[i], i, f"{path.name} molecule {i}")
    return expected


def test_both_slots_damaged_is_an_atp_error(tmp_path: Path) -> None:
    path = tmp_path / "dead.atp"
    _flushes(path, [2, 2])
    data = bytearray(path.read_bytes())
    data[40] ^= 0x01
    data[SLOT_SIZE + 40] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(atp.AtpError, match="dead.atp"):
        atp.open(path)
    with pytest.raises(atp.AtpError, match="dead.atp"):
        atp.Writer.append_to(path)


def test_lost_header_write_leaves_a_tail_that_append_truncates(tmp_path: Path) -> None:
    path = tmp_path / "tail.atp"
    counts = _flushes(path, [3, 3])
    size_after_commit = path.stat().st_size
    # records, schema and index of a third flush reached the file, its header slot did not
    writer = atp.Writer.append_to(path)
    for i in range(counts[-1], counts[-1] + 5):
        writer.add(**expected_molecule(i))
    header_before = path.read_bytes()[:2 * SLOT_SIZE]
    writer.flush()
    writer.close()
    # put the old header slots back: as if the third flush died before its slot write
    path.write_bytes(header_before + path.read_bytes()[2 * SLOT_SIZE:])
    assert path.stat().st_size > size_after_commit
    assert _check_contents(path, {counts[-1]}, "uncommitted tail") == counts[-1]
    writer = atp.Writer.append_to(path)
    writer.add(**expected_molecule(counts[-1]))
    writer.flush()
    writer.close()
    assert _check_contents(path, {counts[-1] + 1}, "after append") == counts[-1] + 1
