"""Where the value rows of a table live: one tensor, or tiers (device, host memory, a disk file).

A table addresses values by slot (bucket * bucket_size + position). ``DenseValues`` keeps row ``slot``
of one tensor. ``TieredValues`` keeps a slot -> row map over three tiers laid end to end: rows
``[0, device_rows)`` on the table's device, the next ``host_rows`` in host memory, the rest in a file
mapped from ``disk_path``. ``migrate`` moves the highest-scoring rows to the fastest tiers (MTrainS);
``promote``, run by the table after every write of scores, swaps each touched row of a slower tier
whose score now exceeds the lowest scores of the device tier with those rows (hot rows move up).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

TIER_NAMES = ("device", "host", "disk")


class DenseValues:
    """All value rows in one tensor on the table's device; row ``slot`` holds the value of that slot."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros(rows, dim, dtype=dtype, device=device)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return self.data.index_select(0, slots)

    def scatter(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self.data.index_copy_(0, slots, values.to(self.data.dtype))

    def add(self, slots: torch.Tensor, deltas: torch.Tensor) -> None:
        self.data.index_add_(0, slots, deltas.to(self.data.dtype))

    def tier_rows(self) -> dict[str, int]:
        return {"device": self.rows, "host": 0, "disk": 0}

    def migrate(self, scores: torch.Tensor, occupied: torch.Tensor) -> None:
        """One tier: nothing to move."""

    def promote(self, slots: torch.Tensor, score_of) -> None:
        """One tier: nothing to move."""

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class TierLimits:
    """Bytes each tier may hold; None: unlimited (the last tier present takes the rest)."""

    device_memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    disk_path: str | None = None

    @property
    def tiered(self) -> bool:
        return self.device_memory_bytes is not None or self.host_memory_bytes is not None or self.disk_path is not None


class TieredValues:
    """Value rows split over device memory, host memory and a disk file, addressed through a slot -> row map."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device, limits: TierLimits):
        row_bytes = max(1, dim * torch.empty((), dtype=dtype).element_size())
        device_rows = rows if limits.device_memory_bytes is None else min(rows, limits.device_memory_bytes // row_bytes)
        rest = rows - device_rows
        host_rows = rest if limits.host_memory_bytes is None else min(rest, limits.host_memory_bytes // row_bytes)
        disk_rows = rest - host_rows
        if disk_rows and limits.disk_path is None:
            raise ValueError(
                f"hkv table of {rows} rows x {row_bytes} bytes does not fit device_memory_bytes="
                f"{limits.device_memory_bytes} + host_memory_bytes={limits.host_memory_bytes}; give disk_path "
                f"for the remaining {disk_rows} rows"
            )
        self.dim, self.dtype, self.device = dim, dtype, device
        self.sizes = (device_rows, host_rows, disk_rows)
        self.tiers = [
            torch.zeros(device_rows, dim, dtype=dtype, device=device),
            torch.zeros(host_rows, dim, dtype=dtype),
            self._disk_tensor(limits.disk_path, disk_rows, dim, dtype),
        ]
        self.disk_path = limits.disk_path if disk_rows else None
        self.starts = torch.tensor([0, device_rows, device_rows + host_rows], device=device)
        self.row_of_slot = torch.arange(rows, device=device)
        self.slot_of_row = torch.arange(rows, device=device)

    @staticmethod
    def _disk_tensor(path: str | None, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
        if not rows:
            return torch.zeros(0, dim, dtype=dtype)
        nbytes = rows * dim * torch.empty((), dtype=dtype).element_size()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(nbytes)
        return torch.from_file(path, shared=True, size=rows * dim, dtype=dtype).view(rows, dim)

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def tier_rows(self) -> dict[str, int]:
        return dict(zip(TIER_NAMES, self.sizes))

    def tier_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """0 (device), 1 (host) or 2 (disk) for each slot."""
        return torch.bucketize(self.row_of_slot[slots], self.starts, right=True) - 1

    def _split(self, slots: torch.Tensor):
        rows = self.row_of_slot[slots]
        tier = torch.bucketize(rows, self.starts, right=True) - 1
        for t, store in enumerate(self.tiers):
            where = (tier == t).nonzero().squeeze(1)
            if where.numel():
                yield where, store, (rows[where] - self.starts[t]).to(store.device)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(slots.numel(), self.dim, dtype=self.dtype, device=self.device)
        for where, store, rows in self._split(slots):
            out[where] = store.index_select(0, rows).to(self.device)
        return out

    def scatter(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        for where, store, rows in self._split(slots):
            store.index_copy_(0, rows, values[where].to(store.device, self.dtype))

    def add(self, slots: torch.Tensor, deltas: torch.Tensor) -> None:
        for where, store, rows in self._split(slots):
            store.index_add_(0, rows, deltas[where].to(store.device, self.dtype))

    def migrate(self, scores: torch.Tensor, occupied: torch.Tensor) -> None:
        """Give the occupied slots with the highest scores the rows of the fastest tiers."""
        order = torch.argsort(torch.where(occupied, scores, torch.iinfo(torch.int64).min), descending=True, stable=True)
        values = self.gather(order)  # the value of every slot, hottest first
        self.row_of_slot[order] = torch.arange(order.numel(), device=self.device)
        self.slot_of_row = order
        self.scatter(order, values)

    def promote(self, slots: torch.Tensor, score_of) -> None:
        """Swap rows between the device tier and the touched ``slots`` of slower tiers: the i-th highest
        scoring of those takes the row of the i-th lowest scoring device-tier slot while its score is
        higher. ``score_of(slots)``: the scores of slots, the lowest int64 for free ones."""
        device_rows = self.sizes[0]
        slots = torch.unique(slots[slots >= 0])
        slow = slots[self.row_of_slot[slots] >= device_rows]
        if not slow.numel() or not device_rows:
            return
        slow_scores, order = score_of(slow).sort(descending=True)
        k = min(slow.numel(), device_rows)
        slow, slow_scores = slow[order[:k]], slow_scores[:k]
        fast_slots = self.slot_of_row[:device_rows]
        fast_scores, pick = torch.topk(score_of(fast_slots), k, largest=False)
        move = slow_scores > fast_scores  # a prefix: slow descending, fast ascending
        up, down = slow[move], fast_slots[pick[move]]
        if not up.numel():
            return
        up_values, down_values = self.gather(up), self.gather(down)
        up_rows, down_rows = self.row_of_slot[up], self.row_of_slot[down]
        self.row_of_slot[up], self.row_of_slot[down] = down_rows, up_rows
        self.slot_of_row[down_rows], self.slot_of_row[up_rows] = up, down
        self.scatter(up, up_values)
        self.scatter(down, down_values)

    def close(self) -> None:
        if self.disk_path is not None:
            self.tiers[2] = torch.zeros(0, self.dim, dtype=self.dtype)


def make_values(rows: int, dim: int, dtype: torch.dtype, device: torch.device, limits: TierLimits):
    return TieredValues(rows, dim, dtype, device, limits) if limits.tiered else DenseValues(rows, dim, dtype, device)
