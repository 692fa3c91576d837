"""jagged_softmax's Triton kernels (runtime/triton_kernels/jagged_softmax.py, TRITON_INTERPRET=1 here) against the
reference, forward and backward: zero-length sequences, a single row, sequences cut at max_L, tiles of 16 rows
split mid-sequence, column blocks."""
import pytest
import torch

ops = torch.ops.recompile


@pytest.mark.parametrize("lengths, dim, max_len", [([0, 1, 37, 5, 0], 3, 40), ([20, 40], 130, 33), ([0], 4, 8),
                                                   ([1], 1, 1)])
def test_jagged_softmax_triton_matches_reference(lengths, dim, max_len):
    gen = torch.Generator().manual_seed(dim)
    offsets = ops.complete_cumsum(torch.tensor(lengths), "cpu")
    values = (torch.randn(sum(lengths), dim, generator=gen) * 3).requires_grad_()
    got, want = ops.jagged_softmax(values, offsets, max_len, "triton"), ops.jagged_softmax(values, offsets, max_len,
                                                                                            "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grad = torch.randn(want.shape, generator=gen)
    (g,), (w,) = torch.autograd.grad(got, values, grad), torch.autograd.grad(want, values, grad)
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
