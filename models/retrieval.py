"""Two-tower retrieval with a dot-product head or a mixture-of-logits (MoL) head.

Each side is a set of embeddings of one size ``dim``: the user side stacks its tower's output (an MLP over the
user-id embedding and the mean of the embeddings of the user's recent items, an EmbeddingBag) with those two
input embeddings, ``[B, 3, dim]``; the item side stacks its tower's output with the item-id embedding,
``[N, 2, dim]``. ``forward(users [B], history [H], history_offsets [B], items [N]) -> logits [B, N]`` for every
user against every candidate item.

- dot: cosine similarity of the two towers' outputs, over a temperature.
- mol (Zhai et al. 2023, "Revisiting Neural Retrieval on Accelerators"): P user and Q item component
  embeddings, each a learned projection of all of its side's embeddings (the paper's embedding sharing) and
  L2-normalised; logit = sum_pq gate_pq(u, x) <u_p, x_q> / temperature, with softmax gates over the P*Q pairs
  from three MLPs: over the user's embeddings, over the item's, and over the P*Q component similarities.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dlrm import mlp

HEADS = ("dot", "mol")
USER_EMBEDDINGS = 3  # user tower output, user-id embedding, history mean
ITEM_EMBEDDINGS = 2  # item tower output, item-id embedding


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
        if self.tower[-1] != self.dim:
            raise ValueError(f"TwoTowerConfig.tower must end in dim={self.dim} (got {self.tower}): the towers' "
                             "outputs are stacked with the id embeddings")


class DotHead(nn.Module):
    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        self.temperature = cfg.temperature

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return F.normalize(user[:, 0], dim=-1) @ F.normalize(item[:, 0], dim=-1).t() / self.temperature


class MoLHead(nn.Module):
    def __init__(self, cfg: TwoTowerConfig):
        super().__init__()
        P, Q, D = cfg.user_components, cfg.item_components, cfg.dim
        self.P, self.Q, self.temperature = P, Q, cfg.temperature
        self.user_proj = nn.Linear(USER_EMBEDDINGS * D, P * D)
        self.item_proj = nn.Linear(ITEM_EMBEDDINGS * D, Q * D)
        self.user_gate = mlp([USER_EMBEDDINGS * D, D, P * Q], last_activation=False)
        self.item_gate = mlp([ITEM_EMBEDDINGS * D, D, P * Q], last_activation=False)
        self.sim_gate = mlp([P * Q, P * Q, P * Q], last_activation=False)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        B, N, D = user.shape[0], item.shape[0], user.shape[2]
        user, item = user.flatten(1), item.flatten(1)
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

    def user_embeddings(self, users, history, history_offsets) -> torch.Tensor:
        """[B, USER_EMBEDDINGS, dim]: the tower's output, then its inputs."""
        inputs = [self.user_emb(users), self.history_emb(history, history_offsets)]
        return torch.stack([self.user_tower(torch.cat(inputs, dim=1)), *inputs], dim=1)

    def item_embeddings(self, items) -> torch.Tensor:
        """[N, ITEM_EMBEDDINGS, dim]: the tower's output, then its input."""
        ids = self.item_emb(items)
        return torch.stack([self.item_tower(ids), ids], dim=1)

    def forward(self, users, history, history_offsets, items):
        return self.head(self.user_embeddings(users, history, history_offsets), self.item_embeddings(items))


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
