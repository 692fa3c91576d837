"""HSTU ranking for serving: a request is a user's history and candidates; each candidate's score is the dot
product of its hidden state with its item embedding. Candidates follow the history in the sequence as HSTU's
targets: each sees the history and itself, not the other candidates.

The models wrap a trained ``models.sequential.HSTU`` (its embeddings and STU layers, unchanged) and run its
layers on jagged rows with ``torch.ops.recompile`` attention ops (no padding):

- ``HSTURanker``: no cache; every request encodes its whole history (``hstu_attention`` with ``num_targets``).
- ``CachedHSTURanker``: one step over the new rows only (new actions + candidates), their attention reading
  the cached prefix's keys and values from the pools of a ``PagedKVCache`` (``hstu_paged_attention``); it
  returns the new rows' keys and values per layer for the cache. A pure function of its inputs: it compiles
  and exports like any module.
- ``RankingServer``: the request loop: cache lookup, page reservation, the cached step, writes, commit.

With the cache the scores equal ``HSTURanker``'s on the same histories (tests/test_kv_cache.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

import recompile  # noqa: F401  (defines torch.ops.recompile.*)
from .sequential import HSTU, STULayer
from recompile.lowering import choose, detect_target
from recompile.serving import PagedKVCache


def fastest(op: str, *args, **kwargs) -> str:
    """The kernel the lowering registry picks for a call of ``op`` on this machine's default target: the first the
    target runs whose ``supports`` takes the call's arguments (``args``/``kwargs`` as the op gets them; real
    tensors are read through fake copies, as the compiler's lowering reads its graph's example values)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t if isinstance(t, FakeTensor) else mode.from_tensor(t),
                                        (args, kwargs))
    return choose(f"recompile::{op}", detect_target(), *args, **kwargs).impl


def project(layer: STULayer, x: torch.Tensor):
    """``u [T, H * dv]`` and ``q, k [T, H, d]``, ``v [T, H, dv]`` of one STU layer, as ``STULayer.forward``."""
    cfg = layer.cfg
    u, v, q, k = torch.split(F.silu(layer.uvqk(F.layer_norm(x, (cfg.dim,)))), layer.split_sizes, dim=-1)
    heads = cfg.num_heads
    return u, q.view(-1, heads, cfg.attn_dim), k.view(-1, heads, cfg.attn_dim), v.view(-1, heads, cfg.linear_dim)


