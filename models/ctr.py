"""CTR models over dense + multi-hot sparse features, written as practitioners write them.

Every model takes ``(dense [B, num_dense], indices: list[Tensor], offsets: list[Tensor])`` (one bag per row and
table, the input of ``nn.EmbeddingBag``), like ``models.dlrm.DLRM``, and returns one logit per row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .dlrm import embedding_bags, mlp

DCN_STRUCTURES = ("stacked", "parallel")


@dataclass
class CTRConfig:
    num_dense: int = 13
    table_rows: list[int] = field(default_factory=lambda: [1000] * 8)
    dim: int = 16
    max_ids_per_bag: int = 4
    deep: list[int] = field(default_factory=lambda: [64, 32])
    # Sparse tables as hkv.DynamicEmbeddingBag hash tables over raw ids (fused SGD row updates).
    dynamic_embeddings: bool = False


@dataclass
class DCNConfig(CTRConfig):
    num_cross: int = 3
    # None: full-rank cross weights (D x D); an int r: low-rank W = U V^T with U, V of shape D x r.
    low_rank: int | None = None
    structure: str = "stacked"
    # > 1 (with low_rank): each cross layer is a mixture of low-rank experts gated by a softmax over them
    # (DCN-v2's DCN-Mix, TorchRec's LowRankMixtureCrossNet).
    num_experts: int = 1

    def __post_init__(self):
        if self.structure not in DCN_STRUCTURES:
            raise ValueError(f"DCNConfig.structure got {self.structure!r}; valid values: {', '.join(DCN_STRUCTURES)}")
        if self.num_experts > 1 and self.low_rank is None:
            raise ValueError(f"DCNConfig.num_experts={self.num_experts} needs a low_rank (the experts' rank)")


def lookup(tables: nn.ModuleList, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> list[torch.Tensor]:
    """One pooled bag per table: ``[B, dim]`` each."""
    return [table(ids, offs) for table, ids, offs in zip(tables, indices, offsets)]


class CrossLayer(nn.Module):
    """DCN-v2 cross layer: x_{l+1} = x_0 * (W x_l + b) + x_l, W full-rank or U V^T."""

    def __init__(self, width: int, low_rank: int | None):
        super().__init__()
        if low_rank is None:
            self.proj = nn.Linear(width, width)
        else:
            self.proj = nn.Sequential(nn.Linear(width, low_rank, bias=False), nn.Linear(low_rank, width))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.proj(x) + x


class MixtureCrossLayer(nn.Module):
    """DCN-Mix cross layer: x_{l+1} = sum_e g_e(x_l) * x_0 * (U_e relu(C_e relu(V_e x_l)) + b_e) + x_l with the
    gates g = softmax(G x_l) over the experts."""

    def __init__(self, width: int, rank: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(width, num_experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, rank, bias=False), nn.ReLU(), nn.Linear(rank, rank, bias=False), nn.ReLU(),
                          nn.Linear(rank, width))
            for _ in range(num_experts)
        )

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.gate(x), dim=1)
        experts = torch.stack([x0 * expert(x) for expert in self.experts], dim=2)  # [B, D, E]
        return (experts * gates.unsqueeze(1)).sum(dim=2) + x


def cross_layer(width: int, cfg: DCNConfig) -> nn.Module:
    if cfg.num_experts > 1:
        return MixtureCrossLayer(width, cfg.low_rank, cfg.num_experts)
    return CrossLayer(width, cfg.low_rank)


class DCNv2(nn.Module):
    def __init__(self, cfg: DCNConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = embedding_bags(cfg.table_rows, cfg.dim, cfg.dynamic_embeddings)
        width = cfg.num_dense + cfg.dim * len(cfg.table_rows)
        self.cross = nn.ModuleList(cross_layer(width, cfg) for _ in range(cfg.num_cross))
        self.deep = mlp([width, *cfg.deep])
        head_in = cfg.deep[-1] if cfg.structure == "stacked" else width + cfg.deep[-1]
        self.head = nn.Linear(head_in, 1)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x0 = torch.cat([dense] + lookup(self.embeddings, indices, offsets), dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        if self.cfg.structure == "stacked":
            out = self.deep(x)
        else:
            out = torch.cat([x, self.deep(x0)], dim=1)
        return self.head(out).squeeze(1)


class LinearTerm(nn.Module):
    """A linear model over dense values and sparse ids (one weight per id): [B, 1]."""

    def __init__(self, cfg: CTRConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.num_dense, 1)
        self.sparse = embedding_bags(cfg.table_rows, 1, cfg.dynamic_embeddings)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        return self.dense(dense) + torch.cat(lookup(self.sparse, indices, offsets), dim=1).sum(dim=1, keepdim=True)


class LinearPlusDeep(nn.Module):
    """Shared by DeepFM and Wide & Deep: field embeddings, a linear term over the raw features, a deep MLP."""

    def __init__(self, cfg: CTRConfig, deep_in: int):
        super().__init__()
        self.cfg = cfg
        self.embeddings = embedding_bags(cfg.table_rows, cfg.dim, cfg.dynamic_embeddings)
        self.linear = LinearTerm(cfg)
        self.deep = mlp([deep_in, *cfg.deep, 1], last_activation=False)


class DeepFM(LinearPlusDeep):
    """First-order terms + factorization machine over the field embeddings + a deep MLP, summed."""

    def __init__(self, cfg: CTRConfig):
        super().__init__(cfg, cfg.dim * (len(cfg.table_rows) + 1))
        self.dense_field = nn.Linear(cfg.num_dense, cfg.dim)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        fields = torch.stack([self.dense_field(dense)] + lookup(self.embeddings, indices, offsets), dim=1)
        second = 0.5 * (fields.sum(dim=1).pow(2) - fields.pow(2).sum(dim=1)).sum(dim=1, keepdim=True)
        deep = self.deep(fields.flatten(1))
        return (self.linear(dense, indices, offsets) + second + deep).squeeze(1)


class WideDeep(LinearPlusDeep):
    """Wide: a linear model over dense values and sparse ids; deep: an MLP over dense + embeddings."""

    def __init__(self, cfg: CTRConfig):
        super().__init__(cfg, cfg.num_dense + cfg.dim * len(cfg.table_rows))

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        deep = self.deep(torch.cat([dense] + lookup(self.embeddings, indices, offsets), dim=1))
        return (self.linear(dense, indices, offsets) + deep).squeeze(1)
