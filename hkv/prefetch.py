"""A prefetch pipeline: the next batch's host-side table work overlaps the current training step.

``Prefetcher(batches, ids_of)`` iterates over ``batches``; while the caller trains on batch ``i``, a
background thread deduplicates and buckets the ids of batch ``i + 1`` on the host (Rec SDK's partial
offload) and inserts the unseen ones into their tables (``DynamicTable.prefetch``: initialised,
scored as never seen, evicting as a lookup would). The step on batch ``i + 1`` then finds every id
present. Training is unaffected: insertion never changes an existing row or score, the step's own
lookup scores the keys and reads rows after the previous step's update (with a random initialiser,
new rows are drawn in the prefetch thread). The table lock orders the two threads; dense compute of
the step runs alongside. Tables with admission are not prefetched (a prefetch is no sighting).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

from hkv.ops import host_unique

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
                uniq, _, grouping = host_unique(ids, module.runtime)
                module.runtime.prefetch(uniq, grouping)

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
