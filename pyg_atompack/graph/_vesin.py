"""The pair search of ``vesin-torch`` (cell lists, CPU and CUDA), one graph at a time.

``vesin-torch`` searches one structure per call with a cell list: its cost grows with the
number of pairs, where the padded search of :mod:`._search` grows with the square of the
atoms and, for periodic graphs, with the number of candidate cell shifts. It has no batch
call, so a batch of small graphs pays a fixed cost per graph (tens of microseconds);
:func:`prefer_vesin` says when that pays (``benchmarks/neighbours.py`` measured the rule).

Only the indices and shifts come from ``vesin``; :func:`pyg_atompack.graph.radius_graph`
builds the edge vectors with torch ops from them, so gradients reach ``pos`` and ``cell``
whichever backend searched.
"""

from __future__ import annotations

import functools
import importlib
import threading
from types import ModuleType

import torch
from torch import Tensor

#: Mean atoms per graph from which ``vesin`` searches batches of periodic cells, and of
#: molecules. ``benchmarks/neighbours.py`` (CPU time, cutoff 5 Å): on one structure alone
#: ``vesin`` takes 0.5-0.95x the padded search's time (0.2x on a 300-atom cell); on
#: batches of 32 small cells 1.1-1.3x, of 300-atom cells 0.15x; on batches of 32 molecules
#: of 20-300 atoms 1.2-4x, and on a 1,000-atom molecule 0.5x.
VESIN_PERIODIC_ATOMS = 128
VESIN_MOLECULE_ATOMS = 600


@functools.lru_cache(maxsize=1)
def vesin_module() -> ModuleType | None:
    """``vesin_torch`` when ``vesin-torch`` is installed and loads, else :obj:`None`."""
    try:
        return importlib.import_module("vesin_torch")
    except (ImportError, OSError):  # OSError: a native library built for another torch
        return None


def prefer_vesin(counts: Tensor, periodic: bool) -> bool:
    """Whether ``backend="auto"`` searches with ``vesin`` (when it is installed).

    Args:
        counts (Tensor): ``[B]`` atoms per graph.
        periodic (bool): Whether some graph of the batch has a periodic axis.
    """
    if vesin_module() is None or not len(counts):
        return False
    if len(counts) == 1:  # alone, the padded search's set-up is shared with no other graph
        return True
    threshold = VESIN_PERIODIC_ATOMS if periodic else VESIN_MOLECULE_ATOMS
    return int(counts.sum()) >= threshold * len(counts)


_PER_THREAD = threading.local()


def _calculator(cutoff: float) -> object:
    # one per thread (a calculator reuses its buffers: a read-ahead thread's transform and
    # the model's forward may search at once); one search thread each, as the consumer's
    # step and DataLoader workers already use the cores
    calculators = _PER_THREAD.__dict__.setdefault("calculators", {})
    calculator = calculators.get(cutoff)
    if calculator is None:
        calculator = calculators[cutoff] = vesin_module().NeighborList(
            cutoff=cutoff, full_list=True, n_threads=1)
    return calculator


def vesin_pairs(pos: Tensor, counts: Tensor, r: float, loop: bool, cell: Tensor | None = None,
                pbc: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Every (target, source, shift) closer than ``r`` (strictly), searched by ``vesin``.

    Args:
        pos (Tensor): ``[N, 3]`` detached positions (any device ``vesin`` supports).
        counts (Tensor): ``[B]`` atoms per graph.
        r (float): Cutoff (strict: ``d < r``).
        loop (bool): Add the zero-shift self pair ``(i, i)``.
        cell (Tensor, optional): ``[B, 3, 3]`` detached lattice vectors with non-periodic
            rows zeroed; :obj:`None` for molecules. (default: :obj:`None`)
        pbc (Tensor, optional): ``[B, 3]`` periodic axes (with ``cell``). (default: :obj:`None`)

    Returns:
        Global target and source indices (int64), ``[E, 3]`` int64 shifts (:obj:`None` for
        molecules) and squared distances, in ``pos.dtype``.
    """
    calculator = _calculator(float(r))
    device, dtype = pos.device, pos.dtype
    no_box = torch.zeros(3, 3, dtype=dtype, device=device)
    targets, sources, shifts, distances = [], [], [], []
    start = 0
    periodic_rows = None if pbc is None else pbc.tolist()
    for graph, size in enumerate(counts.tolist()):
        if size:
            part = pos[start:start + size]
            axes = False if periodic_rows is None else periodic_rows[graph]
            if axes is False or not any(axes):
                target, source, shift, distance = calculator.compute(part, no_box, False, "ijSd")
            else:
                target, source, shift, distance = calculator.compute(
                    part, cell[graph].to(dtype), torch.tensor(axes, device=device), "ijSd")
            targets.append(target.to(torch.int64) + start)
            sources.append(source.to(torch.int64) + start)
            shifts.append(shift.to(torch.int64))
            distances.append(distance.to(dtype))
        start += size
    if loop and start:
        own = torch.arange(start, device=device)
        targets.append(own)
        sources.append(own)
        shifts.append(torch.zeros(start, 3, dtype=torch.int64, device=device))
        distances.append(torch.zeros(start, dtype=dtype, device=device))
    if not targets:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty, None if cell is None else empty.reshape(0, 3), pos.new_empty(0)
    target, source, shift = torch.cat(targets), torch.cat(sources), torch.cat(shifts)
    distance = torch.cat(distances)
    dist2 = distance.square()
    keep = distance < r  # one strict convention whatever the backend
    if not bool(keep.all()):
        target, source, shift, dist2 = target[keep], source[keep], shift[keep], dist2[keep]
    return target, source, (shift if cell is not None else None), dist2
