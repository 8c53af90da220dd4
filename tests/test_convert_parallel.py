"""Parallel (``--workers``) and partitioned (``--part`` + ``merge``) conversion.

The command line runs as real subprocesses with real worker processes. Outputs are
compared byte for byte with a single-process conversion of the same source.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pyg_atompack.convert.parallel import RANGE_SIZE, Part, index_extxyz, plan_part

N_FRAMES = 700  # three ranges of RANGE_SIZE: both workers get some


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyg_atompack.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def write_extxyz(path: Path, count: int, *, bad: int | None = None) -> Path:
    """An extxyz file of small molecules (energy, forces, a per-frame tag, VEC-free)."""
    rng = np.random.default_rng(1)
    lines = []
    for i in range(count):
        n = 2 + i % 4
        energy = "not-a-number" if i == bad else f"{rng.normal():.10f}"
        lines += [str(n), f"Properties=species:S:1:pos:R:3:forces:R:3 energy={energy} "
                          f'tag={i} pbc="F F F"']
        for row in rng.normal(size=(n, 6)):
            lines.append("H " + " ".join(f"{v:.8f}" for v in row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_extxyz(tmp_path_factory.mktemp("parallel") / "frames.extxyz", N_FRAMES)


def _manifest(directory: Path) -> dict:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.pop("created_at_utc")
    return manifest


def _same_tree(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert _manifest(a) == _manifest(b)


def test_index_matches_ase_frames(source: Path) -> None:
    import ase.io

    offsets = index_extxyz(source)
    assert len(offsets) == N_FRAMES + 1 and offsets[-1] == source.stat().st_size
    assert len(list(ase.io.iread(source, index=":"))) == N_FRAMES


@pytest.mark.parametrize("extra", [[], ["--shard-size", "90"]])
def test_two_workers_write_what_one_writes(source: Path, tmp_path: Path, extra) -> None:
    outputs = []
    for workers in (1, 2):
        out = tmp_path / (f"w{workers}.atp" if not extra else f"w{workers}")
        result = run("convert", source, out, "--workers", workers, *extra)
        assert result.returncode == 0, result.stderr
        assert f"wrote {N_FRAMES} structures" in result.stdout
        outputs.append(out)
    if extra:
        _same_tree(*outputs)
    else:
        assert outputs[0].read_bytes() == outputs[1].read_bytes()


def test_generic_sources_convert_in_parallel_too(source: Path, tmp_path: Path) -> None:
    atp_file = tmp_path / "all.atp"
    assert run("convert", source, atp_file).returncode == 0
    one, two = tmp_path / "one", tmp_path / "two"
    for out, workers in ((one, 1), (two, 2)):
        result = run("convert", atp_file, out, "--shard-size", "100", "--workers", workers)
        assert result.returncode == 0, result.stderr
    _same_tree(one, two)


def test_parts_and_merge_equal_one_conversion(source: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    assert run("convert", source, whole, "--shard-size", "90").returncode == 0
    parts = []
    for index in range(3):
        part = tmp_path / f"part{index}"
        result = run("convert", source, part, "--shard-size", "90", "--part", f"{index}/3",
                     "--workers", 2 if index == 1 else 1)
        assert result.returncode == 0, result.stderr
        parts.append(part)
    names = [sorted(p.name for p in part.glob("*.atp")) for part in parts]
    assert not set(names[0]) & set(names[1]) and not set(names[1]) & set(names[2])
    merged = tmp_path / "merged"
    result = run("merge", merged, *reversed(parts))  # any order
    assert result.returncode == 0, result.stderr
    assert f"{N_FRAMES} structures" in result.stdout
    _same_tree(whole, merged)
    assert run("verify", merged).returncode == 0

    missing = run("merge", tmp_path / "m2", parts[0], parts[2])
    assert missing.returncode == 2 and "missing part(s) 1/3" in missing.stderr
    # a damaged copy of part 2 (merged/ shares the part's files: hard links)
    copy = tmp_path / "part2-damaged"
    shutil.copytree(parts[2], copy)
    damaged = bytearray((copy / names[2][0]).read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (copy / names[2][0]).write_bytes(bytes(damaged))
    broken = run("merge", tmp_path / "m3", parts[0], parts[1], copy)
    assert broken.returncode == 2 and names[2][0] in broken.stderr
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def _promoting_extxyz(path: Path, count: int, *, text_from: int | None = None) -> Path:
    """Frames whose ``mu`` is an integer until the last shard, then a float (or text)."""
    lines = []
    for i in range(count):
        mu = i if i < count - 5 else i + 0.5
        if text_from is not None and i >= text_from:
            mu = '"high"'
        lines += ["2", f"Properties=species:S:1:pos:R:3 energy={i * 0.1:.3f} mu={mu} "
                       'pbc="F F F"', "H 0 0 0", f"H 0 0 {0.7 + i * 1e-3:.4f}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def cli(capsys: pytest.CaptureFixture, *args: object) -> tuple[int, str]:
    """The command line in this process (fast), as ``(exit status, stderr)``."""
    from pyg_atompack.cli import main

    capsys.readouterr()
    status = main([*map(str, args), "-q"] if args[0] == "convert" else list(map(str, args)))
    return status, capsys.readouterr().err


@pytest.mark.parametrize("to", ["atp-shards", "pt-shards"])
def test_merge_gives_every_part_the_type_one_conversion_promotes_to(tmp_path: Path, to: str,
                                                                   capsys) -> None:
    # Part 0 only sees integers, part 1 sees the floats: a single conversion stores
    # `mu` as float64 everywhere, so merge must re-encode part 0, not link it.
    source = _promoting_extxyz(tmp_path / "mu.extxyz", 40)
    whole = tmp_path / "whole"
    assert cli(capsys, "convert", source, whole, "--to", to, "--shard-size", "10")[0] == 0
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for index, part in enumerate(parts):
        result = cli(capsys, "convert", source, part, "--to", to, "--shard-size", "10",
                     "--part", f"{index}/2")
        assert result[0] == 0, result[1]
    assert json.loads((parts[0] / "manifest.json").read_text())["part"]["kinds"][
        "properties/mu"][0] == "int"
    merged = tmp_path / "merged"
    result = cli(capsys, "merge", merged, *parts)
    assert result[0] == 0, result[1]
    assert "'mu' re-encoded from an integer to a float" in result[1]
    assert str(parts[0]) in result[1]
    _same_tree(whole, merged)
    # the parts themselves are left as they were written
    assert json.loads((parts[0] / "manifest.json").read_text())["part"]["kinds"][
        "properties/mu"][0] == "int"


def test_merge_names_a_key_the_parts_cannot_share(tmp_path: Path, capsys) -> None:
    source = _promoting_extxyz(tmp_path / "mu.extxyz", 40, text_from=20)
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for index, part in enumerate(parts):
        result = cli(capsys, "convert", source, part, "--shard-size", "10", "--part", f"{index}/2")
        assert result[0] == 0, result[1]
    result = cli(capsys, "merge", tmp_path / "merged", *parts)
    assert result[0] == 2
    assert "'mu'" in result[1] and "a string" in result[1]
    assert "--cast mu=DTYPE" in result[1]
    assert not (tmp_path / "merged").exists()


def test_part_planning_covers_whole_shards() -> None:
    for total, count, size in ((700, 3, 90), (5, 4, 2), (1000, 7, 1000)):
        spans = [plan_part(total, Part(i, count), size) for i in range(count)]
        assert spans[0][0] == 0 and spans[-1][1] == total
        for (start, stop, first), (following, _, _) in zip(spans, spans[1:]):
            assert stop == following and start == first * size
    with pytest.raises(ValueError, match="I/N"):
        Part.parse("3/3")


def test_bad_structure_in_a_worker_stops_everything(tmp_path: Path) -> None:
    bad = RANGE_SIZE + 7  # in the second range: read by the second worker
    source = write_extxyz(tmp_path / "bad.extxyz", N_FRAMES, bad=bad)
    out = tmp_path / "out"
    result = run("convert", source, out, "--shard-size", "50", "--workers", "2")
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert str(source) in line and f"structure {bad}" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.extxyz"]


@pytest.fixture(scope="module")
def big_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A source long enough that the workers are still busy when the test acts."""
    return write_extxyz(tmp_path_factory.mktemp("parallel-big") / "big.extxyz", 60_000)


