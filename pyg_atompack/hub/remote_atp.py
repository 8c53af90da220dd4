"""What HTTP range reads reveal about a remote ``.atp`` file, without downloading it.

The header slots (first 8192 bytes) give the molecule count and where the
schema and index blocks are; those two blocks are small (hundreds of bytes,
and 20 bytes per molecule) and give the fields and the atom counts. Parsing
is the format layer's (:mod:`pyg_atompack.atp`); this module only fetches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pyg_atompack.atp.fields import schema_block_fields
from pyg_atompack.atp.header import select_header
from pyg_atompack.atp.index import index_n_atoms
from pyg_atompack.hub.remote import RemoteFile
from pyg_atompack.hub.transfer import fetch_range

if TYPE_CHECKING:
    from pyg_atompack.remote.objectstore import ObjectStore
    from pyg_atompack.transport.retry import RetryPolicy

HEADER_BYTES = 8192  # both header slots (spec §2)


def _header_info(header: Any) -> dict[str, int]:
    """The header facts this layer keeps, as plain ints (JSON-friendly, picklable)."""
    names = ("num_molecules", "index_offset", "index_len", "schema_offset", "schema_len",
             "record_format", "codec")
    return {name: int(getattr(header, name, 0) or 0) for name in names}


def shard_uri(shard: RemoteFile) -> str:
    """``hf://{type}s/{repo}@{sha}/{path}``: how messages of the format layer name a shard."""
    if shard.repo_type in ("url", "object"):
        return shard.describe()
    return f"hf://{shard.repo_type}s/{shard.repo_id}@{shard.revision}/{shard.path}"


def read_shard_header(shard: RemoteFile, *, token: str | bool | None = None,
                      policy: RetryPolicy | None = None,
                      store: ObjectStore | None = None) -> dict[str, int]:
    """Header facts of a remote shard from one range read of its first 8192 bytes.

    Args:
        shard (RemoteFile): The remote ``.atp`` file.
        token (str or bool, optional): Hub token. (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts; :obj:`None` takes the Hub
            default. (default: :obj:`None`)
        store (ObjectStore, optional): The object-store handle that listed ``shard``
            (object-store URLs only). (default: :obj:`None`)

    Returns:
        ``num_molecules``, ``index_offset``, ``index_len``, ``schema_offset``,
        ``schema_len``, ``record_format`` and ``codec`` of the committed slot.

    Raises:
        pyg_atompack.atp.AtpError: The bytes are not a valid ``.atp`` header.
    """
    head = fetch_range(shard, 0, min(HEADER_BYTES, shard.size), token=token, policy=policy,
                       store=store)
    return _header_info(select_header(head, shard.size, shard_uri(shard)))


def remote_n_atoms(
    shard: RemoteFile, header: dict[str, int], *, token: str | bool | None = None,
    policy: RetryPolicy | None = None, store: ObjectStore | None = None,
) -> np.ndarray:
    """Atoms per molecule of a remote shard, from one range read of its index block.

    Args:
        shard (RemoteFile): The remote ``.atp`` file.
        header (dict[str, int]): Its facts from :func:`read_shard_header`.
        token (str or bool, optional): Hub token of the index read (see
            :func:`read_shard_header`). (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts of the index read.
            (default: :obj:`None`)
        store (ObjectStore, optional): The object-store handle that reads the index
            block (object-store URLs only). (default: :obj:`None`)

    Returns:
        int64 array ``(num_molecules,)``.
    """
    count = header["num_molecules"]
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    raw = fetch_range(shard, header["index_offset"], header["index_len"], token=token,
                      policy=policy, store=store)
    return index_n_atoms(raw, count, shard_uri(shard))


def remote_fields(
    shard: RemoteFile, header: dict[str, int], *, token: str | bool | None = None,
    policy: RetryPolicy | None = None, store: ObjectStore | None = None,
) -> dict | None:
    """A remote shard's fields from one range read of its schema block.

    Args:
        shard (RemoteFile): The remote ``.atp`` file.
        header (dict[str, int]): Its facts from :func:`read_shard_header`.
        token (str or bool, optional): Hub token of the schema read (see
            :func:`read_shard_header`). (default: :obj:`None`)
        policy (RetryPolicy, optional): Retries and timeouts of the schema read.
            (default: :obj:`None`)
        store (ObjectStore, optional): The object-store handle that reads the schema
            block (object-store URLs only). (default: :obj:`None`)

    Returns:
        ``name -> atp.FieldInfo``, or ``None`` when the file has no schema block
        (atompack 0.2.x files: only a scan of the records can tell).
    """
    head = header
    if not head.get("schema_len") or head.get("record_format") not in (2, 3):
        return None  # 0.2.x file: only a scan of the records can tell (format layer does it)
    raw = fetch_range(shard, head["schema_offset"], head["schema_len"], token=token,
                      policy=policy, store=store)
    return schema_block_fields(raw, head["record_format"], shard_uri(shard))
