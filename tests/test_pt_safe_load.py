"""torch's safe loader, the one allow-list and the one layout classifier (``pyg/pt.py``).

Every ``.pt`` layout the in-place indexer does not handle goes to
``torch.load(weights_only=True)`` with :data:`PYG_SAFE_GLOBALS`. It must (1) give the
samples torch's loader gives, (2) refuse every global outside the allow-list however the
pickle spells it (``GLOBAL``, protocol-4 ``STACK_GLOBAL``, copyreg extension codes),
naming it and calling none of it, (3) honour globals the user registers with
``torch.serialization.add_safe_globals``, and (4) never take away a registration made by
someone else (PyG registers ``Data`` at import), also when threads load concurrently.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import threading
from pathlib import Path

import pytest
import torch
from servers.http_server import make_samples
from torch_geometric.data import Data, HeteroData, InMemoryDataset
from torch_geometric.data.storage import GlobalStorage

from pyg_atompack.pyg import PYG_SAFE_GLOBALS, PtPayloadError, UnsafePtPayloadError, decode_pt
from pyg_atompack.pyg.pt import as_samples, load_pt_object, pyg_safe_globals
from pyg_atompack.pyg.samples import CollatedSamples
from pyg_atompack.stream import ShardDecodeError, UnsafePayloadError, decode_shard


class Annotated:
    """A user class a shard may carry once the user allow-lists it."""

    def __init__(self, label: str) -> None:
        self.label = label


def _saved(obj: object, **options) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **options)
    return buffer.getvalue()


def _rich_samples() -> list[Data]:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index, atoms in enumerate((2, 5, 9)):
        samples.append(Data(
            z=torch.randint(1, 90, (atoms,), generator=generator),
            pos=torch.randn(atoms, 3, generator=generator),
            forces=torch.randn(atoms, 3, generator=generator).double(),
            cell=torch.eye(3, dtype=torch.float64) * 7.5,
            pbc=torch.tensor([True, False, True]),
            charges=torch.randn(atoms, generator=generator).half(),
            strided=torch.arange(12.0)[2:8:2],  # a strided view into a larger storage
            name=f"frame-{index}",
            shape=torch.Size([atoms, 3]),
            weight=0.5,
        ))
    return samples


def _hetero() -> HeteroData:
    graph = HeteroData()
    graph["atom"].pos = torch.randn(4, 3)
    graph["atom", "bond", "atom"].edge_index = torch.tensor([[0, 1], [1, 2]])
    return graph


def _assert_same(got, want) -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(map(str, got)) == list(map(str, want))
        for key in want:
            _assert_same(got[key], want[key])
    else:
        assert got == want


def _assert_same_samples(got, want) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert type(a) is type(b)
        _assert_same(a.to_dict(), b.to_dict())


class _Collated(InMemoryDataset):
    def __init__(self, samples: list[Data]) -> None:
        super().__init__(None)
        self.data, self.slices = self.collate(samples)


@pytest.mark.parametrize("layout", ["list", "hetero", "collated", "triple", "single"])
def test_torch_load_path_gives_torchs_samples(layout: str) -> None:
    dataset = _Collated(make_samples(6, 3))
    payload, want = {
        "list": (_rich_samples(), _rich_samples()),
        "hetero": ([_hetero()], None),
        "collated": ((dataset._data, dataset.slices), list(dataset)),
        "triple": ((dataset._data.to_dict(), dataset.slices, Data), list(dataset)),
        "single": (_rich_samples()[1], [_rich_samples()[1]]),
    }[layout]
    raw = _saved(payload)
    with pyg_safe_globals():
        reference = torch.load(io.BytesIO(raw), weights_only=True)
    want = want if want is not None else reference
    got = decode_pt(raw)  # bytes: never indexed in place, always torch.load
    _assert_same_samples(got, want)
    if layout in ("collated", "triple"):
        assert isinstance(got, CollatedSamples)  # cut when taken, as InMemoryDataset does


def test_strided_views_keep_their_strides() -> None:
    (loaded, *_) = decode_pt(_saved(_rich_samples()))
    assert torch.equal(loaded.strided, torch.tensor([2.0, 4.0, 6.0]))
    assert loaded.strided.stride() == (2,)


def test_the_classifier_names_what_it_refuses() -> None:
    with pytest.raises(PtPayloadError, match="got dict"):
        as_samples({"weights": torch.ones(2)})
    with pytest.raises(PtPayloadError, match="element 1 is a str"):
        as_samples([Data(x=torch.ones(1)), "x"])
    data, slices = InMemoryDataset.collate(make_samples(1, 3))
    slices["pos"] = slices["pos"][:2]
    with pytest.raises(PtPayloadError, match="differ in length"):
        as_samples((data, slices))


# --------------------------------------------------------------------- refusals
def _unicode(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _touch_call(marker: Path) -> bytes:
    return pickle.MARK + _unicode(f"touch {marker}") + pickle.TUPLE + pickle.REDUCE


def _archive_with(pickled: bytes) -> bytes:
    """A real torch archive whose ``data.pkl`` is replaced (CRCs recomputed)."""
    import zipfile

    source = zipfile.ZipFile(io.BytesIO(_saved([Data(x=torch.ones(1))])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            body = pickled if info.filename.endswith("/data.pkl") else source.read(info)
            target.writestr(info.filename, body)
    return out.getvalue()


def _global_opcode(marker: Path) -> bytes:
    return b"\x80\x02" + pickle.GLOBAL + b"os\nsystem\n" + _touch_call(marker) + pickle.STOP


def _stack_global(marker: Path) -> bytes:  # protocol 4 spells globals as two strings
    return (b"\x80\x04" + pickle.SHORT_BINUNICODE + b"\x02os" + pickle.SHORT_BINUNICODE
            + b"\x06system" + pickle.STACK_GLOBAL + _touch_call(marker) + pickle.STOP)


def _extension_code(marker: Path) -> bytes:  # EXT1: a global through copyreg's registry
    return b"\x80\x02" + pickle.EXT1 + b"\xf0" + _touch_call(marker) + pickle.STOP


@pytest.fixture
def registered_extension():
    """Registers ``os.system`` as copyreg extension 0xF0, as hostile code could."""
    copyreg.add_extension("os", "system", 0xF0)
    yield
    copyreg.remove_extension("os", "system", 0xF0)


@pytest.mark.usefixtures("registered_extension")
@pytest.mark.parametrize("spelling, named", [
    (_global_opcode, r"os\.system"), (_stack_global, "opcode SHORT_BINUNICODE"),
    (_extension_code, "opcode EXT1"),
])
def test_forbidden_global_is_named_and_never_called(spelling, named, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickled = spelling(marker)
    # the same bytes really do run the command through the unrestricted unpickler
    pickle.loads(pickled)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafePtPayloadError, match=named):
        decode_pt(_archive_with(pickled))
    # as a downloaded shard (a bytearray: the indexer gives up first)
    with pytest.raises(UnsafePayloadError, match=rf"shard evil\.pt.*{named}.*trusted=True"):
        decode_shard(bytearray(_archive_with(pickled)), "evil.pt")
    assert not marker.exists()


def test_bare_legacy_pickle_is_restricted_too(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    with pytest.raises(UnsafePayloadError, match=r"legacy\.pt.*os\.system"):
        decode_shard(bytearray(_global_opcode(marker)), "legacy.pt")
    assert not marker.exists()


def test_garbage_is_a_decode_error_not_a_refusal() -> None:
    with pytest.raises(ShardDecodeError, match=r"junk\.pt: not a readable \.pt file") as caught:
        decode_shard(b"not a pickle at all", "junk.pt")
    assert not isinstance(caught.value, UnsafePayloadError)


# --------------------------------------------------------------- user extensions
def test_user_registered_safe_globals_are_honoured() -> None:
    raw = _saved([Data(x=torch.ones(2), note=Annotated("ok"))])
    with pytest.raises(UnsafePayloadError, match=r"Annotated.*add_safe_globals"):
        decode_shard(bytearray(raw), "custom.pt")
    with torch.serialization.safe_globals([Annotated]):
        (sample,) = decode_shard(bytearray(raw), "custom.pt")
    assert sample.note.label == "ok" and torch.equal(sample.x, torch.ones(2))
    # the registration was scoped: refused again afterwards
    with pytest.raises(UnsafePayloadError):
        decode_shard(bytearray(raw), "custom.pt")


def test_allow_list_never_removes_registrations_of_others() -> None:
    # PyG registers Data at import (restored here in case a test's own
    # torch.serialization.safe_globals block took it away on leaving)
    torch.serialization.add_safe_globals([Data])
    with torch.serialization.safe_globals(PYG_SAFE_GLOBALS):
        pass
    assert Data not in torch.serialization.get_safe_globals()  # what torch's block does
    torch.serialization.add_safe_globals([Data])
    decode_pt(_saved([_hetero()]))
    assert Data in torch.serialization.get_safe_globals()
    assert GlobalStorage not in torch.serialization.get_safe_globals()  # ours: scoped
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pyg_safe_globals():
            inside.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(10)
    try:
        # another load finishing while the first one still runs leaves its globals
        decode_pt(_saved([_hetero()]))
        assert GlobalStorage in torch.serialization.get_safe_globals()
    finally:
        release.set()
        holder.join()
    assert GlobalStorage not in torch.serialization.get_safe_globals()


def test_forced_weights_only_still_reads_trusted_shards(monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    (graph,) = decode_pt(_saved([_hetero()]), trusted=True)
    assert graph["atom"].pos.shape == (4, 3)


def test_loader_wraps_torchs_errors() -> None:
    raw = _saved(make_samples(1, 3))
    with pytest.raises(PtPayloadError, match="not a readable .pt file"):
        load_pt_object(io.BytesIO(raw[: len(raw) // 2]))
    with pytest.raises(PtPayloadError, match="not a readable .pt file"):
        load_pt_object(io.BytesIO(raw[: len(raw) // 2]), trusted=True)
