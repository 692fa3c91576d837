"""hkv.HashTable: HierarchicalKV's embedding hash table on torch tensors.

Layout (as HierarchicalKV): ``capacity = num_buckets * bucket_size`` slots; a key hashes to one
bucket and a home position in it, and is stored at the first free slot probing linearly (wrapping)
from its home; keys and scores live in flat int64 tensors, values in a separate store (``storage``).
Erasing leaves a tombstone (``RECLAIM_KEY``) so probe chains stay intact. A full bucket evicts its
lowest-scoring keys; a new key scoring below every key of its full bucket is refused and reported.

Every batched method is vectorised: probing advances all keys of a batch one slot per round, and
conflicts inside a batch are resolved deterministically (two new keys claiming one free slot: the
later in the batch wins the slot, the other probes on; duplicate keys: the last occurrence's value
is stored, as if the batch were applied in order; LFU increments of duplicates add up).

Rows may be stored row-wise quantized (``dtype="int8"`` or ``"int4"``: FBGEMM's fused layouts, ``hkv.rowwise``):
values go in and come out as fp32 (``dtype`` is then float32), inserts and assigns quantize the rows they store,
reads dequantize them (the CPU kernel while it copies the row out), and growth, tiers, eviction and checkpoints
move the packed bytes as they are. ``qdtype`` names the format (None: rows stored as ``dtype``).
"""
from __future__ import annotations

import copy
import enum
import functools
import threading
from typing import Callable

import torch

from hkv import cpu, kernels
from hkv.rowwise import check_qdtype, dequantize_rows, quantize_rows, stored_row
from hkv.storage import DenseValues, StorageError, TierLimits, allocate, make_values

# HierarchicalKV's reserved keys (as uint64: 0xFFFFFFFFFFFFFFFF, ...FE, ...FD): never stored.
EMPTY_KEY = -1
RECLAIM_KEY = -2
LOCKED_KEY = -3
RESERVED_KEYS = (EMPTY_KEY, RECLAIM_KEY, LOCKED_KEY)

# Linear-probe rounds a lookup takes before scanning the rest of the bucket at once.
PROBE_ROUNDS = 4
# Keys per chunk when scanning whole buckets ([chunk, bucket_size] comparisons at a time).
SCAN_CHUNK = 1 << 16
LOW32 = 0xFFFFFFFF
INT64_MIN = torch.iinfo(torch.int64).min
# What one layout of the table is: swapped whole when the table grows or is restored.
LAYOUT = ("_capacity", "_num_buckets", "_keys", "_scores", "_values", "_size", "_scratch", "_fresh")


class EvictStrategy(enum.Enum):
    """HierarchicalKV's eviction strategies: how a key's score is set; the lowest score is evicted first."""

    LRU = "lru"  # score = the table clock at the last insert/update
    LFU = "lfu"  # score += the given increment (default 1) at each insert/update
    EPOCH_LRU = "epoch_lru"  # high 32 bits: global epoch, low 32 bits: the clock
    EPOCH_LFU = "epoch_lfu"  # high 32 bits: global epoch, low 32 bits: frequency (saturating)
    CUSTOMIZED = "customized"  # score = the caller's score


SCORES_ARE_INCREMENTS = (EvictStrategy.LFU, EvictStrategy.EPOCH_LFU)
CLOCK_STRATEGIES = (EvictStrategy.LRU, EvictStrategy.EPOCH_LRU)
# How the CPU kernel's one-pass upsert sets scores (csrc/probe.h SCORE_*): the clock, +=, epoch | freq, as given.
KERNEL_SCORING = {EvictStrategy.LRU: 0, EvictStrategy.EPOCH_LRU: 0, EvictStrategy.LFU: 1, EvictStrategy.EPOCH_LFU: 2,
                  EvictStrategy.CUSTOMIZED: 3}


