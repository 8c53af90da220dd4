"""Hostile metatrain DiskDataset zips and memmap index files (issue #33, item 2).

The reported inputs, built here as real zips: a 2.7 KB zip whose deflated
``positions.npy`` of zeros sits in a deflated ``system.mta`` (566 MB to read on
``main``), an ``.npy`` header claiming 2**40 rows (numpy's ``MemoryError``) and
positions and types of different lengths (a bare ``ValueError``). Each must be a
:class:`~pyg_atompack.convert.ConvertError` naming the file, the structure, the member
and the field; ``convert``, ``head``, ``info`` and ``verify`` exit 2 with that one line.

A hypothesis fuzz then mutates valid zips (member sizes and compression, ``.npy``
headers, shapes, nesting, bytes) and asserts that every input converts or raises
``ConvertError``, within ``HANG_S`` seconds, and that no input makes the reader
allocate more than ``MEMBER_FLOOR + MEMBER_RATIO x the archive`` a few times over
(``tracemalloc`` peak); the reported inputs are also measured as the peak RSS of a
fresh process. Budget: half of ``PYG_ATOMPACK_FUZZ_EXAMPLES`` (default 200).
"""

from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import textwrap
import tracemalloc
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import assert_bad_input, run
from test_convert_diskdataset import _mts, build_disk_zip
from test_fuzz_atp import EXAMPLES, FUZZ_TIMEOUT_S, HANG_S, FuzzHang, watchdog

from pyg_atompack.convert import ConvertError, open_reader
from pyg_atompack.convert.diskdataset import MEMBER_FLOOR, MEMBER_RATIO
from pyg_atompack.memmap_layout import MemmapLayout, MemmapLayoutError, load_npy

#: Peak allocation allowed while reading one input: a few members' worth of budget.
PEAK_MEMBERS = 4


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False,
                                               "shape": shape})
    return out.getvalue()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def zip_bytes(members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression, compresslevel=9 if compression else None) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out.getvalue()


def nested_bomb(path: Path, rows: int = 2**23 + 2**22) -> None:
    """The reported zip: 0/system.mta (deflated) holding a deflated positions.npy of
    ``rows`` x 3 zeros (566 MB for the default) and a one-atom types.npy."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as system:
        with system.open("positions.npy", "w", force_zip64=True) as handle:
            handle.write(npy_header((rows, 3)))
            zeros = bytes(1 << 20)
            for start in range(0, rows * 24, len(zeros)):
                handle.write(zeros[:min(len(zeros), rows * 24 - start)])
        system.writestr("types.npy", npy(np.ones(1, dtype=np.int32)))
    path.write_bytes(zip_bytes({"0/system.mta": inner.getvalue()}, zipfile.ZIP_DEFLATED))


def system_zip(path: Path, arrays: dict[str, bytes], energy: bool = True) -> None:
    """A one-structure DiskDataset zip whose system.mta holds these raw .npy members."""
    members = {"0/system.mta": zip_bytes(arrays)}
    if energy:
        labels = np.array([(0,)], dtype=[("system", "<i4")])
        members["0/energy.mts"] = _mts(np.array([[1.0]]), labels, [])
    path.write_bytes(zip_bytes(members))


def reported_inputs(directory: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Every reported hostile input: ``name -> (path, fragments its error must name)``."""
    cases = {}
    bomb = directory / "bomb.zip"
    nested_bomb(bomb)
    cases["nested bomb"] = (bomb, ("structure 0", "0/system.mta", "positions.npy",
                                   "declares"))
    huge = directory / "huge_header.zip"
    system_zip(huge, {"positions.npy": npy_header((2**40, 3)) + bytes(240),
                      "types.npy": npy(np.ones(10, dtype=np.int32))})
    cases["2**40 rows"] = (huge, ("structure 0", "0/system.mta", "positions.npy",
                                  "(1099511627776, 3)"))
    lengths = directory / "lengths.zip"
    system_zip(lengths, {"positions.npy": npy(np.zeros((5, 3))),
                         "types.npy": npy(np.ones(4, dtype=np.int32))})
    cases["lengths"] = (lengths, ("structure 0", "0/system.mta", "field 'positions'",
                                  "(5, 3)"))
    target = directory / "target_bomb.zip"
    labels = np.array([(0,)], dtype=[("system", "<i4")])
    inner = zip_bytes({"keys.npy": npy(np.array([(0,)], dtype=[("_", "<i4")])),
                       "blocks/0/samples.npy": npy(labels),
                       "blocks/0/values.npy": npy_header((2**22, 8)) + bytes(2**28)},
                      zipfile.ZIP_DEFLATED)
    target.write_bytes(zip_bytes({
        "0/system.mta": zip_bytes({"positions.npy": npy(np.zeros((1, 3))),
                                   "types.npy": npy(np.ones(1, dtype=np.int32))}),
        "0/energy.mts": npy(np.frombuffer(inner, dtype=np.uint8))}, zipfile.ZIP_DEFLATED))
    cases["target bomb"] = (target, ("0/energy.mts", "blocks/0/values.npy", "declares"))
    return cases


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory):
    return reported_inputs(tmp_path_factory.mktemp("reported"))


