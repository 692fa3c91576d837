"""recompile::complete_cumsum: every kernel against the reference and FBGEMM; the jagged pass finds it."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.runtime.fbgemm import fbgemm_op
from recompile.runtime.kernels import KERNELS
from recompile.runtime.offsets import complete_cumsum_reference

IMPLS = sorted(KERNELS["complete_cumsum"])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 2500), dtype=st.sampled_from([torch.int32, torch.int64]), impl=st.sampled_from(IMPLS))
def test_complete_cumsum_matches_reference_and_fbgemm(n, dtype, impl):
    lengths = torch.randint(0, 50, (n,), dtype=dtype)
    got = torch.ops.recompile.complete_cumsum(lengths, impl)
    assert got.dtype == dtype and got.shape == (n + 1,)
    torch.testing.assert_close(got, complete_cumsum_reference(lengths), rtol=0, atol=0)
    torch.testing.assert_close(got, fbgemm_op("asynchronous_complete_cumsum")(lengths), rtol=0, atol=0)


def test_complete_cumsum_rejects_bad_input():
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        torch.ops.recompile.complete_cumsum(torch.ones(2, 2, dtype=torch.int64), "cpu")
    with pytest.raises(ValueError, match="int32 or int64"):
        torch.ops.recompile.complete_cumsum(torch.ones(3), "cpu")
    with pytest.raises(ValueError, match="has no kernel 'nope'"):
        torch.ops.recompile.complete_cumsum(torch.ones(3, dtype=torch.int64), "nope")


def test_complete_cumsum_opcheck():
    torch.library.opcheck(torch.ops.recompile.complete_cumsum.default, (torch.randint(0, 9, (17,)), "cpu"))


def offsets_from_lengths(lengths, values):
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
    return offsets, values * 2


def test_jagged_pass_rewrites_offsets_and_matches_eager():
    lengths, values = torch.randint(0, 7, (33,)), torch.randn(5)
    report = recompile.explain(offsets_from_lengths, lengths, values)
    [region] = report.to_dict()["regions"]
    assert region["op"] == "recompile::complete_cumsum" and region["kind"] == "jagged"
    compiled = torch.compile(offsets_from_lengths, backend="rec_ascend", options={"verify": True})
    torch.testing.assert_close(compiled(lengths, values), offsets_from_lengths(lengths, values))


def test_jagged_pass_leaves_other_padding_alone():
    def pad_two(lengths):
        return F.pad(torch.cumsum(lengths, 0), (2, 0))

    report = recompile.explain(pad_two, torch.randint(0, 7, (9,)))
    assert report.to_dict()["regions"] == []
