"""Hugging Face Hub / HTTP access: revision pinning, listings, range reads, verified downloads.

This package depends on numpy, huggingface_hub and the format layer
(:mod:`pyg_atompack.atp`); it never imports torch.

Public API::

    from pyg_atompack import hub

    loc = hub.parse_hf_uri("hf://datasets/org/data@main/omat/train")
    # HubLocation(repo_id="org/data", revision="main", path_in_repo="omat/train",
    #             repo_type="dataset")

    sha = hub.resolve_revision("org/data", "main")             # -> 40-hex commit sha
    files = hub.list_remote_files("org/data", "omat/train", revision=sha, pattern="*.atp")
    # [RemoteFile(name, size, sha256, version=sha, url, blob_id, repo), ...]
    # sorted by POSIX path; ONE listing request (recursive tree), no per-file requests

    local = hub.download(files[0], cache_dir)                    # verified (size + sha256)

    with hub.open_hub_atp("org/data", "omat/train", revision="main") as f:
        len(f); f[-1]; f.read_batch([0, 5, 9], fields=["energy"]); f.n_atoms; f.fields
        # shards are downloaded (verified) only when a record inside them is first read;
        # f.download_all() fetches them all now; pickle.dumps(f) carries the listing
    paged = f.by_record(cache_bytes=8 << 30)   # same listing, records read by range
        # through the bounded page cache; f and paged are atp.ShardedReader subclasses

What crosses the network, per call: ``resolve_revision`` one API request;
``list_remote_files`` one tree listing (more pages only past 1000 entries);
``download`` one GET of the file, nothing when a verified copy is cached; ``open_hub_atp`` one
resolve (none for a commit sha), one listing and one 8192-byte range read per
shard, or nothing at all when that commit's listing is in the cache, so a
pinned, already-downloaded dataset opens offline. ``n_atoms`` of a ``HubAtpReader``
reads the schema and index blocks of shards not yet downloaded (one range read each,
cached on disk: :mod:`pyg_atompack.remote.atp_meta`), ``fields`` only their schema
blocks.

Publishing (:mod:`.publish`, :mod:`.card`, :mod:`.pull`)::

    result = hub.push("train.xyz", "me/md17", path_in_repo="aspirin", create=True)
    result.commit, result.uri     # "hf://datasets/me/md17@<sha>/aspirin"
    hub.pull("me/md17", "local_copy", "aspirin", revision=result.commit)

Every remote failure raises a :class:`HubError` subclass whose message names the
repository, revision and path: :class:`HubRepositoryNotFoundError`,
:class:`HubRevisionNotFoundError`, :class:`HubPathNotFoundError`,
:class:`HubNoShardsError`, :class:`HubIntegrityError` (size/checksum mismatch),
:class:`HubGatedRepoError` (terms not accepted: the message says where to accept them),
:class:`HubAuthError` (401/403 otherwise), :class:`HubOfflineError` (``HF_HUB_OFFLINE=1``
and the cache cannot answer), :class:`HubTransferError` (network/HTTP after retries),
:class:`HubURIError` (bad ``hf://``), :class:`HubPublishError` (``push``/``pull`` refused
their input before any transfer). All but HubNoShardsError, HubURIError and
HubPublishError are also :class:`pyg_atompack.transport.TransportError` subclasses.

Endpoint selection. huggingface_hub reads ``HF_ENDPOINT`` once, when it is first
imported, into ``huggingface_hub.constants.ENDPOINT``. Setting the environment
variable later has no effect in a running process. So every function that talks
to the API takes ``endpoint=`` (``None`` = the client's configured endpoint) and
passes it to ``HfApi(endpoint=...)`` and ``hf_hub_url(endpoint=...)``. A
:class:`~pyg_atompack.remote.RemoteFile` carries its full URL, so range reads,
:func:`download` and pickled readers in DataLoader workers keep using the
endpoint they were listed from. For a separate process (a script, ``torchrun``)
set ``HF_ENDPOINT`` in its environment before it starts. Tests do exactly this
against the loopback fake Hub in ``tests/servers/fake_hub.py``.

Tokens follow huggingface_hub: ``None`` uses the saved login / ``HF_TOKEN``,
``False`` sends none, a string is used as is. An explicit token is kept in a
pickled :class:`HubAtpReader` so that workers can download; do not pickle
readers to untrusted places.
"""

from __future__ import annotations

from pyg_atompack.hub.atp_reader import HubAtpReader, open_hub_atp, open_remote_atp
from pyg_atompack.hub.backend import HubBackend
from pyg_atompack.hub.errors import (
    HubAuthError,
    HubError,
    HubGatedRepoError,
    HubIntegrityError,
    HubNoShardsError,
    HubOfflineError,
    HubPathNotFoundError,
    HubRepositoryNotFoundError,
    HubRevisionNotFoundError,
    HubTransferError,
    HubURIError,
)
from pyg_atompack.hub.publish import HubPublishError, PushResult, push
from pyg_atompack.hub.pull import PullResult, pull
from pyg_atompack.hub.remote import list_remote_files, resolve_revision
from pyg_atompack.hub.transfer import download
from pyg_atompack.hub.uri import HubLocation, parse_hf_uri
from pyg_atompack.remote.backends import register_backend

__all__ = [
    "HubAtpReader",
    "HubAuthError",
    "HubBackend",
    "HubError",
    "HubGatedRepoError",
    "HubIntegrityError",
    "HubLocation",
    "HubNoShardsError",
    "HubOfflineError",
    "HubPathNotFoundError",
    "HubPublishError",
    "HubRepositoryNotFoundError",
    "HubRevisionNotFoundError",
    "HubTransferError",
    "HubURIError",
    "PullResult",
    "PushResult",
    "download",
    "list_remote_files",
    "open_hub_atp",
    "open_remote_atp",
    "parse_hf_uri",
    "pull",
    "push",
    "resolve_revision",
]

# the Hub serves hf:// URLs in the one backend registry (remote/ cannot name this layer)
register_backend("hf", HubBackend)
