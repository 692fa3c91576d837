"""Semantic IDs: items as short tuples of codes, by residual k-means (RQ-KMeans) over item embeddings.

Level 1 clusters the embeddings into ``K`` centroids; each next level clusters what the previous levels
left (the residuals), so an item's code tuple ``(c_1, ..., c_L)`` names a coarse-to-fine path and
``sum_l centroid_l[c_l]`` reconstructs its embedding. Items that share all ``L`` codes (collisions) get one
extra level numbering them within their group (0, 1, ...), as TIGER does, so every item has a unique tuple.
:class:`SemanticIds` keeps the codes, the centroids and what the tokenizer reports: the code utilisation of
each level, the collision rate before the extra level and the reconstruction error after each level.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means from a k-means++ start: ``(centroids [k, d], assignment [n])``. An emptied cluster is
    re-seeded with the point farthest from its centroid, so every centroid stays a cluster mean."""
    n = x.shape[0]
    k = min(k, n)
    centroids = x[torch.randint(0, n, (1,), generator=generator)]
    for _ in range(1, k):  # k-means++: the next centre with probability ~ squared distance to the nearest
        dist = torch.cdist(x, centroids).min(1).values.square()
        weights = dist if float(dist.sum()) > 0 else torch.ones_like(dist)
        centroids = torch.cat([centroids, x[torch.multinomial(weights, 1, generator=generator)]])
    for _ in range(iters):
        dist = torch.cdist(x, centroids)
        assign = dist.argmin(1)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        empty = counts == 0
        centroids = torch.where(empty.unsqueeze(1), centroids, sums / counts.clamp(min=1).unsqueeze(1).to(x.dtype))
        if bool(empty.any()):
            far = dist.gather(1, assign.unsqueeze(1)).squeeze(1).topk(int(empty.sum())).indices
            centroids[empty] = x[far]
    return centroids, torch.cdist(x, centroids).argmin(1)


def collision_level(codes: torch.Tensor) -> torch.Tensor:
    """Each item's index among the items with the same code tuple (0 for the first, 1, ...)."""
    _, group = torch.unique(codes, dim=0, return_inverse=True)
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    starts = torch.searchsorted(sorted_group, sorted_group, right=False)
    index = torch.empty_like(group)
    index[order] = torch.arange(len(group)) - starts
    return index


@dataclass
class SemanticIds:
    """Codes of ``n`` items: ``codes [n, levels]`` (int64), the last level the collision level where one was
    needed. ``codebook_sizes[l]``: how many codes level ``l`` can take."""

    codes: torch.Tensor
    centroids: list[torch.Tensor]
    codebook_sizes: list[int]
    reconstruction_errors: list[float]  # mean squared error after each quantization level
    collision_rate: float  # items sharing their tuple of quantized codes with another item

    @property
    def num_levels(self) -> int:
        return self.codes.shape[1]

    def utilisation(self) -> list[float]:
        """Fraction of each level's codes that some item uses."""
        return [len(torch.unique(self.codes[:, level])) / size for level, size in enumerate(self.codebook_sizes)]

    def report(self) -> dict:
        return {"levels": self.num_levels, "codebook_sizes": self.codebook_sizes,
                "utilisation": [round(u, 4) for u in self.utilisation()],
                "collision_rate": round(self.collision_rate, 4),
                "reconstruction_mse": [round(e, 6) for e in self.reconstruction_errors]}


def rq_kmeans(embeddings: torch.Tensor, levels: int, codebook_size: int, iters: int = 20,
              seed: int = 0) -> SemanticIds:
    """Semantic IDs of ``embeddings [n, d]``: ``levels`` of residual k-means with ``codebook_size`` codes each,
    plus a collision level when two items share all ``levels`` codes. Deterministic for a seed."""
    if embeddings.dim() != 2 or embeddings.shape[0] == 0:
        raise ValueError(f"rq_kmeans: embeddings must be [items, dim] with items > 0, got {tuple(embeddings.shape)}")
    if levels < 1 or codebook_size < 1:
        raise ValueError(f"rq_kmeans: levels ({levels}) and codebook_size ({codebook_size}) must be >= 1")
    generator = torch.Generator().manual_seed(seed)
    residual = embeddings.detach().float().clone()
    codes, centroids, errors = [], [], []
    for _ in range(levels):
        level_centroids, assign = kmeans(residual, codebook_size, iters, generator)
        residual = residual - level_centroids[assign]
        codes.append(assign)
        centroids.append(level_centroids)
        errors.append(float(residual.square().sum(1).mean()))
    codes = torch.stack(codes, 1)
    extra = collision_level(codes)
    sizes = [codebook_size] * levels
    counts = torch.unique(codes, dim=0, return_counts=True)[1]
    rate = float(counts[counts > 1].sum()) / len(codes)
    if int(extra.max()) > 0:
        codes = torch.cat([codes, extra.unsqueeze(1)], 1)
        sizes.append(int(extra.max()) + 1)
    return SemanticIds(codes, centroids, sizes, errors, rate)