def _start_conversion(source: Path, out: Path, *prefix: str) -> subprocess.Popen:
    """``pyg-atompack convert SOURCE OUT --workers 2`` in a session of its own.

    SIGINT is reset to its default in the child, as in a terminal: a shell's background
    job (``make test &``) inherits it ignored, and Python then keeps ignoring it, rightly.
    """
    command = list(prefix) or ["-m", "pyg_atompack.cli"]
    return subprocess.Popen(
        [sys.executable, *command, "convert", str(source), str(out), "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_until_writing(process: subprocess.Popen, out: Path) -> list[int]:
    """Wait for the writer's hidden output and both workers; their process ids."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 120
    while not (any(p.name.startswith(f".{out.name}.partial") for p in out.parent.iterdir())
               and len(children.read_text().split()) >= 2):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return [int(pid) for pid in children.read_text().split()]


def _finish(process: subprocess.Popen, timeout: float = 60) -> str:
    """The process's stderr once it *and every worker* have gone (the pipes close).

    A worker left behind keeps the pipes open, so this times out; the whole
    session is then killed so that no test leaves a process running.
    """
    try:
        return process.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"a process of the conversion was still running after "
                             f"{timeout} s") from None


def test_ctrl_c_stops_all_workers_and_leaves_nothing(tmp_path: Path, big_source: Path) -> None:
    out = tmp_path / "big.atp"
    process = _start_conversion(big_source, out)
    # interrupt once the writer has started and both workers are running
    _wait_until_writing(process, out)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    stderr = _finish(process)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert list(tmp_path.iterdir()) == []


# Python runs a signal handler in the main thread at its next instruction, even
# when that thread blocks the signal and another thread (a progress bar's
# monitor) took it: so a Ctrl-C can surface right after fork() returns, before
# multiprocessing has recorded the worker it just started. This runs the
# conversion with a fork() that does exactly that, every time.
_INTERRUPTED_RIGHT_AFTER_FORK = """
import os, signal, sys
fork = os.fork
def interrupted_fork():
    pid = fork()
    if pid:
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
    return pid
os.fork = interrupted_fork
from pyg_atompack.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_workers_start_leaves_no_worker_behind(tmp_path: Path,
                                                             big_source: Path) -> None:
    out = tmp_path / "big.atp"
    process = _start_conversion(big_source, out, "-c", _INTERRUPTED_RIGHT_AFTER_FORK)
    stderr = _finish(process)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr
    assert list(tmp_path.iterdir()) == []


def test_workers_leave_when_the_main_process_is_killed(tmp_path: Path,
                                                       big_source: Path) -> None:
    out = tmp_path / "big.atp"
    process = _start_conversion(big_source, out)
    workers = _wait_until_writing(process, out)
    os.kill(process.pid, signal.SIGKILL)  # the out-of-memory killer, a job's time limit
    _finish(process, timeout=30)
    for pid in workers:  # gone, or a zombie that nobody in this container reaps
        status = Path(f"/proc/{pid}/status")
        assert not status.exists() or "\nState:\tZ" in status.read_text(), pid
