""".pt shards whose tensors claim more than the file holds (issue #33, item 1).

Every input here is a real ``torch.save`` file. A tensor that reuses storage elements
(``torch.ones(1).expand(2**40)``: 2**40 elements in an 8-byte storage) or a sample whose
tensors together claim more bytes than the file must fail at decode time, through the
in-place indexer (a ``bytearray``) and through ``torch.load(weights_only=True)``
(``bytes``) alike, with an error naming the shard, the sample and the attribute; while
everything PyG's ``collate``/``separate`` and ``InMemoryDataset`` slicing write still
decodes to the same values.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from servers.http_server import make_samples
from test_cli import assert_bad_input, run
from torch_geometric.data import Data, HeteroData, InMemoryDataset

from pyg_atompack.convert import ConvertError
from pyg_atompack.convert.pt import load_pt
from pyg_atompack.pyg.errors import PtPayloadError
from pyg_atompack.pyg.pt_arriving import ArrivingPt
from pyg_atompack.pyg.samples import overlapping
from pyg_atompack.stream import ShardDecodeError, decode_shard

NAME = "shard-0003.pt"


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def stride_zero_shard(atoms: int = 2**40) -> bytes:
    """The reported file: samples whose tensors are stride-0 views claiming ``atoms``."""
    samples = make_samples(0, 3)
    samples[1] = Data(z=torch.ones(1, dtype=torch.long).expand(atoms),
                      pos=torch.zeros(1, 3).expand(atoms, 3), energy=torch.zeros(1))
    return saved(samples)


def both_paths(raw: bytes):
    """``decode_shard`` through torch.load (bytes) and the in-place indexer (bytearray)."""
    return {"torch.load": raw, "indexer": bytearray(raw)}


@pytest.mark.parametrize("path", ["torch.load", "indexer"])
def test_stride_zero_shard_is_refused_naming_shard_sample_and_attribute(path: str) -> None:
    raw = stride_zero_shard()
    assert len(raw) < 8192  # a few KB claiming 2**40 atoms
    with pytest.raises(ShardDecodeError) as caught:
        decode_shard(both_paths(raw)[path], NAME)
    message = str(caught.value)
    assert message.startswith(f"shard {NAME}: sample 1, attribute ")
    assert "'z'" in message or "'pos'" in message
    assert "reuses elements of its storage" in message


@pytest.mark.parametrize("layout", ["collated", "slices", "triple"])
@pytest.mark.parametrize("path", ["torch.load", "indexer"])
def test_stride_zero_collated_layouts_are_refused(layout: str, path: str) -> None:
    data, slices = InMemoryDataset.collate(make_samples(1, 4))
    if layout == "slices":  # .tolist() of these slices would build 2**40 integers
        slices["pos"] = torch.zeros(1, dtype=torch.long).expand(2**40)
        where = "slices, attribute 'pos'"
    else:
        data.pos = torch.zeros(1, 3).expand(2**40, 3)
        where = "the collated data, attribute 'pos'"
    obj = (data.to_dict(), slices, Data) if layout == "triple" else (data, slices)
    with pytest.raises(ShardDecodeError, match=f"shard {NAME}: {where}: .*reuses"):
        decode_shard(both_paths(saved(obj))[path], NAME)


@pytest.mark.parametrize("path", ["torch.load", "indexer"])
def test_overlapping_strides_without_a_zero_are_refused(path: str) -> None:
    base = torch.arange(64, dtype=torch.float32)
    sample = Data(z=torch.ones(4, dtype=torch.long), pos=base.as_strided((16, 3), (1, 1)))
    with pytest.raises(ShardDecodeError, match="sample 0, attribute 'pos'.*strides"):
        decode_shard(both_paths(saved([sample]))[path], NAME)


@pytest.mark.parametrize("path", ["torch.load", "indexer"])
def test_sample_claiming_more_bytes_than_the_file_is_refused(path: str) -> None:
    """300 attributes viewing one 64 KiB storage: each fits the file, together 19 MiB."""
    shared = torch.zeros(16384)
    sample = Data(z=torch.ones(2, dtype=torch.long),
                  **{f"a{i}": shared for i in range(300)})
    raw = saved([make_samples(2, 1)[0], sample])
    assert len(raw) < 300 * shared.nbytes // 50
    with pytest.raises(ShardDecodeError, match=rf"sample 1, attribute 'a\d+': its tensors "
                                               rf"claim \d+ bytes so far, more than the "
                                               rf"{len(raw)} bytes of the file"):
        decode_shard(both_paths(raw)[path], NAME)


def test_arriving_indexer_refuses_before_publishing() -> None:
    raw = stride_zero_shard()
    indexer = ArrivingPt(bytearray(raw))
    with pytest.raises(PtPayloadError, match="sample 1, attribute"):
        indexer.feed(len(raw))


def test_claim_that_fits_in_memory_allocates_nothing() -> None:
    """2**28 atoms would really be allocated (12 GiB of positions) by a collate; the
    refusal happens first, measured as the peak RSS of a fresh process."""
    script = textwrap.dedent(f"""
        import io, resource, sys, torch
        sys.path[:0] = {[str(Path(__file__).parent)]!r}
        from test_pt_bounds import stride_zero_shard
        from pyg_atompack.stream import ShardDecodeError, decode_shard
        raw = stride_zero_shard(2**28)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for buffer in (raw, bytearray(raw)):
            try:
                decode_shard(buffer, "s.pt")
            except ShardDecodeError:
                pass
            else:
                raise SystemExit("decoded")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) < 64 * 1024  # KiB: under 64 MiB more


