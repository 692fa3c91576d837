"""recompile::beam_decode_attention: every kernel equals the reference (beams with their own context copy) and
plain attention over explicit per-beam copies; shapes incl. one beam, an empty suffix, no context; fp16/bf16."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile import runtime  # noqa: F401
from recompile.lowering import choose, detect_target
from recompile.runtime.beam_decode_attention import beam_decode_attention_reference

ops = torch.ops.recompile


def _inputs(batch, beams, heads, dim, vdim, context, suffix, dtype=torch.float32, seed=0, full=False):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    ctx_len = torch.full((batch,), context) if full else torch.randint(0, context + 1, (batch,), generator=g)
    beam_len = torch.full((batch,), suffix) if full else torch.randint(0, suffix + 1, (batch,), generator=g)
    return (rand(batch, beams, heads, dim), rand(batch, context, heads, dim), rand(batch, context, heads, vdim),
            ctx_len, rand(batch, beams, suffix, heads, dim), rand(batch, beams, suffix, heads, vdim), beam_len)


def _per_beam_copies(q, ck, cv, ctx_len, bk, bv, beam_len, scale):
    """F.scaled_dot_product_attention, beam by beam, over its own concatenated copy of the valid keys."""
    out = torch.zeros(q.shape[:3] + (cv.shape[3],), dtype=torch.float64)
    for b in range(q.shape[0]):
        for w in range(q.shape[1]):
            keys = torch.cat([ck[b, : ctx_len[b]], bk[b, w, : beam_len[b]]]).double().transpose(0, 1)  # [H, n, D]
            values = torch.cat([cv[b, : ctx_len[b]], bv[b, w, : beam_len[b]]]).double().transpose(0, 1)
            if keys.shape[1]:
                out[b, w] = F.scaled_dot_product_attention(q[b, w].double().unsqueeze(1), keys, values,
                                                           scale=scale).squeeze(1)
    return out


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), beams=st.sampled_from([1, 3, 17]), heads=st.integers(1, 2),
       dim=st.sampled_from([4, 16]), context=st.integers(0, 20), suffix=st.integers(0, 3), seed=st.integers(0, 99))
def test_kernels_match_attention_over_per_beam_copies(impl, batch, beams, heads, dim, context, suffix, seed):
    args = _inputs(batch, beams, heads, dim, dim + 1, context, suffix, seed=seed)
    scale = dim ** -0.5
    got = ops.beam_decode_attention(*args, scale, impl)
    torch.testing.assert_close(got, beam_decode_attention_reference(*args, scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), _per_beam_copies(*args, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("impl", ["cpu", "triton"])
def test_half_precision_matches_the_reference(dtype, impl):
    args = _inputs(2, 5, 2, 16, 16, 12, 3, dtype=dtype, seed=3, full=True)
    got = ops.beam_decode_attention(*args, 0.25, impl)
    assert got.dtype == dtype
    want = ops.beam_decode_attention(*args, 0.25, "reference")
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(want.double(), _per_beam_copies(*args, 0.25), rtol=2e-2, atol=2e-2)


def test_no_valid_key_gives_zeros():
    args = list(_inputs(2, 3, 1, 4, 4, 5, 2, full=True))
    args[3], args[6] = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32)
    for impl in ("reference", "cpu", "triton"):
        out = ops.beam_decode_attention(*args, 1.0, impl)
        assert torch.equal(out, torch.zeros_like(out)), impl


def test_fake_gives_the_output_shape_and_compiles_once_over_lengths():
    calls = []

    def count(gm, example_inputs):
        calls.append(gm)
        return gm

    fn = torch.compile(lambda *a: ops.beam_decode_attention(*a, 0.5, "cpu"), backend=count, fullgraph=True)
    args = _inputs(1, 4, 2, 8, 6, 10, 3, full=True)
    for length in (1, 2, 3):
        a = list(args)
        a[6] = torch.tensor([length])
        torch.testing.assert_close(fn(*a), beam_decode_attention_reference(*a, 0.5))
    assert len(calls) == 1
    with torch._subclasses.FakeTensorMode():
        fake = ops.beam_decode_attention(*_inputs(1, 4, 2, 8, 6, 10, 3), 0.5)
    assert fake.shape == (1, 4, 2, 6)


@pytest.mark.parametrize("position, shape, message", [
    (0, (2, 3, 4), "q must be"),
    (1, (2, 5, 2, 3), "context_k must be"),
    (5, (2, 3, 2, 2, 5), "beam_v must be"),
    (3, (3,), "context_lengths must be"),
])
def test_bad_input_names_the_tensor(position, shape, message):
    args = list(_inputs(2, 3, 2, 4, 4, 5, 2))
    args[position] = torch.zeros(shape, dtype=args[position].dtype)
    with pytest.raises(ValueError, match=f"beam_decode_attention: {message}"):
        ops.beam_decode_attention(*args, 1.0, "cpu")


def test_lowering_on_cpu_is_the_cpu_kernel():
    assert choose("recompile::beam_decode_attention", detect_target("cpu")).impl == "cpu"


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_output_has_the_fakes_layout_whatever_the_query_strides(impl):
    """A query cut from a wider projection (as a compiled decode step passes it) still gives a contiguous output,
    the layout the fake promises: Inductor's compiled code asserts it."""
    q, *rest = _inputs(2, 4, 2, 16, 16, 9, 2, seed=5)
    wide = torch.cat([q, torch.randn_like(q)], -1)[..., :16]  # strides of a [.., 32] tensor
    got = ops.beam_decode_attention(wide, *rest, 0.25, impl)
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        want = ops.beam_decode_attention(*(fake.from_tensor(t) for t in (wide, *rest)), 0.25, impl)
    assert got.stride() == want.stride() and got.is_contiguous()
    torch.testing.assert_close(got, beam_decode_attention_reference(q, *rest, 0.25), rtol=1e-5, atol=1e-5)
