"""Every native CPU kernel (runtime/csrc, C++ torch operators) on every instruction set this build and CPU run
(generic, AVX2, AVX-512: ``recompile.runtime.native.use_isa`` switches in process, as ``RECOMPILE_ISA`` does per process),
forward and backward against its reference, on random inputs: the AVX2 path is tested on an AVX-512 machine."""
import pytest
import torch

from recompile import runtime
from recompile.runtime import embedding_native, native
from recompile.runtime.embedding import NONE, SUM
from tests.test_embedding_native import _group
from tests.test_jagged_native import attention_case

pytestmark = pytest.mark.skipif(not embedding_native.available(), reason="the native kernels are not built")
ops = torch.ops.recompile
ISAS = native.available_isas() if embedding_native.available() else ()


@pytest.fixture(params=ISAS)
def isa(request):
    with native.use_isa(request.param):
        assert native.isa() == request.param
        yield request.param


def _grads(fn, *inputs, seed=0):
    """fn's output and the gradients of a random cotangent with respect to ``inputs``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return [out, *torch.autograd.grad(out, leaves, cotangent)]


def _same(fn, inputs, atol=1e-5, rtol=1e-5):
    """The native kernel against the reference run in float32 (the kernels accumulate in float32 whatever the
    storage), its results rounded to the inputs' dtype."""
    got = _grads(lambda *a: fn(*a, "native"), *inputs)
    want = _grads(lambda *a: fn(*a, "reference"), *(t.float() if t.is_floating_point() else t for t in inputs))
    torch.testing.assert_close(got, [w.to(g.dtype) for g, w in zip(got, want)], atol=atol, rtol=rtol)


def test_isa_names_and_forcing():
    assert "generic" in ISAS and native.isa() in ISAS
    with pytest.raises(ValueError, match="not an instruction set"):
        torch.ops.recompile_native.set_isa("sse9")


def test_dropout(isa):
    """Whole vectors and a tail (3003 elements), NaN and inf kept or dropped as eager does (inf * 0 is NaN)."""
    x, seed = torch.randn(3, 1001), torch.tensor([12345, 678])
    x[0, :40:2], x[1, :40:2] = float("nan"), float("inf")
    torch.testing.assert_close(ops.dropout(x, 0.3, seed, "native"), ops.dropout(x, 0.3, seed, "reference"),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_interactions(isa, dtype, tol):
    g = torch.Generator().manual_seed(1)
    features = [torch.randn(7, 37, generator=g).to(dtype), torch.randn(7, 21, 37, generator=g).to(dtype)]
    prefix = torch.randn(7, 5, generator=g).to(dtype)
    _same(lambda f0, f1, p, impl: ops.dot_interaction([f0, f1], p, True, False, impl), [*features, prefix], tol, tol)
    x0, x = torch.randn(9, 45, generator=g).to(dtype), torch.randn(9, 45, generator=g).to(dtype)
    weight, bias = torch.randn(45, 45, generator=g).to(dtype) / 8, torch.randn(45, generator=g).to(dtype)
    _same(lambda *a: ops.cross_layer(*a[:4], None, a[4]), [x0, x, weight, bias], tol, tol)
    # the cross stack, full and low rank: 9 rows (a tile of 8 and a tail) of 45 (3 AVX-512 vectors); atol: the
    # backward reads the saved h_l + b_l and x_l rounded to 16 bits
    for downs in ([], [torch.randn(5, 45, generator=g).to(dtype) / 8 for _ in range(2)]):
        weights = [torch.randn(45, len(downs) and 5 or 45, generator=g).to(dtype) / 4 for _ in range(2)]
        biases = [torch.randn(45, generator=g).to(dtype) for _ in range(2)]
        _same(lambda x0, x, *p: ops.cross_stack(x0, x, list(p[:2]), list(p[2:4]), list(p[4:-1]), True, p[-1]),
              [x0, x, *weights, *biases, *downs], 3 * tol, tol)
    w, b = [torch.randn(45, generator=g).to(dtype) / 8 for _ in range(2)], [torch.randn(45, generator=g).to(dtype)] * 2
    _same(lambda x0, x, *p: ops.vector_cross(x0, x, list(p[:2]), list(p[2:4]), p[4]), [x0, x, *w, *b], tol, tol)
    gate, downs = torch.randn(2, 45, generator=g), [torch.randn(4, 45, generator=g) / 8 for _ in range(2)]
    mids = [torch.randn(4, 4, generator=g) / 2 for _ in range(2)]
    ups = [torch.randn(45, 4, generator=g) for _ in range(2)]

    def mixture(impl, cast):  # inference: the fused kernel
        lists = ([cast(t) for t in ts] for ts in (downs, mids, ups, biases))
        return ops.cross_mixture(cast(x0), cast(x), cast(gate.to(dtype)), *lists, "relu", False, impl)[0]

    with torch.no_grad():
        torch.testing.assert_close(mixture("native", lambda t: t.to(dtype)),
                                   mixture("reference", lambda t: t.to(dtype).float()).to(dtype), atol=tol, rtol=tol)
    v = torch.randn(6, 11, 37, generator=g).to(dtype)
    for reduce in (True, False):
        _same(lambda v, impl: ops.fm_second_order(v, reduce, impl), [v], tol, tol)


def test_sampled_softmax(isa):
    g = torch.Generator().manual_seed(2)
    pos, neg = torch.randn(13, 1, generator=g), torch.randn(13, 40, generator=g)
    neg_ids, targets = torch.randint(0, 30, (40,), generator=g), torch.randint(0, 30, (13,), generator=g)
    _same(lambda p, n, impl: ops.sampled_softmax_loss(p, n, neg_ids, targets, 0.7, impl), [pos, neg])


@pytest.mark.parametrize("dtype, tol, d, dv", [(torch.float32, 2e-5, 24, 20), (torch.float16, 1e-2, 24, 20),
                                                (torch.float32, 2e-5, 32, 40)])
def test_hstu_attention(isa, dtype, tol, d, dv):
    """Head sizes whose rows are 3, 4 (two register tiles of 2) and 5 AVX2 vectors."""
    q, k, v, offsets, rel, ts, tb = attention_case([0, 5, 70, 33], 2, d, dv, True, dtype=dtype, fused=True)

    def attention(q, k, v, rel, tb, impl):
        return ops.hstu_attention(q, k, v, offsets, 70, 0.3, True, None, 0, rel, ts, tb, impl)

    _same(attention, [q, k, v, rel, tb], tol, tol)


@pytest.mark.parametrize("pooling", [SUM, NONE])
def test_grouped_embedding(isa, pooling):
    weights, features, psws, pools, pads, layout, _ = _group(3, 3, 9, 70, 5, 4, pooling, True, 2, torch.int32)
    args = ([f.ids for f in features], [f.offsets for f in features],
            [torch.empty(0) if p is None else p for p in psws], pools, pads, [False] * 3, [False] * 3, layout, "a,b,c",
            "fatal")
    _same(lambda *a: ops.grouped_embedding_bag(list(a[:-1]), *args, a[-1]), weights)
