"""Row tiles of jagged sequences: the work items the jagged kernels (HSTU and softmax attention, jagged bmm,
jagged <-> dense) loop over, listed on the host without waiting for the device.

The host lists each ``BLOCK``-row tile's sequence and first row (:func:`_tiles`, int32); a work item is a tile and
one of ``per_tile`` things done to it (a head, a block of columns): item ``i`` is tile ``i // per_tile``, part
``i % per_tile``. :func:`tile_grid` sizes the persistent 1-D grid over them, :func:`_tile_item` decodes an item
inside a kernel.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from . import num_programs

BLOCK = 16


@triton.jit
def _work_item(item, heads, offsets_ptr, tile_seq_ptr, tile_start_ptr, targets_ptr, HAS_TARGETS: tl.constexpr):
    """Work item ``item``'s head, its sequence's first row, length (0 for a spare item) and target count, and its
    tile's first row."""
    tile = item // heads
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    start = tl.load(offsets_ptr + seq)
    length = tl.load(offsets_ptr + seq + 1) - start
    length = tl.where(first < length, length, 0)
    if HAS_TARGETS:
        targets = tl.load(targets_ptr + seq).to(tl.int32)
    else:
        targets = 0
    return item % heads, start, length, targets, first


@triton.jit
def _tile_item(item, per_tile, offsets_ptr, tile_seq_ptr, tile_start_ptr, BLOCK: tl.constexpr):
    """Work item ``item``'s part of its tile (``item % per_tile``), its sequence, the sequence's first row and length
    (0 for a spare item), the tile's first row and its ``BLOCK`` rows (positions in the sequence)."""
    part, start, length, _, first = _work_item(item, per_tile, offsets_ptr, tile_seq_ptr, tile_start_ptr, offsets_ptr,
                                               False)
    seq = tl.load(tile_seq_ptr + item // per_tile)
    return part, seq, start, length, first, first + tl.arange(0, BLOCK)


def _tiles(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each BLOCK-row tile's sequence and first row (int32), over every sequence's own tiles, in a list whose size
    the host knows without waiting for the device: ``B + total // BLOCK`` entries, at least the tiles there are;
    a spare entry starts past the end of the last sequence (its work item has nothing to do)."""
    lengths = offsets[1:] - offsets[:-1]
    tiles = (lengths + BLOCK - 1) // BLOCK
    ends = torch.cumsum(tiles, 0)
    index = torch.arange(lengths.numel() + total // BLOCK, device=offsets.device)
    tile_seq = torch.searchsorted(ends, index, right=True).clamp_(max=max(lengths.numel() - 1, 0))
    tile_start = (index - (ends - tiles)[tile_seq]) * BLOCK
    return tile_seq.to(torch.int32), tile_start.to(torch.int32)


class TileGrid(NamedTuple):
    """A launch over the work items: the grid, the three tensors every tiled kernel reads first (``offsets``,
    ``tile_seq``, ``tile_start``, all int32) and the number of items."""
    grid: tuple[int]
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    num_items: int


def tile_grid(offsets: torch.Tensor, total: int, per_tile: int) -> Optional[TileGrid]:
    """The launch over ``per_tile`` work items per row tile of the ``total`` jagged rows ``offsets`` delimit;
    None when there is no work (no sequence, no rows, or ``per_tile`` 0)."""
    offsets = offsets.to(torch.int32)
    if offsets.numel() < 2:
        return None
    tile_seq, tile_start = _tiles(offsets, total)
    num_items = tile_seq.numel() * per_tile
    if num_items == 0:
        return None
    return TileGrid((min(num_programs(offsets.device), num_items),), (offsets, tile_seq, tile_start), num_items)
