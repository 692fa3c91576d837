"""recompile::vector_cross, the DCN-v1 vector cross stack ``x_{l+1} = x0 * (x_l . w_l) + b_l + x_l``: every kernel
(torch closed form, native per-row C++ under each instruction set) against autograd through the plain-torch
reference, forward and backward, with hypothesis (empty batch, one row, D across partial vectors, 1-4 layers,
with and without biases, [D] / [1, D] / [D, 1] weights, non-contiguous inputs, fp32 / fp16 / bf16); opcheck of the
op and its backward; the lowering; a clear error for bad shapes; normalize's one form of the layer's spellings."""
import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.lowering import choose, detect_target
from recompile.runtime import interaction_native, native
from recompile.runtime.interaction import vector_cross_reference
from tests.test_interaction_forms import pipeline_only
from tests.test_normalize import normalized

KERNELS = ["reference", "cpu"] + (["native"] if interaction_native.available() else [])
ISAS = native.available_isas() if interaction_native.available() else ()
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _problem(b, d, layers, bias, shape, seed, dtype=torch.float32, strided=False):
    g = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=g, dtype=torch.float64)

    if strided:  # rows of a wider buffer, and x0 a transposed copy: neither contiguous
        x0, x = randn(d, b).t(), randn(b, 2 * d)[:, ::2]
    else:
        x0, x = randn(b, d), randn(b, d)
    view = {"vector": (d,), "row": (1, d), "column": (d, 1)}[shape]
    weights = [(randn(d) / d ** 0.5).reshape(view) for _ in range(layers)]
    biases = [randn(d) for _ in range(layers)] if bias else []
    return [t.to(dtype) for t in (x0, x)], [w.to(dtype) for w in weights], [q.to(dtype) for q in biases]


def _grads(fn, x0x, weights, biases, grad):
    leaves = [t.detach().clone().requires_grad_() for t in (*x0x, *weights, *biases)]
    layers = len(weights)
    out = fn(leaves[0], leaves[1], leaves[2:2 + layers], leaves[2 + layers:])
    return [out.detach(), *torch.autograd.grad(out, leaves, grad)]


def _oracle(x0x, weights, biases, grad):
    """Autograd through the reference in float64."""
    double = [t.double() for t in x0x], [w.double() for w in weights], [q.double() for q in biases]
    return _grads(vector_cross_reference, *double, grad.double())


def _op(impl):
    return lambda x0, x, weights, biases: torch.ops.recompile.vector_cross(x0, x, weights, biases, impl)


def _assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == dtype
        scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * scale)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(0, 9), d=st.integers(1, 40), layers=st.integers(1, 4), bias=st.booleans(),
       shape=st.sampled_from(["vector", "row", "column"]), strided=st.booleans(), impl=st.sampled_from(KERNELS),
       seed=st.integers(0, 2 ** 16))
def test_kernels_match_the_reference_fp32(b, d, layers, bias, shape, strided, impl, seed):
    x0x, weights, biases = _problem(b, d, layers, bias, shape, seed, strided=strided)
    grad = torch.randn(b, d, generator=torch.Generator().manual_seed(seed + 1))
    _assert_close(_grads(_op(impl), x0x, weights, biases, grad), _oracle(x0x, weights, biases, grad), torch.float32)


@settings(max_examples=15, deadline=None)
@given(b=st.sampled_from([0, 1, 5]), d=st.integers(1, 33), layers=st.integers(1, 3), bias=st.booleans(),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), impl=st.sampled_from(KERNELS),
       seed=st.integers(0, 2 ** 16))
