"""The jagged pass on padded layers as users write them (models/layers_jagged.py): regions found,
compiled forward and gradients equal to eager, regions it cannot prove left padded with the reason,
and at most two compiles over varying batches."""
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from recompile.backend import rec_ascend
from recompile.lowering import choose
from recompile.lowering.targets import detect_target
from models.layers_jagged import HSTULayer, SASRecLayer, jagged_batch
from recompile.runtime.kernels import KERNELS

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

MAX_LEN = 16


def batch_of(lengths, dim=16):
    lengths = torch.tensor(lengths, dtype=torch.int64)
    return torch.randn(int(lengths.sum()), dim), lengths


def regions(model, *args):
    report = recompile.explain(model, *args).to_dict()
    return report, sorted((r["kind"], r["op"]) for r in report["regions"])


def grads_of(model, values, lengths):
    model.zero_grad()
    leaf = values.clone().requires_grad_()
    out = model(leaf, lengths)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [leaf.grad] + [p.grad for p in model.parameters()]


def assert_same_training(model, values, lengths, rtol=1e-5, atol=1e-5):
    torch._dynamo.reset()  # a static first compile, where verify can run the graphs
    compiled = torch.compile(model, backend="rec_ascend", options={"verify": True})
    out_c, grads_c = grads_of(compiled, values, lengths)
    out_e, grads_e = grads_of(model, values, lengths)
    torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)


def test_hstu_layer_becomes_jagged():
    model = HSTULayer(16, 2, 8, MAX_LEN)
    report, found = regions(model, *batch_of([16, 3, 0, 7]))
    assert ("attention", "recompile::hstu_attention") in found
    assert ("jagged", "recompile::jagged_within") in found
    assert report["fallbacks"] == []
    final = report["stages"][-1]["code"]
    assert "jagged_to_padded_dense" not in final and "dense_to_jagged" not in final


def test_hstu_layer_forward_and_grads_equal_eager():
    assert_same_training(HSTULayer(16, 2, 8, MAX_LEN), *batch_of([16, 3, 0, 7]))


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=6))
def test_hstu_layer_over_many_batches(lengths):
    """Zero-length histories, one history, full ones: one compiled layer (dynamic after the 2nd batch)."""
    model, compiled = HSTU_UNDER_TEST
    values, lengths = batch_of(lengths)
    out_c, grads_c = grads_of(compiled, values, lengths)
    out_e, grads_e = grads_of(model, values, lengths)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-4, atol=1e-5)


_hstu = HSTULayer(16, 2, 8, MAX_LEN)
HSTU_UNDER_TEST = (_hstu, torch.compile(_hstu, backend="rec_ascend"))


def test_sasrec_layer_becomes_jagged_in_eval():
    model = SASRecLayer(16, 2, MAX_LEN).eval()
    report, found = regions(model, *batch_of([5, 16, 1]))
    assert ("attention", "recompile::jagged_softmax_attention") in found and report["fallbacks"] == []
    assert_same_training(model, *batch_of([5, 16, 1, 9]))


def test_sasrec_training_dropout_stays_padded_with_reason():
    model = SASRecLayer(16, 2, MAX_LEN).train()
    report, found = regions(model, *batch_of([5, 16, 1]))
    assert ("attention", "recompile::jagged_softmax_attention") not in found
    [fallback] = report["fallbacks"]
    assert "dropout in training mode" in fallback["reason"]


class WindowedHSTU(HSTULayer):
    """HSTU attention whose mask also cuts keys more than 3 positions back: not an op the pass knows."""

    def forward(self, values, lengths):
        n, h, d = self.max_seq_len, self.heads, self.head_dim
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        x = torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [n], 0.0)
        b = x.shape[0]
        u, v, q, k = torch.split(F.silu(self.uvqk(x)), h * d, dim=-1)
        q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in (q, k, v))
        ids = torch.arange(n)
        window = (ids.view(n, 1) >= ids.view(1, n)) & (ids.view(n, 1) - ids.view(1, n) < 3)
        attn = F.silu(torch.matmul(q, k.transpose(-2, -1)) * self.alpha) / n * window
        y = self.out(torch.matmul(attn, v).transpose(1, 2).flatten(2) * u) + x
        return torch.ops.fbgemm.dense_to_jagged(y, [offsets], values.shape[0])[0]


def test_unprovable_mask_stays_padded_and_matches_eager():
    model = WindowedHSTU(16, 2, 8, MAX_LEN)
    values, lengths = batch_of([9, 2, 16])
    report, found = regions(model, values, lengths)
    assert ("attention", "recompile::hstu_attention") not in found
    [fallback] = report["fallbacks"]
    assert "neither causal over the sequence nor the sequence's keys" in fallback["reason"]
    compiled = torch.compile(model, backend="rec_ascend")
    torch.testing.assert_close(compiled(values, lengths), model(values, lengths), rtol=1e-5, atol=1e-6)


def test_sequence_longer_than_padding_raises():
    model = HSTULayer(16, 2, 8, MAX_LEN)
    compiled = torch.compile(model, backend="rec_ascend")
    compiled(*batch_of([3, 4]))
    with pytest.raises(Exception, match="at most 16 positions .* a sequence has 20"):
        compiled(*batch_of([3, 20]))


def count_hstu_kernel_calls(monkeypatch) -> list:
    """A list that gets an entry per call of the HSTU attention kernel the pass lowers to on CPU."""
    calls = []
    impl = choose("recompile::hstu_attention", detect_target("cpu")).impl
    kernel = KERNELS["hstu_attention"][impl]
    monkeypatch.setitem(KERNELS["hstu_attention"], impl, lambda *a: calls.append(1) or kernel(*a))
    return calls


def test_varying_batches_compile_at_most_twice(monkeypatch):
    calls = count_hstu_kernel_calls(monkeypatch)
    model = HSTULayer(16, 2, 8, MAX_LEN).eval()
    # Autotune off: the test pins the kernel it counts.
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    compiled = torch.compile(model, backend=counter)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for batch in (3, 5, 8, 13, 21):
            values, lengths = jagged_batch(batch, MAX_LEN, 16, gen)
            torch.testing.assert_close(compiled(values, lengths), model(values, lengths), rtol=1e-5, atol=1e-6)
    assert counter.frame_count <= 2
    assert len(calls) == 5  # the dynamic-shape graph runs the jagged attention too
