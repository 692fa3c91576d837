"""Sequential recommenders trained as next-item predictors with sampled softmax.

- ``SASRec``: causal softmax self-attention over right-padded histories ``ids [B, L]`` (0 = padding).
- ``HSTU``: STU layers over jagged histories ``(ids [T], timestamps [T], lengths [B])``: one fused uvqk
  projection, SiLU pointwise attention with relative position and time bias, causal mask (Zhai et al. 2024,
  "Actions Speak Louder than Words"). Attention runs on a padded [B, L] view; everything else stays jagged.
- ``NextItemTask``: encoder + sampled-softmax loss (in-batch + uniformly sampled negatives, accidental hits
  masked) over cosine similarities with a temperature. Targets come in the encoder's layout (jagged [T] or
  padded [B, L]); a target of 0 is padding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SASRecConfig:
    """Also the fields HSTU shares with SASRec, so that both compare at one embedding size, depth and length."""

    num_items: int = 1000
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    max_len: int = 50
    dropout: float = 0.2


@dataclass
class HSTUConfig(SASRecConfig):
    attn_dim: int = 32  # per head, q and k
    linear_dim: int = 32  # per head, u and v
    num_time_buckets: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query: torch.Tensor, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        H = self.num_heads
        q = self.q(query).view(B, L, H, D // H).transpose(1, 2)
        k = self.k(x).view(B, L, H, D // H).transpose(1, 2)
        v = self.v(x).view(B, L, H, D // H).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D // H)
        scores = scores.masked_fill(~causal, float("-inf"))
        attn = self.dropout(torch.softmax(scores, dim=-1))
        return self.out(torch.matmul(attn, v).transpose(1, 2).reshape(B, L, D))


class SASRecBlock(nn.Module):
    def __init__(self, cfg: SASRecConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = CausalSelfAttention(cfg.dim, cfg.num_heads, cfg.dropout)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.dim), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(cfg.dim, cfg.dim),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q = self.attn_norm(x)
        x = q + self.attn(q, x, causal)
        x = self.ffn_norm(x)
        return (x + self.ffn(x)) * keep


def init_embeddings(*embeddings: nn.Embedding) -> None:
    """Truncated normal, std 0.02, as generative-recommenders initialises its item and position tables."""
    for emb in embeddings:
        nn.init.trunc_normal_(emb.weight, std=0.02)
        if emb.padding_idx is not None:
            nn.init.zeros_(emb.weight[emb.padding_idx])


class SequenceEncoder(nn.Module):
    """The input side SASRec and HSTU share: item table (0 = padding), absolute positions, input dropout."""

    def __init__(self, cfg: SASRecConfig):
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.dim, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        init_embeddings(self.item_emb, self.pos_emb)


class SASRec(SequenceEncoder):
    input_format = "padded"

    def __init__(self, cfg: SASRecConfig):
        super().__init__(cfg)
        self.blocks = nn.ModuleList(SASRecBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.register_buffer("causal", torch.ones(cfg.max_len, cfg.max_len).tril().bool(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, L] right-padded with 0 -> hidden states [B, L, D]."""
        L = ids.shape[1]
        keep = (ids > 0).unsqueeze(-1).to(self.item_emb.weight.dtype)
        x = self.item_emb(ids) * math.sqrt(self.cfg.dim) + self.pos_emb.weight[:L]
        x = self.dropout(x) * keep
        causal = self.causal[:L, :L]
        for block in self.blocks:
            x = block(x, causal, keep)
        return self.norm(x)


class STULayer(nn.Module):
    """One HSTU layer on jagged x [T, D]."""

    def __init__(self, cfg: HSTUConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.num_heads
        self.split_sizes = [H * cfg.linear_dim, H * cfg.linear_dim, H * cfg.attn_dim, H * cfg.attn_dim]
        self.uvqk = nn.Linear(cfg.dim, sum(self.split_sizes), bias=False)
        self.pos_bias = nn.Parameter(torch.randn(2 * cfg.max_len - 1) * 0.02)
        self.time_bias = nn.Parameter(torch.randn(cfg.num_time_buckets + 1) * 0.02)
        self.out = nn.Linear(H * cfg.linear_dim, cfg.dim)
        self.dropout = nn.Dropout(cfg.dropout)
        nn.init.normal_(self.uvqk.weight, std=0.02)
        nn.init.xavier_uniform_(self.out.weight)

    def forward(self, x, dest, batch: int, rel_pos, time_buckets, mask):
        cfg, L, H = self.cfg, self.cfg.max_len, self.cfg.num_heads
        normed = F.layer_norm(x, (cfg.dim,))
        u, v, q, k = torch.split(F.silu(self.uvqk(normed)), self.split_sizes, dim=-1)
        q = to_padded(q, dest, batch, L).view(batch, L, H, cfg.attn_dim)
        k = to_padded(k, dest, batch, L).view(batch, L, H, cfg.attn_dim)
        v = to_padded(v, dest, batch, L).view(batch, L, H, cfg.linear_dim)
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k)
        scores = scores + (self.pos_bias[rel_pos] + self.time_bias[time_buckets]).unsqueeze(1)
        attn = F.silu(scores) / L * mask.unsqueeze(1)
        out = torch.einsum("bhnm,bmhd->bnhd", attn, v).reshape(batch * L, H * cfg.linear_dim)[dest]
        y = u * F.layer_norm(out, (H * cfg.linear_dim,))
        return x + self.out(self.dropout(y))