def test_kernels_in_16_bit(b, d, layers, bias, dtype, impl, seed):
    """Each kernel in fp16 / bf16 (the reference in that dtype too) within the dtype's rounding of float64."""
    x0x, weights, biases = _problem(b, d, layers, bias, "vector", seed, dtype=dtype)
    grad = torch.randn(b, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    _assert_close(_grads(_op(impl), x0x, weights, biases, grad), _oracle(x0x, weights, biases, grad), dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_under_each_isa(isa, dtype):
    x0x, weights, biases = _problem(37, 45, 3, True, "column", 7, dtype=dtype)
    grad = torch.randn(37, 45).to(dtype)
    with native.use_isa(isa):
        got = _grads(_op("native"), x0x, weights, biases, grad)
    _assert_close(got, _oracle(x0x, weights, biases, grad), dtype)


def test_gradcheck_and_opcheck():
    x0x, weights, biases = _problem(3, 5, 2, True, "row", 0, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (*x0x, *weights, *biases)]
    torch.autograd.gradcheck(lambda x0, x, w0, w1, b0, b1: _op("cpu")(x0, x, [w0, w1], [b0, b1]), inputs)
    for impl in KERNELS:
        x0x, weights, biases = _problem(4, 6, 2, True, "column", 1)
        args = (*[t.float().requires_grad_() for t in x0x], [w.float().requires_grad_() for w in weights],
                [q.float().requires_grad_() for q in biases], impl)
        torch.library.opcheck(torch.ops.recompile.vector_cross.default, args)
        grad = torch.randn(4, 6)
        torch.library.opcheck(torch.ops.recompile.vector_cross_backward.default,
                              (grad, *[a.detach() if isinstance(a, torch.Tensor) else [t.detach() for t in a]
                                       for a in args[:4]], impl))


def test_lowering_picks_the_native_kernel_on_cpu():
    impl = choose("recompile::vector_cross", detect_target("cpu")).impl
    assert impl == ("native" if interaction_native.available() else "cpu")


@pytest.mark.parametrize("weights, biases, names", [
    ([torch.randn(7)], [], "weights"),
    ([torch.randn(6)], [torch.randn(6), torch.randn(6)], "biases"),
    ([torch.randn(6, 2)], [], "weights"),
    ([torch.randn(6, dtype=torch.float64)], [], "float64"),
])
def test_bad_shapes_raise_naming_the_op(weights, biases, names):
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=rf"recompile\.vector_cross: .*{names}"):
        torch.ops.recompile.vector_cross(x, x, weights, biases, "cpu")


DOTS = {  # x_l . w as [B, 1], spelled as users write it (RecBole's tensordot is squeezed, then transposed around)
    "tensordot": lambda x, w: torch.tensordot(x, w, dims=([1], [0])).unsqueeze(1),
    "matmul_vector": lambda x, w: (x @ w).unsqueeze(1),
    "weighted_sum": lambda x, w: (x * w).sum(-1, keepdim=True),
    "matmul_column": lambda x, w: torch.matmul(x, w.unsqueeze(-1)),
}


def _layers(dot):
    def fn(x0, w0, w1, b0, b1):
        x = x0
        for w, b in ((w0, b0), (w1, b1)):
            x = x0 * dot(x, w) + b + x
        return x
    return fn


def _calls(gm) -> list[tuple]:
    """The graph's calls, inputs named by their argument and calls by their place (Dynamo orders its
    placeholders by first use, which differs between spellings)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    name = {n: n.target if n.op == "placeholder" else calls.index(n) for n in gm.graph.nodes if n.op != "output"}
    return [(n.target, fx.node.map_arg(n.args, name.__getitem__)) for n in calls]


def test_spellings_of_the_dot_have_one_canonical_form():
    """Every spelling of ``x0 * (x . w) + b + x`` leaves one graph after normalize (RecBole's
    ``(x0.T * tensordot(x, w)).T`` included), the form the interaction pass matches."""
    d = 6
    args = (torch.randn(4, d), torch.randn(d), torch.randn(d), torch.randn(d), torch.randn(d))

    def recbole(x0, w0, w1, b0, b1):
        x = x0
        for w, b in ((w0, b0), (w1, b1)):
            x = (x0.transpose(0, 1) * torch.tensordot(x, w, dims=([1], [0]))).transpose(0, 1) + b + x
        return x

    forms = {name: _calls(normalized(_layers(dot), *args)) for name, dot in DOTS.items()}
    forms["recbole"] = _calls(normalized(recbole, *args))
    assert all(f == forms["matmul_column"] for f in forms.values()), forms


def test_a_scalar_bias_inside_the_product_is_not_a_vector_cross():
    """``x0 * (x . w + c) + x``: the bias is inside the product (the DCN-v2 form with a [1, D] weight): no region
    (neither op computes it), and the rewritten graph still equals eager."""
    w, c = torch.randn(1, 6), torch.randn(1)

    def fn(x0):
        return x0 * torch.nn.functional.linear(x0, w, c) + x0

    x0 = torch.randn(5, 6)
    regions = recompile.explain(fn, x0).to_dict()["regions"]
    assert not [r for r in regions if r["kind"] == "interaction"]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend=pipeline_only)(x0), fn(x0))


def test_export_keeps_one_op_over_a_dynamic_batch():
    """``recompile.export`` of TorchRec's VectorCrossNet: one ``vector_cross`` call, right at another batch size."""
    from recompile.export import export

    crossnet = pytest.importorskip("torchrec.modules.crossnet")
    torch.manual_seed(0)
    model = crossnet.VectorCrossNet(12, 3)
    program = export(model, (torch.randn(5, 12),), dynamic_shapes=({0: torch.export.Dim("batch")},))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function" and n.target.namespace == "recompile"]
    assert ops == [torch.ops.recompile.vector_cross.default]
    x = torch.randn(9, 12)
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-5, atol=1e-5)
