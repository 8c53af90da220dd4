"""Fuzz the streaming layer's ``.pt`` shard loader with ``trusted=False``.

Inputs are (a) valid shards written by ``torch.save`` (a list of ``Data``, list
slices of an ``InMemoryDataset``, a collated ``InMemoryDataset`` tuple, the
``InMemoryDataset.save`` triple) with
bytes flipped, truncated or spliced, (b) the same archives with their
``data.pkl`` edited and the zip rebuilt (so the CRC is right and the edit
reaches the unpickler), and (c) hand-assembled pickles that try to run code
(``os.system``, ``eval``, ``exec``, ``open``, ``subprocess`` ...) through
``REDUCE``, ``INST``, ``OBJ``, ``NEWOBJ`` and ``BUILD``, each aimed at creating
a marker file, placed inside a torch zip archive or given as a bare pickle.

Every input must either decode into samples that can be read, or raise the
stream layer's ``StreamError`` (``ShardDecodeError`` / ``UnsafePayloadError``)
naming the shard; the marker file must never appear. Each input is decoded as
``bytes`` (straight to ``torch.load(weights_only=True)``) and as a ``bytearray``
(the in-place indexer first, which knows every base layout here). A control test shows that
the same payloads *do* create the marker with ``trusted=True``, so the
payloads are real. Budget: ``PYG_ATOMPACK_FUZZ_EXAMPLES`` (default 200).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import struct
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers.http_server import make_samples
from test_fuzz_atp import EXAMPLES, FUZZ_TIMEOUT_S, HANG_S, FuzzHang, watchdog
from torch_geometric.data import Data, InMemoryDataset

from pyg_atompack.stream import ShardDecodeError, StreamError, UnsafePayloadError, decode_shard

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

SHARD_NAME = "shard-0007.pt"
# callables that would touch the marker, with the argument list that does it
DANGEROUS = (
    ("os", "system", "cmd"), ("posix", "system", "cmd"), ("subprocess", "check_call", "argv"),
    ("subprocess", "Popen", "argv"), ("builtins", "eval", "code"), ("builtins", "exec", "code"),
    ("builtins", "open", "open"), ("io", "open", "open"), ("codecs", "open", "open"),
    ("__builtin__", "eval", "code"), ("runpy", "_run_code", "code"),
    ("torch.serialization", "load", "path"), ("pathlib", "Path.touch", "path"),
)
CALL_OPCODES = ("REDUCE", "INST", "OBJ", "NEWOBJ", "BUILD")


def _torch_bytes(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


class _Collated(InMemoryDataset):
    def __init__(self, samples: list[Data]) -> None:
        super().__init__(None)
        self.data, self.slices = self.collate(samples)


def _views() -> list[Data]:
    """FoldPipe's shards: list slices of a collated dataset (views of one storage)."""
    samples = make_samples(10, 6)
    for i, sample in enumerate(samples):
        sample.edge_index = torch.tensor([[0, 1, 2][: 1 + i % 3], [1, 2, 0][: 1 + i % 3]])
    return [data for data in _Collated(samples)][1:5]


BASES = {
    "list": _torch_bytes(make_samples(7, 3)),
    "views": _torch_bytes(_views()),
    "collated": _torch_bytes(InMemoryDataset.collate(make_samples(8, 3))),
    # the layout InMemoryDataset.save writes: (data.to_dict(), slices, Data)
    "triple": _torch_bytes((InMemoryDataset.collate(make_samples(9, 2))[0].to_dict(),
                            InMemoryDataset.collate(make_samples(9, 2))[1], Data)),
}


