"""The restricted C-speed unpickler that ``.pt`` shards are decoded with by default.

It must (1) give exactly what torch's own ``weights_only=True`` loader gives on every
shard layout the project accepts, (2) refuse every global outside the allow-list however
the pickle spells it (``GLOBAL``, protocol-4 ``STACK_GLOBAL``, copyreg extension codes),
naming the global and calling none of it, and (3) honour globals the user registers with
``torch.serialization.add_safe_globals``, as ``weights_only`` does.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from servers.http_server import make_samples
from torch_geometric.data import Data, HeteroData, InMemoryDataset

from pyg_atompack.stream import UnsafePayloadError, decode_shard
from pyg_atompack.stream.safe_pickle import (
    PYG_SAFE_GLOBALS,
    ForbiddenGlobalError,
    allowed_globals,
    restricted_torch_load,
)


class Annotated:
    """A user class a shard may carry once the user allow-lists it."""

    def __init__(self, label: str) -> None:
        self.label = label


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _reference_load(raw: bytes) -> object:
    with torch.serialization.safe_globals(PYG_SAFE_GLOBALS):
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)


def _rich_samples() -> list[Data]:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index, atoms in enumerate((2, 5, 9)):
        samples.append(Data(
            z=torch.randint(1, 90, (atoms,), generator=generator),
            pos=torch.randn(atoms, 3, generator=generator),
            forces=torch.randn(atoms, 3, generator=generator).double(),
            energy=torch.tensor([float(index)]),
            cell=torch.eye(3, dtype=torch.float64) * 7.5,
            pbc=torch.tensor([True, False, True]),
            charges=torch.randn(atoms, generator=generator).half(),
            edge_index=torch.zeros(2, 0, dtype=torch.long),
            strided=torch.arange(12.0)[2:8:2],  # a strided view into a larger storage
            name=f"frame-{index}",
            shape=torch.Size([atoms, 3]),
            weight=0.5,
        ))
    return samples


def _assert_equal(got: object, want: object) -> None:
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, (Data, HeteroData)):
        assert sorted(got.keys()) == sorted(want.keys())
        for key in sorted(want.keys()):
            for store_got, store_want in zip(got.stores, want.stores):
                if key in store_want:
                    _assert_equal(store_got[key], store_want[key])
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_equal(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for item_got, item_want in zip(got, want):
            _assert_equal(item_got, item_want)
    else:
        assert got == want


def _hetero() -> HeteroData:
    graph = HeteroData()
    graph["atom"].pos = torch.randn(4, 3)
    graph["atom", "bond", "atom"].edge_index = torch.tensor([[0, 1], [1, 2]])
    return graph


PAYLOADS = {
    "list of Data": _rich_samples(),
    "collated (data, slices)": InMemoryDataset.collate(make_samples(6, 3)),
    "InMemoryDataset.save triple": (InMemoryDataset.collate(make_samples(5, 2))[0].to_dict(),
                                    InMemoryDataset.collate(make_samples(5, 2))[1], Data),
    "HeteroData": [_hetero()],
    "tensor containers": {"weights": OrderedDict(a=torch.ones(2)),
                          "parameter": torch.nn.Parameter(torch.zeros(3)),
                          "ids": {1, 2}, "blob": b"\x00\xffbytes", "z": complex(1, 2)},
}


@pytest.mark.parametrize("layout", list(PAYLOADS))
def test_restricted_load_matches_torch_weights_only(layout: str) -> None:
    raw = _saved(PAYLOADS[layout])
    _assert_equal(restricted_torch_load(io.BytesIO(raw)), _reference_load(raw))


def test_decoded_views_keep_their_strides_and_offsets() -> None:
    loaded = restricted_torch_load(io.BytesIO(_saved(_rich_samples())))
    assert torch.equal(loaded[0].strided, torch.tensor([2.0, 4.0, 6.0]))
    assert loaded[0].strided.stride() == (2,)


# --------------------------------------------------------------------- refusals
def _unicode(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _touch_call(marker: Path) -> bytes:
    return b"(" + _unicode(f"touch {marker}") + b"tR"  # MARK arg TUPLE REDUCE


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
    return b"\x80\x02cos\nsystem\n" + _touch_call(marker) + b"."


def _stack_global(marker: Path) -> bytes:  # protocol 4 spells globals as two strings
    return (b"\x80\x04" + b"\x8c\x02os" + b"\x8c\x06system" + b"\x93"
            + _touch_call(marker) + b".")


def _extension_code(marker: Path) -> bytes:  # EXT1: a global through copyreg's registry
    return b"\x80\x02\x82\xf0" + _touch_call(marker) + b"."


@pytest.fixture
def registered_extension(request):
    """Registers ``os.system`` as copyreg extension 0xF0 for the extension-code case."""
    if request.param is _extension_code:
        copyreg.add_extension("os", "system", 0xF0)
    yield request.param
    if request.param is _extension_code:
        copyreg.remove_extension("os", "system", 0xF0)  # also clears the cache entry


@pytest.mark.parametrize("registered_extension", [_global_opcode, _stack_global,
                                                  _extension_code], indirect=True)
def test_forbidden_global_is_named_and_never_called(registered_extension, tmp_path: Path
                                                    ) -> None:
    spelling = registered_extension
    marker = tmp_path / "ran"
    pickled = spelling(marker)
    # the same bytes really do run the command through the unrestricted unpickler
    pickle.loads(pickled)
    assert marker.exists()
    marker.unlink()
    if spelling is _extension_code:
        # the C unpickler now serves code 0xF0 from copyreg's cache without asking
        # find_class, so the load must have gone to torch's checker, which refuses EXT
        with pytest.raises(UnsafePayloadError, match=r"shard evil\.pt.*trusted=True"):
            decode_shard(bytearray(_archive_with(pickled)), "evil.pt")
        assert not marker.exists()
        return
    with pytest.raises(ForbiddenGlobalError, match=r"forbidden global os\.system") as caught:
        restricted_torch_load(io.BytesIO(_archive_with(pickled)))
    assert (caught.value.module, caught.value.name) == ("os", "system")
    with pytest.raises(UnsafePayloadError, match=r"shard evil\.pt.*os\.system.*trusted=True"):
        decode_shard(bytearray(_archive_with(pickled)), "evil.pt")
    assert not marker.exists()


def test_bare_legacy_pickle_is_restricted_too(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # not a zip: torch's legacy reader calls our module's ``load`` for its header
    with pytest.raises(UnsafePayloadError, match=r"os\.system"):
        decode_shard(bytearray(_global_opcode(marker)), "legacy.pt")
    assert not marker.exists()


def test_allow_list_is_a_subset_of_what_weights_only_accepts() -> None:
    import torch._weights_only_unpickler as torch_checker

    torch_accepts = {id(obj) for obj in torch_checker._get_allowed_globals().values()}
    for entry in torch.serialization.get_safe_globals():
        torch_accepts.add(id(entry[0] if isinstance(entry, tuple) else entry))
    ours = allowed_globals()
    extra = {key for key, obj in ours.items()
             if id(obj) not in torch_accepts and obj not in PYG_SAFE_GLOBALS}
    assert extra == set()
    # and no general-purpose callable reached through registration either
    builtin_names = {name for module, name in ours if module == "builtins"}
    assert builtin_names <= {"set", "bytearray", "complex", "list", "dict", "tuple"}
    assert ("builtins", "eval") not in ours and ("builtins", "getattr") not in ours


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


def test_forced_weights_only_environment_falls_back_to_torchs_checker(
        monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    samples = make_samples(4, 3)
    decoded = decode_shard(bytearray(_saved(samples)), "ok.pt")
    assert len(decoded) == len(samples)
    assert all(torch.equal(a.pos, b.pos) for a, b in zip(decoded, samples))
    marker = tmp_path / "ran"
    with pytest.raises(UnsafePayloadError, match=r"shard evil\.pt"):
        decode_shard(bytearray(_archive_with(_global_opcode(marker))), "evil.pt")
    assert not marker.exists()
