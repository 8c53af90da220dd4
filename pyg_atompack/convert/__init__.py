"""Dataset formats in and out: ASE files, metatrain layouts, PyG ``.pt``, `.atp`.

Every format has a reader that streams :class:`Structure` objects and/or a
writer that consumes them, registered by name in :mod:`.registry`::

    from pyg_atompack import convert

    convert.convert("train.extxyz", "train.atp", write_options=convert.WriteOptions("zstd"))
    for structure in convert.open_reader("memmap_dir/"):
        ...

Formats: ``atp``, ``atp-shards``, ``pt``, ``pt-shards``, ``memmap``,
``diskdataset`` (read only), ``ase``/``extxyz``, and those other packages add
through the ``pyg_atompack.formats`` entry-point group (:func:`formats` lists
them all).

``convert(..., workers=N)`` reads and parses the source in ``N`` processes and
writes in order (the same output); ``convert(..., part=Part(I, N))`` converts one
part of a source into a shard directory and :func:`merge_parts` combines the parts
(:mod:`.parallel`, :mod:`.merge`).
"""

from .base import StructureReader, StructureWriter
from .errors import ConversionNote, ConvertError
from .merge import merge_parts
from .options import ReadOptions, WriteOptions, parse_casts, parse_key_map
from .parallel import Part
from .pipeline import convert, shard
from .registry import (
    ENTRY_POINT_GROUP,
    Format,
    detect_destination_format,
    detect_source_format,
    formats,
    open_reader,
    open_writer,
    register,
)
from .shards import check_manifest, read_manifest
from .structure import Structure, as_stress_matrix, voigt_to_matrix
from .units import UnitConversion

__all__ = [
    "ConversionNote",
    "ConvertError",
    "ENTRY_POINT_GROUP",
    "Format",
    "Part",
    "ReadOptions",
    "Structure",
    "StructureReader",
    "StructureWriter",
    "UnitConversion",
    "WriteOptions",
    "as_stress_matrix",
    "check_manifest",
    "convert",
    "detect_destination_format",
    "detect_source_format",
    "formats",
    "merge_parts",
    "open_reader",
    "open_writer",
    "parse_casts",
    "parse_key_map",
    "read_manifest",
    "register",
    "shard",
    "voigt_to_matrix",
]
