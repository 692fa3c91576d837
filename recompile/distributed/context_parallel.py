"""Context-parallel HSTU attention: each user's history split over the ranks of a group, forward and backward.

``ContextParallelLayout(offsets, world_size)`` cuts every sequence into ``2 * world_size`` chunks
(chunk ``i`` is positions ``[i * L // 2W, (i + 1) * L // 2W)``, empty where ``L < 2W``); rank ``r`` keeps chunks
``r`` and ``2W - 1 - r``, an early and a late one, so every rank has about the same share of the causal triangle.
``layout.shard(x, rank)`` takes a rank's rows of a jagged tensor (sequence by sequence: its early chunk, then its
late one).

``context_parallel_hstu_attention(q, k, v, layout, ...)`` equals ``recompile.hstu_attention`` on the whole batch
for this rank's rows. HSTU's attention is pointwise (``silu``, no softmax), so a query's output is the sum of its
parts over key chunks: each rank attends its two query chunks to every rank's key chunks, one chunk pair at a
time, in blocks of at most ``block_size`` positions (scores of at most ``[B, H, block, block]``: memory
linear in the history; causal pairs above the diagonal are skipped), while K/V move
on by one rank (``exchange="ring"``: ``isend``/``irecv``, in forward overlapped with the compute) or all at
once (``exchange="all_gather"``: faster on gloo, but every rank then holds all K/V). Backward recomputes the scores pair by pair; dK/dV accumulators travel the ring
with their K/V and arrive home after one more hop (all_gather: sent home by one ``all_to_all``).

Covered: causal or not, ``alpha``, the relative-position bias, the relative-time bias (key timestamps travel with
K/V), ``num_targets`` and the contextual prefix (all masks are written on global positions). The gradients of
``rel_bias`` and ``time_bias`` are this rank's part: sum them over the group (as for every replicated parameter
of a context-parallel model, e.g. ``all_reduce`` of the gradients or DDP over the group with the loss times W).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recompile.distributed.comm import CollectiveError
from recompile.runtime.jagged import check_offsets
from recompile.runtime.jagged_attention import time_bucket, time_bucket_edges

EXCHANGES = ("ring", "all_gather")
# Positions of a chunk attended at once: scores of at most [B, H, BLOCK_SIZE, BLOCK_SIZE] per chunk pair.
BLOCK_SIZE = 256
KV_TAG, GRAD_TAG = 0, 1  # the ring's two kinds of messages, which may be in flight together


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])``."""
    total = int(lengths.sum())
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first, lengths, output_size=total) + torch.arange(total)


