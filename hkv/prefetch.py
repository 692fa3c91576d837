"""A prefetch pipeline: the next batch's host-side table work overlaps the current training step.

``Prefetcher(batches, ids_of)`` iterates over ``batches``; while the caller trains on batch ``i``, a
background thread deduplicates the ids of batch ``i + 1`` (on the host, as Rec SDK's partial offload)
and inserts the unseen ones into their tables (initialised, admitted, evicting as a lookup would).
The step on batch ``i + 1`` then finds every id present. Values are unaffected: insertion never
changes an existing row, and the step's own lookup reads rows after the previous step's update.
The table lock orders the two threads; dense compute of the step runs alongside.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from hkv.ops import unique_ids

Batch = TypeVar("Batch")


class Prefetcher:
    def __init__(self, batches: Iterable[Batch],
                 ids_of: Callable[[Batch], Iterable[tuple[torch.nn.Module, torch.Tensor]]]):
        """``ids_of(batch)`` gives the (hkv.DynamicEmbedding(Bag) module, ids) pairs of a batch."""
        self.batches = batches
        self.ids_of = ids_of

    def _insert(self, batch) -> None:
        for module, ids in self.ids_of(batch):
            if module.training:  # eval never inserts
                module.runtime.lookup(unique_ids(ids, on_host=True)[0], train=True)

    def __iter__(self) -> Iterator[Batch]:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkv-prefetch") as pool:
            batches = iter(self.batches)
            upcoming = next(batches, None)
            pending = pool.submit(self._insert, upcoming) if upcoming is not None else None
            while upcoming is not None:
                pending.result()
                current, upcoming = upcoming, next(batches, None)
                if upcoming is not None:
                    pending = pool.submit(self._insert, upcoming)
                yield current
