"""All-to-all with variable splits on torch.distributed, differentiable, with byte accounting.

Every exchange goes through ``torch.distributed.all_to_all_single`` on the default process group (gloo,
nccl or hccl, see ``env``). A collective that fails (a peer died, or did not arrive within the process
group's timeout) raises ``CollectiveError`` naming the rank and the exchange, instead of hanging.
"""
from __future__ import annotations

import itertools
import zlib
from collections import Counter
from typing import Sequence

import torch
import torch.distributed as dist

from recompile.distributed.env import world


class CollectiveError(RuntimeError):
    """A collective failed: a peer rank died or timed out."""


class CommStats:
    """Bytes this rank sent to other ranks, and all-to-alls it took part in, per kind ("counts", "ids", "bags",
    "pooled", "grads")."""

    def __init__(self):
        self.bytes = Counter()
        self.calls = Counter()

    def add(self, kind: str, tensor: torch.Tensor, send_splits: Sequence[int], rank: int) -> None:
        remote = sum(n for peer, n in enumerate(send_splits) if peer != rank)
        self.bytes[kind] += remote * tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 else 1)
        self.calls[kind] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.bytes.values())


STATS = CommStats()


def all_to_all(tensor: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], kind: str) -> torch.Tensor:
    """Rows ``tensor[sum(send_splits[:p]) : ...]`` go to rank p; returns the rows received, by source rank."""
    rank, world_size = world()
    if world_size == 1:
        return tensor
    STATS.add(kind, tensor, send_splits, rank)
    out = tensor.new_empty((sum(recv_splits), *tensor.shape[1:]))
    try:
        dist.all_to_all_single(out, tensor.contiguous(), list(recv_splits), list(send_splits))
    except (RuntimeError, dist.DistError) as exc:
        raise CollectiveError(
            f"recompile.distributed: all-to-all of {kind} on rank {rank} of {world_size} failed: a peer rank died "
            f"or did not reach the collective within the process-group timeout ({type(exc).__name__}: {exc})"
        ) from exc
    return out


_ROUNDS = itertools.count()


def exchange_counts(counts: torch.Tensor, tag: str) -> torch.Tensor:
    """``counts`` is [world_size, k] (what this rank sends to each peer); returns [world_size, k] received.

    Every rank stamps the exchange with its round number, ``k`` and a checksum of ``tag`` (what the round is
    about: the tables' names): a peer in another round, or in this round for other tables (the ranks call the
    sharded tables in different orders or numbers), raises ``CollectiveError`` instead of the ranks mixing
    different rounds' data."""
    rank, world_size = world()
    stamp = counts.new_tensor([next(_ROUNDS), counts.shape[1], zlib.crc32(tag.encode())]).expand(world_size, 3)
    width = counts.shape[1] + 3
    got = all_to_all(torch.cat([counts, stamp], 1).reshape(-1), [width] * world_size, [width] * world_size, "counts")
    got = got.reshape(world_size, -1)
    if not torch.equal(got[:, -3:], stamp):
        peers = [p for p in range(world_size) if not torch.equal(got[p, -3:], stamp[p])]
        raise CollectiveError(f"recompile.distributed: rank {rank} is in lookup round {int(stamp[0, 0])} of {tag}, "
                              f"ranks {peers} are not (round, counts, checksum {got[peers, -3:].tolist()} against "
                              f"{stamp[0].tolist()}): the ranks call the sharded tables in different orders or numbers")
    return got[:, :-3]


class _AllToAllRows(torch.autograd.Function):
    """Forward sends pooled rows by ``send_splits``; backward sends their gradients back by the reverse splits."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, grad_scale):
        ctx.splits, ctx.grad_scale = (send_splits, recv_splits), grad_scale
        return all_to_all(rows, send_splits, recv_splits, "pooled")

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        grad = all_to_all(grad, recv_splits, send_splits, "grads")
        return grad * ctx.grad_scale if ctx.grad_scale != 1.0 else grad, None, None, None


def all_to_all_rows(rows: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                    grad_scale: float = 1.0) -> torch.Tensor:
    """Differentiable ``all_to_all``; the gradient arriving back is multiplied by ``grad_scale``."""
    return _AllToAllRows.apply(rows, list(send_splits), list(recv_splits), grad_scale)
