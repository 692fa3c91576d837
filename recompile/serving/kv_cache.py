"""A paged KV cache keyed by user id, for HSTU ranking (the pools ``recompile.hstu_paged_attention`` reads).

Per layer, keys ``k [layers, num_pages, page_size, H, D]`` and values ``v [layers, num_pages, page_size, H, Dv]``;
timestamps ``ts [num_pages, page_size]`` (layer-independent). A user owns a list of pages (its page table) and a
cached length; position ``p`` of its history is row ``p % page_size`` of page ``pages[p // page_size]``.

A request batch goes: ``lookup`` (how much of each user's history is cached: the cached item ids must be a
prefix of the request's history, else the user is dropped and recomputed), ``reserve`` (pages for the new
tokens, evicting least recently used whole users other than the batch's), ``slots`` (the pool rows the new
tokens go to), ``write`` per layer, ``commit``. With a tier (``"host"``, or a directory for disk), an evicted
user's pages are offloaded there and reloaded on its next request instead of being recomputed.
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import torch


@dataclass
class CacheStats:
    hits: int = 0  # users whose cached prefix served a request
    misses: int = 0  # users with nothing usable cached
    invalidations: int = 0  # cached prefixes dropped: the request's history did not extend them
    evictions: int = 0  # users evicted to free pages
    offloads: int = 0  # evicted users whose pages went to the tier
    reloads: int = 0  # users brought back from the tier
    tokens_appended: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class UserEntry:
    pages: list[int]
    ids: torch.Tensor  # the cached history's item ids: a later request must extend them
    length: int = 0


@dataclass
class Offloaded:
    ids: torch.Tensor
    kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # host tier: k, v, ts rows
    path: Optional[str] = None  # disk tier: the file holding them


@dataclass
class PagedKVCache:
    num_layers: int
    num_pages: int
    page_size: int
    heads: int
    head_dim: int
    value_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"
    tier: Optional[str] = None  # None: evicted users are dropped; "host": kept in host memory; else a directory
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        shape = (self.num_layers, self.num_pages, self.page_size, self.heads)
        self.k = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(*shape, self.value_dim, dtype=self.dtype, device=self.device)
        self.ts = torch.zeros(self.num_pages, self.page_size, dtype=torch.int64, device=self.device)
        self.free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self.users: OrderedDict[Hashable, UserEntry] = OrderedDict()  # least recently used first
        self.offloaded: dict[Hashable, Offloaded] = {}
        self._files = itertools.count()
        if self.tier not in (None, "host"):
            os.makedirs(self.tier, exist_ok=True)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free)

    def pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    # -- a request batch ------------------------------------------------------------------------

    def lookup(self, users: Sequence[Hashable], histories: Sequence[torch.Tensor]) -> list[int]:
        """Each user's cached length usable for its request ``histories[b]`` (item ids, oldest first)."""
        lengths = []
        for user, ids in zip(users, histories):
            if user not in self.users and user in self.offloaded:
                self._reload(user, pinned=users)
            entry = self.users.get(user)
            if entry is not None and (entry.length > ids.numel() or not torch.equal(entry.ids, ids[: entry.length])):
                self.stats.invalidations += 1
                self.drop(user)
                entry = None
            if entry is None:
                self.stats.misses += 1
                lengths.append(0)
                continue
            self.stats.hits += 1
            self.users.move_to_end(user)
            lengths.append(entry.length)
        return lengths

    def reserve(self, users: Sequence[Hashable], lengths: Sequence[int]) -> None:
        """Pages for each user's history of ``lengths[b]`` tokens, evicting other users as needed."""
        for user, length in zip(users, lengths):
            entry = self.users.setdefault(user, UserEntry([], torch.empty(0, dtype=torch.int64)))
            self.users.move_to_end(user)
            need = self.pages_for(length) - len(entry.pages)
            self._make_room(need, pinned=users)
            entry.pages += [self.free.pop() for _ in range(max(need, 0))]

    def page_table(self, users: Sequence[Hashable], device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``page_table [B, max_pages]`` (int32) and ``cached_lengths [B]`` (int64) of the batch's users."""
        entries = [self.users[u] for u in users]
        width = max([len(e.pages) for e in entries] + [1])
        table = torch.zeros(len(entries), width, dtype=torch.int32)
        for b, e in enumerate(entries):
            table[b, : len(e.pages)] = torch.tensor(e.pages, dtype=torch.int32)
        lengths = torch.tensor([e.length for e in entries], dtype=torch.int64)
        device = device or self.device
        return table.to(device), lengths.to(device)

    def slots(self, users: Sequence[Hashable], counts: Sequence[int]) -> torch.Tensor:
        """Flat pool rows (``[num_pages * page_size]``) for the next ``counts[b]`` tokens of each user."""
        entries = [self.users[u] for u in users]
        rows = [self._rows(e, e.length, e.length + n) for e, n in zip(entries, counts)]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=self.device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer ``layer``'s keys ``[n, H, D]`` and values ``[n, H, Dv]`` of the new tokens into ``slots``."""
        self.k[layer].view(-1, self.heads, self.head_dim).index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].view(-1, self.heads, self.value_dim).index_copy_(0, slots, v.to(self.dtype))

    def write_layers(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer's keys ``[layers, n, H, D]`` and values ``[layers, n, H, Dv]`` of the new tokens into
        ``slots``: one copy per pool."""
        self.k.view(self.num_layers, -1, self.heads, self.head_dim).index_copy_(1, slots, k.to(self.dtype))
        self.v.view(self.num_layers, -1, self.heads, self.value_dim).index_copy_(1, slots, v.to(self.dtype))

    def commit(self, users: Sequence[Hashable], histories: Sequence[torch.Tensor], slots: torch.Tensor,
               timestamps: torch.Tensor) -> None:
        """The users' cached histories are now ``histories``; ``timestamps`` of the new tokens go to ``slots``."""
        self.ts.view(-1).index_copy_(0, slots, timestamps.to(self.ts))
        for user, ids in zip(users, histories):
            entry = self.users[user]
            self.stats.tokens_appended += ids.numel() - entry.length
            entry.ids, entry.length = ids.clone(), ids.numel()

    def truncate(self, user: Hashable, length: int) -> None:
        """Keep only the first ``length`` cached tokens of a user (pages past them freed): e.g. to undo the
        tokens of a request that was not served."""
        entry = self.users[user]
        length = min(length, entry.length)
        keep = self.pages_for(length)
        self.free += entry.pages[keep:][::-1]
        entry.pages, entry.ids, entry.length = entry.pages[:keep], entry.ids[:length], length

    # -- eviction and tiers ---------------------------------------------------------------------

    def drop(self, user: Hashable) -> None:
        """Forget a user's cached history, in the pools and in the tier."""
        if user in self.users:
            self._release(user)
        self.offloaded.pop(user, None)

    def _release(self, user: Hashable) -> None:
        self.free += self.users.pop(user).pages[::-1]

    def _make_room(self, pages: int, pinned: Sequence[Hashable]) -> None:
        while len(self.free) < pages:
            victim = next((u for u in self.users if u not in pinned), None)
            if victim is None:
                raise MemoryError(f"PagedKVCache: {pages} pages needed, {len(self.free)} free of {self.num_pages}, "
                                  "and every cached user belongs to this batch: add pages or split the batch")
            self.evict(victim)

    def evict(self, user: Hashable) -> None:
        """Evict a user: its pages offloaded to the tier if there is one, then freed."""
        entry = self.users[user]
        self.stats.evictions += 1
        if self.tier is not None and entry.length:
            self._offload(user, entry)
        self._release(user)

    def _rows(self, entry: UserEntry, start: int, stop: int) -> torch.Tensor:
        """Flat pool rows of positions ``start .. stop - 1`` of a user."""
        pages = torch.tensor(entry.pages, dtype=torch.int64)
        pos = torch.arange(start, stop)
        return (pages[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)

    def _offload(self, user: Hashable, entry: UserEntry) -> None:
        rows = self._rows(entry, 0, entry.length)
        kv = (self.k.flatten(1, 2)[:, rows].cpu(), self.v.flatten(1, 2)[:, rows].cpu(), self.ts.view(-1)[rows].cpu())
        if self.tier == "host":
            self.offloaded[user] = Offloaded(entry.ids, kv=kv)
        else:
            path = os.path.join(self.tier, f"user-{next(self._files)}.pt")
            torch.save(kv, path)
            self.offloaded[user] = Offloaded(entry.ids, path=path)
        self.stats.offloads += 1

    def _reload(self, user: Hashable, pinned: Sequence[Hashable]) -> None:
        stored = self.offloaded.pop(user)
        k, v, ts = stored.kv if stored.path is None else torch.load(stored.path)
        if stored.path is not None:
            os.remove(stored.path)
        length = ts.numel()
        self._make_room(self.pages_for(length), pinned)
        entry = UserEntry([self.free.pop() for _ in range(self.pages_for(length))], stored.ids, length)
        self.users[user] = entry
        rows = self._rows(entry, 0, length)
        self.k.flatten(1, 2)[:, rows] = k.to(self.k)
        self.v.flatten(1, 2)[:, rows] = v.to(self.v)
        self.ts.view(-1)[rows] = ts.to(self.ts)
        self.stats.reloads += 1