# ---------------------------------------------------------------------- what is legitimate
class _Dataset(InMemoryDataset):
    def __init__(self, samples: list[Data]) -> None:
        super().__init__(None)
        self.data, self.slices = self.collate(samples)


def _varied(count: int) -> list[Data]:
    samples = []
    for i, sample in enumerate(make_samples(7, count, atoms=4)):
        sample.edge_index = torch.tensor([[0, 1, 2, 3][: 1 + i % 4], [1, 2, 3, 0][: 1 + i % 4]])
        sample.edge_attr = torch.randn(1 + i % 4, 2)
        sample.cell = torch.randn(1, 3, 3)
        sample.y = torch.tensor(float(i))  # 0-dim
        sample.x = torch.randn(5, 4).t()[:, :4].t()  # a transposed view
        sample.tag = f"m{i}"
        samples.append(sample)
    return samples


def _equal(a: Data, b: Data) -> None:
    assert set(a.keys()) == set(b.keys())
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.parametrize("layout", ["views", "shuffled", "stepped", "collated", "triple",
                                    "list", "hetero", "size_one_expand"])
def test_what_pyg_writes_still_decodes(layout: str) -> None:
    samples = _varied(9)
    dataset = _Dataset(samples)
    if layout == "views":  # FoldPipe's shards: list slices of the collated storage
        obj = expected = [dataset[i] for i in range(2, 8)]
    elif layout == "shuffled":
        obj = expected = [dataset[i] for i in (5, 1, 8, 0)]
    elif layout == "stepped":
        obj = expected = list(dataset[::2])
    elif layout == "collated":  # what InMemoryDataset gives (a 0-dim y becomes [1])
        obj, expected = (dataset._data, dataset.slices), list(dataset)
    elif layout == "triple":
        obj, expected = (dataset._data.to_dict(), dataset.slices, Data), list(dataset)
    elif layout == "list":
        obj, expected = samples, samples
    elif layout == "hetero":
        hetero = HeteroData()
        hetero["atom"].x = torch.randn(4, 3)
        hetero["atom", "bond", "atom"].edge_index = torch.tensor([[0, 1], [1, 2]])
        obj, expected = [hetero], None
    else:  # expand on dimensions of size one only: no element is reused
        sample = Data(z=torch.ones(3, dtype=torch.long),
                      cell=torch.eye(3)[None].expand(1, 3, 3))
        obj, expected = [sample], [sample]
    raw = saved(obj)
    for buffer in both_paths(raw).values():
        decoded = decode_shard(buffer, NAME)
        if expected is not None:
            assert len(decoded) == len(expected)
            for got, want in zip(decoded, expected):
                _equal(got, want)
        else:
            assert decoded[0]["atom"].x.shape == (4, 3)


@pytest.mark.parametrize(("shape", "stride", "overlaps"), [
    ((2**40,), (0,), True), ((4, 3), (0, 1), True), ((4, 3), (1, 1), True),
    ((3, 3), (2, 1), True), ((2, 2, 2), (1, 1, 10), True), ((1, 3), (0, 1), False),
    ((3, 4), (1, 3), False), ((2, 5), (20, 1), False), ((5,), (3,), False),
    ((0, 7), (0, 0), False), ((), (), False), ((2, 3), (3, 1), False),
])
def test_overlap_rule(shape, stride, overlaps) -> None:
    assert overlapping(shape, stride) is overlaps
    if not overlaps and 0 not in shape and shape:
        # the rule is exact where torch can tell: distinct offsets for every index
        view = torch.arange(10**4).as_strided(shape, stride)
        assert view.unique().numel() == view.numel()


# ---------------------------------------------------------------------- the converter and CLI
def test_converter_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(stride_zero_shard())
    with pytest.raises(ConvertError, match=r"evil\.pt: sample 1, attribute"):
        load_pt(path)


@pytest.mark.parametrize("command", ["convert", "head", "info", "verify"])
def test_cli_exits_2_with_one_line(tmp_path: Path, command: str) -> None:
    path = tmp_path / "evil.pt"
    path.write_bytes(stride_zero_shard())
    extra = [tmp_path / "out.atp"] if command == "convert" else []
    result = run(command, path, *extra)
    assert_bad_input(result, str(path), "sample 1", "attribute", "reuses elements")
    assert not (tmp_path / "out.atp").exists()
