"""The jagged <-> padded conversions and jagged-dense elementwise add / mul in Triton
(runtime/triton_kernels/jagged_dense.py, TRITON_INTERPRET=1 here) against the reference, forward and backward:
zero-length sequences, a single row, sequences longer than the padded length, inner dimensions, fp16."""
import pytest
import torch
from checks import assert_kernel_matches_reference

ops = torch.ops.recompile


@pytest.mark.parametrize("lengths, inner, padded", [([0, 1, 37, 5, 0], (3,), 40), ([20, 40], (2, 65), 33), ([0], (4,), 8),
                                                    ([1], (1,), 1)])
def test_jagged_dense_triton_matches_reference(lengths, inner, padded):
    gen = torch.Generator().manual_seed(padded)
    offsets = ops.complete_cumsum(torch.tensor(lengths), "cpu")
    x = torch.randn(sum(lengths), *inner, generator=gen).requires_grad_()
    y = torch.randn(len(lengths), padded, *inner, generator=gen).requires_grad_()
    calls = [(ops.jagged_to_padded_dense, (x, offsets, padded, -1.5)), (ops.dense_to_jagged, (y, offsets, sum(lengths))),
             (ops.jagged_dense_elementwise_add, (x, offsets, y)), (ops.jagged_dense_elementwise_mul, (x, offsets, y))]
    for op, args in calls:
        assert_kernel_matches_reference(op, args, "triton", gen, 1e-6)


def test_mixed_dtypes_take_the_result_dtype():
    offsets = ops.complete_cumsum(torch.tensor([3, 0, 2]), "cpu")
    x, y = torch.randn(5, 4).half(), torch.randn(3, 2, 4)
    for op in (ops.jagged_dense_elementwise_add, ops.jagged_dense_elementwise_mul):
        got, want = op(x, offsets, y, "triton"), op(x, offsets, y, "reference")
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want)