def mix64(keys: torch.Tensor) -> torch.Tensor:
    """A 64-bit finaliser (MurmurHash3 fmix64) on int64 tensors; shifts are logical."""
    k = keys ^ ((keys >> 33) & 0x7FFFFFFF)
    k = k * -49064778989728563  # 0xff51afd7ed558ccd
    k = k ^ ((k >> 33) & 0x7FFFFFFF)
    k = k * -4265267296055464877  # 0xc4ceb9fe1a85ec53
    return k ^ ((k >> 33) & 0x7FFFFFFF)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _locked(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


class HashTable:
    """A key -> (value row, score) hash table with HierarchicalKV's API and eviction semantics."""

    _staging = False  # True on the copy ``_relayout`` fills beside the table

    def __init__(
        self,
        dim: int,
        init_capacity: int,
        max_capacity: int,
        max_load_factor: float = 0.5,
        bucket_size: int = 128,
        evict_strategy: EvictStrategy = EvictStrategy.LRU,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str | None = None,
        device_memory_bytes: int | None = None,
        host_memory_bytes: int | None = None,
        disk_path: str | None = None,
        admission=None,
        name: str = "hkv.HashTable",
        kernel: str | None = None,
    ):
        if dim < 0:
            raise ValueError(f"{name}: dim must be >= 0, got {dim}")
        if not 0 < max_load_factor <= 1:
            raise ValueError(f"{name}: max_load_factor must be in (0, 1], got {max_load_factor}")
        if bucket_size < 1 or bucket_size & (bucket_size - 1):
            raise ValueError(f"{name}: bucket_size must be a power of two, got {bucket_size}")
        if init_capacity < 1 or max_capacity < init_capacity:
            raise ValueError(f"{name}: need 1 <= init_capacity <= max_capacity, got {init_capacity}, {max_capacity}")
        self.name = name
        self.dim = dim
        # "int8" / "int4": rows stored quantized, read and written as fp32
        self.qdtype = check_qdtype(dtype, dim, name) if isinstance(dtype, str) else None
        self.dtype = torch.float32 if self.qdtype else dtype
        self._row_format = cpu.ROW_FORMATS[self.qdtype]
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.evict_strategy = EvictStrategy(evict_strategy)
        self.max_load_factor = float(max_load_factor)
        self.bucket_size = min(bucket_size, _pow2_at_least(init_capacity))
        self.max_capacity = self._round_capacity(max_capacity)
        self.tier_limits = TierLimits(device_memory_bytes, host_memory_bytes, disk_path)
        self.admission = admission
        self.global_epoch = 0
        self._clock = 0
        # The kernel that probes the table (hkv.kernels): the CPU kernel where it runs, else vectorised torch.
        self.kernel = kernels.check_kernel(kernel or kernels.default_kernel(self.device), self.device)
        self._lock = threading.RLock()
        self._allocate(self._round_capacity(init_capacity))

    # ---------------------------------------------------------------- layout
    def _round_capacity(self, capacity: int) -> int:
        return self.bucket_size * _pow2_at_least(-(-int(capacity) // self.bucket_size))

    def _allocate(self, capacity: int) -> None:
        """A fresh empty layout of ``capacity`` slots. A staging copy (``_staging``, see ``_relayout``) puts its disk
        tier beside the table's file, so the table's own storage is untouched until the copy is adopted."""
        self._capacity = capacity
        self._num_buckets = capacity // self.bucket_size
        self._keys, self._scores, self._scratch = allocate("device", capacity, 3 * 8, lambda: (
            torch.full((capacity,), EMPTY_KEY, dtype=torch.int64, device=self.device),
            torch.zeros(capacity, dtype=torch.int64, device=self.device),
            # Per-slot scratch, -1 between uses: resolving conflicts touches only the slots of a batch.
            torch.full((capacity,), -1, dtype=torch.int64, device=self.device)))
        self._fresh = (allocate("host", capacity, 1, lambda: torch.zeros(capacity, dtype=torch.uint8))
                       if self.device.type == "cpu" else None)  # for cpu.upsert
        width, dtype = stored_row(self.dim, self.qdtype or self.dtype)
        self._values = make_values(capacity, width, dtype, self.device, self.tier_limits, self._staging)
        self._size = 0

    def _last_per_slot(self, slots: torch.Tensor, batch_pos: torch.Tensor) -> torch.Tensor:
        """For each entry, the largest batch position among the entries sharing its slot."""
        self._scratch.scatter_reduce_(0, slots, batch_pos, "amax")
        last = self._scratch[slots]
        self._scratch[slots] = -1
        return last

    def _home(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First slot of each key's bucket, and its home position in the bucket."""
        h = mix64(keys)
        base = (h & (self._num_buckets - 1)) * self.bucket_size
        return base, (h >> 40) & (self.bucket_size - 1)

    def _occupied(self) -> torch.Tensor:
        return (self._keys != EMPTY_KEY) & (self._keys != RECLAIM_KEY)

    # ---------------------------------------------------------------- stored rows
    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        """Rows as stored: packed (quantized tables), else as they are."""
        return quantize_rows(values, self.qdtype, self.name) if self.qdtype else values

    def _decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as values: dequantized to fp32 (quantized tables), else as they are."""
        return dequantize_rows(rows, self.qdtype) if self.qdtype else rows

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        return self._decode(self._values.gather(slots))

    def _store(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        self._values.scatter(slots, self._encode(values))

    def _add_rows(self, slots: torch.Tensor, deltas: torch.Tensor) -> None:
        """values[slot] += delta (duplicate slots add up); quantized rows are requantized once per slot."""
        if not self.qdtype:
            self._values.add(slots, deltas)
            return
        unique, inverse = torch.unique(slots, return_inverse=True)
        summed = torch.zeros(unique.numel(), self.dim, device=self.device).index_add_(0, inverse, deltas.float())
        self._store(unique, self._read(unique) + summed)

    # ---------------------------------------------------------------- checks
    def _check_keys(self, keys: torch.Tensor, what: str = "keys") -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.dim() != 1:
            raise ValueError(f"{self.name}: {what} must be a 1-D tensor, got {getattr(keys, 'shape', type(keys))}")
        if keys.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{self.name}: {what} must be int64 (or int32), got {keys.dtype}")
        keys = keys.to(self.device, torch.int64)
        reserved = (keys < 0) & (keys >= LOCKED_KEY)
        if bool(reserved.any()):
            bad = keys[reserved][:4].tolist()
            raise ValueError(
                f"{self.name}: {what} contain reserved key(s) {bad}: -1, -2, -3 (0xFFFFFFFFFFFFFFFF, ...FE, ...FD) "
                f"mark empty, erased and locked slots and cannot be stored"
            )
        return keys

    def _check_values(self, values: torch.Tensor, n: int, what: str = "values") -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (n, self.dim):
            raise ValueError(
                f"{self.name}: {what} must have shape ({n}, {self.dim}), got {tuple(getattr(values, 'shape', ()))}"
            )
        return values.to(self.device, self.dtype)

    def _check_scores(self, scores: torch.Tensor | None, n: int) -> torch.Tensor:
        """Per-key score input: the increment (LFU), the score (CUSTOMIZED); the clock strategies take none."""
        strategy = self.evict_strategy
        if scores is None:
            if strategy is EvictStrategy.CUSTOMIZED:
                raise ValueError(f"{self.name}: evict_strategy CUSTOMIZED needs scores for every key")
            return torch.ones(n, dtype=torch.int64, device=self.device)
        if strategy in CLOCK_STRATEGIES:
            raise ValueError(f"{self.name}: evict_strategy {strategy.name} sets scores itself; pass scores=None")
        if scores.shape != (n,):
            raise ValueError(f"{self.name}: scores must have shape ({n},), got {tuple(scores.shape)}")
        return scores.to(self.device, torch.int64)

    # ---------------------------------------------------------------- scores
    def _clock_score(self) -> int:
        if self.evict_strategy is EvictStrategy.EPOCH_LRU:
            return (self.global_epoch << 32) | (self._clock & LOW32)
        return self._clock

    def _new_scores(self, old: torch.Tensor | None, given: torch.Tensor) -> torch.Tensor:
        """Scores after an insert (``old`` None) or update, by strategy; ``given`` is aggregated per key."""
        strategy = self.evict_strategy
        if strategy in CLOCK_STRATEGIES:
            return torch.full_like(given, self._clock_score())
        if strategy is EvictStrategy.LFU:
            return given if old is None else old + given
        if strategy is EvictStrategy.EPOCH_LFU:
            freq = given if old is None else (old & LOW32) + given
            return (self.global_epoch << 32) | freq.clamp(max=LOW32)
        return given

    def _aggregate(self, given: torch.Tensor, members: torch.Tensor, group: torch.Tensor, last: torch.Tensor):
        """One score input per group of duplicate keys (batch positions ``members``, group ids ``group``):
        summed increments (LFU) or the last occurrence's (batch position ``last`` of each group)."""
        if self.evict_strategy in SCORES_ARE_INCREMENTS:
            return torch.zeros(last.numel(), dtype=torch.int64, device=self.device).index_add_(0, group, given[members])
        return given[last]

    # ---------------------------------------------------------------- probing
    def _locate(self, keys: torch.Tensor) -> torch.Tensor:
        """The slot holding each key, -1 where absent."""
        return kernels.LOCATE[self.kernel](self, keys)

    def _probe(self, keys: torch.Tensor) -> torch.Tensor:
        """``_locate`` in vectorised torch: all keys advance one slot per round, then whole-bucket scans."""
        B = self.bucket_size
        base, pos = self._home(keys)
        s = base + pos
        k = self._keys[s]
        slot = torch.where(k == keys, s, -1)
        idx = ((k != keys) & (k != EMPTY_KEY)).nonzero().squeeze(1)
        keys, base, pos = keys[idx], base[idx], pos[idx]
        for r in range(1, min(PROBE_ROUNDS, B)):
            if not idx.numel():
                return slot
            s = base + ((pos + r) & (B - 1))
            k = self._keys[s]
            hit = k == keys
            slot[idx[hit]] = s[hit]
            more = (~hit & (k != EMPTY_KEY)).nonzero().squeeze(1)
            idx, keys, base, pos = idx[more], keys[more], base[more], pos[more]
        if idx.numel() and B > PROBE_ROUNDS:  # long chains: compare against the whole bucket at once
            buckets = self._keys.view(self._num_buckets, B)
            for c in range(0, idx.numel(), SCAN_CHUNK):
                part = slice(c, c + SCAN_CHUNK)
                eq = buckets[base[part] // B] == keys[part, None]
                hit = eq.any(1)
                col = eq.to(torch.int8).argmax(1)
                slot[idx[part][hit]] = (base[part] + col)[hit]
        return slot

    def _claim(self, keys: torch.Tensor, scores: torch.Tensor):
        """Store new unique ``keys`` with ``scores``; returns (slot per key or -1, evicted, refused).

        Keys take the first free slot of their probe (``kernels.CLAIM``); keys whose bucket is full go
        to ``_evict``. ``evicted`` is (keys, values, scores) of replaced entries; ``refused`` indexes ``keys``.
        """
        slot = kernels.CLAIM[self.kernel](self, keys, scores)
        self._size += int((slot >= 0).sum())
        return slot, *self._evict(keys, scores, (slot < 0).nonzero().squeeze(1), slot)

    def _claim_rounds(self, keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``_claim``'s placement in vectorised torch: each round every unplaced key looks at the next
        slot of its chain; a free slot wanted by several goes to the latest in the batch, the others
        probe on; keys whose bucket has no free slot left stop (slot -1)."""
        B, m = self.bucket_size, keys.numel()
        base, pos = self._home(keys)
        bucket = base // B
        free_count = (~self._occupied()).view(self._num_buckets, B).sum(1)
        slot = torch.full((m,), -1, dtype=torch.int64, device=self.device)
        idx = torch.arange(m, device=self.device)
        for r in range(B):
            idx = idx[free_count[bucket[idx]] > 0]
            if not idx.numel():
                break
            s = base[idx] + ((pos[idx] + r) & (B - 1))
            k = self._keys[s]
            cand = ((k == EMPTY_KEY) | (k == RECLAIM_KEY)).nonzero().squeeze(1)
            if cand.numel():
                cs, ci = s[cand], idx[cand]
                won = self._last_per_slot(cs, ci) == ci
                ws, wi = cs[won], ci[won]
                self._keys[ws] = keys[wi]
                self._scores[ws] = scores[wi]
                slot[wi] = ws
                free_count.index_add_(0, ws // B, torch.full_like(ws, -1))
                placed = torch.zeros(idx.numel(), dtype=torch.bool, device=self.device)
                placed[cand[won]] = True
                idx = idx[~placed]
        return slot

    def _evict(self, keys, scores, idx, slot):
        """Place keys ``idx`` (all in full buckets) over the lowest-scoring entries, HierarchicalKV-style.

        Equivalent to inserting the candidates of a bucket in descending score order, each replacing
        the bucket's minimum if its score is not lower: candidate ``r`` (rank in its bucket) meets
        the ``r``-th lowest original entry, since earlier candidates score at least as high.
        """
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if not idx.numel():
            return (empty, torch.empty(0, self.dim, dtype=self.dtype, device=self.device), empty), empty
        B = self.bucket_size
        bucket = self._home(keys)[0] // B
        by_score = idx[torch.argsort(scores[idx], descending=True, stable=True)]
        order = by_score[torch.argsort(bucket[by_score], stable=True)]
        ub, row, counts = torch.unique_consecutive(bucket[order], return_inverse=True, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(order.numel(), device=self.device) - starts[row]
        bucket_scores, slot_order = self._scores.view(self._num_buckets, B)[ub].sort(dim=1, stable=True)
        r = rank.clamp(max=B - 1)
        accept = (rank < B) & (scores[order] >= bucket_scores[row, r])
        won, target = order[accept], ub[row[accept]] * B + slot_order[row[accept], r[accept]]
        # An entry this same batch placed earlier has no value stored yet: it counts as refused.
        placed = (slot >= 0).nonzero().squeeze(1)
        displaced = placed[torch.isin(slot[placed], target)]
        old = target[~torch.isin(target, slot[displaced])]
        evicted = (self._keys[old], self._read(old), self._scores[old])
        slot[displaced] = -1
        self._keys[target] = keys[won]
        self._scores[target] = scores[won]
        slot[won] = target
        return evicted, torch.cat([order[~accept], displaced])

    # ---------------------------------------------------------------- growth
    def _grow_for(self, new_keys: torch.Tensor) -> bool:
        """Double the capacity (up to max_capacity) until ``new_keys`` fit: under max_load_factor and
        with no bucket overflowing, so that no key is evicted while the table may still grow."""
        return self._grow(self._capacity, lambda capacity: self._fits(capacity, new_keys))

    def _grow(self, capacity: int, fits: Callable[[int], bool]) -> bool:
        """Rehash into the first doubling of ``capacity`` (up to max_capacity) that ``fits``; whether it grew."""
        while capacity < self.max_capacity and not fits(capacity):
            capacity *= 2
        if capacity == self._capacity:
            return False
        lost = self._rehash(capacity)
        if lost:
            raise RuntimeError(f"{self.name}: growing to {capacity} slots lost {lost} keys")
        return True

    def _fits(self, capacity: int, new_keys: torch.Tensor) -> bool:
        if self._size + new_keys.numel() > self.max_load_factor * capacity:
            return False
        num_buckets, B = capacity // self.bucket_size, self.bucket_size
        buckets, incoming = torch.unique(mix64(new_keys) & (num_buckets - 1), return_counts=True)
        if capacity == self._capacity and buckets.numel() * B < capacity:  # only the buckets the keys go to
            rows = self._keys.view(num_buckets, B)[buckets]
            present = ((rows != EMPTY_KEY) & (rows != RECLAIM_KEY)).sum(1)
        else:
            held = self._keys[self._occupied()]
            present = torch.bincount(mix64(held) & (num_buckets - 1), minlength=num_buckets)[buckets]
        return not buckets.numel() or int((present + incoming).max()) <= B

    def _rehash(self, capacity: int) -> int:
        """Move every entry into a fresh layout of ``capacity`` slots; returns how many did not fit."""
        occupied = self._occupied().nonzero().squeeze(1)
        return self._relayout(capacity, self._keys[occupied], self._values.gather(occupied), self._scores[occupied])

    def _relayout(self, capacity: int, keys, values, scores, accept: Callable[[int], None] = lambda lost: None) -> int:
        """Replace the entries by ``keys, values, scores`` (``values``: rows as stored) in a new layout of
        ``capacity`` slots (growing as they need); returns how many did not fit, after ``accept(lost)`` (which may
        refuse by raising).

        The layout is built on a staging copy beside the table and swapped in only when complete: on any
        failure the table stays exactly as it was, and a StorageError names the tier and path that failed.
        """
        staging = copy.copy(self)
        staging._staging = True
        try:
            staging._allocate(capacity)
            lost = staging._restore_entries(keys, values, scores)
            staging._values.migrate(staging._scores, staging._occupied())
        except Exception as exc:
            self._fail(staging, capacity, exc)
        try:
            accept(lost)
        except BaseException:
            self._drop(staging)
            raise
        if not self._staging:  # the outermost layout moves its staged disk file into place
            try:
                staging._values.adopt()
            except Exception as exc:
                self._fail(staging, capacity, exc)
        old = self._values
        for name in LAYOUT:
            setattr(self, name, getattr(staging, name))
        old.discard()
        return lost

    def _drop(self, staging: "HashTable") -> None:
        if staging._values is not self._values:
            staging._values.discard()

    def _fail(self, staging: "HashTable", capacity: int, exc: Exception):
        """Raise the error of a failed ``_relayout`` once the staging copy's storage is released."""
        self._drop(staging)
        if isinstance(exc, StorageError) and str(exc).startswith(self.name):
            raise exc  # a nested growth of the staging copy said it already
        raise StorageError(f"{self.name}: building a layout of {capacity} slots (now {self._capacity}) failed, "
                           f"the table is unchanged: {exc}") from exc

    def _restore_entries(self, keys, values, scores) -> int:
        """Store unique entries with their scores as they are; returns how many full buckets refused."""
        self._grow_for(keys)
        slot, _, refused = self._claim(keys, scores)
        placed = slot >= 0
        self._values.scatter(slot[placed], values[placed])
        return refused.numel()

    # ---------------------------------------------------------------- upsert core
    def _upsert(self, keys, values, scores, insert: bool, admit: bool = False, grouping: int = 0):
        """Assign existing keys and insert missing ones (``insert``).

        ``values``: an (n, dim) tensor written for every stored key (the last occurrence of a duplicate
        wins), or a function ``rows(positions) -> (len(positions), dim)`` giving only new keys' values
        (then the stored rows of all keys are returned as ``out``), or None (scores only).
        ``grouping``: the keys are grouped by bucket for a table of that many buckets (0: not grouped).
        Returns (slot per key or -1, new-key positions, evicted (keys, values, scores), refused keys, out or None).
        """
        self._clock += 1
        given = self._check_scores(scores, keys.numel())
        if self._runs_native(admit):
            return self._upsert_native(keys, values, given, insert, grouping == self._num_buckets)
        result = self._upsert_rounds(keys, values, given, insert, admit)
        self._values.promote(result[0], self._score_or_lowest)
        return *result, None

    def _score_or_lowest(self, slots: torch.Tensor) -> torch.Tensor:
        """Scores of ``slots``, the lowest int64 for free slots."""
        keys = self._keys[slots]
        return torch.where((keys == EMPTY_KEY) | (keys == RECLAIM_KEY), INT64_MIN, self._scores[slots])

    def _runs_native(self, admit: bool) -> bool:
        """Whether the CPU kernel's one-pass upsert applies: dense values and no admission. It only fills
        free slots; keys of full buckets then take the general path (which grows or evicts), and the
        table grows afterwards if the load factor went above its maximum."""
        return (self.kernel == "cpu" and isinstance(self._values, DenseValues)
                and not (admit and self.admission is not None))

    def _upsert_native(self, keys, values, given, insert: bool, grouped: bool):
        """``_upsert`` by ``cpu.upsert`` (probe, claim, score and value in one pass); keys of full buckets
        are then placed by ``_upsert_rounds`` (growth or eviction)."""
        new_rows = self._encode(values) if isinstance(values, torch.Tensor) else None
        copy_out = callable(values)
        slot, status, counts, out = cpu.upsert(
            self._keys, self._scores, self._num_buckets, self.bucket_size, self._values.data, keys, new_rows, given,
            KERNEL_SCORING[self.evict_strategy], insert, self._clock_score(), self.global_epoch, copy_out, grouped,
            self._fresh, self._row_format, self.dim)
        self._size += counts[cpu.INSERTED]
        missing = (status == cpu.INSERTED).nonzero().squeeze(1) if counts[cpu.INSERTED] else keys[:0]
        if copy_out and counts[cpu.INSERTED]:  # new keys: the last occurrence's initial value, read by every one
            pending = ((status == cpu.INSERTED) | (status == cpu.FOUND_NEW)).nonzero().squeeze(1)
            ps = slot[pending]
            winners = pending[self._last_per_slot(ps, pending) == pending]
            self._store(slot[winners], values(winners))
            out[pending] = self._read(ps)
        evicted, refused = self._no_rows(), keys[:0]
        capacity = self._capacity
        if counts[cpu.FULL]:
            full = (status == cpu.FULL).nonzero().squeeze(1)
            rows = values[full] if new_rows is not None else (lambda pos: values(full[pos])) if copy_out else None
            full_slot, full_new, evicted, refused = self._upsert_rounds(keys[full], rows, given[full], insert, False)
            slot[full] = full_slot
            missing = torch.sort(torch.cat([missing, full[full_new]]))[0]
            if copy_out:
                out[full] = self._gather(full_slot, full_slot >= 0)
        self._grow(self._capacity, lambda c: self._size <= self.max_load_factor * c)
        if self._capacity != capacity:  # grown: every slot moved
            slot = self._locate(keys)
        return slot, missing, evicted, refused, out

    def _upsert_rounds(self, keys, values, given, insert: bool, admit: bool):
        """``_upsert`` in vectorised torch over the table's probe kernel (any device)."""
        n = keys.numel()
        slot = self._locate(keys)
        missing = (slot < 0).nonzero().squeeze(1)
        evicted, refused = self._no_rows(), keys[:0]
        if not missing.numel() and not isinstance(values, torch.Tensor) and self.evict_strategy in CLOCK_STRATEGIES:
            self._scores[slot] = self._clock_score()  # all present, no values to write: only touch the clock
            return slot, missing, evicted, refused
        if insert and missing.numel():
            uniq, inv = torch.unique(keys[missing], return_inverse=True)
            if admit and self.admission is not None:
                admitted = self.admission.admit(uniq)
                keep = admitted[inv]
                missing, uniq = missing[keep], uniq[admitted]
                inv = (torch.cumsum(admitted, 0) - 1)[inv[keep]]
            last = torch.full((uniq.numel(),), -1, dtype=torch.int64, device=self.device)
            last.scatter_reduce_(0, inv, missing, "amax")
            if self._grow_for(uniq):
                slot = self._locate(keys)
            new_scores = self._new_scores(None, self._aggregate(given, missing, inv, last))
            uslot, evicted, refused_idx = self._claim(uniq, new_scores)
            slot[missing] = uslot[inv]
            refused = uniq[refused_idx]
            if refused.numel():
                refused_values = values[last[refused_idx]] if isinstance(values, torch.Tensor) else None
                evicted = self._with_refused(evicted, refused, refused_values, new_scores[refused_idx])
            is_new = torch.zeros(n, dtype=torch.bool, device=self.device)
            is_new[missing] = True
        else:
            missing = missing[:0]
            is_new = torch.zeros(n, dtype=torch.bool, device=self.device)
        self._write(values, given, slot, is_new, missing)
        return slot, missing, evicted, refused

    def _no_rows(self):
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return empty, torch.empty(0, self.dim, dtype=self.dtype, device=self.device), empty

    def _with_refused(self, evicted, keys, values, scores):
        if values is None:
            values = torch.zeros(keys.numel(), self.dim, dtype=self.dtype, device=self.device)
        return tuple(torch.cat([a, b]) for a, b in zip(evicted, (keys, values, scores)))

    def _write(self, values, given, slot, is_new, missing) -> None:
        """Values of stored keys (last occurrence wins) and updated scores of keys that existed."""
        stored = slot >= 0
        everything = bool(stored.all())  # the common case: no index subsets to build
        valid = torch.arange(slot.numel(), device=self.device) if everything else stored.nonzero().squeeze(1)
        vs = slot if everything else slot[valid]
        last = self._last_per_slot(vs, valid)
        distinct = bool((last == valid).all())
        winners = valid if distinct else valid[last == valid]
        win_slots = vs if distinct else slot[winners]
        if isinstance(values, torch.Tensor):
            self._store(win_slots, values if everything and distinct else values[winners])
        elif missing.numel():
            new_winners = winners[is_new[winners]]
            if new_winners.numel():
                self._store(slot[new_winners], values(new_winners))
        old = winners if not missing.numel() else winners[~is_new[winners]]
        if old.numel():
            os_ = win_slots if not missing.numel() else slot[old]
            if self.evict_strategy in SCORES_ARE_INCREMENTS:  # duplicates' increments add up
                was = ~is_new[valid]
                total = torch.zeros(slot.numel(), dtype=torch.int64, device=self.device)
                agg = total.index_add_(0, last[was], given[valid[was]])[old]
            else:
                agg = given[old]
            self._scores[os_] = self._new_scores(self._scores[os_], agg)

    # ---------------------------------------------------------------- the HierarchicalKV API
    @_locked
    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None):
        """Insert or overwrite ``keys``; returns the keys refused by full buckets (empty when all stored)."""
        keys = self._check_keys(keys)
        values = self._check_values(values, keys.numel())
        return self._upsert(keys, values, scores, insert=True)[3]

    @_locked
    def insert_and_evict(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None):
        """Insert or overwrite; returns (keys, values, scores) evicted, including new keys that were refused."""
        keys = self._check_keys(keys)
        values = self._check_values(values, keys.numel())
        return self._upsert(keys, values, scores, insert=True)[2]

    @_locked
    def find(self, keys: torch.Tensor, return_scores: bool = False):
        """(values, found) for ``keys``; rows of missing keys are zero. Scores are not updated."""
        keys = self._check_keys(keys)
        if return_scores:
            slot = self._locate(keys)
            found = slot >= 0
            return self._gather(slot, found), found, torch.where(found, self._scores[slot.clamp(min=0)], 0)
        return kernels.FIND[self.kernel](self, keys)

    def _gather(self, slot: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        values = self._read(slot.clamp(min=0))
        missing = (~found).nonzero().squeeze(1)
        if missing.numel():
            values[missing] = 0
        return values

    @_locked
    def find_or_insert(self, keys: torch.Tensor, init=None, scores: torch.Tensor | None = None,
                       grouping: int = 0) -> torch.Tensor:
        """Values of ``keys``, inserting missing ones with ``init``.

        ``init``: None (zeros), a number, a (dim,) or (n, dim) tensor, or ``fn(rows, dim, dtype, device)``.
        ``grouping``: ``num_buckets()`` when the keys come grouped by bucket (``hkv.cpu.unique``), so the
        CPU kernel splits them over threads without scanning; a table grown since then ignores it.
        With admission, a key not yet admitted is not stored and gets its ``init`` value.
        """
        keys = self._check_keys(keys)
        rows = self._init_rows(init, keys.numel())
        slot, _, _, _, values = self._upsert(keys, rows, scores, insert=True, admit=True, grouping=grouping)
        found = slot >= 0
        if values is None:
            values = self._gather(slot, found)
        unstored = (~found).nonzero().squeeze(1)
        if unstored.numel():
            values[unstored] = rows(unstored)
        return values

    def _init_rows(self, init, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """``rows(positions)``: the initial values of the keys at ``positions`` of the batch."""
        shape = (self.dim,)
        if callable(init):
            return lambda pos: init(pos.numel(), self.dim, self.dtype, self.device)
        if init is None or isinstance(init, (int, float)):
            fill = 0.0 if init is None else float(init)
            return lambda pos: torch.full((pos.numel(), self.dim), fill, dtype=self.dtype, device=self.device)
        init = init.to(self.device, self.dtype)
        if tuple(init.shape) == shape:
            return lambda pos: init.expand(pos.numel(), self.dim)
        self._check_values(init, n, "init")
        return lambda pos: init[pos]

    @_locked
    def assign(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrite values (and scores) of keys present; absent keys are ignored. Returns the found mask."""
        keys = self._check_keys(keys)
        values = self._check_values(values, keys.numel())
        return self._upsert(keys, values, scores, insert=False)[0] >= 0

    @_locked
    def assign_scores(self, keys: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Update the scores of keys present (by strategy); returns the found mask."""
        keys = self._check_keys(keys)
        return self._upsert(keys, None, scores, insert=False)[0] >= 0

    @_locked
    def accum_or_assign(self, keys: torch.Tensor, values_or_deltas: torch.Tensor, accum_flags: torch.Tensor,
                        scores: torch.Tensor | None = None) -> torch.Tensor:
        """Add deltas to present keys whose flag is set; insert or assign keys whose flag is clear, as if the
        batch were applied in order: a delta after an assign of its key adds to the assigned value, one before
        it is overwritten, and a delta on a key absent at its turn (not present before the batch, no assign
        of it earlier in the batch) is ignored.

        As HierarchicalKV: a set flag on an absent key is ignored; a clear flag on a present key assigns.
        Returns the mask of keys applied (False: flag set and key absent at its turn, or refused by a full
        bucket). A key evicted by this batch's own inserts counts as absent for all of its deltas.
        """
        keys = self._check_keys(keys)
        values = self._check_values(values_or_deltas, keys.numel(), "values_or_deltas")
        flags = accum_flags.to(self.device, torch.bool)
        if flags.shape != keys.shape:
            raise ValueError(f"{self.name}: accum_flags must have shape {tuple(keys.shape)}, got {tuple(flags.shape)}")
        n = keys.numel()
        applied = torch.zeros(n, dtype=torch.bool, device=self.device)
        acc, assign = flags.nonzero().squeeze(1), (~flags).nonzero().squeeze(1)
        present_before = self._locate(keys[acc]) >= 0 if acc.numel() else None
        if assign.numel():
            given = None if scores is None else scores[assign]
            applied[assign] = self._upsert(keys[assign], values[assign], given, insert=True)[0] >= 0
        if acc.numel():
            _, group = torch.unique(keys, return_inverse=True)
            first_assign = torch.full((n,), n, dtype=torch.int64, device=self.device)
            first_assign.scatter_reduce_(0, group[assign], assign, "amin")
            last_assign = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            last_assign.scatter_reduce_(0, group[assign], assign, "amax")
            slot = self._locate(keys[acc])
            stored = slot >= 0
            applied[acc] = stored & (present_before | (first_assign[group[acc]] < acc))
            adds = stored & (acc > last_assign[group[acc]])  # deltas after the last assign of their key
            self._add_rows(slot[adds], values[acc[adds]])
        return applied

    @_locked
    def update_rows(self, keys: torch.Tensor, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Replace the value rows of present (unique) ``keys`` by ``fn(rows, positions)`` in one probe
        (``positions`` None: all keys are present); scores are left as they are (an hkv extension: the
        fused optimizer step). Returns the found mask."""
        slot = self._locate(self._check_keys(keys))
        found = slot >= 0
        if bool(found.all()):  # the common case: no subset to build
            self._store(slot, fn(self._read(slot), None))
            return found
        hit = found.nonzero().squeeze(1)
        s = slot[hit]
        self._store(s, fn(self._read(s), hit))
        return found

    @_locked
    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        return self._locate(self._check_keys(keys)) >= 0

    @_locked
    def erase(self, keys: torch.Tensor) -> int:
        """Remove ``keys`` (absent ones are ignored); returns how many were removed."""
        slot = self._locate(self._check_keys(keys))
        slot = torch.unique(slot[slot >= 0])
        self._erase_slots(slot)
        return slot.numel()

    def _erase_slots(self, slot: torch.Tensor) -> None:
        self._keys[slot] = RECLAIM_KEY
        self._scores[slot] = 0
        self._size -= slot.numel()

    @_locked
    def erase_if(self, predicate_or_score_threshold) -> int:
        """Remove entries with score < threshold, or where ``predicate(keys, scores)`` is True; returns the count."""
        occupied = self._occupied().nonzero().squeeze(1)
        mask = self._select(predicate_or_score_threshold, occupied, below=True)
        self._erase_slots(occupied[mask])
        return int(mask.sum())

    def _select(self, predicate_or_threshold, slots: torch.Tensor, below: bool) -> torch.Tensor:
        keys, scores = self._keys[slots], self._scores[slots]
        if callable(predicate_or_threshold):
            return predicate_or_threshold(keys, scores).to(torch.bool)
        threshold = int(predicate_or_threshold)
        return scores < threshold if below else scores >= threshold

    @_locked
    def clear(self) -> None:
        self._keys.fill_(EMPTY_KEY)
        self._scores.zero_()
        self._size = 0

    @_locked
    def export_batch(self, n: int, offset: int = 0, stored: bool = False):
        """(keys, values, scores) of the entries in slots ``[offset, offset + n)``; ``stored``: the rows as stored
        (a quantized table's packed uint8 rows) instead of their values."""
        slots = torch.arange(offset, min(offset + n, self._capacity), device=self.device)
        return self._export(slots[self._occupied()[slots]], stored)

    @_locked
    def export_batch_if(self, predicate_or_score_threshold, n: int | None = None, offset: int = 0,
                        stored: bool = False):
        """Entries in slots ``[offset, offset + n)`` with score >= threshold (or where ``predicate`` holds)."""
        end = self._capacity if n is None else min(offset + n, self._capacity)
        slots = torch.arange(offset, end, device=self.device)
        slots = slots[self._occupied()[slots]]
        return self._export(slots[self._select(predicate_or_score_threshold, slots, below=False)], stored)

    def _export(self, slots: torch.Tensor, stored: bool):
        rows = self._values.gather(slots)
        return self._keys[slots], rows if stored else self._decode(rows), self._scores[slots]

    @_locked
    def quantized(self, qdtype: str, dim: int | None = None, disk_path: str | None = None) -> "HashTable":
        """A new table holding this one's entries (keys, scores, clock, settings) with their first ``dim`` columns
        (default all; fewer drop an optimizer's state) stored row-wise quantized as ``qdtype``. Its tiers keep
        this table's memory limits; a disk tier needs its own ``disk_path``."""
        dim = self.dim if dim is None else dim
        limits = self.tier_limits
        new = HashTable(dim, self._capacity, self.max_capacity, self.max_load_factor, self.bucket_size,
                        self.evict_strategy, qdtype, self.device, limits.device_memory_bytes,
                        limits.host_memory_bytes, disk_path, copy.deepcopy(self.admission), self.name, self.kernel)
        occupied = self._occupied().nonzero().squeeze(1)
        rows = new._encode(self._read(occupied)[:, :dim])
        new._relayout(self._capacity, self._keys[occupied], rows, self._scores[occupied])
        new.global_epoch, new._clock = self.global_epoch, self._clock
        return new

    def size(self) -> int:
        return self._size

    def num_buckets(self) -> int:
        return self._num_buckets

    def capacity(self) -> int:
        return self._capacity

    def load_factor(self) -> float:
        return self._size / self._capacity

    @_locked
    def reserve(self, capacity: int) -> None:
        """Rehash into at least ``capacity`` slots (never fewer than now, never above max_capacity)."""
        capacity = min(self._round_capacity(capacity), self.max_capacity)
        if capacity > self._capacity:
            self._rehash(capacity)

    @_locked
    def set_global_epoch(self, epoch: int) -> None:
        if not 0 <= epoch <= 0x7FFFFFFF:
            raise ValueError(f"{self.name}: global epoch must be in [0, 2**31), got {epoch}")
        self.global_epoch = int(epoch)

    @_locked
    def migrate(self) -> None:
        """Move the highest-scoring rows to the fastest storage tier."""
        self._values.migrate(self._scores, self._occupied())

    def tier_rows(self) -> dict[str, int]:
        return self._values.tier_rows()

    def save(self, path: str) -> None:
        from hkv.checkpoint import save

        with self._lock:
            save(self, path)

    @classmethod
    def load(cls, path: str, **overrides) -> "HashTable":
        """A new table from a checkpoint; ``overrides`` (init_capacity, device, ...) replace saved settings.

        Raises CheckpointError for a corrupt or crafted file, and when entries would be dropped
        (``allow_eviction=True`` keeps the highest-scoring ones that fit) or the eviction strategy differs
        from the saved one (``allow_strategy_change=True``)."""
        from hkv.checkpoint import load

        return load(path, **overrides)

    def __deepcopy__(self, memo) -> "HashTable":
        """An independent copy (new lock, copied tensors); tiered tables refuse (their disk file would be shared)."""
        if self.tier_limits.tiered:
            raise TypeError(f"{self.name}: a table with storage tiers cannot be deep-copied; save() and load() it")
        with self._lock:
            new = copy.copy(self)
            memo[id(self)] = new
            new._lock = threading.RLock()
            for name in ("_keys", "_scores", "_scratch", "_fresh", "_values", "admission"):
                setattr(new, name, copy.deepcopy(getattr(self, name), memo))
            return new

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, size={self._size}, capacity={self._capacity}, "
                f"evict_strategy={self.evict_strategy.name}, dtype={self.qdtype or self.dtype}, device={self.device})")
