"""The jagged pass on padded regions written without FBGEMM, one small module per form: paddings by
index_copy / index_put / scatter at (row, position) from the offsets, gathers back by the same indices or by
the padding mask, attention as einsum, SDPA with an arange mask, nn.MultiheadAttention with a key padding
mask; and forms it cannot prove (left padding) stay padded with the reason."""
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.utils.rnn import pad_sequence

import recompile
from recompile.backend import rec_ascend
from recompile.runtime.kernels import KERNELS

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

N, C, H = 8, 8, 2


def row_position(values, lengths):
    """offsets, and the (row, position) of every value, as users compute them."""
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
    ids = torch.arange(values.shape[0], device=values.device)
    rows = torch.searchsorted(offsets, ids, right=True) - 1
    return offsets, rows, ids - offsets[rows]


def causal_key_mask(lengths):
    ids = torch.arange(N)
    return (ids.view(1, N, 1) >= ids.view(1, 1, N)) & (ids.view(1, 1, N) < lengths.view(-1, 1, 1))


class IndexCopyFFN(nn.Module):
    """index_copy into a flat zero tensor, per-position LayerNorm/Linear/SiLU/eval dropout, flat[dest] back."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin, self.drop = nn.LayerNorm(C), nn.Linear(C, C), nn.Dropout(0.5)

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        dest = rows * N + positions
        x = values.new_zeros(b * N, C).index_copy(0, dest, values).view(b, N, C)
        y = self.drop(F.silu(self.lin(self.norm(x)))) + x
        return y.reshape(b * N, C)[dest]


class IndexPutSDPA(nn.Module):
    """index_put at (row, position), SDPA with a causal & length mask from arange compares, [row, position] back."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        x = values.new_zeros(b, N, C).index_put((rows, positions), values)
        q, k, v = (t.view(b, N, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_key_mask(lengths).unsqueeze(1))
        y = self.out(a.transpose(1, 2).reshape(b, N, C))
        return y[rows, positions]


class ScatterEinsumHSTU(nn.Module):
    """scatter into a flat zero tensor, HSTU's SiLU attention written with einsum and a float mask."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        dest = rows * N + positions
        index = dest.unsqueeze(1).expand(-1, 3 * C)
        x = values.new_zeros(b * N, 3 * C).scatter(0, index, F.silu(self.qkv(values))).view(b, N, 3 * C)
        q, k, v = (t.view(b, N, H, C // H) for t in x.split(C, dim=-1))
        mask = causal_key_mask(lengths).float()
        attn = F.silu(torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(C // H)) / N * mask.unsqueeze(1)
        return torch.einsum("bhnm,bmhd->bnhd", attn, v).reshape(b * N, C)[dest]


class MaskGather(IndexCopyFFN):
    """The same padding, gathered back by the padding mask (a data-dependent size: rec_ascend traces it
    with Dynamo's capture_dynamic_output_shape_ops)."""

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        x = values.new_zeros(b, N, C).index_put((rows, positions), values)
        y = F.silu(self.lin(self.norm(x)))
        return y[torch.arange(N) < lengths.unsqueeze(1)]


class MultiheadSASRec(nn.Module):
    """SASRec's attention as users write it: nn.MultiheadAttention with key_padding_mask and a causal attn_mask."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(C, H, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(C)

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        x = values.new_zeros(b, N, C).index_put((rows, positions), values)
        ids = torch.arange(N)
        padding = ids.view(1, N) >= lengths.view(-1, 1)
        future = torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1)
        y, _ = self.mha(x, x, x, key_padding_mask=padding, attn_mask=future, need_weights=False)
        return self.norm(x + y)[rows, positions]


class LeftPadded(IndexCopyFFN):
    """Left padding (the history ends at position N - 1): not the jagged layout, so it stays padded."""

    def forward(self, values, lengths):
        b = lengths.shape[0]
        _, rows, positions = row_position(values, lengths)
        dest = rows * N + N - lengths[rows] + positions
        x = values.new_zeros(b * N, C).index_copy(0, dest, values).view(b, N, C)
        return F.silu(self.lin(x)).reshape(b * N, C)[dest]


class PadSequenceCausal(nn.Module):
    """pad_sequence over a split by Python lengths, causal SDPA (is_causal), the rows cut back and concatenated."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, values, sizes):
        x = pad_sequence(torch.split(values, sizes), batch_first=True)
        b, n = x.shape[:2]
        q, k, v = (t.view(b, n, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        y = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, C))
        return torch.cat([y[i, :size] for i, size in enumerate(sizes)])


def test_pad_sequence_becomes_jagged_and_equals_eager():
    model = PadSequenceCausal().eval()
    sizes = [3, 7, 1, 5]
    values = torch.randn(sum(sizes), C)
    report = recompile.explain(model, values, sizes).to_dict()
    assert report["fallbacks"] == []
    assert ("attention", "recompile::jagged_softmax_attention") in {(r["kind"], r["op"]) for r in report["regions"]}
    assert "pad_sequence" not in report["stages"][-1]["code"]
    assert_compiled_equals_eager(model, values, sizes)


def batch_of(lengths):
    lengths = torch.tensor(lengths)
    return torch.randn(int(lengths.sum()), C), lengths


def outputs_and_grads(model, values, lengths):
    """``lengths``: a tensor, or Python sizes."""
    model.zero_grad()
    leaf = values.clone().requires_grad_()
    out = model(leaf, lengths)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.detach(), leaf.grad] + [p.grad for p in model.parameters()]


def assert_compiled_equals_eager(model, values, lengths):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rec_ascend")
    for got, want in zip(outputs_and_grads(compiled, values, lengths), outputs_and_grads(model, values, lengths)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


REWRITTEN = [
    (IndexCopyFFN, None),
    (IndexPutSDPA, "recompile::jagged_softmax_attention"),
    (ScatterEinsumHSTU, "recompile::hstu_attention"),
    (MultiheadSASRec, "recompile::jagged_softmax_attention"),
]


@pytest.mark.parametrize("module, attention", REWRITTEN, ids=lambda x: getattr(x, "__name__", str(x)))
def test_form_becomes_jagged_and_equals_eager(module, attention):
    model = module().eval()
    values, lengths = batch_of([5, 0, 8, 1])
    report = recompile.explain(model, values, lengths).to_dict()
    found = {(r["kind"], r["op"]) for r in report["regions"]}
    assert report["fallbacks"] == []
    assert ("jagged", "recompile::jagged_within") in found
    if attention is not None:
        assert ("attention", attention) in found
    final = report["stages"][-1]["code"]
    assert "index_copy" not in final and "index_put" not in final and "scatter" not in final
    assert_compiled_equals_eager(model, values, lengths)


def test_mask_gather_becomes_jagged():
    model = MaskGather().eval()
    values, lengths = batch_of([5, 0, 8, 1])
    report = recompile.explain(model, values, lengths).to_dict()
    assert report["fallbacks"] == []
    assert "index_put" not in report["stages"][-1]["code"]
    assert_compiled_equals_eager(model, values, lengths)


def test_left_padding_stays_padded_with_reason():
    model = LeftPadded().eval()
    values, lengths = batch_of([5, 2, 8])
    report = recompile.explain(model, values, lengths).to_dict()
    assert "jagged_within" not in report["stages"][-1]["code"]
    [fallback] = report["fallbacks"]
    assert "not (row, position) of each value" in fallback["reason"]
    assert_compiled_equals_eager(model, values, lengths)


def test_multihead_attention_weights_in_use_stay_padded_with_reason():
    class Weights(MultiheadSASRec):
        def forward(self, values, lengths):
            b = lengths.shape[0]
            _, rows, positions = row_position(values, lengths)
            x = values.new_zeros(b, N, C).index_put((rows, positions), values)
            padding = torch.arange(N).view(1, N) >= lengths.view(-1, 1)
            y, w = self.mha(x, x, x, key_padding_mask=padding)
            return y[rows, positions] * w.sum()

    report = recompile.explain(Weights().eval(), *batch_of([5, 2, 8])).to_dict()
    [fallback] = report["fallbacks"]
    assert "need_weights" in fallback["reason"]


@pytest.mark.slow  # tests/test_jagged_pass.py::test_hstu_layer_over_many_batches in make test
@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(0, N), min_size=1, max_size=5))
def test_index_padded_hstu_over_many_batches(lengths):
    """Empty and full histories, one history: one compiled model (dynamic after the second batch), equal to
    eager forward and backward."""
    model, compiled = SCATTER_UNDER_TEST
    values, lengths = batch_of(lengths)
    for got, want in zip(outputs_and_grads(compiled, values, lengths), outputs_and_grads(model, values, lengths)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


_scatter = ScatterEinsumHSTU()
SCATTER_UNDER_TEST = (_scatter, torch.compile(_scatter, backend="rec_ascend"))


def test_index_padded_forms_compile_at_most_twice(monkeypatch):
    calls = []
    kernel = KERNELS["jagged_softmax_attention"]["cpu"]
    monkeypatch.setitem(KERNELS["jagged_softmax_attention"], "cpu", lambda *a: calls.append(1) or kernel(*a))
    model = IndexPutSDPA().eval()
    # Autotune off: the test pins the kernel it counts.
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    compiled = torch.compile(model, backend=counter)
    batches = ([3, 8, 2], [5, 1, 7, 4, 6], [8, 0, 2, 2, 7, 1, 3, 5], [2, 6, 6, 1])
    with torch.no_grad():
        for lengths in batches:
            values, lengths = batch_of(lengths)
            torch.testing.assert_close(compiled(values, lengths), model(values, lengths), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2
    assert len(calls) == len(batches)  # the dynamic graph is rewritten too
