"""recompile::cross_stack and cross_mixture: every kernel against the reference, forward and backward, and the
pass finding the stacked and the mixture-of-experts cross layers as practitioners write them."""
from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from models.ctr import DCNConfig, DCNv2, MixtureCrossLayer
from models.dlrm import synthetic_batch
from recompile.runtime import interaction_native
from recompile.runtime.interaction import ACTIVATIONS, _cross_stack_torch, cross_mixture_reference, cross_stack_reference
from recompile.runtime.kernels import KERNELS
from tests.test_interaction_pass import _assert_same_training, _regions, pipeline_only

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=1e-1),
       torch.float16: dict(rtol=1e-2, atol=3e-2)}


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def _forward_and_grads(fn, leaves):
    out = fn(*leaves)
    weight = torch.linspace(0.5, 1.5, out.numel()).view_as(out).to(out.dtype)
    return out.detach(), torch.autograd.grad((out * weight).sum(), leaves)


def _stack_args(b, d, layers, rank, bias, dtype=torch.float32):
    x0, x = torch.randn(b, d), torch.randn(b, d)
    weights = [torch.randn(d, rank or d) / d ** 0.5 for _ in range(layers)]
    biases = [torch.randn(d) for _ in range(layers)] if bias else []
    downs = [torch.randn(rank, d) / d ** 0.5 for _ in range(layers)] if rank else []
    return [t.to(dtype) for t in (x0, x, *weights, *biases, *downs)], (layers, len(biases), len(downs))


def _stack_fn(op, sizes):
    layers, nb, nd = sizes

    def fn(x0, x, *params):
        weights, biases, downs = params[:layers], params[layers:layers + nb], params[layers + nb:]
        result = op(x0, x, list(weights), list(biases), list(downs))
        return result[0] if isinstance(result, tuple) else result
    return fn


@settings(max_examples=20, deadline=None)
@given(b=st.integers(0, 9), d=st.integers(1, 12), layers=st.integers(1, 4), rank=st.sampled_from([None, 1, 3]),
       bias=st.booleans(), impl=st.sampled_from(sorted(KERNELS["cross_stack"])),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_cross_stack_kernels_forward_and_backward(b, d, layers, rank, bias, impl, dtype):
    if impl == "triton" and dtype != torch.float32:
        dtype = torch.float32  # the interpreter's tl.dot: fp32 inputs
    args, sizes = _stack_args(b, d, layers, rank, bias, dtype)
    op = _stack_fn(lambda *a: torch.ops.recompile.cross_stack(*a, True, impl), sizes)
    got = _forward_and_grads(op, _leaves(*args))
    want = _forward_and_grads(_stack_fn(cross_stack_reference, sizes), _leaves(*[a.float() for a in args]))
    tol = TOL[dtype]
    torch.testing.assert_close((got[0].float(), [g.float() for g in got[1]]), (want[0], list(want[1])),
                               rtol=tol["rtol"], atol=tol["atol"] * d * layers * max(b, 1))


@settings(max_examples=25, deadline=None)
@given(b=st.integers(0, 9), d=st.integers(1, 40), layers=st.integers(1, 3), rank=st.sampled_from([None, 1, 3]),
       bias=st.booleans(), same=st.booleans(), impl=st.sampled_from(["cpu", "native", "reference"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), pad=st.booleans(), wide=st.booleans())
def test_cross_stack_inference_kernels(b, d, layers, rank, bias, same, impl, dtype, pad, wide):
    """Inference calls (save=False): the native kernel runs fused where the weights stay in cache; ``wide``
    (full-rank rows of 129 or more) takes its GEMM path, which pads rows to 16 elements unless d is a multiple of
    16 (``pad``: from any width, else from its PAD_MIN_WIDTH). Both must return the [B, D] contiguous result the
    fake promises, also when x is x0."""
    if wide:
        d, rank = 129 + d % 16, None
    args, sizes = _stack_args(b, d, layers, rank, bias, dtype)
    if same:
        args[1] = args[0]
    pad_from = 1 if pad else interaction_native.PAD_MIN_WIDTH
    with torch.no_grad(), mock.patch.object(interaction_native, "PAD_MIN_WIDTH", pad_from):
        out = _stack_fn(lambda *a: torch.ops.recompile.cross_stack(*a, False, impl), sizes)(*args)
        want = _stack_fn(cross_stack_reference, sizes)(*[a.float() for a in args])
    assert out.shape == (b, d) and out.dtype == dtype and out.is_contiguous()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), want, rtol=tol["rtol"], atol=tol["atol"] * d * layers * max(b, 1))


