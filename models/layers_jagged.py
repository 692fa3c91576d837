"""Sequence layers over user histories, written padded the way models usually are (plain PyTorch).

Both take jagged histories ``values [total, dim]`` with ``lengths [B]``, pad them to
``max_seq_len``, compute on the padded batch with masks, and return jagged values again:

- ``HSTULayer``: one HSTU block (generative-recommenders' STU): a fused ``uvqk`` projection with
  SiLU, pointwise attention ``silu(alpha * q k^T + relative position bias) / N`` under a causal
  mask over the padded histories, then ``out(norm(attn) * u) + x``.
- ``SASRecLayer``: SASRec's block: causal softmax attention with a key padding mask
  (``F.scaled_dot_product_attention``), then a position-wise feed-forward, both residual.

The rec_ascend ``jagged`` pass rewrites their padded regions into jagged ops; eager runs them as
written. ``long_tailed_lengths`` draws the history lengths the benchmark and tests use.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from recompile.runtime.fbgemm import load_fbgemm

load_fbgemm()  # registers torch.ops.fbgemm.*


def long_tailed_lengths(batch: int, max_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Most histories short, a few long: a Pareto-like draw, clamped to ``[1, max_len]``, with one at max."""
    u = torch.rand(batch, generator=generator)
    lengths = (max_len * 0.04 / (1 - u * 0.999) ** 1.2).long().clamp(1, max_len)
    lengths[0] = max_len
    return lengths


def jagged_batch(batch: int, max_len: int, dim: int, generator: torch.Generator | None = None):
    lengths = long_tailed_lengths(batch, max_len, generator)
    return torch.randn(int(lengths.sum()), dim, generator=generator), lengths


class HSTULayer(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 2, head_dim: int = 32, max_seq_len: int = 256):
        super().__init__()
        self.heads, self.head_dim, self.max_seq_len = heads, head_dim, max_seq_len
        self.alpha = 1.0 / head_dim**0.5
        self.norm_in = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.rel_pos = nn.Parameter(torch.randn(2 * max_seq_len - 1) * 0.02)
        self.norm_attn = nn.LayerNorm(heads * head_dim)
        self.out = nn.Linear(heads * head_dim, dim)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n, h, d = self.max_seq_len, self.heads, self.head_dim
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        x = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [n], 0.0)  # [B, N, dim]
        b = x.shape[0]
        u, v, q, k = torch.split(F.silu(self.uvqk(self.norm_in(x))), h * d, dim=-1)
        q = q.view(b, n, h, d).transpose(1, 2)
        k = k.view(b, n, h, d).transpose(1, 2)
        v = v.view(b, n, h, d).transpose(1, 2)
        ids = torch.arange(n, device=x.device)
        rel_bias = self.rel_pos[n - 1 + ids.view(1, n) - ids.view(n, 1)]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.alpha + rel_bias
        causal = ids.view(1, n, 1) >= ids.view(1, 1, n)
        valid = causal & (ids.view(1, 1, n) < lengths.view(-1, 1, 1))
        attn = F.silu(scores) / n * valid.unsqueeze(1)
        o = torch.matmul(attn, v).transpose(1, 2).flatten(2)
        y = self.out(self.norm_attn(o) * u) + x
        return torch.ops.fbgemm.dense_to_jagged(y, [offsets], values.shape[0])[0]


class SASRecLayer(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 2, max_seq_len: int = 256, dropout: float = 0.1):
        super().__init__()
        self.heads, self.max_seq_len = heads, max_seq_len
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        n, h = self.max_seq_len, self.heads
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        x = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [n], 0.0)
        b, dim = x.shape[0], x.shape[2]
        y = self.norm1(x)
        q, k, v = (proj(y).view(b, n, h, dim // h).transpose(1, 2) for proj in (self.q, self.k, self.v))
        ids = torch.arange(n, device=x.device)
        key_padding = ids.view(1, n) >= lengths.view(-1, 1)  # True where padding
        causal = ids.view(n, 1) >= ids.view(1, n)
        mask = causal.view(1, 1, n, n) & ~key_padding.view(b, 1, 1, n)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.dropout(self.proj(a.transpose(1, 2).flatten(2)))
        x = x + self.dropout(self.ffn(self.norm2(x)))
        return torch.ops.fbgemm.dense_to_jagged(x, [offsets], values.shape[0])[0]
