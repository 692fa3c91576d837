"""Jagged ops (runtime/jagged.py): every kernel against the per-sequence reference and torch.ops.fbgemm,
forward and backward, over zero-length sequences, one sequence, int32/int64 offsets and low precision."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.runtime import jagged
from recompile.runtime.fbgemm import fbgemm_op
from recompile.runtime.kernels import KERNELS

ops = torch.ops.recompile
IMPLS = ("reference", "cpu", "fbgemm")

lengths_st = st.lists(st.integers(0, 9), min_size=1, max_size=6)
offset_dtype_st = st.sampled_from([torch.int32, torch.int64])


def make_offsets(lengths, dtype):
    return torch.ops.recompile.complete_cumsum(torch.tensor(lengths, dtype=dtype), "cpu")


def close(a, b, dtype=torch.float32):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def grads(fn, *inputs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fn(*inputs)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    out.backward(seed, inputs=inputs)
    return out, [x.grad for x in inputs]


def test_every_jagged_op_has_all_kernels():
    for op in ("jagged_to_padded_dense", "dense_to_jagged", "jagged_dense_elementwise_add",
                                   "jagged_dense_elementwise_mul", "jagged_softmax", "jagged_jagged_bmm",
                                   "jagged_dense_bmm"):
        assert set(IMPLS) <= set(KERNELS[op]), op


@settings(max_examples=20, deadline=None)
@given(lengths=lengths_st, odt=offset_dtype_st, n=st.integers(1, 10), d=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_pad_and_unpad(lengths, odt, n, d, dtype):
    offsets = make_offsets(lengths, odt)
    values = torch.randn(sum(lengths), d).to(dtype)
    dense = torch.randn(len(lengths), n, d).to(dtype)
    want_pad = fbgemm_op("jagged_to_padded_dense")(values, [offsets], [n], -1.5)
    want_unpad = fbgemm_op("dense_to_jagged")(dense, [offsets], sum(lengths))[0]
    for impl in IMPLS:
        close(ops.jagged_to_padded_dense(values, offsets, n, -1.5, impl), want_pad, dtype)
        close(ops.dense_to_jagged(dense, offsets, sum(lengths), impl), want_unpad, dtype)
    # 3-D values (heads): the same as the flattened op
    values3 = torch.randn(sum(lengths), 2, d)
    got = ops.jagged_to_padded_dense(values3, offsets, n, 0.0, "fbgemm")
    close(got, ops.jagged_to_padded_dense(values3, offsets, n, 0.0, "cpu"))
    close(ops.dense_to_jagged(got, offsets, sum(lengths), "fbgemm"), ops.dense_to_jagged(got, offsets, None, "cpu"))


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=offset_dtype_st, n=st.integers(1, 10), d=st.integers(1, 4))
def test_pad_unpad_backward(lengths, odt, n, d):
    offsets = make_offsets(lengths, odt)
    values, dense = torch.randn(sum(lengths), d), torch.randn(len(lengths), n, d)
    ref = [grads(lambda v: ops.jagged_to_padded_dense(v, offsets, n, 0.0, "reference"), values),
           grads(lambda x: ops.dense_to_jagged(x, offsets, sum(lengths), "reference"), dense)]
    for impl in ("cpu", "fbgemm"):
        got = [grads(lambda v: ops.jagged_to_padded_dense(v, offsets, n, 0.0, impl), values),
               grads(lambda x: ops.dense_to_jagged(x, offsets, sum(lengths), impl), dense)]
        for (o1, g1), (o2, g2) in zip(got, ref):
            close(o1, o2), close(g1[0], g2[0])


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=offset_dtype_st, n=st.integers(1, 10), d=st.integers(1, 4))
def test_jagged_dense_elementwise(lengths, odt, n, d):
    offsets = make_offsets(lengths, odt)
    x, y = torch.randn(sum(lengths), d), torch.randn(len(lengths), n, d)
    want_add = fbgemm_op("jagged_dense_elementwise_add_jagged_output")(x, [offsets], y)[0]
    want_mul = fbgemm_op("jagged_dense_elementwise_mul")(x, [offsets], y)[0]
    ref_add = grads(lambda a, b: ops.jagged_dense_elementwise_add(a, offsets, b, "reference"), x, y)
    ref_mul = grads(lambda a, b: ops.jagged_dense_elementwise_mul(a, offsets, b, "reference"), x, y)
    close(ref_add[0], want_add), close(ref_mul[0], want_mul)
    for impl in ("cpu", "fbgemm"):
        for op, ref in ((ops.jagged_dense_elementwise_add, ref_add), (ops.jagged_dense_elementwise_mul, ref_mul)):
            out, g = grads(lambda a, b: op(a, offsets, b, impl), x, y)
            close(out, ref[0]), close(g[0], ref[1][0]), close(g[1], ref[1][1])
    if max(lengths) > n:
        return
    # gradients against autograd through the padded formulation (which covers every position)
    for op, fn in ((ops.jagged_dense_elementwise_add, torch.add), (ops.jagged_dense_elementwise_mul, torch.mul)):
        seed = torch.randn(sum(lengths), d)
        xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
        (op(xg, offsets, yg, "cpu") * seed).sum().backward()
        xe, ye = x.clone().requires_grad_(), y.clone().requires_grad_()
        dense = fn(ops.jagged_to_padded_dense(xe, offsets, n, 0.0, "reference"), ye)
        (ops.dense_to_jagged(dense, offsets, sum(lengths), "reference") * seed).sum().backward()
        close(xg.grad, xe.grad), close(yg.grad, ye.grad)


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=offset_dtype_st, max_l=st.integers(1, 10), d=st.integers(1, 4))
def test_jagged_softmax(lengths, odt, max_l, d):
    offsets = make_offsets(lengths, odt)
    x = torch.randn(sum(lengths), d)
    within = ops.dense_to_jagged(torch.ones(len(lengths), max_l, 1), offsets, sum(lengths), "cpu").bool()
    want = fbgemm_op("jagged_softmax")(x, offsets, max_l)[0]
    ref_out, (ref_grad,) = grads(lambda v: ops.jagged_softmax(v, offsets, max_l, "reference"), x)
    close(torch.where(within, ref_out, 0), torch.where(within, want, 0))  # fbgemm leaves rows past max_l unset
    for impl in ("cpu", "fbgemm"):
        out, (g,) = grads(lambda v: ops.jagged_softmax(v, offsets, max_l, impl), x)
        close(out, ref_out), close(g, ref_grad)


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=offset_dtype_st, max_l=st.integers(1, 10), m=st.integers(1, 4), k=st.integers(1, 4))
def test_jagged_bmm(lengths, odt, max_l, m, k):
    offsets = make_offsets(lengths, odt)
    total, b = sum(lengths), len(lengths)
    x, y, w = torch.randn(total, m), torch.randn(total, k), torch.randn(b, m, k)
    close(ops.jagged_jagged_bmm(x, y, offsets, max_l, "reference"), fbgemm_op("jagged_jagged_bmm")(x, y, offsets, max_l))
    close(ops.jagged_dense_bmm(x, offsets, w, max_l, "reference"), fbgemm_op("jagged_dense_bmm")(x, offsets, w, max_l)[0])
    for impl in ("cpu", "fbgemm"):
        for op, args in ((ops.jagged_jagged_bmm, lambda a, c: (a, c, offsets, max_l)),
                         (ops.jagged_dense_bmm, lambda a, c: (a, offsets, c, max_l))):
            second = y if op is ops.jagged_jagged_bmm else w
            out, g = grads(lambda a, c: op(*args(a, c), impl), x, second)
            ref, g_ref = grads(lambda a, c: op(*args(a, c), "reference"), x, second)
            close(out, ref), close(g[0], g_ref[0]), close(g[1], g_ref[1])


def test_bmm_backward_matches_autograd_of_reference_loop():
    offsets = make_offsets([3, 0, 5, 1], torch.int64)
    x, w = torch.randn(9, 3, requires_grad=True), torch.randn(4, 3, 2, requires_grad=True)
    out = ops.jagged_dense_bmm(x, offsets, w, 4, "cpu")
    seed = torch.randn_like(out)
    gx, gw = torch.autograd.grad((out * seed).sum(), (x, w))
    ex, ew = torch.autograd.grad((jagged.jagged_dense_bmm_reference(x, offsets, w, 4) * seed).sum(), (x, w))
    close(gx, ex), close(gw, ew)


def test_opcheck_jagged_ops():
    offsets = make_offsets([2, 0, 3], torch.int64)
    x, y3, w = torch.randn(5, 3), torch.randn(3, 4, 3), torch.randn(3, 3, 2)
    cases = [
        (ops.jagged_to_padded_dense.default, (x, offsets, 4, 0.0, "cpu")),
        (ops.dense_to_jagged.default, (y3, offsets, 5, "cpu")),
        (ops.jagged_dense_elementwise_add.default, (x, offsets, y3, "cpu")),
        (ops.jagged_dense_elementwise_mul.default, (x, offsets, y3, "cpu")),
        (ops.jagged_softmax.default, (x, offsets, 4, "cpu")),
        (ops.jagged_jagged_bmm.default, (x, torch.randn(5, 2), offsets, 4, "cpu")),
        (ops.jagged_dense_bmm.default, (x, offsets, w, 4, "cpu")),
    ]
    for op, args in cases:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        torch.library.opcheck(op, args)


def test_bad_jagged_inputs_raise():
    with pytest.raises(ValueError, match="offsets must be int32 or int64"):
        ops.jagged_to_padded_dense(torch.randn(3, 2), torch.tensor([0.0, 3.0]), 4, 0.0, "cpu")
    with pytest.raises(ValueError, match="dense must be"):
        ops.dense_to_jagged(torch.randn(3, 4, 2), torch.tensor([0, 3]), None, "cpu")
    with pytest.raises(ValueError, match="y must be"):
        ops.jagged_dense_bmm(torch.randn(3, 2), torch.tensor([0, 3]), torch.randn(1, 3, 2), 3, "cpu")
