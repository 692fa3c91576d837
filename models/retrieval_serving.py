"""Retrieval serving: top-k items of a corpus for the two-tower heads of ``models.retrieval``, block by block.

- ``blocked_topk(score_block, num_items, k)``: scores ``[B, block]`` of one block of items at a time, each
  block's best ``k`` merged into the running best; the ``[B, num_items]`` score matrix never exists (each
  block's scores stay in cache for their top-k). The values equal
  ``torch.topk`` of the full matrix; indices too, up to the choice among items tied with the k-th value
  (which ``torch.topk`` leaves unspecified as well). Results are sorted by score, then by item index.
- ``ItemIndex``: a two-tower model's item embeddings computed once for the corpus; ``topk(users, history,
  offsets, k)`` with the model's head (dot: normalised matmul per block; MoL: the head on each block), and
  ``shortlist=M`` for an h-indexer-style first stage: a cheap score (one matmul) picks ``M`` items, the MoL
  head re-scores only those (``recall`` measures what that loses against exact MoL top-k).
- ``QuantizedItems``: plain dot-product top-k over a float corpus by the native kernel: int8 bounds prune, the
  survivors are re-scored exactly (reads about a quarter of the corpus' bytes, no score matrix).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .retrieval import DotHead, TwoTower

ScoreBlock = Callable[[int, int], torch.Tensor]  # (start, stop) -> scores [B, stop - start]


def sort_by_score(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by value descending, equal values by index ascending."""
    by_index = indices.argsort(dim=1)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    order = values.argsort(dim=1, descending=True, stable=True)
    return values.gather(1, order), indices.gather(1, order)


def blocked_topk(score_block: ScoreBlock, num_items: int, k: int, block: int = 65536):
    """``(values [B, k], indices [B, k])`` of the best ``k`` of ``num_items`` scores, computed ``block`` at a time."""
    if not 0 < k <= num_items:
        raise ValueError(f"blocked_topk: k must be in [1, num_items={num_items}], got {k}")
    values = indices = None
    for start in range(0, num_items, block):
        scores = score_block(start, min(start + block, num_items))
        top = scores.topk(min(k, scores.shape[1]), dim=1)
        if values is None:
            values, indices = top.values, top.indices + start
        else:
            values, indices = torch.cat([values, top.values], 1), torch.cat([indices, top.indices + start], 1)
            top = values.topk(min(k, values.shape[1]), dim=1)
            values, indices = top.values, indices.gather(1, top.indices)
    return sort_by_score(values, indices)


def matmul_scores(queries: torch.Tensor, items: torch.Tensor, scale: float = 1.0) -> ScoreBlock:
    """Scores ``scale * queries [B, d] @ items[start:stop].T``."""

    def score_block(start: int, stop: int) -> torch.Tensor:
        scores = torch.mm(queries, items[start:stop].t())
        return scores.mul_(scale) if scale != 1.0 else scores

    return score_block


class QuantizedItems:
    """A corpus of float item vectors ``[N, d]`` indexed for exact dot-product top-k on CPU
    (``torch.ops.recompile_native.item_topk``, runtime/csrc/item_topk.h): int8 codes per item (scale max|x| / 127)
    in blocks of 16 items laid out dimension-major, read to bound every item's score; only the items whose bound
    reaches the running k-th best are re-scored from the float rows. Built once per corpus; ``topk(queries, k)``
    equals ``torch.topk`` of ``queries @ items.T`` (values, and indices up to ties) without the score matrix."""

    BLOCK = 16

    def __init__(self, items: torch.Tensor):
        from recompile.runtime import jagged_attention_native  # loads the native library

        if not jagged_attention_native.available():
            raise RuntimeError("QuantizedItems: the native CPU kernels are not built")
        self.items = items.detach().float().contiguous()
        n, d = self.items.shape
        padded = F.pad(self.items, (0, 0, 0, -n % self.BLOCK))
        scales = padded.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        codes = torch.round(padded / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.codes = codes.view(-1, self.BLOCK, d).transpose(1, 2).contiguous()  # [N / 16, d, 16]
        self.scales = scales.contiguous()

    def topk(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values [B, k], indices [B, k])``: the best ``k`` items of each query, sorted, equal values by index."""
        return torch.ops.recompile_native.item_topk(queries.detach().float().contiguous(), self.items, self.codes,
                                                    self.scales, k)


def recall(found: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean fraction of each row's exact top-k that ``found`` holds."""
    hits = (found.unsqueeze(2) == exact.unsqueeze(1)).any(1).float()
    return float(hits.mean())


class ItemIndex:
    """A ``TwoTower``'s corpus (items 1..num_items) embedded once, for top-k retrieval by its head.

    The shortlist's cheap score for a MoL head is the similarity of the mean user and mean item component
    (``<mean_p u_p, mean_q x_q>``: the MoL logit with uniform gates), one matmul over precomputed item vectors.
    """

    def __init__(self, model: TwoTower, block: int = 65536):
        self.model, self.block = model, block
        with torch.no_grad():
            self.items = model.item_embeddings(torch.arange(1, model.cfg.num_items + 1))  # [N, ITEM_EMBEDDINGS, d]
            if isinstance(model.head, DotHead):
                self.cheap_items = F.normalize(self.items[:, 0], dim=-1)
            else:
                self.cheap_items = self._components(model.head.item_proj, self.items).mean(1)

    def _components(self, proj, side: torch.Tensor) -> torch.Tensor:
        """A MoL side's normalised component embeddings ``[n, components, d]``, as ``MoLHead.forward``."""
        return F.normalize(proj(side.flatten(1)).view(side.shape[0], -1, side.shape[2]), dim=-1)

    def _cheap(self, user: torch.Tensor) -> ScoreBlock:
        if isinstance(self.model.head, DotHead):
            query = F.normalize(user[:, 0], dim=-1)
        else:
            query = self._components(self.model.head.user_proj, user).mean(1)
        return matmul_scores(query, self.cheap_items, 1.0 / self.model.cfg.temperature)

    @torch.no_grad()
    def topk(self, users, history, history_offsets, k: int, shortlist: Optional[int] = None):
        """``(scores [B, k], item ids [B, k])`` by the model's head; ``shortlist``: the MoL head re-scores the
        ``shortlist`` items the cheap score ranks best."""
        user = self.model.user_embeddings(users, history, history_offsets)
        head, n = self.model.head, self.items.shape[0]
        if isinstance(head, DotHead):
            values, rows = blocked_topk(self._cheap(user), n, k, self.block)
        elif shortlist is None:
            values, rows = blocked_topk(lambda s, e: head(user, self.items[s:e]), n, k, self.block)
        else:
            _, short = blocked_topk(self._cheap(user), n, shortlist, self.block)
            scores = torch.stack([head(user[b : b + 1], self.items[short[b]])[0] for b in range(short.shape[0])])
            top = scores.topk(k, dim=1)
            values, rows = sort_by_score(top.values, short.gather(1, top.indices))
        return values, rows + 1  # row i is item i + 1