@dataclass
class Chunk:
    """Chunk ``index`` of every sequence on one rank, padded to ``width``: global positions ``pos [B, width]``,
    ``valid [B, width]`` and the rank's local rows ``rows [B, width]`` (0 where not valid)."""

    index: int
    pos: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, *inner]`` (the rank's rows) -> ``[B, width, *inner]``, zero past each chunk's end."""
        valid = self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1)))
        return torch.where(valid, x[self.rows], torch.zeros((), dtype=x.dtype))

    def scatter_add_(self, out: torch.Tensor, part: torch.Tensor) -> None:
        out.index_add_(0, self.rows[self.valid], part[self.valid])


class ContextParallelLayout:
    """Where each sequence's chunks live on a context-parallel group of ``world_size`` ranks (the same on all)."""

    def __init__(self, offsets: torch.Tensor, world_size: int):
        check_offsets("context_parallel_hstu_attention", offsets)
        if world_size < 1:
            raise ValueError(f"recompile.context_parallel: world_size must be >= 1, got {world_size}")
        self.offsets = offsets.long().cpu()
        self.world_size = world_size
        self.lengths = self.offsets[1:] - self.offsets[:-1]
        n = 2 * world_size
        self.bounds = self.lengths.view(-1, 1) * torch.arange(n + 1).view(1, -1) // n  # [B, 2W + 1]
        self.chunk_lengths = self.bounds[:, 1:] - self.bounds[:, :-1]  # [B, 2W]

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.world_size - 1 - rank

    def local_lengths(self, rank: int) -> torch.Tensor:
        early, late = self.chunk_ids(rank)
        return self.chunk_lengths[:, early] + self.chunk_lengths[:, late]

    def local_offsets(self, rank: int) -> torch.Tensor:
        return F.pad(torch.cumsum(self.local_lengths(rank), 0), (1, 0))

    def local_total(self, rank: int) -> int:
        return int(self.local_lengths(rank).sum())

    def global_rows(self, rank: int) -> torch.Tensor:
        """The rows of the whole jagged batch that rank ``rank`` holds, in its local order."""
        lengths = self.chunk_lengths[:, list(self.chunk_ids(rank))]  # [B, 2]
        starts = self.offsets[:-1].view(-1, 1) + self.bounds[:, list(self.chunk_ids(rank))]
        return _ranges(starts.flatten(), lengths.flatten())

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of the jagged ``x [total, *inner]``."""
        return x[self.global_rows(rank).to(x.device)]

    def unshard(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole jagged tensor from every rank's ``shard``."""
        out = parts[0].new_empty((int(self.offsets[-1]), *parts[0].shape[1:]))
        for rank, part in enumerate(parts):
            out[self.global_rows(rank).to(part.device)] = part
        return out

    def chunks(self, rank: int, device, block_size: int) -> list[Chunk]:
        """Rank ``rank``'s early and late chunks of every sequence, padded, in blocks of at most ``block_size``
        positions (each block keeps its chunk's index); empty chunks are left out."""
        out, skip = [], torch.zeros_like(self.lengths)
        local_offsets = self.local_offsets(rank)[:-1]
        for index in self.chunk_ids(rank):
            lengths = self.chunk_lengths[:, index]
            width = int(lengths.max()) if lengths.numel() else 0
            for start in range(0, width, block_size):
                col = torch.arange(start, min(start + block_size, width)).view(1, -1)
                valid = col < lengths.view(-1, 1)
                rows = torch.where(valid, (local_offsets + skip).view(-1, 1) + col, 0)
                out.append(Chunk(index, (self.bounds[:, index].view(-1, 1) + col).to(device), valid.to(device),
                                 rows.to(device)))
            skip = skip + lengths
        return out


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unpack(buffer: torch.Tensor, specs) -> list[torch.Tensor]:
    out, at = [], 0
    for shape, dtype in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        out.append(buffer[at:at + nbytes].view(dtype).view(shape))
        at += nbytes
    return out


def _hstu_ids(pos, lengths, num_targets, contextual_seq_len):
    """HSTU's mask ids of global positions ``pos [B, n]`` and each sequence's ``max_ids [B, 1]``."""
    ids, max_ids = pos, lengths.view(-1, 1)
    if contextual_seq_len > 0:
        ids, max_ids = (pos - contextual_seq_len + 1).clamp(min=0), max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1)
        ids = torch.minimum(ids, max_ids)
    return ids, max_ids