def finish(layer: STULayer, x: torch.Tensor, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """The layer's output from its attention ``[T, H, dv]``, as ``STULayer.forward``."""
    out = attn.flatten(1)
    return x + layer.out(layer.dropout(u * F.layer_norm(out, (out.shape[1],))))


class RankerBase(nn.Module):
    """``impl``: the attention op's kernel; None: the registry's choice (``fastest``) on the op's arguments at the
    first call (kept: the model's dtype, device and biases decide it, not a batch's sizes). Before compiling or
    exporting a model whose kernel is not chosen yet, ``choose_kernel(*inputs)`` decides it on fake inputs."""

    op: str

    def __init__(self, encoder: HSTU, impl: Optional[str] = None):
        super().__init__()
        self.encoder = encoder
        self.max_len = encoder.cfg.max_len
        self.impl = impl

    def kernel(self, *args) -> str:
        """The kernel of this call of the attention op, whose arguments are ``args``."""
        if self.impl is None:
            if torch.compiler.is_compiling():
                raise RuntimeError(f"{type(self).__name__}: no kernel chosen for recompile::{self.op} yet: call "
                                   "choose_kernel(*inputs) (or the model once) before compiling or exporting it")
            self.impl = fastest(self.op, *args)
        return self.impl

    @torch.no_grad()
    def choose_kernel(self, *inputs) -> str:
        """Decide the kernel on ``inputs`` without running it: the forward once on fake copies of them."""
        if self.impl is None:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                self(*pytree.tree_map_only(torch.Tensor, mode.from_tensor, inputs))
        return self.impl

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        return enc.dropout(enc.item_emb(ids) * math.sqrt(enc.cfg.dim) + enc.pos_emb(positions))

    def scores(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every row's score against its own item: ``<hidden, item_emb(id)>``."""
        return (hidden * self.encoder.item_emb(ids)).sum(-1)


class HSTURanker(RankerBase):
    """``forward(ids, timestamps, positions, offsets, num_targets) -> scores [T]``: jagged sequences (history then
    ``num_targets[b]`` candidates), every row scored against its own item (candidates' scores are the last
    ``num_targets[b]`` of each sequence)."""

    op = "hstu_attention"

    def forward(self, ids, timestamps, positions, offsets, num_targets):
        x = self.embed(ids, positions)
        for layer in self.encoder.layers:
            u, q, k, v = project(layer, x)
            args = (q, k, v, offsets, self.max_len, 1.0, True, num_targets, 0, layer.pos_bias, timestamps,
                    layer.time_bias)
            attn = torch.ops.recompile.hstu_attention(*args, self.kernel(*args))
            x = finish(layer, x, u, attn)
        return self.scores(x, ids)


class CachedHSTURanker(RankerBase):
    """``forward(ids, timestamps, positions, offsets, num_targets, page_table, cached_lengths, k_cache, v_cache,
    ts_cache) -> (scores [T], k_new [layers, T, H, d], v_new [layers, T, H, dv])`` over the new rows."""

    op = "hstu_paged_attention"

    def forward(self, ids, timestamps, positions, offsets, num_targets, page_table, cached_lengths, k_cache, v_cache,
                ts_cache):
        x = self.embed(ids, positions)
        keys, values = [], []
        for i, layer in enumerate(self.encoder.layers):
            u, q, k, v = project(layer, x)
            args = (q, k, v, offsets, k_cache[i], v_cache[i], page_table, cached_lengths, self.max_len, 1.0,
                    num_targets, layer.pos_bias, timestamps, ts_cache, layer.time_bias)
            attn = torch.ops.recompile.hstu_paged_attention(*args, self.kernel(*args))
            keys.append(k)
            values.append(v)
            x = finish(layer, x, u, attn)
        return self.scores(x, ids), torch.stack(keys), torch.stack(values)


def compile_step(model: nn.Module, backend: str = "rec_ascend"):
    """``torch.compile`` of a ranker with every dim dynamic and no duck sizing (dims that happen to be equal in
    the first batch, e.g. the batch and the number of layers, stay distinct symbols), so that batches of other
    sizes, row counts and page-table widths run the one graph."""
    compiled = torch.compile(model, backend=backend, dynamic=True)

    def step(*args):
        model.choose_kernel(*args)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return step


@dataclass
class Request:
    """One user's ranking request: its whole history (oldest first) and the candidates to score."""

    user: Hashable
    history: torch.Tensor  # item ids [n]
    history_ts: torch.Tensor  # [n]
    candidates: torch.Tensor  # item ids [c]
    candidate_ts: torch.Tensor  # [c]


def jagged(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated parts and their offsets (int64)."""
    lengths = torch.tensor([p.numel() for p in parts])
    return torch.cat(list(parts)), F.pad(torch.cumsum(lengths, 0), (1, 0))


def candidate_scores(scores: torch.Tensor, offsets: torch.Tensor, num_targets: torch.Tensor) -> list[torch.Tensor]:
    ends = offsets[1:].tolist()
    return [scores[e - c : e] for e, c in zip(ends, num_targets.tolist())]


def no_cache_inputs(requests: Sequence[Request]):
    """``HSTURanker``'s inputs for a batch: each user's history then its candidates."""
    ids, offsets = jagged([torch.cat([r.history, r.candidates]) for r in requests])
    ts, _ = jagged([torch.cat([r.history_ts, r.candidate_ts]) for r in requests])
    positions = torch.cat([torch.arange(r.history.numel() + r.candidates.numel()) for r in requests])
    num_targets = torch.tensor([r.candidates.numel() for r in requests])
    return ids, ts, positions, offsets, num_targets


@torch.no_grad()
def rank_without_cache(model, requests: Sequence[Request]) -> list[torch.Tensor]:
    """Each request's candidate scores from ``HSTURanker`` (or a compiled or loaded form of it)."""
    ids, ts, positions, offsets, num_targets = no_cache_inputs(requests)
    return candidate_scores(model(ids, ts, positions, offsets, num_targets), offsets, num_targets)


class RankingServer:
    """Serves batches of requests with a ``PagedKVCache``: only the history past each user's cached prefix and
    the candidates are computed; the new history rows' keys and values are then cached."""

    def __init__(self, model: CachedHSTURanker, cache: PagedKVCache, step=None):
        self.model, self.cache = model, cache
        self.step = model if step is None else step  # the step as it runs: eager, torch.compile'd or a loaded package

    def prepare(self, requests: Sequence[Request]) -> "Step":
        """Look the users up in the cache and reserve pages for their new tokens: the step's inputs."""
        cache, users = self.cache, [r.user for r in requests]
        cached = cache.lookup(users, [r.history for r in requests])
        cache.reserve(users, [r.history.numel() for r in requests])
        page_table, cached_lengths = cache.page_table(users)
        ids, offsets = jagged([torch.cat([r.history[c:], r.candidates]) for r, c in zip(requests, cached)])
        ts, _ = jagged([torch.cat([r.history_ts[c:], r.candidate_ts]) for r, c in zip(requests, cached)])
        positions = torch.cat([torch.arange(c, r.history.numel() + r.candidates.numel())
                               for r, c in zip(requests, cached)])
        num_targets = torch.tensor([r.candidates.numel() for r in requests])
        fresh = [r.history.numel() - c for r, c in zip(requests, cached)]
        args = (ids, ts, positions, offsets, num_targets, page_table, cached_lengths, cache.k, cache.v, cache.ts)
        return Step(requests, args, fresh)

    @torch.no_grad()
    def rank(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Each request's candidate scores; the new history tokens' keys and values are cached."""
        step = self.prepare(requests)
        scores, keys, values = self.step(*step.args)
        ts, offsets, num_targets = step.args[1], step.args[3], step.args[4]
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(offsets.tolist(), step.fresh)])  # new history rows
        users = [r.user for r in requests]
        slots = self.cache.slots(users, step.fresh)
        self.cache.write_layers(slots, keys[:, rows], values[:, rows])
        self.cache.commit(users, [r.history for r in requests], slots, ts[rows])
        return candidate_scores(scores, offsets, num_targets)


@dataclass
class Step:
    """A batch's inputs to ``CachedHSTURanker`` and the count of new history tokens per request."""

    requests: Sequence[Request]
    args: tuple
    fresh: list[int]


def make_cache(encoder: HSTU, num_pages: int, page_size: int = 32, tier: Optional[str] = None) -> PagedKVCache:
    """A cache shaped for ``encoder``'s layers."""
    cfg = encoder.cfg
    return PagedKVCache(cfg.num_layers, num_pages, page_size, cfg.num_heads, cfg.attn_dim, cfg.linear_dim,
                        dtype=encoder.item_emb.weight.dtype, tier=tier)
