"""Dense multi-head self-attention over a model's fields (AutoInt's ``nn.MultiheadAttention``, no mask): the jagged
pass's ``_field_attention`` rewrites it to the in-projection, ``recompile.padded_softmax_attention`` with a zero
``[1, 1, 1, N]`` mask and the out-projection, and the native kernel runs such a mask on its dense path
(``runtime/csrc/field_attention.h``). Checked: the dense path against the formula forward and backward (batch and
fields down to 1, several heads and head dims, more fields than a vector's lanes, float32 / float16 / bfloat16,
per-head key masks, strided q, k, v views of one packed projection); ``nn.MultiheadAttention`` modules (batch first
or not, with or without biases, need_weights True or False) compiled equal eager with the region found; with
rec_ascend, a stream of batch sizes compiles at most twice; dropout on the weights in training, and weights in use,
stay unfused with the reason reported."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from models.corpus.harness import rec_passes_aot_eager
from recompile.backend import rec_ascend
from recompile.runtime.padded_attention import native_available, padded_softmax_attention_reference

pytestmark = pytest.mark.skipif(not native_available(), reason="runtime/_C is not built")

op = torch.ops.recompile.padded_softmax_attention
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def packed_heads(batch, fields, heads, dim, dtype):
    """q, k, v ``[B, H, N, D]`` views of one ``[N, B, 3 * H * D]`` projection, as the pass makes them."""
    qkv = torch.randn(fields, batch, 3 * heads * dim).to(dtype)
    return [t.unflatten(-1, (heads, dim)).permute(1, 2, 0, 3) for t in qkv.chunk(3, -1)]


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 5), fields=st.integers(1, 20), heads=st.integers(1, 3), dim=st.integers(1, 9),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), mask=st.sampled_from(["zero", "heads"]),
)
def test_dense_path_equals_the_formula(batch, fields, heads, dim, dtype, mask):
    q, k, v = packed_heads(batch, fields, heads, dim, dtype)
    m = torch.zeros(1, 1, 1, fields) if mask == "zero" else torch.randn(1, heads, 1, fields)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = op(*leaves, m.to(dtype), dim ** -0.5, "native")
    grad = torch.randn(out.shape).to(dtype)
    got = (out, *torch.autograd.grad(out, leaves, grad))
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want = padded_softmax_attention_reference(*exact, m.to(dtype).double(), dim ** -0.5)
    want = (want, *torch.autograd.grad(want, exact, grad.double()))
    for a, w in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), w, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


class Fields(nn.Module):
    """AutoInt's interacting layer: an nn.MultiheadAttention over ``[B, N, E]`` fields, then a ReLU."""

    def __init__(self, batch_first: bool, bias: bool, need_weights: bool, dropout: float = 0.2):
        super().__init__()
        self.batch_first, self.need_weights = batch_first, need_weights
        self.attention = nn.MultiheadAttention(8, 2, dropout=dropout, bias=bias, batch_first=batch_first)

    def forward(self, x):
        x = x if self.batch_first else x.transpose(0, 1)
        out, _ = self.attention(x, x, x, need_weights=self.need_weights)
        return (out if self.batch_first else out.transpose(0, 1)).relu()


def attention_regions(model, x):
    report = recompile.explain(model, x)
    regions = [r.op for _, r in report.regions() if r.kind == "attention"]
    return regions, [f.reason for g in report.graphs for f in g.ctx.fallbacks]


def outputs_and_grads(fn, model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = fn(x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_becomes_the_dense_op_and_equals_eager(batch_first, bias, need_weights):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Fields(batch_first, bias, need_weights).eval()
    assert attention_regions(model, torch.randn(4, 7, 8)) == (["recompile::padded_softmax_attention"], [])
    assert_equal_over_batches(model, rec_passes_aot_eager, (1, 6, 11))


def assert_equal_over_batches(model, backend, batches):
    """Outputs and gradients equal eager's on each batch size, compiled at most twice (static, then dynamic)."""
    torch._dynamo.reset()
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return backend(gm, example_inputs)

    counting.backend_ctx_ctor = rec_ascend.backend_ctx_ctor
    compiled = torch.compile(model, backend=counting)
    for batch in batches:
        x = torch.randn(batch, 7, 8)
        for got, want in zip(outputs_and_grads(compiled, model, x), outputs_and_grads(model, model, x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(compiles) <= 2


@pytest.mark.slow
@pytest.mark.usefixtures("quick_race")
@pytest.mark.parametrize("batch_first, need_weights", [(False, True), (True, False)])
def test_rec_ascend_equals_eager_and_compiles_at_most_twice(batch_first, need_weights):
    """Through Inductor and the race (slow: Inductor compiles forward and backward, static then dynamic)."""
    torch.manual_seed(1)
    assert_equal_over_batches(Fields(batch_first, True, need_weights).eval(), rec_ascend, (3, 5, 9))


def test_training_dropout_and_used_weights_stay_unfused_with_the_reason():
    torch._dynamo.reset()
    regions, fallbacks = attention_regions(Fields(True, True, False).train(), torch.randn(4, 7, 8))
    assert regions == [] and any("dropout in training" in f for f in fallbacks), fallbacks

    class Weights(Fields):
        def forward(self, x):
            out, weights = self.attention(x, x, x)
            return out.relu() + weights.sum(-1, keepdim=True)

    torch._dynamo.reset()
    regions, fallbacks = attention_regions(Weights(True, True, True).eval(), torch.randn(4, 7, 8))
    assert regions == [] and any("need_weights" in f for f in fallbacks), fallbacks
    torch._dynamo.reset()
    assert attention_regions(Fields(True, True, False, dropout=0.0).train(), torch.randn(4, 7, 8))[0] == [
        "recompile::padded_softmax_attention"]