@pytest.mark.skipif(not interaction_native.available(), reason="no C compiler: no native kernel")
def test_native_stack_sees_weight_updates(monkeypatch):
    """The padded weight copies (the GEMM path: rows of 130) are remade after an in-place update and after
    ``.data`` is replaced."""
    monkeypatch.setattr(interaction_native, "PAD_MIN_WIDTH", 1)
    args, sizes = _stack_args(4, 130, 2, None, True)
    x0, x, *params = args
    weights, biases = params[:2], params[2:]

    def check():
        with torch.no_grad():
            got = torch.ops.recompile.cross_stack(x0, x, weights, biases, [], False, "native")[0]
        torch.testing.assert_close(got, cross_stack_reference(x0, x, weights, biases, []), rtol=1e-4, atol=1e-4)

    check()
    weights[0].mul_(2)
    biases[1].add_(1)
    check()
    weights[1].data = torch.randn(130, 130) / 16
    check()


@pytest.mark.skipif(not interaction_native.available(), reason="no C compiler: no native kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank", [None, 4])
def test_fused_stack_tiles_and_saved(rank, dtype):
    """The fused kernel over many row tiles and a tail (B = 21), rows of 70 (column blocks of 3 and 2 vectors),
    a weight given as a transposed view (``x @ W``): output and saved tensors equal the GEMM path's, whether the
    call comes through the op (C++, below autograd) or interaction_native's Python entry."""
    torch.manual_seed(0)
    args, sizes = _stack_args(21, 70, 3, rank, True, dtype)
    x0, x, *p = args
    weights, biases, downs = p[:3], p[3:6], p[6:]
    weights[1] = weights[1].t().contiguous().t()
    assert torch.ops.recompile_native.cross_stack_fused(rank or 70, 70)
    want = _cross_stack_torch(*[t.float() for t in (x0, x)], [w.float() for w in weights],
                              [b.float() for b in biases], [v.float() for v in downs], True)
    tol = dict(rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * 10)
    for got in (torch.ops.recompile.cross_stack(x0, x, weights, biases, downs, True, "native"),
                interaction_native.cross_stack(x0, x, weights, biases, downs, True)):
        assert len(got[1]) == 5 and all(t.dtype == dtype and t.is_contiguous() for t in (got[0], *got[1]))
        torch.testing.assert_close([t.float() for t in (got[0], *got[1])], [want[0], *want[1]], **tol)


@pytest.mark.parametrize("save", [False, True])
def test_native_stack_opcheck(save):
    """The padded inference path and the saving one against the op's fake (shapes and strides) and schema."""
    args, sizes = _stack_args(3, 6, 2, None, True)
    x0, x, *p = _leaves(*args) if save else args
    torch.library.opcheck(torch.ops.recompile.cross_stack.default, (x0, x, p[:2], p[2:], [], save, "native"))


def _mixture_args(b, d, experts, rank, mid, bias):
    x0, x, gate = torch.randn(b, d), torch.randn(b, d), torch.randn(experts, d)
    downs = [torch.randn(rank, d) for _ in range(experts)]
    mids = [torch.randn(rank, rank) for _ in range(experts)] if mid else []
    ups = [torch.randn(d, rank) for _ in range(experts)]
    biases = [torch.randn(d) for _ in range(experts)] if bias else []
    return [x0, x, gate, *downs, *mids, *ups, *biases], (experts, len(mids), len(biases))


def _mixture_fn(op, sizes, activation):
    e, m, nb = sizes

    def fn(x0, x, gate, *p):
        return op(x0, x, gate, list(p[:e]), list(p[e:e + m]), list(p[e + m:2 * e + m]), list(p[2 * e + m:]),
                  activation)
    return fn


@settings(max_examples=20, deadline=None)
@given(b=st.integers(0, 9), d=st.integers(1, 12), experts=st.integers(1, 4), rank=st.integers(1, 4),
       mid=st.booleans(), bias=st.booleans(), activation=st.sampled_from(sorted(ACTIVATIONS)),
       impl=st.sampled_from(sorted(KERNELS["cross_mixture"])))
def test_cross_mixture_kernels_forward_and_backward(b, d, experts, rank, mid, bias, activation, impl):
    args, sizes = _mixture_args(b, d, experts, rank, mid, bias)
    got = _forward_and_grads(_mixture_fn(lambda *a: torch.ops.recompile.cross_mixture(*a, True, impl)[0], sizes,
                                         activation), _leaves(*args))
    want = _forward_and_grads(_mixture_fn(cross_mixture_reference, sizes, activation), _leaves(*args))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * d * rank)


