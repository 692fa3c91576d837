"""DLRM as practitioners write it: one nn.EmbeddingBag per sparse feature, a dot (or concat) interaction, MLPs.

``TorchRecDLRM`` is the same network over a TorchRec ``EmbeddingBagCollection`` fed a ``KeyedJaggedTensor``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

INTERACTIONS = ("dot", "cat")


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
    # "dot": pairwise dot products of the feature vectors (DLRM); "cat": their concatenation.
    interaction: str = "dot"
    # Sparse tables as hkv.DynamicEmbeddingBag hash tables over raw ids (fused SGD row updates).
    dynamic_embeddings: bool = False

    def __post_init__(self):
        if self.interaction not in INTERACTIONS:
            raise ValueError(f"DLRMConfig.interaction got {self.interaction!r}; "
                             f"valid values: {', '.join(INTERACTIONS)}")
        if self.bottom[-1] != self.dim:
            raise ValueError(f"DLRMConfig.bottom must end in dim={self.dim} (got {self.bottom}) "
                             "to interact with the embeddings")


def mlp(sizes: list[int], last_activation: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def embedding_bags(rows: list[int], dim: int, dynamic: bool = False) -> nn.ModuleList:
    """One sum-pooled bag table per sparse feature: nn.EmbeddingBag, or an hkv hash table over raw ids."""
    if not dynamic:
        return nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
    from hkv import DynamicEmbeddingBag, DynamicEmbInitializerArgs, DynamicEmbTableOptions

    init = DynamicEmbInitializerArgs(std_dev=dim ** -0.5)
    return nn.ModuleList(
        DynamicEmbeddingBag(DynamicEmbTableOptions(dim=dim, max_capacity=2 * n, initializer_args=init), mode="sum",
                            name=f"table_{t}")
        for t, n in enumerate(rows)
    )


class DLRMInteraction(nn.Module):
    """Dense vector ``x`` [B, D] and pooled embeddings [B, D] each -> the top MLP's input."""

    def __init__(self, num_features: int, dim: int, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "dot":
            rows, cols = torch.triu_indices(num_features, num_features, offset=1)
            self.register_buffer("pair_rows", rows, persistent=False)
            self.register_buffer("pair_cols", cols, persistent=False)
            self.out_dim = dim + num_features * (num_features - 1) // 2
        else:
            self.out_dim = dim * num_features

    def forward(self, x: torch.Tensor, embs: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "cat":
            return torch.cat([x] + embs, dim=1)
        features = torch.stack([x] + embs, dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        pairs = dots[:, self.pair_rows, self.pair_cols]
        return torch.cat([x, pairs], dim=1)


class DLRM(nn.Module):
    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = embedding_bags(cfg.table_rows, cfg.dim, cfg.dynamic_embeddings)
        self.bottom = mlp([cfg.num_dense, *cfg.bottom])
        self.interaction = DLRMInteraction(len(cfg.table_rows) + 1, cfg.dim, cfg.interaction)
        self.top = mlp([self.interaction.out_dim, *cfg.top], last_activation=False)

    def forward(self, dense: torch.Tensor, indices: list[torch.Tensor], offsets: list[torch.Tensor]) -> torch.Tensor:
        x = self.bottom(dense)
        embs = [emb(ids, offs) for emb, ids, offs in zip(self.embeddings, indices, offsets)]
        return self.top(self.interaction(x, embs)).squeeze(1)


def feature_names(cfg: DLRMConfig) -> list[str]:
    return [f"cat_{i}" for i in range(len(cfg.table_rows))]


class TorchRecDLRM(nn.Module):
    """DLRM whose sparse features are a TorchRec EmbeddingBagCollection over a KeyedJaggedTensor."""

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        from torchrec import EmbeddingBagCollection
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

        if cfg.dynamic_embeddings:
            raise ValueError("TorchRecDLRM: dynamic embeddings are hkv tables, not an EmbeddingBagCollection; use DLRM")
        self.cfg = cfg
        self.keys = feature_names(cfg)
        tables = [
            EmbeddingBagConfig(name=f"t_{key}", embedding_dim=cfg.dim, num_embeddings=rows, feature_names=[key],
                               pooling=PoolingType.SUM)
            for key, rows in zip(self.keys, cfg.table_rows)
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        self.bottom = mlp([cfg.num_dense, *cfg.bottom])
        self.interaction = DLRMInteraction(len(cfg.table_rows) + 1, cfg.dim, cfg.interaction)
        self.top = mlp([self.interaction.out_dim, *cfg.top], last_activation=False)

    def forward(self, dense: torch.Tensor, features) -> torch.Tensor:
        x = self.bottom(dense)
        pooled = self.ebc(features)
        embs = [pooled[key] for key in self.keys]
        return self.top(self.interaction(x, embs)).squeeze(1)


def to_kjt(cfg: DLRMConfig, indices: list[torch.Tensor], offsets: list[torch.Tensor]):
    """The per-table (indices, offsets) of ``synthetic_batch`` as one KeyedJaggedTensor (key-major)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    lengths = [torch.diff(offs, append=offs.new_tensor([ids.numel()])) for ids, offs in zip(indices, offsets)]
    return KeyedJaggedTensor.from_lengths_sync(feature_names(cfg), torch.cat(indices), torch.cat(lengths))


def synthetic_batch(cfg, batch: int, generator: torch.Generator | None = None):
    """Random dense features and 1..max_ids_per_bag ids per bag for every table (synthetic data)."""
    dense = torch.randn(batch, cfg.num_dense, generator=generator)
    indices, offsets = [], []
    for rows in cfg.table_rows:
        lengths = torch.randint(1, cfg.max_ids_per_bag + 1, (batch,), generator=generator)
        indices.append(_ids(rows, int(lengths.sum()), getattr(cfg, "id_alpha", None), generator))  # any CTR config
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
