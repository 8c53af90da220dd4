"""Work planning for the blockwise neighbour search.

The search never materialises an ``N_total x N_total`` matrix. Consecutive
graphs are grouped into chunks padded to the chunk's largest graph and to a
shared grid of cell shifts (a single zero shift for molecules). A chunk is cut
into row and shift blocks so that one block evaluates at most ``max_pairs``
candidate pairs (``graphs x rows x width x shifts``). One row of one graph
against one shift needs ``n_i`` pairs whatever the budget; that is the only
way a block can exceed it.

The planner is pure Python over integers, so its memory promise can be tested
without touching tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

Bounds = tuple[int, int, int]


class SearchBlock(NamedTuple):
    """One padded block of the neighbour search.

    Attributes:
        first: Index of the first graph of the chunk (into the planned list).
        stop: One past the last graph of the chunk.
        row_start: First row (local atom index) handled by this block.
        row_stop: One past the last row.
        shift_start: First shift (index into the chunk's shift grid).
        shift_stop: One past the last shift.
        width: Padded number of atoms per graph in the chunk.
        bounds: Largest ``|shift|`` per axis of the chunk's shift grid; the grid
            holds ``prod(2 * bounds + 1)`` shifts.
    """

    first: int
    stop: int
    row_start: int
    row_stop: int
    shift_start: int
    shift_stop: int
    width: int
    bounds: Bounds

    @property
    def num_pairs(self) -> int:
        """Number of candidate pairs the block evaluates at once."""
        return ((self.stop - self.first) * (self.row_stop - self.row_start) * self.width
                * (self.shift_stop - self.shift_start))


def grid_size(bounds: Bounds) -> int:
    """Number of shifts ``S`` with ``|S_k| <= bounds[k]`` on every axis."""
    return math.prod(2 * b + 1 for b in bounds)


def plan_blocks(counts: Sequence[int], bounds: Sequence[Bounds] | None,
                max_pairs: int) -> list[SearchBlock]:
    """Cuts a batch into padded search blocks of bounded size.

    Consecutive graphs are grouped greedily while ``graphs x width**2 x shifts``
    stays within ``max_pairs``. A graph too large on its own is searched
    alone, in blocks of shifts and rows. Graphs without atoms are skipped.

    Args:
        counts (Sequence[int]): Number of atoms of every graph, in order.
        bounds (Sequence[Bounds] | None): Largest shift per axis of every graph (``(0, 0, 0)`` for a
            molecule), or ``None`` when no graph is periodic.
        max_pairs (int): Largest number of candidate pairs evaluated at once.

    Returns:
        Blocks covering every (row, shift) of every non-empty graph exactly once.
    """
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be positive, got {max_pairs}")
    if bounds is None:
        bounds = [(0, 0, 0)] * len(counts)
    blocks: list[SearchBlock] = []
    index, total = 0, len(counts)
    while index < total:
        size, grid = counts[index], tuple(bounds[index])
        if size == 0:
            index += 1
            continue
        shifts = grid_size(grid)
        if size * size * shifts > max_pairs:
            blocks.extend(_split_graph(index, size, grid, max_pairs))
            index += 1
            continue
        stop, width = index + 1, size
        while stop < total:
            grown_width = max(width, counts[stop])
            grown_grid = tuple(max(a, b) for a, b in zip(grid, bounds[stop]))
            pairs = (stop + 1 - index) * grown_width * grown_width * grid_size(grown_grid)
            if pairs > max_pairs:
                break
            width, grid = grown_width, grown_grid
            stop += 1
        blocks.append(SearchBlock(index, stop, 0, width, 0, grid_size(grid), width, grid))
        index = stop
    return blocks


def _split_graph(index: int, size: int, grid: Bounds, max_pairs: int) -> list[SearchBlock]:
    """Row and shift blocks of one graph larger than the budget."""
    shifts = grid_size(grid)
    shifts_per_block = min(shifts, max(1, max_pairs // size))
    rows_per_block = min(size, max(1, max_pairs // (size * shifts_per_block)))
    return [
        SearchBlock(index, index + 1, row, min(row + rows_per_block, size), shift,
                    min(shift + shifts_per_block, shifts), size, grid)
        for row in range(0, size, rows_per_block)
        for shift in range(0, shifts, shifts_per_block)
    ]
