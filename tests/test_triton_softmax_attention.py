"""The jagged softmax attention (SASRec) Triton kernels (runtime/triton_kernels/softmax_attention.py,
TRITON_INTERPRET=1 here) against the reference, forward and backward, over zero-length sequences, a single row,
tiles of 16 split mid-sequence, causal or not, int32 and int64 offsets."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ops = torch.ops.recompile


def check_against_reference(lengths, heads, d, causal, odt=torch.int64):
    gen = torch.Generator().manual_seed(sum(lengths) + d)
    offsets = ops.complete_cumsum(torch.tensor(lengths, dtype=odt), "cpu")
    q, k, v = (torch.randn(sum(lengths), heads, d, generator=gen).requires_grad_() for _ in range(3))
    args = (q, k, v, offsets, 0.35, causal)
    got, want = ops.jagged_softmax_attention(*args, "triton"), ops.jagged_softmax_attention(*args, "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(want.shape, generator=gen)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@settings(max_examples=5, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3), heads=st.integers(1, 2),
       d=st.sampled_from([4, 16]), causal=st.booleans(), odt=st.sampled_from([torch.int32, torch.int64]))
def test_softmax_attention_triton_matches_reference(lengths, heads, d, causal, odt):
    check_against_reference(lengths, heads, d, causal, odt)


def test_softmax_attention_triton_single_row_and_all_empty():
    for causal in (True, False):
        check_against_reference([1], 1, 8, causal)
        check_against_reference([0, 0], 2, 8, causal)