class ContextParallelHSTU:
    """One call's arguments, its rank in the group and the ring; ``forward`` and ``backward`` on local rows."""

    def __init__(self, layout: ContextParallelLayout, group, exchange: str, block_size: int, max_seq_len: int,
                 alpha: float, causal: bool, num_targets: Optional[torch.Tensor], contextual_seq_len: int, device):
        self.layout, self.group, self.exchange = layout, group, exchange
        self.rank = dist.get_rank(group) if layout.world_size > 1 else 0
        self.max_seq_len, self.alpha, self.causal, self.contextual = max_seq_len, alpha, causal, contextual_seq_len
        self.lengths = layout.lengths.to(device)
        self.num_targets = None if num_targets is None else num_targets.to(device).long()
        self.device = device
        self.chunks = [layout.chunks(r, device, block_size) for r in range(layout.world_size)]

    # -- one chunk pair ----------------------------------------------------------------------------------------
    def _skip(self, qc: Chunk, kc: Chunk) -> bool:
        """Causal without a contextual prefix: no query sees a key of a later chunk."""
        return self.causal and self.contextual == 0 and kc.index > qc.index

    def _mask(self, qc: Chunk, kc: Chunk) -> torch.Tensor:
        (qi, max_ids), (ki, _) = (_hstu_ids(c.pos, self.lengths, self.num_targets, self.contextual) for c in (qc, kc))
        row, col = qi.unsqueeze(2), ki.unsqueeze(1)
        dist_ = row - col if self.causal else (row - col).abs()
        valid = (qc.pos.unsqueeze(2) == kc.pos.unsqueeze(1)) | (dist_ > 0)
        if self.contextual > 0:
            valid |= (row == 0) & (col < max_ids.unsqueeze(2))
        return valid & qc.valid.unsqueeze(2) & kc.valid.unsqueeze(1)

    def _scores(self, qc, kc, q, k, tq, tk, rel_bias, time_bias):
        """Pre-activation scores ``[B, H, cq, ck]``, the mask and the bias indices of one chunk pair."""
        scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * self.alpha
        bias = rel_index = time_index = None
        if rel_bias is not None:
            rel_index = (self.max_seq_len - 1 + kc.pos.unsqueeze(1) - qc.pos.unsqueeze(2)).clamp_(0, rel_bias.numel() - 1)
            bias = rel_bias[rel_index]
        if time_bias is not None:
            num_buckets = time_bias.numel() - 1
            gaps = tq.unsqueeze(2) - tk.unsqueeze(1)
            if gaps.is_floating_point():
                time_index = time_bucket(gaps, num_buckets)
            else:
                time_index = torch.bucketize(gaps.long().abs(), time_bucket_edges(num_buckets, gaps.device), right=True)
            bias = time_bias[time_index] if bias is None else bias + time_bias[time_index]
        if bias is not None:
            scores = scores + bias.to(scores.dtype).unsqueeze(1)
        return scores, self._mask(qc, kc).unsqueeze(1), rel_index, time_index

    def _pair_forward(self, qc, kc, q, kv, ts, biases):
        k, v, tk = kc.gather(kv[0]), kc.gather(kv[1]), None if len(kv) < 3 else kc.gather(kv[2])
        scores, mask, _, _ = self._scores(qc, kc, qc.gather(q), k, None if ts is None else qc.gather(ts), tk, *biases)
        weights = F.silu(scores).mul_(mask).mul_(1.0 / self.max_seq_len)
        return torch.matmul(weights, v.transpose(1, 2)).transpose(1, 2)

    def _pair_backward(self, qc, kc, q, kv, ts, grad, biases, dq, dkv, dbiases):
        k, v, tk = kc.gather(kv[0]), kc.gather(kv[1]), None if len(kv) < 3 else kc.gather(kv[2])
        qp, g = qc.gather(q), qc.gather(grad).transpose(1, 2)
        scores, mask, rel_index, time_index = self._scores(qc, kc, qp, k, None if ts is None else qc.gather(ts), tk,
                                                           *biases)
        sig = torch.sigmoid(scores)
        scale = mask * (1.0 / self.max_seq_len)
        dv = torch.matmul((scores * sig * scale).transpose(2, 3), g)
        dscores = torch.matmul(g, v.permute(0, 2, 3, 1)).mul_(scale).mul_(sig * (1 + scores * (1 - sig)))
        qc.scatter_add_(dq, self.alpha * torch.matmul(dscores, k.transpose(1, 2)).transpose(1, 2))
        kc.scatter_add_(dkv[0], self.alpha * torch.matmul(dscores.transpose(2, 3), qp.transpose(1, 2)).transpose(1, 2))
        kc.scatter_add_(dkv[1], dv.transpose(1, 2))
        per_pair = dscores.sum(1)
        for acc, index in zip(dbiases, (rel_index, time_index)):
            if acc is not None:
                acc.index_add_(0, index.flatten(), per_pair.flatten().to(acc.dtype))

    def _pairs(self, src: int):
        for qc in self.chunks[self.rank]:
            for kc in self.chunks[src]:
                if not self._skip(qc, kc):
                    yield qc, kc

    # -- exchange ----------------------------------------------------------------------------------------------
    def _specs(self, tensors, rank: int):
        n = self.layout.local_total(rank)
        return [((n, *t.shape[1:]), t.dtype) for t in tensors]

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _shift(self, tensors, recv_rank: int, tag: int):
        """Send ``tensors`` to the next rank, receive the previous rank's (those of ``recv_rank``), each tensor in
        place (no packing copy); returns a function that waits and returns them."""
        world = self.layout.world_size
        recv = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self._specs(tensors, recv_rank)]
        nxt, prv = self._global((self.rank + 1) % world), self._global((self.rank - 1) % world)
        ops = ([dist.P2POp(dist.isend, t.contiguous(), nxt, self.group, tag) for t in tensors if t.numel()]
               + [dist.P2POp(dist.irecv, t, prv, self.group, tag) for t in recv if t.numel()])
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except (RuntimeError, dist.DistError) as exc:
            raise self._error("ring send/recv", exc) from exc

        def wait():
            try:
                for w in works:
                    w.wait()
            except (RuntimeError, dist.DistError) as exc:
                raise self._error("ring send/recv", exc) from exc
            return recv

        return wait

    def _all_gather(self, tensors) -> list[list[torch.Tensor]]:
        world = self.layout.world_size
        send = _pack(tensors)
        sizes = [sum(torch.Size(s).numel() * d.itemsize for s, d in self._specs(tensors, r)) for r in range(world)]
        bufs = [send.new_empty(max(sizes)) for _ in range(world)]
        try:
            dist.all_gather(bufs, F.pad(send, (0, max(sizes) - send.numel())), group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._error("all_gather", exc) from exc
        return [_unpack(buf, self._specs(tensors, r)) for r, buf in enumerate(bufs)]

    def _send_home(self, parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """``parts[r]``: gradients for rank r's K/V; returns the sum of every rank's part for ours."""
        send = torch.cat([_pack(p) for p in parts])
        mine = _pack(parts[self.rank]).numel()
        recv = send.new_empty(mine * self.layout.world_size)
        try:
            dist.all_to_all_single(recv, send, [mine] * self.layout.world_size,
                                   [_pack(p).numel() for p in parts], group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise self._error("all_to_all of dK/dV", exc) from exc
        specs = [(t.shape, t.dtype) for t in parts[self.rank]]
        got = [_unpack(chunk, specs) for chunk in recv.split(mine)]
        return [torch.stack(ts).sum(0) for ts in zip(*got)]

    def _error(self, what: str, exc: BaseException) -> CollectiveError:
        return CollectiveError(f"recompile.context_parallel_hstu_attention: {what} on rank {self.rank} of "
                               f"{self.layout.world_size} failed: a peer rank died or did not reach it within the "
                               f"process-group timeout ({type(exc).__name__}: {exc})")

    def _sources(self, kv, prefetch: bool):
        """(source rank, its K/V [, timestamps]) in the order this rank gets them. ``prefetch``: the ring receives
        the next K/V while the caller computes on these (else after: two buffers fewer held at once)."""
        world = self.layout.world_size
        if world == 1:
            yield 0, kv
        elif self.exchange == "all_gather":
            yield from enumerate(self._all_gather(kv))
        else:
            for step in range(world):
                src = (self.rank - step) % world
                last = step == world - 1
                wait = self._shift(kv, (src - 1) % world, KV_TAG) if prefetch and not last else None
                yield src, kv
                if not last:
                    kv = (wait or self._shift(kv, (src - 1) % world, KV_TAG))()

    # -- the attention -----------------------------------------------------------------------------------------
    def forward(self, q, k, v, ts, rel_bias, time_bias) -> torch.Tensor:
        out = v.new_zeros(v.shape)
        kv = [k, v] + ([] if ts is None else [ts])
        for src, src_kv in self._sources(kv, prefetch=True):
            for qc, kc in self._pairs(src):
                qc.scatter_add_(out, self._pair_forward(qc, kc, q, src_kv, ts, (rel_bias, time_bias)))
        return out

    def backward(self, grad, q, k, v, ts, rel_bias, time_bias):
        world = self.layout.world_size
        dq = torch.zeros_like(q)
        dbiases = [None if b is None else torch.zeros_like(b) for b in (rel_bias, time_bias)]
        kv = [k, v] + ([] if ts is None else [ts])
        dkv = [torch.zeros_like(k), torch.zeros_like(v)]
        gathered = world > 1 and self.exchange == "all_gather"
        parts = [None] * world
        # No prefetch: the dK/dV exchange after a step would find two K/V and two dK/dV buffers alive, not three.
        for src, src_kv in self._sources(kv, prefetch=False):
            if gathered:  # one accumulator per source, sent home at the end
                dkv = [torch.zeros_like(src_kv[0]), torch.zeros_like(src_kv[1])]
            for qc, kc in self._pairs(src):
                self._pair_backward(qc, kc, q, src_kv, ts, grad, (rel_bias, time_bias), dq, dkv, dbiases)
            if gathered:
                parts[src] = dkv
            elif world > 1:  # the ring: the accumulator moves on with its K/V
                dkv = self._shift(dkv, (src - 1) % world, GRAD_TAG)()
        if gathered:
            dkv = self._send_home(parts)
        return dq, dkv[0], dkv[1], *dbiases


class _ContextParallelHSTUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rel_bias, time_bias, timestamps, attention: ContextParallelHSTU):
        ctx.save_for_backward(q, k, v, timestamps, rel_bias, time_bias)
        ctx.attention = attention
        return attention.forward(q, k, v, timestamps, rel_bias, time_bias)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, ts, rel_bias, time_bias = ctx.saved_tensors
        dq, dk, dv, drel, dtime = ctx.attention.backward(grad.contiguous(), q, k, v, ts, rel_bias, time_bias)
        return dq, dk, dv, drel, dtime, None, None


def context_parallel_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ContextParallelLayout, max_seq_len: int,
    alpha: float, causal: bool = True, num_targets: Optional[torch.Tensor] = None, contextual_seq_len: int = 0,
    rel_bias: Optional[torch.Tensor] = None, timestamps: Optional[torch.Tensor] = None,
    time_bias: Optional[torch.Tensor] = None, group=None, exchange: str = "ring", block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """``recompile.hstu_attention`` of the whole batch, for this rank's rows (``layout.shard(x, rank)``) of
    ``q, k [n, H, D]``, ``v [n, H, Dv]`` and ``timestamps [n]``; ``num_targets [B]`` is per sequence (the same on
    every rank); ``group``: the context-parallel process group (default: all ranks); ``block_size``: the most
    positions of a chunk attended at once (scores of at most ``[B, H, block_size, block_size]``)."""
    op = "recompile.context_parallel_hstu_attention"
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if layout.world_size != world:
        raise ValueError(f"{op}: the layout is for {layout.world_size} ranks, the group has {world}")
    if exchange not in EXCHANGES:
        raise ValueError(f"{op}: exchange must be one of {EXCHANGES}, got {exchange!r}")
    rank = dist.get_rank(group) if world > 1 else 0
    n = layout.local_total(rank)
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2] or q.shape[0] != n:
        raise ValueError(f"{op}: q, k must be [{n}, heads, D] (rank {rank}'s rows) and v [{n}, heads, Dv], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (timestamps is None) != (time_bias is None):
        raise ValueError(f"{op}: timestamps and time_bias come together")
    if layout.lengths.numel() and int(layout.lengths.max()) > max_seq_len:
        raise ValueError(f"{op}: a sequence of {int(layout.lengths.max())} is longer than max_seq_len {max_seq_len}")
    if rel_bias is not None and rel_bias.numel() != 2 * max_seq_len - 1:
        raise ValueError(f"{op}: rel_bias must have 2 * max_seq_len - 1 = {2 * max_seq_len - 1} entries, "
                         f"got {rel_bias.numel()}")
    if block_size < 1:
        raise ValueError(f"{op}: block_size must be >= 1, got {block_size}")
    attention = ContextParallelHSTU(layout, group, exchange, block_size, max_seq_len, alpha, causal, num_targets,
                                    contextual_seq_len, q.device)
    return _ContextParallelHSTUFunction.apply(q, k, v, rel_bias, time_bias, timestamps, attention)
