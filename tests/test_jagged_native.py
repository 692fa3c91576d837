"""The native CPU kernel of recompile.hstu_attention (runtime/csrc/jagged_attention.h), forward and backward,
against the reference kernel (the padded formulation) and per-sequence eager attention: jagged lengths with
zero-length sequences, one sequence, lengths across the kernel's 32-row and 64-key tiles and at max_seq_len,
int32/int64 offsets, targets, contextual prefixes, relative position and time bias (gaps on both sides of
every bucket bound), strided q/k/v views, f16/bf16, one and two threads."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.lowering import choose
from recompile.lowering.targets import detect_target
from recompile.runtime import jagged_attention_native as native
from recompile.runtime.jagged_attention import time_bucket_edges
from recompile.runtime.kernels import UnsupportedInputs
from tests.test_jagged_attention import hstu_per_sequence

ops = torch.ops.recompile
MAX_LEN = 70  # above one 64-key tile and two 32-row blocks
NUM_BUCKETS = 20

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the op keeps its cpu kernel")


def make_offsets(lengths, dtype=torch.int64):
    return ops.complete_cumsum(torch.tensor(lengths, dtype=dtype), "cpu")


def edge_timestamps(total: int, generator: torch.Generator) -> torch.Tensor:
    """Timestamps whose gaps to their neighbours fall on, just below and just above the bucket bounds."""
    edges = time_bucket_edges(NUM_BUCKETS, torch.device("cpu"))
    edges = edges[edges < 2**40]
    gaps = torch.cat([edges - 1, edges, edges + 1, torch.randint(0, 10**6, (total,), generator=generator)])
    picks = gaps[torch.randint(0, gaps.numel(), (total,), generator=generator)]
    signs = torch.randint(0, 2, (total,), generator=generator) * 2 - 1
    return torch.cumsum(picks * signs, 0)


def attention_case(lengths, heads, d, dv, bias, odt=torch.int64, seed=0, dtype=torch.float32, fused=False):
    """Inputs of one call; with ``fused``, q, k, v are strided views of one projection output."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    if fused:
        uvqk = torch.randn(total, heads * (2 * d + dv) + 3, generator=gen).to(dtype)
        q, k, v = torch.split(uvqk[:, 3:], [heads * d, heads * d, heads * dv], dim=1)
        q, k, v = q.view(total, heads, d), k.view(total, heads, d), v.view(total, heads, dv)
    else:
        q, k = (torch.randn(total, heads, d, generator=gen).to(dtype) for _ in range(2))
        v = torch.randn(total, heads, dv, generator=gen).to(dtype)
    rel = torch.randn(2 * MAX_LEN - 1, generator=gen) if bias else None
    ts = edge_timestamps(total, gen) if bias else None
    tb = torch.randn(NUM_BUCKETS + 1, generator=gen) if bias else None
    return q, k, v, make_offsets(lengths, odt), rel, ts, tb


def forward_and_grads(fn, q, k, v, rel, tb, seed):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    biases = [None if b is None else b.detach().requires_grad_() for b in (rel, tb)]
    out = fn(*leaves, *biases)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    wrt = leaves + [b for b in biases if b is not None]
    return out, torch.autograd.grad(out, wrt, grad)


def check_against_reference(lengths, heads, d, dv, causal, targets, contextual, bias, odt, seed, **case):
    q, k, v, offsets, rel, ts, tb = attention_case(lengths, heads, d, dv, bias, odt, seed, **case)
    num_targets = torch.tensor([min(3, n) for n in lengths], dtype=odt) if targets else None

    def op(impl):
        return lambda q, k, v, rel, tb: ops.hstu_attention(q, k, v, offsets, MAX_LEN, 0.3, causal, num_targets,
                                                          contextual, rel, ts, tb, impl)

    want, want_grads = forward_and_grads(op("reference"), q, k, v, rel, tb, seed)
    got, got_grads = forward_and_grads(op("native"), q, k, v, rel, tb, seed)
    tol = {"rtol": 1e-4, "atol": 1e-5} if q.dtype == torch.float32 else {"rtol": 3e-2, "atol": 3e-2}
    torch.testing.assert_close(got, want, **tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol)
    return q, k, v, offsets, num_targets, rel, ts, tb, got, got_grads


