"""DLRM as practitioners write it: one nn.EmbeddingBag per sparse feature, a dot interaction, MLPs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class DLRMConfig:
    num_dense: int = 13
    table_rows: list[int] = field(default_factory=lambda: [1000] * 8)
    dim: int = 16
    bottom: list[int] = field(default_factory=lambda: [64, 16])
    top: list[int] = field(default_factory=lambda: [64, 1])
    max_ids_per_bag: int = 4
    # Ids drawn from a power law P(id = k) ~ (k + 1)^-alpha (Criteo-like skew); None: uniform.
    id_alpha: float | None = None


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, cfg.dim, mode="sum") for rows in cfg.table_rows)
        self.bottom = mlp([cfg.num_dense, *cfg.bottom])
        num_features = len(cfg.table_rows) + 1
        num_pairs = num_features * (num_features - 1) // 2
        self.top = mlp([cfg.dim + num_pairs, *cfg.top], last_activation=False)
        rows, cols = torch.triu_indices(num_features, num_features, offset=1)
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        embs = [emb(ids, offs) for emb, ids, offs in zip(self.embeddings, indices, offsets)]
        features = torch.stack([x] + embs, dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        pairs = dots[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def synthetic_batch(cfg: DLRMConfig, batch: int, generator: torch.Generator | None = None):
    """Random dense features and 1..max_ids_per_bag ids per bag for every table (synthetic data)."""
    dense = torch.randn(batch, cfg.num_dense, generator=generator)
    indices, offsets = [], []
    for rows in cfg.table_rows:
        lengths = torch.randint(1, cfg.max_ids_per_bag + 1, (batch,), generator=generator)
        indices.append(_ids(rows, int(lengths.sum()), cfg.id_alpha, generator))
        offsets.append(torch.cumsum(lengths, 0) - lengths)
    return dense, indices, offsets


def _ids(rows: int, n: int, alpha: float | None, generator: torch.Generator | None) -> torch.Tensor:
    if alpha is None:
        return torch.randint(0, rows, (n,), generator=generator)
    # Inverse CDF of the continuous power law on [1, rows + 1), shifted to start at id 0.
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    a = 1.0 - alpha
    k = (rows + 1) ** u if a == 0 else (((rows + 1) ** a - 1) * u + 1) ** (1 / a)
    return (k.long() - 1).clamp_(0, rows - 1)
