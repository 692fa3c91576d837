"""jagged_dense_bmm and jagged_jagged_bmm's Triton kernels (runtime/triton_kernels/jagged_bmm.py,
TRITON_INTERPRET=1 here) against the reference, forward and backward (each is the other's backward): zero-length
sequences, a single row, sequences cut at max_L, tiles of 16 rows split mid-sequence, dims past one block."""
import pytest
import torch
from checks import assert_kernel_matches_reference

ops = torch.ops.recompile


@pytest.mark.parametrize("lengths, k, n, max_len", [([0, 1, 37, 5, 0], 3, 5, 40), ([20, 40], 40, 33, 33), ([0], 4, 4, 8),
                                                    ([1], 1, 1, 1)])
def test_jagged_bmm_triton_matches_reference(lengths, k, n, max_len):
    gen = torch.Generator().manual_seed(k + n)
    offsets = ops.complete_cumsum(torch.tensor(lengths), "cpu")
    x = torch.randn(sum(lengths), k, generator=gen).requires_grad_()
    x2 = torch.randn(sum(lengths), n, generator=gen).requires_grad_()
    y = torch.randn(len(lengths), k, n, generator=gen).requires_grad_()
    for op, args in ((ops.jagged_dense_bmm, (x, offsets, y, max_len)), (ops.jagged_jagged_bmm, (x, x2, offsets, max_len))):
        assert_kernel_matches_reference(op, args, "triton", gen, 1e-5)
