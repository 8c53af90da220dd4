"""A file shrinking under a reader: an error or the old file, never SIGBUS (issue #33, item 5).

The reader runs in a subprocess, so a ``SIGBUS`` shows as exit code -7 instead of
killing pytest; a second party (this process, or a writer subprocess) shrinks or
rewrites the file between the reader's first pass (every page mapped and touched)
and its second.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack import atp

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120
RECORDS = 300

# READ a file (ACCESS) twice: once before "go" arrives on stdin, once after.
# Prints "ok <sum of energies>" or "error <class>: <message>".
READER = textwrap.dedent("""
    import sys
    import numpy as np
    from pyg_atompack import atp
    path, access, how = sys.argv[1:4]
    reader = atp.Reader(path, access=access)

    def read():
        if how == "read_batch":
            out = reader.read_batch(np.arange(len(reader)))
            return float(np.asarray(out["energy"]).sum() + out["positions"].sum())
        if how == "iterate":
            return float(sum(m.energy + float(np.sum(m.positions)) for m in reader))
        if how in ("getitem", "get"):
            get = reader.get if how == "get" else reader.__getitem__
            return float(sum(get(i).energy + float(np.sum(get(i).positions))
                             for i in range(len(reader))))
        if how == "raw_record":
            return float(sum(len(reader.raw_record(i)) for i in range(len(reader))))
        raise SystemExit(f"unknown {how}")

    first = read()
    print("ready", first, flush=True)
    sys.stdin.readline()
    try:
        print("ok", read(), flush=True)
    except atp.AtpError as exc:
        print("error", f"{type(exc).__name__}: {exc}", flush=True)