def test_the_reported_bomb_is_small(reported) -> None:
    assert reported["nested bomb"][0].stat().st_size < 4096  # the report: 2.7 KB


@pytest.mark.parametrize("case", ["nested bomb", "2**40 rows", "lengths", "target bomb"])
def test_reported_inputs_raise_convert_error(reported, case: str) -> None:
    path, fragments = reported[case]
    with pytest.raises(ConvertError) as caught:
        list(open_reader(path))
    message = str(caught.value)
    assert message.startswith(str(path)), message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("command", ["convert", "head", "info", "verify"])
@pytest.mark.parametrize("case", ["nested bomb", "2**40 rows", "lengths", "target bomb"])
def test_cli_exits_2_with_one_line(reported, tmp_path: Path, command: str, case: str) -> None:
    path, fragments = reported[case]
    extra = [tmp_path / "out.atp"] if command == "convert" else []
    assert_bad_input(run(command, path, *extra), str(path), *fragments)
    assert not (tmp_path / "out.atp").exists()


def test_reported_inputs_peak_memory_and_time(reported) -> None:
    """Read in a fresh process: peak RSS growth under 4 members' budget, in seconds."""
    paths = [str(path) for path, _ in reported.values()]
    script = textwrap.dedent(f"""
        import resource, time
        from pyg_atompack.convert import ConvertError, open_reader
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        for path in {paths!r}:
            try:
                list(open_reader(path))
            except ConvertError:
                pass
            else:
                raise SystemExit(path + " converted")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before,
              time.perf_counter() - started)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    grown_kib, seconds = result.stdout.split()
    assert int(grown_kib) * 1024 < PEAK_MEMBERS * MEMBER_FLOOR, grown_kib  # main: 566 MB
    assert float(seconds) < 10


def test_member_inflating_past_its_declared_size(tmp_path: Path) -> None:
    """A member whose central directory understates its size: zipfile stops at the
    declared size and the CRC-32 disagrees; nothing past it is inflated."""
    path = tmp_path / "liar.zip"
    system_zip(path, {"positions.npy": npy(np.zeros((4, 3))),
                      "types.npy": npy(np.ones(4, dtype=np.int32))})
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("0/system.mta")
    # shrink the declared (uncompressed) size in both the local and central headers
    for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = data.index(signature)
        data[start + at:start + at + 4] = (info.file_size // 2).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match=r"structure 0\): 0/system.mta"):
        list(open_reader(path))


def test_member_budget_is_stated_relative_to_the_archive(tmp_path: Path) -> None:
    path = tmp_path / "ok.zip"
    build_disk_zip(path, count=2)
    reader = open_reader(path)
    assert reader.budget == MEMBER_FLOOR + MEMBER_RATIO * path.stat().st_size
    assert len(list(reader)) == 2


# ---------------------------------------------------------------------- .npy and memmap
def test_load_npy_refuses_claims_beyond_its_bytes() -> None:
    with pytest.raises(ValueError, match=r"claims shape \(1099511627776,\)"):
        load_npy(npy_header((2**40,)) + bytes(64))
    with pytest.raises(ValueError, match="Python objects"):
        load_npy(npy(np.array([None, 1], dtype=object)))
    array = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(load_npy(npy(array)), array)
    # a header dict cut open (found by the fuzzer): numpy's tokenizer stops, not its parser
    damaged = npy(array).replace(b"}", b" ", 1)
    with pytest.raises(ValueError, match="not a readable .npy array"):
        load_npy(damaged)
    np.testing.assert_array_equal(load_npy(npy(np.asfortranarray(array))), array)


@pytest.mark.parametrize("name", ["ns.npy", "na.npy"])
def test_memmap_index_claiming_2_40_rows(tmp_path: Path, name: str) -> None:
    from test_convert_memmap import hand_built

    hand_built(tmp_path / "mm")
    (tmp_path / "mm" / name).write_bytes(npy_header((2**40,), "<i8") + bytes(64))
    with pytest.raises(MemmapLayoutError, match=rf"{name}: unreadable: .*1099511627776"):
        MemmapLayout(tmp_path / "mm")
    result = run("head", tmp_path / "mm")
    assert_bad_input(result, name, "1099511627776")


# ---------------------------------------------------------------------- fuzz
def _valid_members() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as directory:
        build_disk_zip(Path(directory) / "base.zip", count=2)
        with zipfile.ZipFile(Path(directory) / "base.zip") as archive:
            return {name: archive.read(name) for name in archive.namelist()}


BASE_MEMBERS = _valid_members()


def _inner(data: bytes) -> dict[str, bytes] | None:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return {name: archive.read(name) for name in archive.namelist()}
    except Exception:  # noqa: BLE001 - an .mts member is an npy of a zip
        return None


def _mts_inner(data: bytes) -> dict[str, bytes] | None:
    try:
        return _inner(load_npy(data).tobytes())
    except ValueError:  # an earlier step damaged it
        return None


@st.composite
def mutated_zips(draw: st.DrawFn) -> tuple[str, bytes]:
    members = dict(BASE_MEMBERS)
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(members)))
        is_mts = name.endswith(".mts")
        inner = _mts_inner(members[name]) if is_mts else _inner(members[name])
        kind = draw(st.sampled_from(["shape", "header", "bomb", "truncate", "flip",
                                     "drop", "dtype"]))
        steps.append(f"{kind} {name}")
        if not inner or kind in ("truncate", "flip"):
            data = bytearray(members[name])
            if data and kind == "flip":
                data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
            elif data:
                del data[draw(st.integers(0, len(data) - 1)):]
            members[name] = bytes(data)
            continue
        array_name = draw(st.sampled_from(sorted(inner)))
        if kind == "drop":
            del inner[array_name]
        elif kind == "header":  # a claim far beyond the bytes
            rows = draw(st.sampled_from([2**31, 2**40, 2**62, 10**6]))
            inner[array_name] = npy_header((rows, 3)) + bytes(draw(st.integers(0, 512)))
        elif kind == "bomb":  # a real, honest, huge array of zeros (deflated below)
            rows = draw(st.sampled_from([2**20, 2**22]))  # 25 and 100 MB of zeros
            inner[array_name] = npy_header((rows, 3)) + bytes(rows * 24)
        elif kind == "dtype":
            try:
                value = load_npy(inner[array_name])
            except ValueError:  # an earlier step's claim
                value = np.zeros(1)
            target = draw(st.sampled_from(["<U4", "|S2", "<c16", "|b1", "<i2"]))
            inner[array_name] = npy(np.zeros(value.shape, dtype=target))
        else:  # a shape that disagrees with the others
            value = np.zeros((draw(st.integers(0, 9)), draw(st.integers(0, 4))))
            inner[array_name] = npy(value)
        # a bomb is deflated (stored, it is a legitimately large archive, not a bomb)
        compression = zipfile.ZIP_DEFLATED if kind == "bomb" else draw(
            st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
        packed = zip_bytes({f"{key}.npy" if not key.endswith(".npy") else key: value
                            for key, value in inner.items()}, compression)
        members[name] = npy(np.frombuffer(packed, dtype=np.uint8)) if is_mts else packed
    outer = draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))
    return str(steps), zip_bytes(members, outer)


def _convert_all(path: Path) -> str:
    try:
        with open_reader(path) as reader:
            for _ in reader:
                pass
    except ConvertError as error:
        assert str(error).startswith(str(path)), error
        return "ConvertError"
    return "ok"


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_mutated_zips_convert_or_raise_convert_error(tmp_path: Path) -> None:
    outcomes: Counter = Counter()
    path = tmp_path / "input.zip"
    _convert_all(Path(__file__).parent / "missing.zip")  # warm the error path's imports

    # half the budget: each example converts a whole zip under tracemalloc, the costliest
    # example of the three fuzzers (``make fuzz`` runs 20,000 of them)
    @settings(max_examples=max(EXAMPLES // 2, 50), derandomize=True, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))
    @given(mutated_zips())
    def fuzz(case: tuple[str, bytes]) -> None:
        what, data = case
        path.write_bytes(data)
        budget = MEMBER_FLOOR + MEMBER_RATIO * len(data)
        tracemalloc.start()
        try:
            with watchdog(HANG_S, what):
                outcomes[_convert_all(path)] += 1
            peak = tracemalloc.get_traced_memory()[1]
        except (AssertionError, FuzzHang):
            raise
        except Exception as error:  # the property under test: nothing else escapes
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error
        finally:
            tracemalloc.stop()
        assert peak < PEAK_MEMBERS * budget, f"{what}: {peak} bytes allocated"

    fuzz()
    print(f"diskdataset fuzz outcomes: {dict(outcomes)}")
    assert outcomes["ConvertError"] > 0 and outcomes["ok"] > 0, outcomes
