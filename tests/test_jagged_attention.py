"""Jagged attention ops (runtime/jagged_attention.py): HSTU pointwise and softmax attention, forward and
backward, every kernel against per-sequence oracles, over zero-length sequences, one sequence, int32/int64
offsets, targets, contextual prefixes, position/time bias and bf16."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.runtime.jagged_attention import hstu_valid_mask
from recompile.runtime.kernels import KERNELS

ops = torch.ops.recompile
IMPLS = sorted(set(KERNELS["jagged_softmax_attention"]) - {"triton"})  # reference, cpu (triton: tests/test_triton_*.py)
MAX_LEN = 12


def make_offsets(lengths, dtype=torch.int64):
    return ops.complete_cumsum(torch.tensor(lengths, dtype=dtype), "cpu")


def hstu_per_sequence(q, k, v, offsets, max_seq_len, alpha, causal, num_targets, contextual, rel_bias, ts, time_bias):
    """One sequence at a time, no padding: the definition."""
    outs = []
    bounds = offsets.tolist()
    for b in range(len(bounds) - 1):
        s, e = bounds[b], bounds[b + 1]
        n = e - s
        if n == 0:
            continue
        scores = alpha * torch.einsum("ihd,jhd->hij", q[s:e], k[s:e])
        i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
        if rel_bias is not None:
            scores = scores + rel_bias[max_seq_len - 1 + j - i]
        if time_bias is not None:
            diff = (ts[s:e].view(n, 1) - ts[s:e].view(1, n)).abs().clamp(min=1).float()
            scores = scores + time_bias[(diff.log() / 0.301).long().clamp(0, time_bias.numel() - 1)]
        targets = None if num_targets is None else num_targets[b : b + 1]
        mask = hstu_valid_mask(torch.tensor([n]), n, causal, targets, contextual)[0]
        outs.append(torch.einsum("hij,jhd->ihd", F.silu(scores) * mask / max_seq_len, v[s:e]))
    return torch.cat(outs) if outs else v * 0


def softmax_per_sequence(q, k, v, offsets, scale, causal):
    outs = []
    bounds = offsets.tolist()
    for b in range(len(bounds) - 1):
        s, e = bounds[b], bounds[b + 1]
        if e > s:
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat(outs) if outs else v * 0


def test_hstu_mask_semantics():
    # causal incl. diagonal; the last 2 are targets: they see the history and themselves only
    mask = hstu_valid_mask(torch.tensor([5]), 5, True, torch.tensor([2]), 0)[0]
    assert mask[4].tolist() == [True, True, True, False, True]
    assert mask[3].tolist() == [True, True, True, True, False]
    assert mask[1].tolist() == [True, True, False, False, False]
    # a contextual prefix of 2: the first row sees every non-target position
    mask = hstu_valid_mask(torch.tensor([5]), 5, True, torch.tensor([1]), 2)[0]
    assert mask[0].tolist() == [True, True, True, True, False]


lengths_st = st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=5)


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=st.sampled_from([torch.int32, torch.int64]), heads=st.integers(1, 2),
       d=st.integers(1, 5), causal=st.booleans(), targets=st.booleans(), contextual=st.integers(0, 2),
       bias=st.booleans())
def test_hstu_attention_forward_backward(lengths, odt, heads, d, causal, targets, contextual, bias):
    offsets = make_offsets(lengths, odt)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d, requires_grad=True) for _ in range(3))
    num_targets = torch.tensor([min(2, n) for n in lengths]) if targets else None
    rel = torch.randn(2 * MAX_LEN - 1, requires_grad=True) if bias else None
    ts = torch.randint(0, 100000, (total,)) if bias else None
    tb = torch.randn(12, requires_grad=True) if bias else None
    args = (MAX_LEN, 0.7, causal, num_targets, contextual)
    leaves = [q, k, v] + ([rel, tb] if bias else [])
    want = hstu_per_sequence(q, k, v, offsets, *args, rel, ts, tb)
    seed = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * seed).sum(), leaves, allow_unused=True)
    for impl in IMPLS:
        out = ops.hstu_attention(q, k, v, offsets, *args, rel, ts, tb, impl)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        got = torch.autograd.grad((out * seed).sum(), leaves, allow_unused=True)
        for g, w in zip(got, want_grads):
            torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-4, atol=1e-5)


@settings(max_examples=15, deadline=None)
@given(lengths=lengths_st, odt=st.sampled_from([torch.int32, torch.int64]), heads=st.integers(1, 2),
       d=st.integers(1, 5), causal=st.booleans())
def test_softmax_attention_forward_backward(lengths, odt, heads, d, causal):
    offsets = make_offsets(lengths, odt)
    q, k, v = (torch.randn(sum(lengths), heads, d, requires_grad=True) for _ in range(3))
    want = softmax_per_sequence(q, k, v, offsets, 0.4, causal)
    seed = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * seed).sum(), (q, k, v), allow_unused=True)
    for impl in IMPLS:
        out = ops.jagged_softmax_attention(q, k, v, offsets, 0.4, causal, impl)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        got = torch.autograd.grad((out * seed).sum(), (q, k, v))
        for g, w in zip(got, want_grads):
            torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision(dtype):
    offsets = make_offsets([7, 0, 3, 12])
    q, k, v = (torch.randn(22, 2, 8) for _ in range(3))
    want = ops.hstu_attention(q, k, v, offsets, MAX_LEN, 0.5, True, None, 0, None, None, None, "reference")
    got = ops.hstu_attention(q.to(dtype), k.to(dtype), v.to(dtype), offsets, MAX_LEN, 0.5, True, None, 0, None, None,
                             None, "cpu")
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    want = softmax_per_sequence(q, k, v, offsets, 0.3, True)
    got = ops.jagged_softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), offsets, 0.3, True, "cpu")
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_attention_opcheck_and_errors():
    offsets = make_offsets([3, 0, 4])
    q, k, v = (torch.randn(7, 2, 4, requires_grad=True) for _ in range(3))
    rel = torch.randn(2 * 5 - 1, requires_grad=True)
    torch.library.opcheck(ops.hstu_attention.default, (q, k, v, offsets, 5, 0.5, True, None, 0, rel, None, None, "cpu"))
    torch.library.opcheck(ops.jagged_softmax_attention.default, (q, k, v, offsets, 0.5, True, "cpu"))
    with pytest.raises(ValueError, match="rel_bias must have 2 \\* max_seq_len - 1 = 9"):
        ops.hstu_attention(q, k, v, offsets, 5, 0.5, True, None, 0, torch.randn(4), None, None, "cpu")
    with pytest.raises(ValueError, match="q, k must be"):
        ops.jagged_softmax_attention(q, k[:, :1], v, offsets, 0.5, True, "cpu")


def test_time_buckets_by_edges_equal_the_log_formula():
    """The kernels bucket integer time gaps by searching the bucket edges; that is HSTU's log formula exactly,
    on both sides of every edge."""
    from recompile.runtime.jagged_attention import relative_time_index, time_bucket, time_bucket_edges

    for num_buckets in (1, 16, 128):
        edges = time_bucket_edges(num_buckets, torch.device("cpu"))
        edges = edges[edges < 2**62]
        gaps = torch.cat([torch.arange(-20, 300), edges - 1, edges, edges + 1, -edges,
                          torch.randint(0, 2**40, (1000,), generator=torch.Generator().manual_seed(0))])
        ts = torch.stack([torch.zeros_like(gaps), gaps], 1)
        expected = time_bucket(ts.unsqueeze(2) - ts.unsqueeze(1), num_buckets)
        assert torch.equal(relative_time_index(ts, num_buckets), expected)
        ts32 = ts.clamp(-(2**29), 2**29).to(torch.int32)
        assert torch.equal(relative_time_index(ts32, num_buckets),
                           time_bucket(ts32.unsqueeze(2) - ts32.unsqueeze(1), num_buckets))
