"""A one-channel convolution whose kernel spans its input's width or height becomes the GEMM of its windows before
Inductor (recompile.conv_gemm), in inference graphs those as wide as one input a GEMM each of its shared windows:
outputs (and gradients) equal eager's, over a sweep of shapes, one compile serves every batch size, and other
convolutions are left as they are; in inference graphs a one-column kernel as high as its input becomes a weighted sum
of its rows."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import recompile.backend
from recompile.conv_gemm import CONV2D, convs_as_gemms
from tests.checks import inductor_on_captured, replace_step_before_inductor, train_step


def convs(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is CONV2D]


class Caser(torch.nn.Module):
    """RecBole Caser's convolutions over a history's embeddings [B, L, d]: a vertical ``Conv2d(1, n_v, (L, 1))``
    and, for each height i, a horizontal ``Conv2d(1, n_h, (i, d))`` with ReLU and a max-pool over its positions."""

    def __init__(self, length: int = 3, dim: int = 4, n_v: int = 3, n_h: int = 2):
        super().__init__()
        self.conv_v = torch.nn.Conv2d(1, n_v, (length, 1))
        self.conv_h = torch.nn.ModuleList(torch.nn.Conv2d(1, n_h, (i, dim)) for i in range(1, length + 1))

    def forward(self, seq):
        x = seq.unsqueeze(1)
        out = [self.conv_v(x).view(x.shape[0], -1)]
        for conv in self.conv_h:
            h = torch.relu(conv(x).squeeze(3))
            out.append(F.max_pool1d(h, h.size(2)).squeeze(2))
        return torch.cat(out, 1)


def test_caser_convolutions_are_gemms_and_equal_eager():
    torch.manual_seed(0)
    model, seq = Caser(), torch.randn(16, 3, 4, requires_grad=True)
    (got, grads), (graph, *_), _ = inductor_on_captured(model, (seq,), convs_as_gemms, training=True)
    want, want_grads = train_step(model, (seq,))
    assert not convs(graph)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys() and "conv_h.2.weight" in grads and "conv_v.bias" in grads
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)


class Conv(torch.nn.Module):
    def __init__(self, kernel, channels: int = 3):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, channels, kernel)

    def forward(self, x):
        return self.conv(x)


@pytest.mark.parametrize("shape, kernel", [
    ((8, 1, 6, 5), (6, 2)),  # as high as the input, two columns wide: an unfold along the width
    ((8, 1, 1, 5), (1, 5)),  # L = 1
    ((8, 1, 6, 1), (3, 1)),  # d = 1
])
def test_through_inductor_at_edge_shapes(shape, kernel):
    torch.manual_seed(0)
    model, x = Conv(kernel), torch.randn(shape, requires_grad=True)
    (got, grads), (graph, *_), _ = inductor_on_captured(model, (x,), convs_as_gemms, training=True)
    want, want_grads = train_step(model, (x,))
    assert not convs(graph)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_under_rec_ascend_one_compile_serves_every_batch(monkeypatch):
    torch.manual_seed(0)
    model, graphs = Caser(), []
    replace_step_before_inductor(monkeypatch, convs_as_gemms,
                                 lambda gm: graphs.append(convs_as_gemms(gm)) or graphs[-1])
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for batch in (16, 24, 37):
        seq = torch.randn(batch, 3, 4)
        torch._dynamo.maybe_mark_dynamic(seq, 0)
        got, grads = train_step(compiled, (seq,))
        want, want_grads = train_step(model, (seq,))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    assert counter.frame_count == 1 and graphs and not any(convs(gm) for gm in graphs)


def rewritten(fn, x):
    """``fn`` captured by Dynamo (rec_ascend's tracing settings), its convolutions rewritten, run as FX (no
    Inductor): the rewritten graphs beside the compiled ``fn``."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(convs_as_gemms(gm))
        return graphs[-1]

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile.backend.TRACING_CONFIG):
        return torch.compile(fn, backend=backend, dynamic=False), graphs


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 7), dim=st.integers(1, 5), channels=st.integers(1, 3),
       span=st.integers(1, 7), wide=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_sweep_equals_conv2d_forward_and_backward(batch, length, dim, channels, span, wide, bias, seed):
    """A kernel of ``span`` rows as wide as the input (``wide``) or of ``span`` columns as high as it, in float64:
    k = 1, k = L, L = 1, batch 1 and d = 1 among the shapes."""
    gen = torch.Generator().manual_seed(seed)
    kernel = (min(span, length), dim) if wide else (length, min(span, dim))
    x = torch.randn(batch, 1, length, dim, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(channels, 1, *kernel, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(channels, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    compiled, graphs = rewritten(lambda x, w, b: F.conv2d(x, w, b), x)
    got = compiled(x, w, b)
    want = F.conv2d(x, w, b)
    assert len(graphs) == 1 and not convs(graphs[0]) and got.is_contiguous()
    torch.testing.assert_close(got, want)
    grad = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    for g, e in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("weight, kwargs", [
    ((2, 3, 4, 5), {}),  # three input channels
    ((2, 1, 3, 3), {}),  # narrower than the input both ways
    ((2, 1, 3, 5), {"stride": 2}),
    ((2, 1, 3, 5), {"padding": 1}),
    ((2, 1, 3, 5), {"dilation": (2, 1)}),
    ((2, 1, 7, 1), {"padding": "same"}),
])
def test_left_as_it_is(weight, kwargs):
    x = torch.randn(4, weight[1], 7, 5, requires_grad=True)
    w = torch.randn(weight, requires_grad=True)
    compiled, graphs = rewritten(lambda x: F.conv2d(x, w, **kwargs), x)
    torch.testing.assert_close(compiled(x), F.conv2d(x, w, **kwargs))
    assert len(convs(graphs[0])) == 1


def test_caser_inference_shares_windows_in_as_many_kernels_as_plain_inductor():
    """The horizontal convolutions become GEMMs of one copy of the input's windows, position-major, each reading
    only the positions its convolution keeps, and the vertical one a sum of the rows, all fused where Inductor makes
    the input: no C++ kernel more than plain Inductor's."""
    torch.manual_seed(0)
    model, seq = Caser(length=5, dim=4).eval(), torch.randn(6, 5, 4)
    got, (gm, *_), kernels = inductor_on_captured(model, (seq,), convs_as_gemms)
    _, _, plain = inductor_on_captured(model, (seq,), lambda gm: gm)
    with torch.no_grad():
        torch.testing.assert_close(got, model(seq), rtol=1e-5, atol=1e-5)
    assert not convs(gm) and sum(n.target is torch.Tensor.unfold for n in gm.graph.nodes) == 1
    rows = [n.args[0].meta["example_value"].shape for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    assert rows == [(6 * (5 - k + 1), k * 4) for k in range(1, 6)]
    assert len(kernels) <= len(plain)


def test_inference_under_rec_ascend_one_compile_serves_every_batch(monkeypatch):
    torch.manual_seed(0)
    model, graphs = Caser().eval(), []
    replace_step_before_inductor(monkeypatch, convs_as_gemms,
                                 lambda gm: graphs.append(convs_as_gemms(gm)) or graphs[-1])
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for batch in (16, 24, 37):
            seq = torch.randn(batch, 6, 4)
            torch._dynamo.maybe_mark_dynamic(seq, 0)
            torch.testing.assert_close(compiled(seq), model(seq), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1 and graphs and all(len(convs(gm)) == 1 for gm in graphs)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 7), dim=st.integers(1, 5),
       heights=st.lists(st.integers(1, 7), min_size=1, max_size=4), channels=st.integers(1, 3),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_inference_sweep_full_width_convs_of_one_input(batch, length, dim, heights, channels, bias, seed):
    """Several kernels as wide as one input, of heights 1..L (repeats, k = 1, k = L, L = 1, batch 1, d = 1 among
    them), in float64 without gradients: each equals ``conv2d``; one ``unfold`` at most."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, length, dim, dtype=torch.float64, generator=gen)
    weights = [torch.randn(channels + i % 2, 1, min(h, length), dim, dtype=torch.float64, generator=gen)
               for i, h in enumerate(heights)]
    biases = [torch.randn(w.shape[0], dtype=torch.float64, generator=gen) if bias else None for w in weights]

    def fn(x):
        return [F.conv2d(x, w, b) for w, b in zip(weights, biases)]

    compiled, graphs = rewritten(fn, x)
    with torch.no_grad():
        got = compiled(x)
    assert len(graphs) == 1 and not convs(graphs[0]) and all(g.is_contiguous() for g in got)
    assert sum(n.target is torch.Tensor.unfold for n in graphs[0].graph.nodes) <= 1
    for g, want in zip(got, fn(x)):
        torch.testing.assert_close(g, want)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 4), length=st.integers(1, 7), dim=st.integers(2, 5), channels=st.integers(1, 3),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_inference_sweep_one_column_conv_as_high_as_its_input(batch, length, dim, channels, bias, seed):
    """A kernel [C, 1, L, 1] over [B, 1, L, d] (RecBole Caser's vertical convolution; L = 1 and batch 1 among the
    shapes), in float64 without gradients: a sum over the rows, equal to ``conv2d``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 1, length, dim, dtype=torch.float64, generator=gen)
    w = torch.randn(channels, 1, length, 1, dtype=torch.float64, generator=gen)
    b = torch.randn(channels, dtype=torch.float64, generator=gen) if bias else None
    compiled, graphs = rewritten(lambda x: F.conv2d(x, w, b), x)
    with torch.no_grad():
        got = compiled(x)
    assert len(graphs) == 1 and not convs(graphs[0]) and got.is_contiguous()
    torch.testing.assert_close(got, F.conv2d(x, w, b))


@pytest.mark.parametrize("weight, kwargs", [
    ((2, 1, 3, 1), {}),  # one column, not as high as the input
    ((2, 1, 3, 3), {}),
    ((2, 3, 4, 5), {}),
    ((2, 1, 3, 5), {"padding": 1}),
])
def test_inference_left_as_it_is(weight, kwargs):
    x, w = torch.randn(4, weight[1], 7, 5), torch.randn(weight)
    compiled, graphs = rewritten(lambda x: F.conv2d(x, w, **kwargs), x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), F.conv2d(x, w, **kwargs))
    assert len(convs(graphs[0])) == 1