lengths_st = st.lists(st.integers(0, MAX_LEN), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, heads=st.integers(1, 3), d=st.sampled_from([1, 5, 16, 20, 33]),
       dv=st.sampled_from([3, 16, 24]), causal=st.booleans(), targets=st.booleans(), contextual=st.integers(0, 3),
       bias=st.booleans(), odt=st.sampled_from([torch.int32, torch.int64]), seed=st.integers(0, 2**16))
def test_native_hstu_attention_matches_reference(lengths, heads, d, dv, causal, targets, contextual, bias, odt, seed):
    check_against_reference(lengths, heads, d, dv, causal, targets, contextual, bias, odt, seed)


@pytest.mark.parametrize("lengths", [[MAX_LEN], [0, 0], [1], [MAX_LEN, 0, 1, 64, 65, 32, 33]])
def test_native_edge_lengths_against_eager(lengths):
    """One sequence, only empty ones, single items, and lengths at max_seq_len and on the tile edges, compared
    with eager attention computed one sequence at a time as well."""
    q, k, v, offsets, num_targets, rel, ts, tb, got, _ = check_against_reference(
        lengths, 2, 32, 32, True, True, 2, True, torch.int64, 0)
    want = hstu_per_sequence(q, k, v, offsets, MAX_LEN, 0.3, True, num_targets, 2, rel, ts, tb)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_native_low_precision_strided_views(dtype):
    """q, k, v as strided views of one fused projection (read in place), stored in f16/bf16, float inside."""
    check_against_reference([40, 0, 70, 9], 2, 16, 16, True, False, 0, True, torch.int64, 1, dtype=dtype, fused=True)
    q, *_ = attention_case([5], 1, 4, 4, False, dtype=dtype, fused=True)
    assert q.stride(0) != q.shape[1] * q.shape[2]


def test_native_threads_agree():
    q, k, v, offsets, rel, ts, tb = attention_case([70, 3, 64, 0, 41, 70], 2, 32, 32, True)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(forward_and_grads(
                lambda q, k, v, rel, tb: ops.hstu_attention(q, k, v, offsets, MAX_LEN, 0.3, True, None, 0, rel, ts,
                                                            tb, "native"), q, k, v, rel, tb, 0))
    finally:
        torch.set_num_threads(threads)
    (out1, grads1), (out2, grads2) = results
    torch.testing.assert_close(out1, out2)
    for a, b in zip(grads1, grads2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_native_rows_outside_the_offsets_and_float_timestamps():
    """Offsets that leave rows outside every sequence are refused by name (issue 22); float timestamps are not the
    native kernel's (its supports() says so at compile time, and a call with them raises rather than hand off)."""
    q, k, v, good, rel, ts, tb = attention_case([6, 4, 5], 1, 8, 8, True)
    offsets = torch.tensor([2, 8, 12])
    args = (q, k, v, offsets, MAX_LEN, 0.3, True, None, 0, rel, ts, tb)
    with pytest.raises(ValueError, match="hstu_attention: offsets must start at 0"):
        ops.hstu_attention(*args, "native")
    float_ts = ts.double() + 0.25
    args = (q, k, v, good, MAX_LEN, 0.3, True, None, 0, rel, float_ts, tb)
    with pytest.raises(UnsupportedInputs, match="integer timestamps"):
        ops.hstu_attention(*args, "native")


def test_native_errors_and_opcheck():
    q, k, v, offsets, rel, ts, tb = attention_case([3, 0, 4], 2, 4, 4, True)
    args = (q.requires_grad_(), k, v, offsets, MAX_LEN, 0.5, True, None, 0, rel.requires_grad_(), ts,
            tb.requires_grad_(), "native")
    torch.library.opcheck(ops.hstu_attention.default, args)
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        ops.hstu_attention(q, k, v, offsets, 3, 0.5, True, None, 0, torch.randn(5), None, None, "native")
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.hstu_attention(q, k, v, torch.tensor([0, 5, 3]), MAX_LEN, 0.5, True, None, 0, None, None, None, "native")
    with pytest.raises(ValueError, match="one entry per item"):
        ops.hstu_attention(q, k, v, offsets, MAX_LEN, 0.5, True, None, 0, None, ts[:3], tb, "native")


def test_lowering_prefers_the_native_kernel_on_cpu():
    for op in ("recompile::hstu_attention", "recompile::hstu_attention_backward"):
        assert choose(op, detect_target("cpu")).impl == "native"
        assert choose(op, detect_target("npu")).impl != "native"
