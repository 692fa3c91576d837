"""A DCN-v2 as practitioners write it, for the interaction benchmark: EmbeddingBags, a cross network, a deep tower."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models.dlrm import mlp


@dataclass
class DCNConfig:
    num_dense: int = 13
    table_rows: list[int] = field(default_factory=lambda: [10_000] * 20)
    dim: int = 16
    num_cross: int = 3
    low_rank: int | None = None  # None: full-rank cross layers; r: x0 * U(V x) + b + x
    deep: list[int] = field(default_factory=lambda: [512, 256])
    max_ids_per_bag: int = 4


class CrossLayer(nn.Module):
    def __init__(self, d: int, rank: int | None):
        super().__init__()
        self.proj = nn.Linear(d, d) if rank is None else nn.Sequential(nn.Linear(d, rank, bias=False), nn.Linear(rank, d))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.proj(x) + x


class DCNv2(nn.Module):
    """Stacked DCN-v2: x0 -> cross layers -> deep tower -> logit."""

    def __init__(self, cfg: DCNConfig):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, cfg.dim, mode="sum") for rows in cfg.table_rows)
        d = cfg.num_dense + cfg.dim * len(cfg.table_rows)
        self.cross = nn.ModuleList(CrossLayer(d, cfg.low_rank) for _ in range(cfg.num_cross))
        self.deep = mlp([d, *cfg.deep])
        self.head = nn.Linear(cfg.deep[-1], 1)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        embs = [emb(ids, offs) for emb, ids, offs in zip(self.embeddings, indices, offsets)]
        x0 = torch.cat([dense] + embs, dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        return self.head(self.deep(x)).squeeze(1)