def _with_pickle(archive: bytes, pickled: bytes) -> bytes:
    """Replace ``data.pkl`` of a torch zip archive, rebuilding the zip (valid CRCs)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info.filename)
            target.writestr(info.filename, pickled if info.filename.endswith("/data.pkl")
                            else data)
    return out.getvalue()


def _data_pkl(archive: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(archive))
    name = next(n for n in source.namelist() if n.endswith("/data.pkl"))
    return source.read(name)


# ---------------------------------------------------------------------- crafted pickles
def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw  # BINUNICODE


def _arguments(style: str, marker: Path) -> list[str] | list[list[str]]:
    if style == "cmd":
        return [f"touch {marker}"]
    if style == "argv":
        return [["touch", str(marker)]]
    if style == "code":
        return [f"open({str(marker)!r}, 'w').close()"]
    if style == "open":
        return [str(marker), "w"]
    return [str(marker)]


def _push(value: str | list[str]) -> bytes:
    if isinstance(value, list):
        return b"]" + b"(" + b"".join(_unicode(v) for v in value) + b"e"  # EMPTY_LIST MARK APPENDS
    return _unicode(value)


def evil_pickle(module: str, name: str, style: str, call: str, marker: Path,
                wrap: bool, protocol_header: bool) -> bytes:
    """A pickle that calls ``module.name`` on arguments that would create ``marker``."""
    args = b"".join(_push(a) for a in _arguments(style, marker))
    ref = f"{module}\n{name}\n".encode()
    if call == "REDUCE":
        body = b"c" + ref + b"(" + args + b"t" + b"R"
    elif call == "INST":
        body = b"(" + args + b"i" + ref
    elif call == "OBJ":
        body = b"(" + b"c" + ref + args + b"o"
    elif call == "NEWOBJ":
        body = b"c" + ref + b"(" + args + b"t" + b"\x81"
    else:  # BUILD: an allowed class whose state carries the call's result
        body = (b"ctorch_geometric.data.data\nData\n)\x81" + b"}" + _unicode("x")
                + b"c" + ref + b"(" + args + b"t" + b"R" + b"s" + b"b")
    if wrap:
        body = b"]" + body + b"a"  # a list holding the object, like a shard
    return (b"\x80\x02" if protocol_header else b"") + body + b"."


@st.composite
def crafted_inputs(draw: st.DrawFn, marker: Path) -> tuple[str, bytes]:
    module, name, style = draw(st.sampled_from(DANGEROUS))
    call = draw(st.sampled_from(CALL_OPCODES))
    pickled = evil_pickle(module, name, style, call, marker, wrap=draw(st.booleans()),
                          protocol_header=draw(st.booleans()))
    container = draw(st.sampled_from(["zip", "bare"]))
    data = _with_pickle(BASES[draw(st.sampled_from(sorted(BASES)))], pickled) \
        if container == "zip" else pickled
    return f"{call} {module}.{name} in {container}", data


# ---------------------------------------------------------------------- byte-level mutations
@st.composite
def mutated_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    base_name = draw(st.sampled_from(sorted(BASES)))
    data = bytearray(BASES[base_name])
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "truncate", "pickle_flip", "pickle_insert",
                                     "pickle_truncate", "splice"]))
        if kind == "flip" and data:
            at = draw(st.integers(0, len(data) - 1))
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        elif kind == "splice" and data:
            src, dst = draw(st.integers(0, len(data) - 1)), draw(st.integers(0, len(data) - 1))
            chunk = bytes(data[src:src + draw(st.integers(1, 64))])
            data[dst:dst + len(chunk)] = chunk
        else:
            try:
                pickled = bytearray(_data_pkl(bytes(data)))
            except Exception:  # noqa: BLE001 - zipfile cannot read these mutated headers
                continue
            if not pickled:
                continue
            at = draw(st.integers(0, len(pickled) - 1))
            if kind == "pickle_flip":
                pickled[at] ^= 1 << draw(st.integers(0, 7))
            elif kind == "pickle_insert":
                pickled[at:at] = draw(st.binary(min_size=1, max_size=8))
            else:
                del pickled[at:]
            try:
                data = bytearray(_with_pickle(bytes(data), bytes(pickled)))
            except Exception:  # noqa: BLE001 - zipfile cannot rebuild these mutated headers
                continue
        steps.append(kind)
    return f"{base_name} {steps}", bytes(data)


# ---------------------------------------------------------------------- harness
def decode_and_read(data: bytes | bytearray) -> str:
    """Decode with trusted=False and read every sample; ``"ok"`` or the error class."""
    try:
        samples = decode_shard(data, SHARD_NAME, trusted=False)
    except StreamError as error:
        assert SHARD_NAME in str(error), f"error does not name the shard: {error}"
        return type(error).__name__
    for sample in samples:
        for _key, value in sample.items():
            if isinstance(value, torch.Tensor):
                value.sum()
    return "ok"


def _run(case: tuple[str, bytes], marker: Path, outcomes: Counter) -> None:
    what, data = case
    with watchdog(HANG_S, what):
        try:
            outcomes[decode_and_read(data)] += 1
            # a bytearray (what downloads give) goes through the lazy in-place indexer
            # of lists of Data first, and to torch.load only when it gives up
            outcomes["lazy " + decode_and_read(bytearray(data))] += 1
        except (AssertionError, FuzzHang):
            raise
        except Exception as error:
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error
    assert not marker.exists(), f"{what}: the payload ran code (marker file created)"


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_crafted_pickles_never_execute_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    outcomes: Counter = Counter()

    @settings(max_examples=max(EXAMPLES // 2, 20), derandomize=True, deadline=None,
              database=None, suppress_health_check=list(HealthCheck))
    @given(crafted_inputs(marker))
    def fuzz(case: tuple[str, bytes]) -> None:
        _run(case, marker, outcomes)

    fuzz()
    assert outcomes["ok"] == 0 and outcomes["lazy ok"] == 0, outcomes
    assert outcomes["UnsafePayloadError"] > 0, outcomes
    assert outcomes["lazy UnsafePayloadError"] == outcomes["UnsafePayloadError"], outcomes


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_mutated_pt_shards_decode_or_raise_stream_error(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    outcomes: Counter = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated_inputs())
    def fuzz(case: tuple[str, bytes]) -> None:
        _run(case, marker, outcomes)

    fuzz()
    print(f"pt fuzz outcomes: {dict(outcomes)}")
    assert outcomes["ShardDecodeError"] + outcomes["UnsafePayloadError"] > 0, outcomes
    assert outcomes["lazy ok"] > 0 and outcomes["lazy ShardDecodeError"] > 0, outcomes


@pytest.mark.parametrize("call", ["REDUCE", "INST", "OBJ", "BUILD"])  # NEWOBJ needs a class
def test_payloads_are_real_when_trusted(tmp_path: Path, call: str) -> None:
    """Control: the crafted pickles do run code when unpickled without the allow-list."""
    marker = tmp_path / f"pwned-{call}"
    pickled = evil_pickle("os", "system", "cmd", call, marker, wrap=True, protocol_header=True)
    # BUILD yields a valid list of Data; the other calls leave no Data behind
    with contextlib.suppress(StreamError):
        decode_shard(_with_pickle(BASES["list"], pickled), SHARD_NAME, trusted=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafePayloadError, match="trusted=True"):
        decode_shard(_with_pickle(BASES["list"], pickled), SHARD_NAME, trusted=False)
    assert not marker.exists()


def test_unmodified_bases_decode(tmp_path: Path) -> None:
    for name, data in BASES.items():
        assert decode_and_read(data) == "ok", name
        assert decode_and_read(bytearray(data)) == "ok", name
    assert len(decode_shard(BASES["collated"], SHARD_NAME)) == 3


def test_error_family() -> None:
    assert issubclass(UnsafePayloadError, ShardDecodeError)
    assert issubclass(ShardDecodeError, StreamError)
    with pytest.raises(ShardDecodeError, match=SHARD_NAME):
        decode_shard(b"not a pickle at all", SHARD_NAME)
    with pytest.raises(StreamError, match=SHARD_NAME):
        decode_shard(pickle.dumps({"a": 1}, protocol=2), SHARD_NAME)


# ---------------------------------------------------------------------- known stream-layer bug
# A damaged collated shard (slices that do not fit the data, or a Data whose storage did
# not survive unpickling) must fail as a named ShardDecodeError at decode time, where
# on_error="skip" can handle it. Found by this fuzzer (PYG_ATOMPACK_FUZZ_EXAMPLES=2000).


def _read_all(data: bytes) -> None:
    for sample in decode_shard(data, SHARD_NAME, trusted=False):
        sample.to_dict()


def test_collated_shard_with_inconsistent_slices_raises_stream_error() -> None:
    data, slices = InMemoryDataset.collate(make_samples(3, 3))
    slices["pos"] = torch.tensor([0, 100, 200, 300])  # the data holds 9 rows, not 300
    with pytest.raises(ShardDecodeError, match=SHARD_NAME):
        _read_all(_torch_bytes((data, slices)))


def test_collated_shard_with_damaged_storage_raises_stream_error() -> None:
    pickled = _data_pkl(BASES["collated"])
    assert b"_store" in pickled
    with pytest.raises(ShardDecodeError, match=SHARD_NAME):
        _read_all(_with_pickle(BASES["collated"], pickled.replace(b"_store", b"_stord", 1)))


# ---------------------------------------------------------------------- found at 1,500 examples
def test_huge_memo_index_is_harmless() -> None:
    """One flipped byte in a LONG_BINPUT asked CPython's C unpickler for a ~10^9-entry
    memo: gigabytes allocated and ~15 s spent clearing them, on a 3 KB shard. The
    in-place indexer and torch's safe loader keep their memo in a dict: the shard is a
    named decode error and costs next to nothing. (``trusted=True`` hands such a shard
    to the C unpickler, like any ``torch.load(weights_only=False)``: not promised.)"""
    import tracemalloc

    pickled = bytearray(_data_pkl(BASES["list"]))
    at = pickled.index(b"q\x01")  # the first BINPUT, turned into LONG_BINPUT 1114728289
    pickled[at:at + 2] = pickle.LONG_BINPUT + struct.pack("<I", 1_114_728_289)
    damaged = _with_pickle(BASES["list"], bytes(pickled))
    for data in (damaged, bytearray(damaged)):
        tracemalloc.start()
        try:
            with pytest.raises(ShardDecodeError, match=f"{SHARD_NAME}: not a readable"):
                decode_shard(data, SHARD_NAME)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 2**24, peak  # 16 MiB; the C unpickler asked for gigabytes


def test_list_of_data_with_damaged_storage_raises_stream_error() -> None:
    """A flipped bit turning ``_store`` into ``^store`` unpickled into a Data that raised
    RuntimeError on first use, in the consumer's loop instead of at decode time."""
    damaged = _with_pickle(BASES["list"],
                           _data_pkl(BASES["list"]).replace(b"_store", b"^store", 1))
    for data in (damaged, bytearray(damaged)):
        with pytest.raises(ShardDecodeError, match=f"{SHARD_NAME}: element 0 is a damaged"):
            decode_shard(data, SHARD_NAME)


