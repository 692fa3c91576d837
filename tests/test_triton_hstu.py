"""The Triton HSTU kernels (runtime/triton_kernels/jagged_attention.py, TRITON_INTERPRET=1 here) against the
reference, forward and backward, with every feature the zoo uses: relative position and time bias (integer and
float timestamps), ``num_targets`` and a contextual prefix, over zero-length sequences, a single row and tiles
of 16 split mid-sequence."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ops = torch.ops.recompile
MAX_LEN = 40


def _inputs(lengths, heads, d, targets, contextual, rel, time, odt=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = ops.complete_cumsum(torch.tensor(lengths, dtype=odt), "cpu")
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, d, generator=gen).requires_grad_() for _ in range(3))
    num_targets = None
    if targets:  # at most the sequence less its contextual prefix
        num_targets = torch.tensor([torch.randint(0, max(n - contextual, 0) + 1, (1,), generator=gen).item()
                                    for n in lengths])
    rel_bias = torch.randn(2 * MAX_LEN - 1, generator=gen).requires_grad_() if rel else None
    timestamps = time_bias = None
    if time:
        gaps = torch.randint(0, 5000, (total,), generator=gen)
        timestamps = gaps.cumsum(0) if time == "int" else gaps.cumsum(0).double() + torch.rand(total, generator=gen)
        time_bias = torch.randn(33, generator=gen).requires_grad_()
    return (q, k, v, offsets, MAX_LEN, 0.4), dict(num_targets=num_targets, contextual_seq_len=contextual,
                                                 rel_bias=rel_bias, timestamps=timestamps, time_bias=time_bias)


def check_against_reference(lengths, heads=2, d=8, causal=True, targets=False, contextual=0, rel=False, time=None,
                            odt=torch.int64):
    args, kw = _inputs(lengths, heads, d, targets, contextual, rel, time, odt)
    call = [*args, causal, kw["num_targets"], contextual, kw["rel_bias"], kw["timestamps"], kw["time_bias"]]
    got, want = ops.hstu_attention(*call, "triton"), ops.hstu_attention(*call, "reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    leaves = [t for t in (*args[:3], kw["rel_bias"], kw["time_bias"]) if t is not None]
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    for g, w in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(st.integers(0, 24), min_size=1, max_size=3), causal=st.booleans(), targets=st.booleans(),
       contextual=st.sampled_from([0, 1, 3]), rel=st.booleans(), time=st.sampled_from([None, "int", "float"]),
       odt=st.sampled_from([torch.int32, torch.int64]))
def test_hstu_triton_every_feature_matches_reference(lengths, causal, targets, contextual, rel, time, odt):
    check_against_reference(lengths, causal=causal, targets=targets, contextual=contextual, rel=rel, time=time, odt=odt)


@pytest.mark.parametrize("causal", [True, False])
def test_hstu_triton_contextual_prefix_past_a_tile(causal):
    """A prefix of 18 rows spans two query tiles: key tiles past the diagonal collect those tiles' gradients."""
    check_against_reference([38, 0, 1], causal=causal, targets=True, contextual=18, rel=True, time="int")


def test_hstu_triton_single_row_and_all_empty():
    check_against_reference([1], targets=True, time="int", rel=True)
    check_against_reference([0, 0], targets=True, time="int", rel=True)


def test_tiles_are_listed_without_waiting_for_the_device():
    """The work list has B + total // 16 entries (known on the host); the real tiles are every sequence's own,
    the spare entries start past their sequence."""
    from recompile.runtime.triton_kernels.tiles import _tiles

    lengths = [0, 17, 16, 1, 0, 33]
    seq, start = _tiles(ops.complete_cumsum(torch.tensor(lengths), "cpu"), sum(lengths))
    assert seq.numel() == len(lengths) + sum(lengths) // 16
    real = [(s, t) for s, t in zip(seq.tolist(), start.tolist()) if t < lengths[s]]
    assert real == [(1, 0), (1, 16), (2, 0), (3, 0), (5, 0), (5, 16), (5, 32)]
