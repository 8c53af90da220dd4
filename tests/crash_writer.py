"""Subprocess for ``test_crash_consistency.py``: append and flush in a loop until killed.

The parent process kills this writer with SIGKILL, either at a random moment or
by asking it (``--die``) to kill itself at an exact point of the commit protocol.
The self-kill points are reached by wrapping, in this process only, the I/O
primitives that :mod:`pyg_atompack.atp.writer` uses (its file object's ``write``
and ``os.fsync``), so the writer itself needs no test hook.

Molecule ``i`` is a pure function of ``i`` (:func:`expected_molecule`), so the
parent can check every value of whatever survived. Progress goes to a log file
through unbuffered ``os.write`` calls (they reach the kernel at once, which is
all SIGKILL needs): ``begin N`` just before ``flush()`` commits ``N``
molecules, ``done N`` right after it returned.

Usage::

    python crash_writer.py FILE LOG START [--die KIND:N[:K]] [--seed S]

``--die`` kinds: ``write:N`` (die before the N-th write into the file),
``precommit:N`` (die inside the N-th flush after the index is written and
flushed, before the header slot is written), ``torn:N:K`` (in the N-th flush
write only the first K bytes of the header slot, then die), ``committed:N`` (die
right after the N-th flush wrote its header slot, before the final fsync).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np

# the tests directory is not a package; make `pyg_atompack` importable from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyg_atompack.atp import writer as writer_module  # noqa: E402

SLOT_SIZE = 4096
HEADER_SIZE = 2 * SLOT_SIZE


def expected_molecule(i: int) -> dict[str, Any]:
    """The keyword arguments ``Writer.add`` receives for molecule ``i``.

    Sizes, values and the string length all vary with ``i`` so that records of
    different layouts interleave, as in real data.

    Args:
        i: global molecule index.

    Returns:
        ``positions``, ``atomic_numbers`` and optional fields for ``Writer.add``.
    """
    n = 1 + i % 6
    base = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    positions = base * np.float32(0.25) + np.float32(i)
    numbers = ((np.arange(n) + i) % 90 + 1).astype(np.uint8)
    forces = -positions * np.float32(0.5)
    return dict(
        positions=positions,
        atomic_numbers=numbers,
        energy=-0.5 * i - 0.125,
        forces=forces,
        name="m" * (i % 5) + str(i),
        properties={"index": i},
    )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KillPlan:
    """Decides when this process kills itself (see the module docstring)."""

    def __init__(self, spec: str | None) -> None:
        parts = (spec or "none:0").split(":")
        self.kind = parts[0]
        self.at = int(parts[1]) if len(parts) > 1 else 0
        self.keep = int(parts[2]) if len(parts) > 2 else 0
        self.writes = 0
        self.flushes = 0
        self.fsyncs_in_flush = 0

    def before_write(self, handle: Any, data: bytes) -> None:
        """Called before every write into the file; may end the process."""
        self.writes += 1
        if self.kind == "write" and self.writes == self.at:
            handle.flush()
            _die()
        is_slot = len(data) == SLOT_SIZE and handle.tell() in (0, SLOT_SIZE)
        if is_slot and self.flushes == self.at and self.kind == "torn":
            # a torn slot: the first K bytes are new, the rest still holds the old slot
            handle.raw_write(bytes(data[:self.keep]))
            handle.flush()
            _die()

    def after_write(self, handle: Any, data: bytes) -> None:
        """Called after every write into the file; may end the process."""
        is_slot = len(data) == SLOT_SIZE and handle.tell() - SLOT_SIZE in (0, SLOT_SIZE)
        if is_slot and self.flushes == self.at and self.kind == "committed":
            handle.flush()  # in the kernel: survives SIGKILL like any written page
            _die()

    def before_fsync(self) -> None:
        """The writer fsyncs twice per flush: after the index, then after the header slot."""
        self.fsyncs_in_flush += 1
        if self.fsyncs_in_flush == 1:
            self.flushes += 1
            if self.kind == "precommit" and self.flushes == self.at:
                _die()
        else:
            self.fsyncs_in_flush = 0


class _InstrumentedFile:
    """A file object that lets a :class:`_KillPlan` intercept every write."""

    def __init__(self, handle: Any, plan: _KillPlan) -> None:
        self._handle = handle
        self._plan = plan

    def write(self, data: bytes) -> int:
        self._plan.before_write(self, data)
        written = self._handle.write(data)
        self._plan.after_write(self, data)
        return written

    def raw_write(self, data: bytes) -> int:
        return self._handle.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _install(plan: _KillPlan) -> None:
    real_open = open
    real_fsync = os.fsync

    def instrumented_open(*args: Any, **kwargs: Any) -> Any:
        return _InstrumentedFile(real_open(*args, **kwargs), plan)

    def instrumented_fsync(fd: int) -> None:
        plan.before_fsync()
        real_fsync(fd)

    # the writer resolves `open` through its module globals first, then builtins
    writer_module.open = instrumented_open
    os.fsync = instrumented_fsync


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("log")
    parser.add_argument("start", type=int, help="molecules the file holds now")
    parser.add_argument("--die", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    _install(_KillPlan(args.die))
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rng = np.random.default_rng(args.seed)
    writer = writer_module.Writer.append_to(args.file)
    if len(writer) != args.start:
        os.write(log, f"error reopened with {len(writer)}, expected {args.start}\n".encode())
        sys.exit(3)
    os.write(log, b"ready\n")
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    count = args.start
    while True:
        for _ in range(int(rng.integers(1, 5))):
            writer.add(**expected_molecule(count))
            count += 1
        os.write(log, f"begin {count}\n".encode())
        writer.flush()
        os.write(log, f"done {count}\n".encode())


if __name__ == "__main__":
    main()