def test_counted_length_past_the_end_is_refused(capsys) -> None:
    """A damaged BYTEARRAY8 (found at 20,000 examples) asked CPython's C unpickler for
    7e18 bytes, which left a bytearray freed while its buffer was still exported; torch's
    safe loader does not run that opcode at all."""
    pickled = _data_pkl(BASES["collated"])
    damaged_pickle = pickled[:2] + pickle.BYTEARRAY8 + \
        struct.pack("<Q", 7_521_981_625_658_443_121) + pickled[2:]
    damaged = _with_pickle(BASES["collated"], damaged_pickle)
    for data in (damaged, bytearray(damaged)):
        with pytest.raises(ShardDecodeError, match=f"{SHARD_NAME}.*BYTEARRAY8"):
            decode_shard(data, SHARD_NAME)
    assert "exported buffers" not in capsys.readouterr().err


# ---------------------------------------------------------------------- stride and size claims
# Real torch.save files whose tensors claim more than their storages hold (issue #33):
# zero and overlapping strides, many attributes viewing one storage, collated data and
# slices built the same way. Every input must decode into samples whose tensors reuse no
# storage element and claim no more bytes than the file (then copied), or raise
# ShardDecodeError naming the shard; the whole run happens in a fresh process whose peak
# RSS growth must stay under CLAIMS_RSS_BOUND (one claim slipping through is 2**28+
# elements: gigabytes) and whose every input finishes within HANG_S.
CLAIMS_RSS_BOUND = 256 << 20


