"""Where the value rows of a table live: one tensor, or tiers (device, host memory, a disk file).

A table addresses values by slot (bucket * bucket_size + position). ``DenseValues`` keeps row ``slot``
of one tensor. ``TieredValues`` keeps a slot -> row map over three tiers laid end to end: rows
``[0, device_rows)`` on the table's device, the next ``host_rows`` in host memory, the rest in a file
mapped from ``disk_path``. ``migrate`` moves the highest-scoring rows to the fastest tiers (MTrainS);
``promote``, run by the table after every write of scores, swaps each touched row of a slower tier
whose score now exceeds the lowest scores of the device tier with those rows (hot rows move up).

A table grows by building a whole new store beside the old one (``staged=True``: the disk tier goes to
``<disk_path>.grow-<pid>``) and only then ``adopt``-ing it (the staged file renamed over ``disk_path``);
a failure while building raises ``StorageError`` naming the tier and path and leaves the old store intact.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

TIER_NAMES = ("device", "host", "disk")
_STAGED = itertools.count()  # tells apart the staged files of nested growths


class StorageError(RuntimeError):
    """Allocating a storage tier failed (out of memory, disk full, a bad or unwritable disk path)."""


def allocate(tier: str, rows: int, row_bytes: int, make, path: str | None = None):
    """``make()`` with any failure raised as a StorageError naming the tier, its size and its path."""
    try:
        return make()
    except Exception as exc:
        where = f" at {path!r}" if path is not None else ""
        raise StorageError(f"could not allocate the {tier} tier ({rows} rows x {row_bytes} bytes){where}: "
                           f"{type(exc).__name__}: {exc}") from exc


class DenseValues:
    """All value rows in one tensor on the table's device; row ``slot`` holds the value of that slot."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device):
        row_bytes = dim * torch.empty((), dtype=dtype).element_size()
        self.data = allocate("device", rows, row_bytes, lambda: torch.zeros(rows, dim, dtype=dtype, device=device))

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

    def adopt(self) -> None:
        """Nothing staged."""

    def close(self) -> None:
        pass

    def discard(self) -> None:
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

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device: torch.device, limits: TierLimits,
                 staged: bool = False):
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
        self.disk_path = limits.disk_path if disk_rows else None
        # Where the disk tier's file is now: beside disk_path while staged, disk_path once adopted.
        self.file = self.disk_path
        if staged and self.disk_path is not None:
            self.file = f"{self.disk_path}.grow-{os.getpid()}-{next(_STAGED)}"
        try:
            self.tiers = [
                allocate("device", device_rows, row_bytes,
                         lambda: torch.zeros(device_rows, dim, dtype=dtype, device=device)),
                allocate("host", host_rows, row_bytes, lambda: torch.zeros(host_rows, dim, dtype=dtype)),
                allocate("disk", disk_rows, row_bytes, lambda: self._disk_tensor(self.file, disk_rows, dim, dtype),
                         self.file),
            ]
            self.starts, self.row_of_slot, self.slot_of_row = allocate("device", rows, 3 * 8, lambda: (
                torch.tensor([0, device_rows, device_rows + host_rows], device=device),
                torch.arange(rows, device=device), torch.arange(rows, device=device)))
        except BaseException:
            if staged and self.file is not None and os.path.exists(self.file):
                os.remove(self.file)
            raise

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

    def adopt(self) -> None:
        """Move a staged disk file over ``disk_path`` (the mapping follows the file); the old store's mapping
        keeps the old file's contents until it is closed."""
        if self.file is not None and self.file != self.disk_path:
            allocate("disk", self.sizes[2], 0, lambda: os.replace(self.file, self.disk_path), self.disk_path)
            self.file = self.disk_path

    def close(self) -> None:
        if self.disk_path is not None:
            self.tiers[2] = torch.zeros(0, self.dim, dtype=self.dtype)

    def discard(self) -> None:
        """Drop a store that was never adopted, and its staged file."""
        self.close()
        if self.file is not None and self.file != self.disk_path and os.path.exists(self.file):
            os.remove(self.file)


def make_values(rows: int, dim: int, dtype: torch.dtype, device: torch.device, limits: TierLimits,
                staged: bool = False):
    if limits.tiered:
        return TieredValues(rows, dim, dtype, device, limits, staged)
    return DenseValues(rows, dim, dtype, device)
