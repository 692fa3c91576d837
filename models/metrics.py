"""Metrics: HR@K / NDCG@K by full ranking over all items, AUC and log-loss for CTR, a popularity baseline."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def target_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-based rank of each target among all items: the number of items scored strictly higher.

    scores [B, N] over items 1..N (column i-1 is item i); targets [B] item ids in 1..N.
    """
    target_scores = scores.gather(1, (targets - 1).unsqueeze(1))
    return (scores > target_scores).sum(1)


def hits(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """Per user: 1 when the target ranks in the top K."""
    return (ranks < k).double()


def ndcg_gains(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """Per user, NDCG@K with one relevant item: 1 / log2(rank + 2) when it ranks in the top K."""
    return torch.where(ranks < k, 1.0 / torch.log2(ranks.double() + 2), torch.zeros((), dtype=torch.double))


USER_GAINS = {"HR": hits, "NDCG": ndcg_gains}


def user_gains(ranks: torch.Tensor, metric: str) -> torch.Tensor:
    """Per-user gains of a metric named like ``ranking_metrics``' keys ("HR@10", "NDCG@10"): their mean is it."""
    name, k = metric.split("@")
    return USER_GAINS[name](ranks, int(k))


def hit_rate(ranks: torch.Tensor, k: int) -> float:
    return hits(ranks, k).mean().item()


def ndcg(ranks: torch.Tensor, k: int) -> float:
    return ndcg_gains(ranks, k).mean().item()


def ranking_metrics(ranks: torch.Tensor, ks: tuple[int, ...] = (10, 50)) -> dict[str, float]:
    out = {}
    for k in ks:
        out[f"HR@{k}"] = hit_rate(ranks, k)
        out[f"NDCG@{k}"] = ndcg(ranks, k)
    return out


def popularity_scores(train_items: list[np.ndarray], num_items: int) -> torch.Tensor:
    """Training-set counts of items 1..N: the popularity baseline's score for every user."""
    counts = np.bincount(np.concatenate(train_items), minlength=num_items + 1)[1:]
    return torch.from_numpy(counts.astype(np.float64))


def auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties)."""
    labels, scores = labels.double().flatten(), scores.double().flatten()
    num_pos = labels.sum().item()
    num_neg = len(labels) - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    sorted_scores, order = scores.sort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.double)
    # average ranks over ties
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return ((ranks * labels).sum().item() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)


def log_loss(labels: torch.Tensor, logits: torch.Tensor) -> float:
    return F.binary_cross_entropy_with_logits(logits.double().flatten(), labels.double().flatten()).item()
