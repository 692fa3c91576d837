"""An HSTU encoder written the way Meta's generative-recommenders writes it (its research ``hstu.py``), from the
published semantics, not our zoo's layer: jagged ``x`` [sum N_i, D] with ``x_offsets``; one ``mm`` with a raw
``uvqk`` parameter, SiLU, split into u, v, q, k; q, k and v padded with ``torch.ops.fbgemm.jagged_to_padded_dense``;
``einsum`` scores plus a relative position bias, ``silu(scores) / n`` times a causal 0/1 mask, ``einsum`` with v,
``torch.ops.fbgemm.dense_to_jagged`` back; ``u * layer_norm(attention)`` through the output linear, plus ``x``.
The user's vector is the last item of each history (GR's ``get_current_embeddings``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ITEMS, MAX_LEN, DIM, HEADS, HEAD_DIM, LAYERS = 200, 12, 16, 2, 8, 2


class RelativePositionBias(nn.Module):
    """w[j - i] for every (i, j) of an n x n attention: a learned weight per relative position."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.randn(2 * n - 1) * 0.02)

    def forward(self) -> torch.Tensor:
        n = self.n
        t = F.pad(self.w, [0, n]).repeat(n)[:-n].reshape(1, n, 3 * n - 2)
        r = (2 * n - 1) // 2
        return t[..., r:-r]


class STUJagged(nn.Module):
    """One sequential transduction unit on jagged rows."""

    def __init__(self, n: int):
        super().__init__()
        self.uvqk = nn.Parameter(torch.randn(DIM, 4 * HEADS * HEAD_DIM) * 0.02)
        self.bias = RelativePositionBias(n)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x, x_offsets, invalid_attn_mask):
        n, b = invalid_attn_mask.size(-1), x_offsets.size(0) - 1
        mixed = F.silu(torch.mm(F.layer_norm(x, [DIM], eps=1e-6), self.uvqk))
        u, v, q, k = torch.split(mixed, HEADS * HEAD_DIM, dim=1)
        padded_q = torch.ops.fbgemm.jagged_to_padded_dense(values=q, offsets=[x_offsets], max_lengths=[n], padding_value=0.0)
        padded_k = torch.ops.fbgemm.jagged_to_padded_dense(values=k, offsets=[x_offsets], max_lengths=[n], padding_value=0.0)
        scores = torch.einsum("bnhd,bmhd->bhnm", padded_q.view(b, n, HEADS, HEAD_DIM), padded_k.view(b, n, HEADS, HEAD_DIM))
        scores = scores + self.bias().unsqueeze(1)
        scores = F.silu(scores) / n * invalid_attn_mask.unsqueeze(0).unsqueeze(0)
        padded_v = torch.ops.fbgemm.jagged_to_padded_dense(v, [x_offsets], [n]).reshape(b, n, HEADS, HEAD_DIM)
        attn = torch.einsum("bhnm,bmhd->bnhd", scores, padded_v).reshape(b, n, HEADS * HEAD_DIM)
        attn = torch.ops.fbgemm.dense_to_jagged(attn, [x_offsets])[0]
        return self.o(u * F.layer_norm(attn, [HEADS * HEAD_DIM], eps=1e-6)) + x


class HSTU(nn.Module):
    """Padded item histories [B, N] and their lengths -> the user's vector [B, DIM] (``forward``); ``loss`` is the
    softmax cross-entropy of the next item over all items."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(ITEMS, DIM, padding_idx=0)
        self.layers = nn.ModuleList(STUJagged(MAX_LEN) for _ in range(LAYERS))
        self.register_buffer("causal", torch.tril(torch.ones(MAX_LEN, MAX_LEN)), persistent=False)

    def forward(self, item_seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        x_offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
        x = torch.ops.fbgemm.dense_to_jagged(self.items(item_seq) * DIM ** 0.5, [x_offsets])[0]
        for layer in self.layers:
            x = layer(x, x_offsets, self.causal)
        return F.normalize(x[x_offsets[1:] - 1], dim=-1)

    def loss(self, item_seq: torch.Tensor, lengths: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(item_seq, lengths) @ self.items.weight.t(), target)


def build(seed: int = 0) -> HSTU:
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm, as generative-recommenders imports it)

    torch.manual_seed(seed)
    return HSTU()


def batch(size: int, seed: int = 0) -> tuple:
    """(padded histories [size, MAX_LEN] of 1..MAX_LEN items, their lengths, next items)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, MAX_LEN + 1, (size,), generator=gen)
    seq = torch.randint(1, ITEMS, (size, MAX_LEN), generator=gen)
    seq = seq * (torch.arange(MAX_LEN) < lengths[:, None])
    return seq, lengths, torch.randint(1, ITEMS, (size,), generator=gen)
