"""recompile::dot_interaction, cross_layer, fm_second_order: every kernel against the reference, and autograd."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from recompile.lowering import LOWERINGS
from recompile.runtime.interaction import (
    cross_layer_reference,
    dot_interaction_reference,
    fm_second_order_reference,
    pair_indices,
)
from recompile.runtime import interaction_native
from recompile.runtime.kernels import KERNELS

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2),
       torch.float16: dict(rtol=1e-2, atol=2e-2)}
DTYPES = st.sampled_from(list(TOL))


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


LAYOUTS = ("matrix", "rows", "mixed")


def _items(T: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """The features of ``T`` [B, F, D] as the op takes them: the matrix, one [B, D] per feature, or a
    [B, D] head and the [B, F-1, D] rest (DLRM's dense vector before a grouped lookup's output)."""
    if layout == "matrix" or (layout == "mixed" and T.shape[1] == 1):
        return [T]
    if layout == "rows":
        return list(T.unbind(1))
    return [T[:, 0], T[:, 1:]]


def test_pair_orders_are_torchrec_and_original_dlrm():
    rows, cols = pair_indices(4, upper=True, self_interaction=False)
    assert list(zip(rows.tolist(), cols.tolist()))[:4] == [(0, 1), (0, 2), (0, 3), (1, 2)]
    rows, cols = pair_indices(4, upper=False, self_interaction=True)
    # the original DLRM: [(i, j) for i in range(n) for j in range(i + 1)]
    assert list(zip(rows.tolist(), cols.tolist())) == [(i, j) for i in range(4) for j in range(i + 1)]


@settings(max_examples=30, deadline=None)
@given(b=st.integers(0, 5), f=st.integers(1, 9), d=st.integers(1, 40), k=st.sampled_from([None, 1, 5]),
       upper=st.booleans(), self_interaction=st.booleans(), dtype=DTYPES,
       impl=st.sampled_from(sorted(KERNELS["dot_interaction"])), layout=st.sampled_from(LAYOUTS))
def test_dot_interaction_kernels(b, f, d, k, upper, self_interaction, dtype, impl, layout):
    features = _randn(b, f, d, dtype=dtype)
    prefix = None if k is None else _randn(b, k, dtype=dtype)
    got = torch.ops.recompile.dot_interaction(_items(features, layout), prefix, upper, self_interaction, impl)
    want = dot_interaction_reference([features.float()], None if prefix is None else prefix.float(), upper,
                                     self_interaction)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 40), d=st.integers(1, 40), rank=st.sampled_from([None, 1, 3]), bias=st.booleans(),
       dtype=DTYPES, impl=st.sampled_from(sorted(KERNELS["cross_layer"])))
def test_cross_layer_kernels(b, d, rank, bias, dtype, impl):
    x0, x = _randn(b, d, dtype=dtype), _randn(b, d, dtype=dtype)
    weight = _randn(d, rank or d, dtype=dtype)
    down = None if rank is None else _randn(rank, d, dtype=dtype)
    bias_t = _randn(d, dtype=dtype) if bias else None
    got = torch.ops.recompile.cross_layer(x0, x, weight, bias_t, down, impl)
    floats = [None if t is None else t.float() for t in (x0, x, weight, bias_t, down)]
    want = cross_layer_reference(*floats)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol["rtol"], atol=tol["atol"] * d)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 6), f=st.integers(1, 9), d=st.integers(1, 40), reduce=st.booleans(), dtype=DTYPES,
       impl=st.sampled_from(sorted(KERNELS["fm_second_order"])))
def test_fm_second_order_kernels(b, f, d, reduce, dtype, impl):
    v = _randn(b, f, d, dtype=dtype)
    got = torch.ops.recompile.fm_second_order(v, reduce, impl)
    want = fm_second_order_reference(v.float(), reduce)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol["rtol"], atol=tol["atol"] * f * (d if reduce else 1))


def _double(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("self_interaction", [True, False])
@pytest.mark.parametrize("b", [1, 3])
def test_dot_interaction_grad(upper, self_interaction, b):
    op = torch.ops.recompile.dot_interaction
    assert gradcheck(lambda t, p: op([t], p, upper, self_interaction, "cpu"), (_double(b, 4, 3), _double(b, 2)))
    assert gradcheck(lambda t: op([t], None, upper, self_interaction, "reference"), (_double(b, 5, 2),))
    assert gradcheck(lambda x, t: op([x, t], x, upper, self_interaction, "reference"), (_double(b, 2), _double(b, 3, 2)))


@pytest.mark.parametrize("low_rank", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cross_layer_grad(low_rank, bias):
    d, r = 4, 2
    args = [_double(3, d), _double(3, d), _double(d, r if low_rank else d), _double(d) if bias else None,
            _double(r, d) if low_rank else None]
    assert gradcheck(lambda *a: torch.ops.recompile.cross_layer(*a, "cpu"), args)


@pytest.mark.parametrize("reduce", [False, True])
def test_fm_second_order_grad(reduce):
    assert gradcheck(lambda v: torch.ops.recompile.fm_second_order(v, reduce, "cpu"), (_double(2, 3, 4),))


def test_opcheck_fake_and_autograd_registrations():
    g = dict(requires_grad=True)
    torch.library.opcheck(torch.ops.recompile.dot_interaction.default,
                          ([torch.randn(3, 5, 7, **g)], torch.randn(3, 4, **g), False, True, "cpu"))
    torch.library.opcheck(torch.ops.recompile.dot_interaction.default,
                          ([torch.randn(3, 7, **g), torch.randn(3, 2, 7, **g)], None, True, False, "native"))
    torch.library.opcheck(torch.ops.recompile.cross_layer.default,
                          (torch.randn(6, 8, **g), torch.randn(6, 8, **g), torch.randn(8, 2, **g),
                           torch.randn(8, **g), torch.randn(2, 8, **g), "cpu"))
    torch.library.opcheck(torch.ops.recompile.fm_second_order.default, (torch.randn(4, 3, 5, **g), True, "cpu"))


def test_bad_inputs_name_the_op_and_tensor():
    with pytest.raises(ValueError, match="dot_interaction: features must be"):
        torch.ops.recompile.dot_interaction([torch.randn(3, 4, 2, 1)], None, True, False, "cpu")
    with pytest.raises(ValueError, match="dot_interaction: features must be"):
        torch.ops.recompile.dot_interaction([torch.randn(3, 4), torch.randn(2, 4)], None, True, False, "native")
    with pytest.raises(ValueError, match="dot_interaction: prefix must be"):
        torch.ops.recompile.dot_interaction([torch.randn(3, 4, 2)], torch.randn(2, 4), True, False, "cpu")
    with pytest.raises(ValueError, match="cross_layer: expected"):
        torch.ops.recompile.cross_layer(torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 4), None, None, "cpu")
    with pytest.raises(ValueError, match="fm_second_order: v must be"):
        torch.ops.recompile.fm_second_order(torch.randn(3, 4), False, "cpu")


def test_lowering_tables_end_with_reference_and_cover_kernels():
    for op in ("dot_interaction", "cross_layer", "cross_stack", "cross_mixture", "fm_second_order"):
        impls = [i.impl for i in LOWERINGS[f"recompile::{op}"]]
        assert impls[-1] == "reference" and set(impls) == set(KERNELS[op])


def _grads_of(fn, inputs):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    weight = torch.linspace(0.5, 1.5, out.numel()).view_as(out).to(out.dtype)
    live = [t for t in leaves if t is not None]
    return out.detach(), torch.autograd.grad((out * weight).sum(), live)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 4), f=st.integers(1, 7), d=st.integers(1, 9), k=st.sampled_from([None, 3]),
       upper=st.booleans(), self_interaction=st.booleans(), low_rank=st.booleans(), reduce=st.booleans(),
       impl=st.sampled_from(["cpu", "triton", "native"]), layout=st.sampled_from(LAYOUTS))
def test_backward_matches_autograd_of_reference(b, f, d, k, upper, self_interaction, low_rank, reduce, impl, layout):
    t, prefix = torch.randn(b, f, d), None if k is None else torch.randn(b, k)
    items = _items(t, layout)
    n = len(items)

    def dot(op):
        return lambda p, *items: op(list(items), p, upper, self_interaction)

    got = _grads_of(dot(lambda *a: torch.ops.recompile.dot_interaction(*a, impl)), [prefix, *items])
    want = _grads_of(dot(dot_interaction_reference), [prefix, *items])
    assert len(got[1]) == n + (prefix is not None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    rank = 2 if low_rank else d
    args = [torch.randn(b, d), torch.randn(b, d), torch.randn(d, rank), torch.randn(d),
            torch.randn(rank, d) if low_rank else None]
    got = _grads_of(lambda *a: torch.ops.recompile.cross_layer(*a, impl), args)
    torch.testing.assert_close(got, _grads_of(cross_layer_reference, args), rtol=1e-4, atol=1e-4 * d)

    got = _grads_of(lambda v: torch.ops.recompile.fm_second_order(v, reduce, impl), [t])
    want = _grads_of(lambda v: fm_second_order_reference(v, reduce), [t])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * f)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(0, 6), f=st.integers(1, 30), d=st.integers(1, 70), k=st.sampled_from([None, 4]),
       upper=st.booleans(), self_interaction=st.booleans(), dtype=DTYPES, layout=st.sampled_from(LAYOUTS))
def test_native_kernels_forward_and_backward_in_every_dtype(b, f, d, k, upper, self_interaction, dtype, layout):
    """The C kernels (runtime/csrc/interaction.h) against autograd of the fp32 reference, fp16/bf16 included;
    D spans partial and several vector tiles, F runs of pairs shorter and longer than a block."""
    if not interaction_native.available():
        pytest.skip("no C compiler: the native kernels fall back to the torch ones")
    tol = TOL[dtype]
    t, prefix = _randn(b, f, d, dtype=dtype), None if k is None else _randn(b, k, dtype=dtype)
    items = _items(t, layout)

    def dot(op):
        return lambda p, *items: op(list(items), p, upper, self_interaction)

    got = _grads_of(dot(lambda *a: torch.ops.recompile.dot_interaction(*a, "native")), [prefix, *items])
    want = _grads_of(dot(dot_interaction_reference), [None if prefix is None else prefix.float(),
                                                     *[i.float() for i in items]])
    torch.testing.assert_close(_floats(got), want, rtol=tol["rtol"], atol=tol["atol"] * d)

    x0, x, bias = _randn(b, d, dtype=dtype), _randn(b, d, dtype=dtype), _randn(d, dtype=dtype)
    weight = _randn(d, d, dtype=dtype) / d ** 0.5
    args = [x0, x, weight, bias, None]
    got = _grads_of(lambda *a: torch.ops.recompile.cross_layer(*a, "native"), args)
    want = _grads_of(cross_layer_reference, [None if a is None else a.float() for a in args])
    torch.testing.assert_close(_floats(got), want, rtol=tol["rtol"], atol=tol["atol"] * max(b, 1) * 4)

    v = _randn(b, f, d, dtype=dtype)
    for reduce in (False, True):
        got = _grads_of(lambda v: torch.ops.recompile.fm_second_order(v, reduce, "native"), [v])
        want = _grads_of(lambda v: fm_second_order_reference(v, reduce), [v.float()])
        torch.testing.assert_close(_floats(got), want, rtol=tol["rtol"], atol=tol["atol"] * f * (d if reduce else 1))


def _floats(result):
    out, grads = result
    return out.float(), tuple(g.float() for g in grads)
