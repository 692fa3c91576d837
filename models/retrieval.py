"""Two-tower retrieval with a dot-product head or a mixture-of-logits (MoL) head.

User tower: user-id embedding + mean of the embeddings of the user's recent items (an EmbeddingBag over the
history), then an MLP. Item tower: item-id embedding, then an MLP. ``forward(users [B], history [H],
history_offsets [B], items [N]) -> logits [B, N]`` for every user against every candidate item.

- dot: cosine similarity of one user and one item vector, over a temperature.
- mol (Zhai et al. 2023, "Revisiting Neural Retrieval on Accelerators"): P user and Q item component vectors,
  logit = sum_pq gate_pq(u, x) <u_p, x_q> with softmax gates computed from the user, the item and the P*Q
  component similarities.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.dlrm import mlp

HEADS = ("dot", "mol")


@dataclass
class TwoTowerConfig:
    num_users: int = 1000
    num_items: int = 1000
    dim: int = 64
    tower: list[int] = field(default_factory=lambda: [128, 64])
    head: str = "dot"
    user_components: int = 4
    item_components: int = 4
    temperature: float = 0.05

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"TwoTowerConfig.head got {self.head!r}; valid values: {', '.join(HEADS)}")


class DotHead(nn.Module):
    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        self.temperature = cfg.temperature

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return F.normalize(user, dim=-1) @ F.normalize(item, dim=-1).t() / self.temperature


class MoLHead(nn.Module):
    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        P, Q, D = cfg.user_components, cfg.item_components, cfg.tower[-1]
        self.P, self.Q, self.temperature = P, Q, cfg.temperature
        self.user_proj = nn.Linear(D, P * D)
        self.item_proj = nn.Linear(D, Q * D)
        self.user_gate = nn.Linear(D, P * Q)
        self.item_gate = nn.Linear(D, P * Q)
        self.sim_gate = nn.Sequential(nn.Linear(P * Q, P * Q), nn.SiLU(), nn.Linear(P * Q, P * Q))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        B, N, D = user.shape[0], item.shape[0], user.shape[1]
        u = F.normalize(self.user_proj(user).view(B, self.P, D), dim=-1)
        x = F.normalize(self.item_proj(item).view(N, self.Q, D), dim=-1)
        sims = torch.einsum("bpd,nqd->bnpq", u, x).reshape(B, N, self.P * self.Q)
        gate_logits = self.user_gate(user).unsqueeze(1) + self.item_gate(item).unsqueeze(0) + self.sim_gate(sims)
        gates = torch.softmax(gate_logits, dim=-1)
        return (gates * sims).sum(-1) / self.temperature


class TwoTower(nn.Module):
    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.user_emb = nn.Embedding(cfg.num_users + 1, cfg.dim)
        self.history_emb = nn.EmbeddingBag(cfg.num_items + 1, cfg.dim, mode="mean", padding_idx=0)
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.dim, padding_idx=0)
        self.user_tower = mlp([2 * cfg.dim, *cfg.tower], last_activation=False)
        self.item_tower = mlp([cfg.dim, *cfg.tower], last_activation=False)
        self.head = DotHead(cfg) if cfg.head == "dot" else MoLHead(cfg)

    def user_vectors(self, users, history, history_offsets):
        features = torch.cat([self.user_emb(users), self.history_emb(history, history_offsets)], dim=1)
        return self.user_tower(features)

    def forward(self, users, history, history_offsets, items):
        return self.head(self.user_vectors(users, history, history_offsets), self.item_tower(self.item_emb(items)))


class InBatchSoftmaxTask(nn.Module):
    """forward(users, history, history_offsets, positives [B], negatives [S]) -> loss.

    Candidates are the batch's positives (in-batch negatives for the other rows) followed by sampled items;
    a candidate equal to the row's positive, other than its own, is masked out (accidental hit).
    """

    def __init__(self, model: TwoTower):
        super().__init__()
        self.model = model

    def forward(self, users, history, history_offsets, positives, negatives):
        candidates = torch.cat([positives, negatives])
        logits = self.model(users, history, history_offsets, candidates)
        labels = torch.arange(positives.shape[0], device=positives.device)
        hit = candidates.unsqueeze(0) == positives.unsqueeze(1)
        own = F.pad(torch.eye(positives.shape[0], device=positives.device, dtype=torch.bool), (0, negatives.shape[0]))
        return F.cross_entropy(logits.masked_fill(hit & ~own, float("-inf")), labels)