""")


def _write(path: Path, count: int, compression: str = "none", seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with atp.Writer(path, compression=compression, overwrite=True) as writer:
        writer.add_batch(rng.standard_normal((count, 64, 3)).astype(np.float32),
                         rng.integers(1, 90, (count, 64)).astype(np.uint8),
                         energy=rng.standard_normal(count),
                         forces=rng.standard_normal((count, 64, 3)).astype(np.float32))


def _run(path: Path, access: str, how: str, shrink) -> tuple[int, str, str]:
    """Start the reader, call ``shrink()`` after its first pass; (exit code, stdout lines)."""
    return _run_script(READER, [str(path), access, how], shrink)


def _run_script(script: str, args: list[str], shrink) -> tuple[int, str, str]:
    """Run ``script`` until it prints ``ready``, call ``shrink()``, then let it go on."""
    process = subprocess.Popen([sys.executable, "-c", script, *args],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        ready = process.stdout.readline().decode()
        assert ready.startswith("ready"), process.stderr.read().decode()
        shrink()
        out, err = process.communicate(b"go\n", timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return process.returncode, ready.split()[1], out.decode() + err.decode()


def _truncate(path: Path) -> None:
    os.truncate(path, 20000)  # the header and a few records are left


def _copy_over(path: Path, small: Path) -> None:
    shutil.copyfile(small, path)  # opens the destination "wb": truncates in place


@pytest.mark.parametrize("access", ["auto", "mmap", "pread"])
@pytest.mark.parametrize("how", ["read_batch", "iterate", "raw_record", "get"])
@pytest.mark.parametrize("who", ["truncate", "copy over"])
def test_another_program_shrinking_the_file_raises_truncated_not_sigbus(
        tmp_path: Path, access: str, how: str, who: str) -> None:
    path, small = tmp_path / "data.atp", tmp_path / "small.atp"
    _write(path, RECORDS)
    _write(small, 3, seed=1)
    shrink = (lambda: _truncate(path)) if who == "truncate" else (lambda: _copy_over(path, small))
    code, _, out = _run(path, access, how, shrink)
    assert code == 0, f"reader died with {signal.Signals(-code).name if code < 0 else code}: {out}"
    assert out.startswith("error TruncatedFileError"), out
    assert str(path) in out


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.parametrize("access", ["auto", "mmap"])
@pytest.mark.parametrize("how", ["get", "read_batch"])
def test_compressed_files_are_checked_too(tmp_path: Path, compression: str, access: str,
                                          how: str) -> None:
    path = tmp_path / "data.atp"
    _write(path, RECORDS, compression)
    code, _, out = _run(path, access, how, lambda: _truncate(path))
    assert code == 0, out
    assert out.startswith("error TruncatedFileError"), out


def _overwrite_in_another_process(path: Path) -> None:
    script = ("import sys, numpy as np; from pyg_atompack import atp\n"
              "with atp.Writer(sys.argv[1], overwrite=True) as w:\n"
              "    w.add(np.zeros((1, 3), np.float32), np.array([1]), energy=1.0)\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=TIMEOUT_S,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert len(atp.Reader(path)) == 1


@pytest.mark.parametrize("access", ["auto", "mmap", "pread"])
@pytest.mark.parametrize("how", ["read_batch", "iterate", "getitem"])
def test_library_overwrite_leaves_open_readers_on_the_old_file(tmp_path: Path, access: str,
                                                               how: str) -> None:
    # the reproduction: atp.Writer(path, overwrite=True) used to truncate the
    # file in place, and a mapped reader of it died of SIGBUS
    path = tmp_path / "data.atp"
    _write(path, RECORDS)
    code, first, out = _run(path, access, how, lambda: _overwrite_in_another_process(path))
    assert code == 0, out
    assert out.split()[:2] == ["ok", first]  # the same records, read again


@pytest.mark.parametrize("access", ["auto", "mmap"])
def test_appending_writer_dropping_a_crashed_tail_does_not_disturb_readers(
        tmp_path: Path, access: str) -> None:
    # the only shrink a library writer does: an uncommitted tail, past every commit
    path = tmp_path / "data.atp"
    _write(path, RECORDS)
    with open(path, "ab") as handle:
        handle.write(b"\x55" * 300_000)  # a crashed writer's records, never committed
    size = os.path.getsize(path)

    def append() -> None:
        with atp.Writer.append_to(path) as writer:
            writer.add(np.zeros((1, 3), np.float32), np.array([1]), energy=0.0)
        assert os.path.getsize(path) < size - 200_000  # the file did shrink

    code, first, out = _run(path, access, "read_batch", append)
    assert code == 0, out
    assert out.split()[:2] == ["ok", first]


# A training run's data loading: two persistent DataLoader workers read one epoch,
# the file changes, they read another. Prints "ok <sum>" or "error <class>: <message>".
LOADER = textwrap.dedent("""
    import sys
    from pyg_atompack import atp
    from pyg_atompack.data import AtompackDataset, AtompackLoader
    from torch_geometric.loader import DataLoader
    path, kind = sys.argv[1:3]
    dataset = AtompackDataset(path, log=False)
    make = AtompackLoader if kind == "AtompackLoader" else DataLoader
    loader = make(dataset, batch_size=16, num_workers=2, persistent_workers=True)

    def epoch():
        return repr(sum(float(batch.pos.double().sum()) for batch in loader))

    print("ready", epoch(), flush=True)
    sys.stdin.readline()
    try:
        print("ok", epoch(), flush=True)
    except atp.AtpError as exc:
        print("error", f"{type(exc).__name__}: {exc}", flush=True)
""")


def _run_loader(path: Path, kind: str, shrink) -> tuple[int, str, str]:
    return _run_script(LOADER, [str(path), kind], shrink)


@pytest.mark.parametrize("kind", ["AtompackLoader", "DataLoader"])
def test_dataloader_workers_get_truncated_file_error_not_a_signal(tmp_path: Path,
                                                                  kind: str) -> None:
    path = tmp_path / "data.atp"
    _write(path, RECORDS)
    code, _, out = _run_loader(path, kind, lambda: _truncate(path))
    assert code == 0, out
    assert "killed by signal" not in out
    assert out.startswith("error TruncatedFileError"), out
    assert str(path) in out.splitlines()[0] or str(path) in out


@pytest.mark.parametrize("kind", ["AtompackLoader", "DataLoader"])
def test_dataloader_workers_keep_reading_a_file_the_library_overwrote(tmp_path: Path,
                                                                      kind: str) -> None:
    path = tmp_path / "data.atp"
    _write(path, RECORDS)
    code, first, out = _run_loader(path, kind, lambda: _overwrite_in_another_process(path))
    assert code == 0, out
    assert out.split()[:2] == ["ok", first]