@st.composite
def claimed_inputs(draw: st.DrawFn) -> tuple[str, bytes]:
    base = torch.arange(64, dtype=torch.float32)
    ndim = draw(st.integers(1, 3))
    big = draw(st.sampled_from([2**20, 2**28, 2**40]))
    shape = tuple(draw(st.sampled_from([1, 2, 3, 5, big])) for _ in range(ndim))
    stride = tuple(draw(st.sampled_from([0, 1, 2, 3, 8])) for _ in range(ndim))
    try:
        view = base.as_strided(shape, stride)
    except RuntimeError:  # the view runs past the 64 elements: not what torch.save sees
        view = base.as_strided((2, 3), (0, 1))
    sharing = draw(st.integers(1, 400))
    layout = draw(st.sampled_from(["list", "collated", "slices", "shared"]))
    samples = make_samples(3, 3)
    if layout == "list":
        samples[draw(st.integers(0, 2))].pos = view
        obj: object = samples
    elif layout == "shared":
        shared = torch.zeros(draw(st.sampled_from([16, 4096, 16384])))
        for i in range(sharing):
            samples[1][f"a{i}"] = shared
        obj = samples
    else:
        data, slices = InMemoryDataset.collate(samples)
        if layout == "collated":
            data.extra = view
            slices["extra"] = torch.tensor([0, 0, 0, min(view.shape[0], 2**62)])
        else:
            slices["pos"] = torch.zeros(1, dtype=torch.long).expand(big)
        obj = (data, slices)
    return f"{layout} shape={shape} stride={stride} sharing={sharing}", _torch_bytes(obj)


