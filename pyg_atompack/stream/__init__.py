"""Streaming remote ``.pt`` / ``.atp`` shards into PyTorch Geometric training.

Sources (:class:`RemoteSource` over the backend a URL's scheme names: ``http(s)://``,
``hf://``, ``s3://`` / ``gs://`` / ``az://``, schemes other packages register;
:class:`LocalSource`; or your own :class:`Source`; :func:`open_source` picks one from a
URL) list shards once and fetch their bytes; :class:`SourceOptions` say how one
source's shards are fetched, checked and decoded; :class:`ShardStreamDataset`
prefetches and decodes them with a bounded working set (in a child process that hands
items over through shared memory, or on background threads:
``SourceOptions(retrieval=)``), splits them across DataLoader workers and DDP ranks,
resumes from a ``state_dict`` and records per-shard traces.

Example::

    from torch_geometric.loader import DataLoader
    from pyg_atompack.stream import ShardStreamDataset, SourceOptions

    dataset = ShardStreamDataset("https://host/data/manifest.json",
                                 options=SourceOptions(retries=8),
                                 prefetch=2, concurrency=2, shuffle=True, seed=0)
    for epoch in range(10):
        dataset.set_epoch(epoch)
        for batch in DataLoader(dataset, batch_size=32, num_workers=2):
            ...
        print(dataset.stats())
"""

from pyg_atompack.stream.dataset import ShardStreamDataset
from pyg_atompack.stream.errors import (
    ShardDecodeError,
    ShardFetchError,
    ShardIntegrityError,
    StreamError,
    UnsafePayloadError,
)
from pyg_atompack.stream.open import open_source
from pyg_atompack.stream.options import SourceOptions
from pyg_atompack.stream.payloads import ShardFormat, decode_shard, register_shard_format
from pyg_atompack.stream.sources import (
    CancelToken,
    LocalSource,
    RemoteSource,
    ShardInfo,
    Source,
)
from pyg_atompack.transport.buffers import ShardBuffer

__all__ = [
    "ShardStreamDataset",
    "SourceOptions",
    "Source",
    "ShardInfo",
    "CancelToken",
    "LocalSource",
    "RemoteSource",
    "open_source",
    "ShardBuffer",
    "decode_shard",
    "ShardFormat",
    "register_shard_format",
    "StreamError",
    "ShardFetchError",
    "ShardIntegrityError",
    "ShardDecodeError",
    "UnsafePayloadError",
]
