"""The jagged pass on generative-recommenders' HSTU layer (models/corpus/gr_hstu.py): ``jagged_to_padded_dense``
called with keyword arguments (the pass read ``node.args[0]`` and failed with an IndexError, falling back), a
relative position bias moved into place by pad / repeat / slices, and a causal mask held in a module buffer ->
``recompile.hstu_attention``, equal to eager forward and backward; biases and masks it cannot prove stay padded
with the reason."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from models.corpus import gr_hstu
from recompile.backend import rec_ascend
from recompile.tracing import TracingConfig

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

pytest.importorskip("fbgemm_gpu")
N = gr_hstu.MAX_LEN


class Layer(torch.nn.Module):
    """One STU layer over jagged rows, with its causal mask as a buffer (as GR's encoder holds it)."""

    def __init__(self, mask=None):
        super().__init__()
        torch.manual_seed(0)
        self.stu = gr_hstu.STUJagged(N)
        self.register_buffer("mask", torch.tril(torch.ones(N, N)) if mask is None else mask, persistent=False)

    def forward(self, x, lengths):
        return self.stu(x, torch.ops.fbgemm.asynchronous_complete_cumsum(lengths), self.mask)


def batch_of(lengths):
    lengths = torch.tensor(lengths)
    return torch.randn(int(lengths.sum()), gr_hstu.DIM), lengths


def regions_and_fallbacks(model, *inputs):
    torch._dynamo.reset()
    report = recompile.explain(model, *inputs).to_dict()
    return {(r["kind"], r["op"]) for r in report["regions"]}, [f["reason"] for f in report["fallbacks"]]


def outputs_and_grads(model, x, lengths):
    model.zero_grad()
    leaf = x.clone().requires_grad_()
    out = model(leaf, lengths)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.detach(), leaf.grad] + [p.grad for p in model.parameters()]


def test_keyword_padding_einsum_attention_becomes_hstu_attention():
    """The IndexError case: values=..., offsets=..., max_lengths=... given by keyword."""
    found, fallbacks = regions_and_fallbacks(Layer(), *batch_of([3, 12, 1, 7]))
    assert fallbacks == []
    assert ("attention", "recompile::hstu_attention") in found


def test_gr_layer_equals_eager_and_compiles_at_most_twice():
    model = Layer()
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    counter.backend_ctx_ctor = TracingConfig  # as rec_ascend traces: one graph through dense_to_jagged
    compiled = torch.compile(model, backend=counter)
    for lengths in ([3, 12, 1, 7], [5, 0, 2, 12, 9], [1, 1, 4, 6, 2, 8, 11]):
        x, lengths = batch_of(lengths)
        for got, want in zip(outputs_and_grads(compiled, x, lengths), outputs_and_grads(model, x, lengths)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


def test_a_mask_buffer_that_attends_padded_keys_stays_padded():
    """All ones: padded keys would be attended to, which the jagged op cannot give."""
    found, fallbacks = regions_and_fallbacks(Layer(torch.ones(N, N)), *batch_of([3, 12, 1, 7]))
    assert ("attention", "recompile::hstu_attention") not in found
    assert any("attention mask" in why for why in fallbacks), fallbacks


def test_a_bias_moved_to_other_positions_stays_padded(monkeypatch):
    """w moved into w[N - 1 + i - j] (transposed) is not HSTU's relative bias."""
    forward = gr_hstu.RelativePositionBias.forward
    monkeypatch.setattr(gr_hstu.RelativePositionBias, "forward", lambda self: forward(self).transpose(1, 2))
    found, fallbacks = regions_and_fallbacks(Layer(), *batch_of([3, 12, 1, 7]))
    assert ("attention", "recompile::hstu_attention") not in found
    assert any("N - 1 + j - i" in why for why in fallbacks), fallbacks
