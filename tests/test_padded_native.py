"""The native CPU kernel of ``recompile.padded_softmax_attention`` (``runtime/csrc/padded_attention.h``): forward and
backward equal to the padded formula (the reference) on random inputs, through the op (its C++ path below autograd)
and its autograd formula; zero-length and full histories, a single row, masks with holes (not a prefix mask: the
kernel weighs every key such a row attends to), rows that attend to no key, read rows (int32 and int64), broadcast
and strided inputs, float32 / float16 / bfloat16; the lowering chooses it on CPU and the 'cpu' kernel where it does
not take the inputs."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.runtime.padded_attention import (native_available, padded_softmax_attention_backward_reference,
                                                padded_softmax_attention_reference)
from tests.test_padded_sequence import additive_mask

pytestmark = pytest.mark.skipif(not native_available(), reason="runtime/_C is not built")

op = torch.ops.recompile.padded_softmax_attention


def forward_and_grads(impl, q, k, v, mask, rows, grad):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = op(*leaves, mask, 0.5, impl, rows=rows)
    return (out, *torch.autograd.grad(out, leaves, grad))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5),
    n=st.integers(1, 13),
    dims=st.tuples(st.integers(1, 20), st.integers(1, 20)),
    heads=st.integers(1, 3),
    causal=st.booleans(),
    holes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12)), max_size=2),
    mask_heads=st.booleans(),
    read=st.one_of(st.none(), st.sampled_from([torch.int32, torch.int64])),
)
def test_native_equals_the_padded_formula(lengths, n, dims, heads, causal, holes, mask_heads, read):
    lengths = torch.tensor(lengths).clamp(max=n)
    b, (d, dv) = len(lengths), dims
    q, k = torch.randn(b, heads, n, d), torch.randn(b, heads, n, d)
    v = torch.randn(b, heads, n, dv)
    mask = additive_mask(lengths, n, causal, holes, heads if mask_heads else 1, torch.float32)
    rows = None if read is None else (lengths - 1).clamp(min=0).to(read)
    grad = torch.randn(b, heads, n, dv)
    got = forward_and_grads("native", q, k, v, mask, rows, grad)
    want = (padded_softmax_attention_reference(q, k, v, mask, 0.5, rows),
            *padded_softmax_attention_backward_reference(grad, q, k, v, mask, 0.5, rows))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("nq, n, d, dv", [(16, 16, 16, 16), (12, 12, 8, 8), (17, 17, 8, 8), (12, 12, 8, 17),
                                           (5, 12, 8, 3), (12, 3, 4, 8), (1, 1, 1, 1)])
@pytest.mark.parametrize("read", [False, True])
def test_few_rows_and_keys_and_the_tiled_path(nq, n, d, dv, read):
    """Up to 16 query rows, keys and dims each (AVX-512's vector: the rows as lanes) and just past it (the tiled path):
    self and cross attention (nq != n), read rows, a causal mask with a hole read through a transposed view (a key
    stride other than 1), a history attending to no key."""
    b, h = 6, 2
    q, k, v, grad = torch.randn(b, h, nq, d), torch.randn(b, h, n, d), torch.randn(b, h, n, dv), torch.randn(b, h, nq, dv)
    lengths = torch.tensor([n, n - 1, 1, 0, n // 2, n]).clamp(min=0)
    keep = (torch.arange(n) < lengths.view(-1, 1)).view(b, 1, 1, n) & torch.ones(nq, n, dtype=torch.bool).tril(n - nq)
    keep[0, 0, :, n // 3] = False
    mask = torch.where(keep, 0.0, -10000.0).transpose(-1, -2).contiguous().transpose(-1, -2)
    rows = (lengths - 1).clamp(min=0) if read and nq == n else None
    got = forward_and_grads("native", q, k, v, mask, rows, grad)
    want = (padded_softmax_attention_reference(q, k, v, mask, 0.5, rows),
            *padded_softmax_attention_backward_reference(grad, q, k, v, mask, 0.5, rows))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def test_strided_broadcast_inputs_and_a_row_attending_to_nothing():
    """k a permuted view (as RecBole makes it), the mask expanded over batch and query rows (stride 0), a grad with
    strides; every key masked for one sequence: the padded formula spreads it over every key."""
    b, h, n, d = 3, 2, 9, 6
    q, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    k = torch.randn(b, n, h, d).permute(0, 2, 1, 3)
    keep = torch.arange(n) < torch.tensor([4, 0, 9]).view(-1, 1)
    mask = torch.where(keep, 0.0, -10000.0).view(b, 1, 1, n).expand(b, 1, n, n)
    grad = torch.randn(b, n, h, d).transpose(1, 2)
    got = forward_and_grads("native", q, k, v, mask, None, grad)
    want = (padded_softmax_attention_reference(q, k, v, mask, 0.5),
            *padded_softmax_attention_backward_reference(grad, q, k, v, mask, 0.5))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(op.default, (q, k, v, mask, 0.5, "native"), {"rows": torch.tensor([3, 0, 8])})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_in_half_precision(dtype):
    lengths = torch.tensor([3, 8, 1, 0])
    q, k, v = (torch.randn(4, 2, 8, 4) for _ in range(3))
    mask = additive_mask(lengths, 8, True, [], 1, torch.float32)
    grad = torch.randn(4, 2, 8, 4)
    got = forward_and_grads("native", *(x.to(dtype) for x in (q, k, v)), mask.to(dtype), lengths - 1, grad.to(dtype))
    want = (padded_softmax_attention_reference(q, k, v, mask, 0.5, lengths - 1),
            *padded_softmax_attention_backward_reference(grad, q, k, v, mask, 0.5, lengths - 1))
    for a, w in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), w, rtol=3e-2, atol=3e-2)


def test_bad_input_names_the_op():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    mask = additive_mask(torch.tensor([4, 6]), 6, True, [], 1, torch.float32)
    with pytest.raises(ValueError, match="recompile_native.padded_attention_fwd: the mask must broadcast"):
        torch.ops.recompile_native.padded_attention_fwd(q, k, v, mask.expand(2, 3, 6, 6), 0.5, None)
    with pytest.raises(ValueError, match="recompile_native.padded_attention_bwd: grad must be"):
        torch.ops.recompile_native.padded_attention_bwd(q[:1], q, k, v, mask, 0.5, None)
    with pytest.raises(ValueError, match="does not support these inputs"):  # float64: the lowering picks 'cpu'
        op(q.double(), k.double(), v.double(), mask.double(), 0.5, "native")


@pytest.mark.parametrize("dtype, kernel", [(torch.float32, "native"), (torch.float64, "cpu")])
def test_lowering_chooses_native_where_it_takes_the_inputs(dtype, kernel):
    from tests.test_padded_rows import QueryNormed, batch

    model = QueryNormed().eval().to(dtype)
    torch._dynamo.reset()
    report = recompile.explain(model, *batch([3, 12, 1, 6])).to_dict()
    attention = [r for r in report["regions"] if r["op"] == "recompile::padded_softmax_attention"]
    assert len(attention) == 2 and {r["impl"] for r in attention} == {kernel}


@pytest.mark.parametrize("batch", [1, 9])
def test_threads_give_the_numbers_of_one_thread(batch):
    """Work items (sequence, head) over OpenMP threads, fewer and more of them than threads: each item is computed
    alone, so the numbers are one thread's, bit for bit."""
    lengths = torch.randint(0, 11, (batch,))
    q, k, v, grad = (torch.randn(batch, 2, 10, 6) for _ in range(4))
    mask = additive_mask(lengths, 10, True, [], 1, torch.float32)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(forward_and_grads("native", q, k, v, mask, (lengths - 1).clamp(min=0), grad))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*results):
        assert torch.equal(a, b)
