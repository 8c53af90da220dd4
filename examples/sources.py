"""Turn the example's data flags into a shard source (and a loopback server if simulated).

* ``--source DIR`` / ``http(s)://.../manifest.json`` / ``hf://datasets/{repo}@{rev}/{path}``
  uses the shards as they are.
* ``--md17 ROOT`` converts PyG's ``MD17(ROOT, "aspirin")`` (or another MD17 molecule)
  into shards once, cached next to ``ROOT``.
* No flag: the embedded aspirin EMT trajectory (:mod:`aspirin`).

Local shards can be served through :class:`loopback.LoopbackServer` with simulated
latency and bandwidth, so that even the embedded data really streams over HTTP.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aspirin
import numpy as np
import shards
from loopback import LoopbackServer

from pyg_atompack import stream


class ShardSubset:
    """A view of some shards of another source (a :class:`pyg_atompack.stream.Source`).

    The example holds the last shard out for evaluation and trains on (some of) the
    others; both are subsets of one listing, so the source is listed only once.

    Args:
        source: The full source.
        listing: ``source.list_shards()``, already fetched.
        indices: Positions in ``listing`` to expose, in order.
    """

    def __init__(self, source, listing: Sequence[stream.ShardInfo], indices: Sequence[int]):
        self.source = source
        self._shards = tuple(listing[i] for i in indices)

    def list_shards(self) -> Sequence[stream.ShardInfo]:
        """The selected shards."""
        return self._shards

    def fetch(self, shard: stream.ShardInfo, cancel: stream.CancelToken):
        """Delegate to the full source."""
        return self.source.fetch(shard, cancel)

    def fetch_in_parts(self, shard: stream.ShardInfo, cancel: stream.CancelToken,
                       parts: int):
        """Delegate to the full source (one plain download if it has no ranged fetch)."""
        in_parts = getattr(self.source, "fetch_in_parts", None)
        if in_parts is None:
            return self.source.fetch(shard, cancel)
        return in_parts(shard, cancel, parts)

    def __repr__(self) -> str:
        names = ", ".join(s.name for s in self._shards)
        return f"{type(self).__name__}({self.source!r}, [{names}])"


@dataclass
class ResolvedData:
    """Where the shards of a run come from.

    Attributes:
        source: The shard source.
        description: One line for the output (what and where).
        units: ``(energy unit, force unit)`` for the summary.
        server: The loopback server when the remote is simulated, else :obj:`None`.
    """

    source: object
    description: str
    units: tuple[str, str]
    server: LoopbackServer | None = None


def build_md17_shards(
    root: str | os.PathLike,
    name: str = "aspirin",
    *,
    frames: int = 2048,
    shard_size: int = 256,
    seed: int = 0,
) -> Path:
    """Write a random subset of PyG's MD17 molecule as shards (cached).

    ``torch_geometric.datasets.MD17`` downloads the data into ``root`` on first use
    (energies in kcal/mol, forces in kcal/mol/Å). Attribute ``force`` is renamed
    ``forces`` to match the project's attribute table.

    Args:
        root: Root folder handed to ``MD17``.
        name: MD17 molecule, e.g. ``"aspirin"`` or ``"revised aspirin"``.
            (default: :obj:`"aspirin"`)
        frames: Frames to sample without replacement. (default: :obj:`2048`)
        shard_size: Frames per shard. (default: :obj:`256`)
        seed: Seed of the frame sample. (default: :obj:`0`)

    Returns:
        The folder holding ``pt/`` and ``atp/`` shards.
    """
    from torch_geometric.datasets import MD17

    folder = f"{name.replace(' ', '_')}-n{frames}-s{shard_size}-seed{seed}"
    target = Path(root) / "pyg_atompack_shards" / folder
    manifests = [target / fmt / shards.MANIFEST_NAME for fmt in shards.SHARD_FORMATS]
    if all(shards.manifest_is_intact(path) for path in manifests):
        return target
    dataset = MD17(str(root), name=name)
    picks = np.random.default_rng(seed).permutation(len(dataset))[: min(frames, len(dataset))]
    samples = [dataset[int(i)] for i in picks]
    shards.write_shards(
        target,
        samples[0].z.numpy(),
        np.stack([s.pos.numpy() for s in samples]),
        np.array([float(s.energy.view(-1)[0]) for s in samples]),
        np.stack([s.force.numpy() for s in samples]),
        shard_size=shard_size,
    )
    return target


def _remote_source(spec: str):
    if spec.startswith(("http://", "https://")):
        return stream.RemoteSource(spec)
    if spec.startswith("hf://"):
        from pyg_atompack import hub

        try:
            return stream.RemoteSource(spec, pattern="*.pt")
        except hub.HubNoShardsError:
            return stream.RemoteSource(spec, pattern="*.atp")
    return None


@contextlib.contextmanager
def open_data(
    *,
    source: str | None,
    md17: str | None,
    md17_name: str,
    data_dir: str | os.PathLike,
    shard_format: str,
    trajectory: aspirin.TrajectoryConfig,
    simulate_remote: bool | None,
    latency_s: float,
    bandwidth_bps: float | None,
    log=print,
) -> Iterator[ResolvedData]:
    """Resolve the data flags; serve local shards over loopback HTTP when simulating.

    Args:
        source: ``--source`` value or :obj:`None`.
        md17: ``--md17`` root or :obj:`None`.
        md17_name: MD17 molecule name.
        data_dir: Cache folder of the embedded data.
        shard_format: ``"pt"`` or ``"atp"`` for generated shards.
        trajectory: Settings of the embedded trajectory.
        simulate_remote: Serve through the throttled loopback server; :obj:`None`
            means "only for the embedded data".
        latency_s: Simulated per-request latency.
        bandwidth_bps: Simulated per-connection bandwidth (bytes/s).
        log: Progress message callable.

    Yields:
        A :class:`ResolvedData`; the server (if any) stops when the context exits.
    """
    if source and md17:
        raise ValueError("give at most one of --source and --md17")
    units = ("eV", "eV/Å")
    if source:
        remote = _remote_source(source)
        if remote is not None:
            if simulate_remote:
                log("note: --simulate-remote only applies to local shards; ignored")
            yield ResolvedData(remote, f"remote shards {source}", ("E units", "F units"))
            return
        directory = Path(source)
        description, units = f"local shards {directory}", ("E units", "F units")
        simulate_remote = bool(simulate_remote)
    elif md17:
        root = build_md17_shards(md17, md17_name, shard_size=trajectory.shard_size)
        directory = root / shard_format
        description, units = f"PyG MD17 {md17_name!r} ({directory})", ("kcal/mol", "kcal/mol/Å")
        simulate_remote = bool(simulate_remote)
    else:
        root = aspirin.prepare_aspirin_shards(data_dir, trajectory, log=log)
        log(aspirin.NOT_QUANTUM_CHEMISTRY)
        directory = root / shard_format
        description = f"embedded aspirin EMT MD, {shard_format} shards in {directory}"
        simulate_remote = True if simulate_remote is None else simulate_remote
    if not simulate_remote:
        yield ResolvedData(stream.LocalSource(directory), description, units)
        return
    with LoopbackServer(directory, latency_s=latency_s, bandwidth_bps=bandwidth_bps) as server:
        rate = f"{bandwidth_bps / 1e6:.2f} MB/s" if bandwidth_bps else "unlimited"
        url = server.url(shards.MANIFEST_NAME)
        log(f"serving {directory} at {url} (latency {latency_s * 1e3:.0f} ms, {rate})")
        yield ResolvedData(stream.RemoteSource(url), description, units, server)