def _claims_hold(data: bytes | bytearray) -> str:
    from pyg_atompack.pyg.samples import overlapping

    try:
        samples = decode_shard(data, SHARD_NAME, trusted=False)
    except StreamError as error:
        assert SHARD_NAME in str(error), error
        return type(error).__name__
    for sample in samples:
        total = 0
        for _key, value in sample.items():
            if isinstance(value, torch.Tensor):
                assert not overlapping(value.shape, value.stride())
                total += value.numel() * value.element_size()
                value.clone()  # what a collate does: allocate what the tensor claims
        assert total <= len(data)
    return "ok"


def run_claims_fuzz() -> Counter:
    """The claims fuzz (run in a fresh process by the test below)."""
    outcomes: Counter = Counter()

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(claimed_inputs())
    def fuzz(case: tuple[str, bytes]) -> None:
        what, data = case
        with watchdog(HANG_S, what):
            outcomes[_claims_hold(data)] += 1
            outcomes["lazy " + _claims_hold(bytearray(data))] += 1

    fuzz()
    return outcomes


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_stride_and_size_claims_decode_bounded_or_raise() -> None:
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, sys
        sys.path[:0] = {[str(Path(__file__).parent)]!r}
        from test_fuzz_pt import run_claims_fuzz
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        outcomes = run_claims_fuzz()
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(dict(outcomes))
        print(grown)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=FUZZ_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    outcomes_line, grown_kib = result.stdout.strip().splitlines()[-2:]
    print(f"claims fuzz outcomes: {outcomes_line}, peak RSS growth {grown_kib} KiB")
    assert int(grown_kib) * 1024 < CLAIMS_RSS_BOUND, grown_kib
    assert "'ok'" in outcomes_line and "'ShardDecodeError'" in outcomes_line, outcomes_line
    assert "'lazy ok'" in outcomes_line and "'lazy ShardDecodeError'" in outcomes_line