def to_padded(values: torch.Tensor, dest: torch.Tensor, batch: int, max_len: int) -> torch.Tensor:
    """Jagged values [T, C] -> padded [B, L, C] (zeros past each length); ``dest`` = row * L + position."""
    padded = values.new_zeros(batch * max_len, values.shape[1]).index_copy(0, dest, values)
    return padded.view(batch, max_len, values.shape[1])


class HSTU(SequenceEncoder):
    input_format = "jagged"

    def __init__(self, cfg: HSTUConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList(STULayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, ids: torch.Tensor, timestamps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Jagged histories: ids and timestamps [T], lengths [B] (each <= max_len) -> hidden states [T, D]."""
        L, B = self.cfg.max_len, lengths.shape[0]
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        rows = torch.searchsorted(offsets, torch.arange(ids.shape[0], device=ids.device), right=True) - 1
        positions = torch.arange(ids.shape[0], device=ids.device) - offsets[rows]
        dest = rows * L + positions
        x = self.item_emb(ids) * math.sqrt(self.cfg.dim) + self.pos_emb(positions)
        x = self.dropout(x)
        # Relative time: bucketed log of |t_query - t_key| (seconds), as in HSTU's relative attention bias.
        ts = to_padded(timestamps.unsqueeze(1), dest, B, L).view(B, L)
        gap = (ts.unsqueeze(2) - ts.unsqueeze(1)).abs().clamp(min=1).float()
        time_buckets = (torch.log(gap) / 0.301).long().clamp(max=self.cfg.num_time_buckets)
        pos = torch.arange(L, device=ids.device)
        rel_pos = pos[None, :] - pos[:, None] + L - 1
        valid = (pos < lengths.unsqueeze(1)).float()
        mask = torch.ones(L, L, device=ids.device).tril() * valid.unsqueeze(1)
        for layer in self.layers:
            x = layer(x, dest, B, rel_pos, time_buckets, mask)
        return x


class NextItemTask(nn.Module):
    """Encoder + sampled softmax over cosine similarity / temperature: forward(targets, negatives, *inputs) -> loss."""

    def __init__(self, encoder: nn.Module, temperature: float = 0.05):
        super().__init__()
        self.encoder = encoder
        self.temperature = temperature

    def forward(self, targets: torch.Tensor, negatives: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(*inputs)
        h = F.normalize(hidden.reshape(-1, hidden.shape[-1]), dim=-1)
        targets = targets.reshape(-1)
        item_emb = self.encoder.item_emb
        pos = (h * F.normalize(item_emb(targets), dim=-1)).sum(-1, keepdim=True)
        neg = h @ F.normalize(item_emb(negatives), dim=-1).t()
        neg = neg.masked_fill(negatives.unsqueeze(0) == targets.unsqueeze(1), float("-inf"))
        logits = torch.cat([pos, neg], dim=1) / self.temperature
        labels = torch.zeros_like(targets)
        losses = F.cross_entropy(logits, labels, reduction="none")
        weight = (targets > 0).to(losses.dtype)
        return (losses * weight).sum() / weight.sum()

    @torch.no_grad()
    def user_embeddings(self, *inputs: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Normalised hidden state at flat position ``last`` [B] of each history (the next-item query)."""
        hidden = self.encoder(*inputs)
        return F.normalize(hidden.reshape(-1, hidden.shape[-1])[last], dim=-1)

    @torch.no_grad()
    def item_embeddings(self) -> torch.Tensor:
        """Normalised embeddings of items 1..N (row i-1 is item i)."""
        return F.normalize(self.encoder.item_emb.weight[1:], dim=-1)