@pytest.mark.skipif(not interaction_native.available(), reason="no C compiler: no native kernel")
@settings(max_examples=25, deadline=None)
@given(b=st.integers(0, 19), d=st.integers(1, 70), experts=st.integers(1, 3), rank=st.integers(1, 4),
       mid=st.booleans(), bias=st.booleans(), activation=st.sampled_from(sorted(ACTIVATIONS)),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_native_mixture_inference(b, d, experts, rank, mid, bias, activation, dtype):
    """The fused inference kernel (save=False) against the reference: tiles and a tail, rows of up to 5 vectors
    (column blocks), 16-bit storage; it keeps nothing."""
    args, sizes = _mixture_args(b, d, experts, rank, mid, bias)
    args = [a / d ** 0.5 for a in args]
    with torch.no_grad():
        out, saved = _mixture_fn(lambda *a: torch.ops.recompile.cross_mixture(*a, False, "native"), sizes,
                                 activation)(*[a.to(dtype) for a in args])
        want = _mixture_fn(cross_mixture_reference, sizes, activation)(*[a.to(dtype).float() for a in args])
    assert saved == [] and out.dtype == dtype and out.shape == (b, d)
    torch.testing.assert_close(out.float(), want, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"])


@pytest.mark.parametrize("rank", [None, 2])
def test_cross_stack_gradcheck_and_opcheck(rank):
    args, sizes = _stack_args(3, 4, 2, rank, True, torch.float64)
    assert gradcheck(_stack_fn(lambda *a: torch.ops.recompile.cross_stack(*a, True, "cpu"), sizes),
                     _leaves(*args))
    x0, x, *p = _leaves(*args)
    layers = sizes[0]
    torch.library.opcheck(torch.ops.recompile.cross_stack.default,
                          (x0, x, p[:layers], p[layers:2 * layers], p[2 * layers:], True, "cpu"))


@pytest.mark.parametrize("impl", sorted(KERNELS["cross_stack"]))
def test_cross_stack_for_inference_keeps_nothing(impl):
    args, sizes = _stack_args(5, 6, 3, None, True)
    x0, x, *p = _leaves(*args)
    out, saved = torch.ops.recompile.cross_stack(x0, x, p[:3], p[3:], [], False, impl)
    assert saved == []
    torch.testing.assert_close(out, cross_stack_reference(x0, x, p[:3], p[3:], []), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="save=False"):
        out.sum().backward()


@pytest.mark.parametrize("impl", sorted(KERNELS["cross_mixture"]))
def test_cross_mixture_for_inference_keeps_nothing(impl):
    args, sizes = _mixture_args(5, 6, 3, 2, True, True)
    fn = _mixture_fn(lambda *a: torch.ops.recompile.cross_mixture(*a, False, impl), sizes, "relu")
    out, saved = fn(*_leaves(*args))
    assert saved == []
    torch.testing.assert_close(out, _mixture_fn(cross_mixture_reference, sizes, "relu")(*args), rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="save=False"):
        out.sum().backward()


def test_cross_mixture_gradcheck_and_opcheck():
    args, sizes = _mixture_args(3, 4, 2, 2, True, True)
    args = [a.double() for a in args]
    assert gradcheck(_mixture_fn(lambda *a: torch.ops.recompile.cross_mixture(*a, True, "cpu")[0], sizes, "relu"),
                     _leaves(*args))
    x0, x, gate, *p = _leaves(*args)
    torch.library.opcheck(torch.ops.recompile.cross_mixture.default,
                          (x0, x, gate, p[:2], p[2:4], p[4:6], p[6:], "identity", True, "cpu"))


def test_bad_cross_inputs_name_the_op_and_layer():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="cross_stack: layer 1"):
        torch.ops.recompile.cross_stack(x, x, [torch.randn(4, 4), torch.randn(5, 4)], [], [], True, "cpu")
    with pytest.raises(ValueError, match="cross_stack: expected one or more weights"):
        torch.ops.recompile.cross_stack(x, x, [torch.randn(4, 4)], [torch.randn(4)] * 2, [], True, "cpu")
    with pytest.raises(ValueError, match="cross_mixture: expected"):
        torch.ops.recompile.cross_mixture(x, x, torch.randn(2, 4), [torch.randn(2, 4)] * 2, [], [torch.randn(4, 3)] * 2,
                                          [], "relu", True, "cpu")


class TorchRecStyleMixture(nn.Module):
    """TorchRec LowRankMixtureCrossNet's spelling over [B, D]: no C stage, one shared-free bias per expert,
    ``matmul(experts, softmax(gates).unsqueeze(-1)).squeeze(-1)``, two layers."""

    def __init__(self, d=10, rank=3, experts=2, layers=2):
        super().__init__()
        self.gates = nn.ModuleList(nn.Linear(d, experts, bias=False) for _ in range(layers))
        self.v = nn.ModuleList(nn.ModuleList(nn.Linear(d, rank, bias=False) for _ in range(experts))
                               for _ in range(layers))
        self.u = nn.ModuleList(nn.ModuleList(nn.Linear(rank, d) for _ in range(experts)) for _ in range(layers))

    def forward(self, x0):
        x = x0
        for gate, vs, us in zip(self.gates, self.v, self.u):
            g = torch.softmax(gate(x), -1)
            experts = torch.stack([x0 * u(torch.relu(v(x))) for v, u in zip(vs, us)], -1)
            x = torch.matmul(experts, g.unsqueeze(-1)).squeeze(-1) + x
        return x.sum(1)


def test_mixture_forms_found_and_equal_eager():
    x0 = torch.randn(7, 10)
    model = TorchRecStyleMixture()
    assert [r["op"] for r in _regions(model, x0)] == ["recompile::cross_mixture"] * 2
    _assert_same_training(model, (x0,))
    layer = MixtureCrossLayer(10, 3, 4)
    [region] = _regions(layer, x0, torch.randn(7, 10))
    assert region["op"] == "recompile::cross_mixture"
    _assert_same_training(layer, (x0, torch.randn(7, 10)))


def test_mixture_with_an_outside_use_is_left_alone():
    class Leaky(MixtureCrossLayer):
        def forward(self, x0, x):
            gates = torch.softmax(self.gate(x), dim=1)
            experts = torch.stack([x0 * expert(x) for expert in self.experts], dim=2)
            return (experts * gates.unsqueeze(1)).sum(dim=2) + x, experts.mean()

    assert _regions(Leaky(6, 2, 3), torch.randn(4, 6), torch.randn(4, 6)) == []


# The full-rank stack is slow: make test keeps the low-rank one (same regions and compiles) and the zoo's full-rank
# stacked DCN-v2 through rec_ascend, forward and gradients (test_models.py zoo[dcn_v2]).
@pytest.mark.parametrize("cfg", [
    pytest.param(DCNConfig(table_rows=[40, 50, 60], dim=4, num_cross=3, deep=[8]), marks=pytest.mark.slow),
    DCNConfig(table_rows=[40, 50, 60], dim=4, num_cross=3, low_rank=3, deep=[8]),
    DCNConfig(table_rows=[40, 50, 60], dim=4, num_cross=2, low_rank=3, num_experts=3, deep=[8]),
], ids=["stacked", "stacked_low_rank", "mixture"])
def test_dcn_of_the_zoo(cfg):
    model, args = DCNv2(cfg), synthetic_batch(cfg, 6)
    ops = [r["op"] for r in _regions(model, *args) if r["kind"] == "interaction"]
    assert ops == (["recompile::cross_mixture"] * 2 if cfg.num_experts > 1 else ["recompile::cross_stack"])
    _assert_same_training(model, args)
    _assert_same_training(model, args, backend=torch._dynamo.lookup_backend("rec_ascend"))
    with torch.no_grad():  # an inference graph: the stack keeps nothing for a backward
        torch.testing.assert_close(torch.compile(model, backend=pipeline_only)(*args), model(*args), rtol=1e-5,
                                   atol=1e-5)


def test_mixture_batch_changes_compile_at_most_twice():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = MixtureCrossLayer(6, 2, 3)
    counter = CompileCounterWithBackend(pipeline_only)
    compiled = torch.compile(model, backend=counter)
    for batch in (1, 5, 9, 16):
        x0, x = torch.randn(batch, 6), torch.randn(batch, 6)
        torch.testing.assert_close(compiled(x0, x), model(x0, x), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


def test_stack_batch_changes_compile_at_most_twice():
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = DCNConfig(table_rows=[40, 50], dim=4, num_cross=3, low_rank=2, deep=[8])
    model = DCNv2(cfg)
    counter = CompileCounterWithBackend(pipeline_only)
    compiled = torch.compile(model, backend=counter)
    for batch in (1, 5, 9, 16):
        args = synthetic_batch(cfg, batch)
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-5)
    assert counter.frame_count <= 2


def test_mixture_of_experts_of_different_ranks_is_left_alone():
    layer = MixtureCrossLayer(6, 2, 2)
    layer.experts[1] = nn.Sequential(nn.Linear(6, 3, bias=False), nn.ReLU(), nn.Linear(3, 3, bias=False), nn.ReLU(),
                                     nn.Linear(3, 6))
    x0, x = torch.randn(4, 6), torch.randn(4, 6)
    assert _regions(layer, x0, x) == []
