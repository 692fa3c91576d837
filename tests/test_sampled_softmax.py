"""recompile::sampled_softmax_loss and its pass: the native kernel against the spelling it replaces (forward and
backward, hits, no hits, empty), and the pass on the forms a user writes, and only on them."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.lowering import choose, detect_target
from recompile.runtime.kernels import UnsupportedInputs

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

loss_op = torch.ops.recompile.sampled_softmax_loss


def eager_loss(pos, neg, neg_ids, target_ids, scale):
    if neg_ids is not None:
        neg = neg.masked_fill(neg_ids.unsqueeze(0) == target_ids.unsqueeze(1), float("-inf"))
    logits = torch.cat([pos, neg], 1) * scale
    return F.cross_entropy(logits, torch.zeros(pos.shape[0], dtype=torch.long), reduction="none")


def _loss_and_grads(fn, pos, neg, *rest):
    pos, neg = pos.detach().requires_grad_(), neg.detach().requires_grad_()
    loss = fn(pos, neg, *rest)
    (loss * torch.linspace(0.5, 1.5, loss.numel())).sum().backward()
    return loss.detach(), pos.grad, neg.grad


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 12), k=st.integers(0, 40), ids=st.sampled_from([None, 3, 50]), scale=st.floats(0.5, 20.0),
       id_dtype=st.sampled_from([torch.int32, torch.int64]), impl=st.sampled_from(["native", "reference"]))
def test_kernels_match_the_eager_spelling(n, k, ids, scale, id_dtype, impl):
    pos, neg = torch.randn(n, 1), torch.randn(n, k)
    neg_ids = target_ids = None
    if ids is not None:  # few distinct ids: rows with several hits, and rows whose negatives are all hits
        neg_ids, target_ids = torch.randint(0, ids, (k,), dtype=id_dtype), torch.randint(0, ids, (n,), dtype=id_dtype)
    got = _loss_and_grads(lambda p, q: loss_op(p, q, neg_ids, target_ids, scale, impl)[0], pos, neg)
    want = _loss_and_grads(lambda p, q: eager_loss(p, q, neg_ids, target_ids, scale), pos, neg)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)  # gradients carry the scale


def test_every_negative_a_hit_leaves_the_positive_alone():
    pos, neg = torch.randn(4, 1), torch.randn(4, 6)
    loss, lse = loss_op(pos, neg, torch.full((6,), 7), torch.full((4,), 7), 2.0, "native")
    torch.testing.assert_close(loss, torch.zeros(4))
    torch.testing.assert_close(lse, 2.0 * pos.squeeze(1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_take_the_reference(dtype):
    """The lowering chooses the reference for them (the native kernel refuses them, naming the dtype)."""
    pos, neg = torch.randn(5, 1, dtype=dtype), torch.randn(5, 9, dtype=dtype)
    ids, targets = torch.randint(0, 4, (9,)), torch.randint(0, 4, (5,))
    chosen = choose("recompile::sampled_softmax_loss", detect_target("cpu"), pos, neg, ids, targets, 3.0)
    assert chosen.impl == "reference"
    with pytest.raises(UnsupportedInputs, match=f"kernel 'native'.*{str(dtype)[6:]}"):
        loss_op(pos, neg, ids, targets, 3.0, "native")
    got = loss_op(pos, neg, ids, targets, 3.0, "reference")[0]
    assert got.dtype == dtype
    tolerance = 1e-7 if dtype == torch.float64 else 2e-2  # the eager loss accumulates half types in float
    torch.testing.assert_close(got, eager_loss(pos, neg, ids, targets, 3.0), rtol=tolerance, atol=tolerance)


def test_gradcheck_and_opcheck():
    pos, neg = torch.randn(3, 1, dtype=torch.float64, requires_grad=True), torch.randn(3, 5, dtype=torch.float64,
                                                                                        requires_grad=True)
    ids, targets = torch.tensor([0, 1, 2, 1, 4]), torch.tensor([1, 3, 4])
    assert torch.autograd.gradcheck(lambda p, q: loss_op(p, q, ids, targets, 2.0, "reference")[0], (pos, neg))
    f32 = (pos.detach().float().requires_grad_(), neg.detach().float().requires_grad_(), ids, targets, 2.0, "native")
    torch.library.opcheck(loss_op.default, f32)


def test_bad_shapes_name_the_op():
    with pytest.raises(ValueError, match="recompile.sampled_softmax_loss: expected pos"):
        loss_op(torch.randn(3, 2), torch.randn(3, 4), None, None, 1.0, "native")
    with pytest.raises(ValueError, match="both or neither"):
        loss_op(torch.randn(3, 1), torch.randn(3, 4), torch.arange(4), None, 1.0, "native")


class Sampled(nn.Module):
    """Next-item sampled softmax as models.sequential.NextItemTask writes it (or a variant)."""

    def __init__(self, form="divided", mask=True, reduction="none", labels="zeros_like"):
        super().__init__()
        self.item = nn.Embedding(50, 8)
        self.form, self.mask, self.reduction, self.labels = form, mask, reduction, labels

    def forward(self, h, targets, negatives):
        pos = (h * self.item(targets)).sum(-1, keepdim=True)
        neg = h @ self.item(negatives).t()
        if self.mask:
            neg = neg.masked_fill(negatives.unsqueeze(0) == targets.unsqueeze(1), float("-inf"))
        logits = torch.cat([pos, neg], dim=1)
        logits = {"divided": logits / 0.1, "multiplied": 10.0 * logits, "plain": logits}[self.form]
        labels = torch.zeros_like(targets) if self.labels == "zeros_like" else torch.arange(targets.shape[0]) % 2
        losses = F.cross_entropy(logits, labels, reduction=self.reduction)
        return losses.sum() if self.reduction == "none" else losses


def _inputs(n=24, k=16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 50, (n,), generator=g), torch.randint(0, 50, (k,), generator=g)


def _regions(model):
    report = recompile.explain(model, *_inputs()).to_dict()
    return [r for r in report["regions"] if r["op"] == "recompile::sampled_softmax_loss"]


@pytest.mark.parametrize("form", ["divided", "multiplied", "plain"])
@pytest.mark.parametrize("mask", [True, False])
def test_the_pass_replaces_the_loss_and_matches_eager(form, mask):
    model = Sampled(form, mask)
    [region] = _regions(model)
    assert "labels" in region["replaced"] or any("zeros_like" in name for name in region["replaced"])
    h, targets, negatives = _inputs()
    compiled = torch.compile(model, backend="rec_ascend")
    got = _loss_and_grads_of_module(compiled, h, targets, negatives)
    want = _loss_and_grads_of_module(model, h, targets, negatives)
    # Logits scaled by 10: eager's fp32 result is itself up to ~5e-5 from float64's, and whichever kernel the
    # race keeps sums in another order (measured: the op is as close to float64 as eager, or closer).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _loss_and_grads_of_module(model, h, targets, negatives):
    h = h.detach().requires_grad_()
    for p in model.parameters():
        p.grad = None
    loss = model(h, targets, negatives)
    loss.backward()
    return loss.detach(), h.grad, next(model.parameters()).grad


@pytest.mark.parametrize("kwargs", [{"reduction": "mean"}, {"labels": "arange"}])
def test_other_losses_are_left_alone(kwargs):
    assert _regions(Sampled(**kwargs)) == []


def test_the_zoo_sequential_models_use_it():
    from models.zoo import MODELS

    for name in ("hstu", "sasrec"):
        workload = MODELS[name]("small")
        report = recompile.explain(workload.model, *workload.inputs).to_dict()
        assert [r["op"] for r in report["regions"]].count("recompile::sampled_softmax_loss") == 1, name


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_gradients_have_the_strides_the_fake_promises(impl):
    pos, neg, grad = torch.randn(4, 1), torch.randn(4, 6), torch.randn(4)
    _, lse = loss_op(pos, neg, None, None, 2.0, impl)
    grad_pos, grad_neg = torch.ops.recompile.sampled_softmax_loss_backward(grad, pos, neg, None, None, lse, 2.0, impl)
    assert grad_pos.is_contiguous() and grad_neg.is_contiguous()
