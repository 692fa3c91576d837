"""Every kernel of grouped_embedding_bag gives the same outcome for empty offsets (no bags) with ids."""
import pytest
import torch

import recompile.runtime.embedding_native  # noqa: F401  (registers the native kernel)
from recompile.runtime.kernels import KERNELS

ops = torch.ops.recompile


@pytest.mark.parametrize("impl", sorted(KERNELS["grouped_embedding_bag"]))
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_empty_offsets_with_ids_are_refused_by_every_kernel(impl, include_last_offset):
    w = torch.randn(10, 4)
    empty = torch.empty(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="feature 'f': offsets are empty but there are 3 ids"):
        ops.grouped_embedding_bag([w], [torch.tensor([1, 2, 3])], [empty], [torch.empty(0)], [0], [-1],
                                  [include_last_offset], [False], "concat", "f", "fatal", impl)
    if not include_last_offset:  # no bags, no ids: an empty batch from every kernel
        out = ops.grouped_embedding_bag([w], [empty], [empty], [torch.empty(0)], [0], [-1], [False], [False],
                                        "concat", "f", "fatal", impl)
        assert out.shape == (0, 4)
