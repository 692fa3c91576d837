"""recompile::dropout and the dropout pass: the native kernel draws the reference's mask bit for bit, the mask keeps
1 - p of the elements, forward and backward agree under compile, and the pass rewrites only active dropout."""
import pytest
import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from recompile.lowering import choose, detect_target
from recompile.runtime.dropout import SEED_BOUND, dropout_reference, keep_mask
from recompile.runtime.kernels import UnsupportedInputs

dropout = torch.ops.recompile.dropout


def _seed(*values):
    return torch.tensor(values or [12345, 678], dtype=torch.int64)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 37), min_size=1, max_size=3), p=st.floats(0.0, 0.99),
       s0=st.integers(0, SEED_BOUND - 1), s1=st.integers(0, SEED_BOUND - 1), transposed=st.booleans())
def test_native_draws_the_reference_mask(shape, p, s0, s1, transposed):
    x = torch.randn(shape)
    if transposed and x.dim() > 1:
        x = x.transpose(0, -1)  # not contiguous: the mask follows the logical (row-major) order
    seed = _seed(s0, s1)
    got, want = dropout(x, p, seed, "native"), dropout(x, p, seed, "reference")
    assert got.shape == x.shape and torch.equal(got, want)
    torch.testing.assert_close(got, x * keep_mask(x.shape, p, seed) / (1 - p), rtol=1e-6, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_mask_keeps_one_minus_p(p):
    n = 1 << 20
    kept = keep_mask(torch.Size([n]), p, _seed()).double().mean().item()
    assert abs(kept - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    halves = keep_mask(torch.Size([2, n // 2]), p, _seed())  # no correlation between neighbouring halves
    assert abs((halves[0] & halves[1]).double().mean().item() - (1 - p) ** 2) < 5 / n ** 0.5


def test_masks_depend_on_the_seed_only():
    x = torch.randn(64, 33)
    assert torch.equal(dropout(x, 0.3, _seed(1, 2), "native"), dropout(x, 0.3, _seed(1, 2), "native"))
    for other in (_seed(2, 2), _seed(1, 3)):
        assert not torch.equal(dropout(x, 0.3, _seed(1, 2), "native"), dropout(x, 0.3, other, "native"))
    flat = keep_mask(torch.Size([64 * 33]), 0.3, _seed())
    assert torch.equal(keep_mask(x.shape, 0.3, _seed()).flatten(), flat)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_take_the_reference(dtype):
    """The lowering chooses the reference for them (the native kernel refuses them, naming the dtype)."""
    x = torch.randn(40, 8).to(dtype)
    assert choose("recompile::dropout", detect_target("cpu"), x, 0.25, _seed()).impl == "reference"
    with pytest.raises(UnsupportedInputs, match=f"recompile::dropout: kernel 'native'.*{str(dtype)[6:]}"):
        dropout(x, 0.25, _seed(), "native")
    got = dropout(x, 0.25, _seed(), "reference")
    assert got.dtype == dtype and torch.equal(got, dropout_reference(x, 0.25, _seed()))
    kept = keep_mask(x.shape, 0.25, _seed())
    assert torch.equal(got[~kept], torch.zeros_like(got[~kept]))
    torch.testing.assert_close(got[kept], x[kept] / 0.75)


def test_nan_and_inf_stay_nan_where_dropped():
    x = torch.full((1000,), float("nan"))
    x[::2] = float("inf")
    got = dropout(x, 0.5, _seed(), "native")
    kept = keep_mask(x.shape, 0.5, _seed())
    assert torch.isnan(got[~kept]).all()
    torch.testing.assert_close(got[kept], x[kept] / 0.5, equal_nan=True)
    assert torch.equal(got.isnan(), dropout(x, 0.5, _seed(), "reference").isnan())


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_the_backward_is_the_same_mask(impl):
    x = torch.randn(50, 7, requires_grad=True)
    weights = torch.randn(50, 7)
    (dropout(x, 0.4, _seed(), impl) * weights).sum().backward()
    torch.testing.assert_close(x.grad, weights * keep_mask(x.shape, 0.4, _seed()) / 0.6)
    x64 = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)  # float64: the reference's (native: float32)
    assert torch.autograd.gradcheck(lambda t: dropout(t, 0.4, _seed(), "reference"), (x64,))
    torch.library.opcheck(dropout.default, (x.detach().requires_grad_(), 0.4, _seed(), impl))


def test_bad_inputs_name_the_op():
    x = torch.randn(3)
    with pytest.raises(ValueError, match="recompile.dropout: p must be in"):
        dropout(x, 1.0, _seed(), "native")
    with pytest.raises(ValueError, match="recompile.dropout: seed must be an int64 tensor of 2 values"):
        dropout(x, 0.5, torch.tensor([1, 2, 3]), "native")
    with pytest.raises(TypeError, match="recompile.dropout: x must be a floating-point"):
        dropout(torch.arange(3), 0.5, _seed(), "native")


class Block(nn.Module):
    def __init__(self, p=0.2, inplace=False):
        super().__init__()
        self.linear, self.drop = nn.Linear(16, 16), nn.Dropout(p, inplace=inplace)

    def forward(self, x):
        return self.drop(torch.relu(self.linear(x))) + torch.dropout(x, 0.5, self.training)


def _dropout_regions(model, *args, **options):
    report = recompile.explain(model, *args, options=options or None).to_dict()
    return [r for r in report["regions"] if r["op"] == "recompile::dropout"]


def test_the_pass_rewrites_active_out_of_place_dropout():
    x = torch.randn(8, 16)
    assert [r["pass"] for r in _dropout_regions(Block(), x)] == ["dropout", "dropout"]
    assert _dropout_regions(Block().eval(), x) == []
    assert len(_dropout_regions(Block(inplace=True), x)) == 1  # torch.dropout only
    assert len(_dropout_regions(Block(p=0.0), x)) == 1
    assert _dropout_regions(Block(), x, target="cuda") == []  # Inductor's own random numbers there
    with inductor_config.patch(fallback_random=True):  # eager's random numbers asked for
        assert _dropout_regions(Block(), x) == []


def test_compiled_dropout_is_a_mask_of_the_eager_values_and_its_backward_the_same_mask():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Dropout(0.3))
    x = torch.randn(4096, 16)
    compiled = torch.compile(model, backend="rec_ascend")
    torch.manual_seed(7)
    out = compiled(x)
    with torch.no_grad():
        dense = model[:2](x)
    kept = out != 0
    assert abs(kept.double().mean().item() - 0.7) < 0.01
    torch.testing.assert_close(out[kept], dense[kept] / 0.7)
    hidden = model[:2](x).detach().requires_grad_()
    torch.manual_seed(7)
    again = torch.compile(model[2], backend="rec_ascend")(hidden)
    again.sum().backward()
    assert torch.equal(again != 0, kept)  # the same seed draws the same mask
    torch.testing.assert_close(hidden.grad, kept / 0.7)  # and the backward uses it
    torch.manual_seed(8)
    assert not torch.equal(compiled(x) != 0, kept)


def test_one_compile_for_every_batch_size_and_verify_passes():
    model = Block()
    counter = CompileCounterWithBackend("rec_ascend")
    compiled = torch.compile(model, backend=counter)
    for batch in (8, 5, 13):
        x = torch.randn(batch, 16, requires_grad=True)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        compiled(x).sum().backward()
    assert counter.frame_count == 1
    verified = torch.compile(Block(), backend="rec_ascend", options={"verify": True})
    assert verified(torch.randn(8, 16)).shape == (8, 16)


@pytest.mark.slow  # the compiled-dropout tests above keep every backend's masks in make test
def test_the_benchmark_runs_every_backend_and_checks_the_results():
    from models.bench_sequential import Case, SampledSoftmax, bench, keeps, same_as_eager

    lines = bench("dropout 256x64", Case(nn.Dropout(0.2), lambda: (torch.randn(256, 64),), keeps(0.2)), 1)
    loss_inputs = lambda: (torch.randn(64, 16), torch.randint(0, 1683, (64,)), torch.randint(1, 1683, (1024,)))  # noqa: E731
    lines += bench("sampled softmax 64x16", Case(SampledSoftmax(16), loss_inputs, same_as_eager), 1)
    assert len(lines) == 4 and all("rec/eager" in line for line in lines)
