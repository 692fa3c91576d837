"""Padded histories: RecBole's SASRec and BERT4Rec (unmodified module classes, configs from RecBole's Config for its
bundled ml-100k) take ids padded with 0 and an additive mask from ``item_seq != 0``; their attention becomes
``recompile.padded_softmax_attention``, equal to eager forward and backward, one recompile at most over batches
of changing size and padded length; the op equals its padded formula on prefix masks, masks with holes and
empty histories."""
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import recompile
from models.corpus.recbole_zoo import anomaly_kept, numpy_aliases
from recompile.runtime.padded_attention import padded_softmax_attention_reference

N_ITEMS, MAX_LEN, HIDDEN = 40, 12, 16


@functools.cache
def recbole_models():
    """RecBole's SASRec and BERT4Rec classes and a small Config each (RecBole 1.2.1 reads NumPy 1 aliases at
    import; importing its sequential models turns autograd anomaly detection on, which is put back)."""
    numpy_aliases()
    with anomaly_kept():
        from recbole.config import Config
        from recbole.model.sequential_recommender.bert4rec import BERT4Rec
        from recbole.model.sequential_recommender.sasrec import SASRec

    small = {"n_layers": 2, "n_heads": 2, "hidden_size": HIDDEN, "inner_size": 2 * HIDDEN,
             "MAX_ITEM_LIST_LENGTH": MAX_LEN, "hidden_dropout_prob": 0.0, "attn_dropout_prob": 0.0, "loss_type": "CE",
             "train_neg_sample_args": None,
             # set by RecBole's data preparation, which these tests skip: no dataset is loaded
             "MASK_ITEM_SEQ": "Mask_item_id_list", "POS_ITEMS": "Pos_item_id", "NEG_ITEMS": "Neg_item_id",
             "MASK_INDEX": "MASK_INDEX", "device": "cpu"}
    return {cls.__name__: (cls, Config(model=cls.__name__, dataset="ml-100k", config_dict=small))
            for cls in (SASRec, BERT4Rec)}


class Items:
    """The one thing RecBole's sequential models read from a dataset: the number of item ids."""

    def num(self, field):
        return N_ITEMS


def build(name):
    cls, config = recbole_models()[name]
    torch.manual_seed(0)
    return cls(config, Items())


def histories(lengths, width=MAX_LEN, holes=()):
    """Ids ``[B, width]`` left-aligned and padded with 0 (RecBole's layout); ``holes``: (row, position) set to 0."""
    lengths = torch.tensor(lengths)
    seq = torch.randint(1, N_ITEMS - 1, (len(lengths), width)) * (torch.arange(width) < lengths[:, None])
    for row, position in holes:
        seq[row, position] = 0
    return seq, lengths


def inputs_of(name, seq, lengths):
    return (seq, lengths) if name == "SASRec" else (seq,)


def outputs_and_grads(model, *inputs):
    model.zero_grad()
    out = model(*inputs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_equal_eager(compiled, model, inputs):
    got, want = outputs_and_grads(compiled, *inputs), outputs_and_grads(model, *inputs)
    assert len(got) == len(want)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


MODELS = ["SASRec", "BERT4Rec"]


@pytest.mark.parametrize("name", MODELS)
def test_recbole_attention_becomes_padded_attention(name):
    model = build(name).eval()
    report = recompile.explain(model, *inputs_of(name, *histories([3, 12, 1, 6]))).to_dict()
    # the one note: the item lookup (padding_idx 0) is not grouped with the position lookup of the same ids' shape
    assert len(report["graphs"]) == 1 and [f["pass"] for f in report["fallbacks"]] == ["embedding"]
    assert "padding_idx" in report["fallbacks"][0]["reason"]
    attention = [r for r in report["regions"] if r["op"] == "recompile::padded_softmax_attention"]
    assert len(attention) == 2  # one per layer
    assert "functional.softmax" not in report["stages"][-1]["code"]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_recbole_model_equals_eager_over_changing_batches(name):
    """Training mode, forward and backward; batch size and padded length change; at most one recompile; the
    fused op really runs (its calls are counted by the profiler: the native kernel runs below Python)."""
    model = build(name).train()
    # Autotune off: the test compares the rewrite, which the race could otherwise set aside.
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    # The second batch changes both the batch size and the padded length: Dynamo makes both dynamic at once.
    batches = [([3, 12, 1, 6], MAX_LEN), ([5, 2, 7, 8, 4, 1], 8), ([7, 10, 4], 10)]
    graphs = 0
    calls = 0
    for lengths, width in batches:
        counters.clear()
        inputs = inputs_of(name, *histories(lengths, width))
        assert_equal_eager(compiled, model, inputs)
        graphs += counters["stats"]["unique_graphs"]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            compiled(*inputs)  # compiled by now: the op's calls are the graph's
        calls += sum(e.name == "recompile::padded_softmax_attention" for e in profile.events())
    assert graphs <= 2
    assert calls == 2 * len(batches)


@pytest.mark.parametrize("name", MODELS)
def test_padding_id_inside_a_history_falls_back_correctly(name):
    """A 0 inside a history (not a prefix mask) and, for BERT4Rec, an empty history (every key masked): the padded
    formula's numbers."""
    model = build(name).eval()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    lengths = [6, 12, 3] if name == "SASRec" else [6, 0, 3]
    inputs = inputs_of(name, *histories(lengths, holes=[(0, 2), (1, 5)]))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


def additive_mask(lengths, n, causal, holes, heads, dtype):
    keep = (torch.arange(n) < lengths[:, None]).clone()
    for row, position in holes:
        if row < len(lengths):
            keep[row, position % n] = False
    keep = keep[:, None, None, :].expand(len(lengths), heads, n, n)
    if causal:
        keep = keep.tril()
    return torch.where(keep, 0.0, -10000.0).to(dtype)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    n=st.integers(9, 12),
    causal=st.booleans(),
    holes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 11)), max_size=2),
    heads=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_cut_kernel_equals_padded_formula(lengths, n, causal, holes, heads, dtype):
    """Prefix masks, masks with holes, empty histories, a single row; forward and backward."""
    lengths = torch.tensor(lengths)
    b = len(lengths)
    q, k, v = (torch.randn(b, 2, n, 4, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = additive_mask(lengths, n, causal, holes, heads, dtype)
    got = torch.ops.recompile.padded_softmax_attention(q, k, v, mask, 0.5, "cpu")
    want = padded_softmax_attention_reference(q, k, v, mask, 0.5)
    grad = torch.randn_like(want)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    for a, b_ in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b_, **tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cut_kernel_in_half_precision(dtype):
    lengths = torch.tensor([3, 8, 1])
    q, k, v = (torch.randn(3, 2, 8, 4).to(dtype) for _ in range(3))
    mask = additive_mask(lengths, 8, True, [], 1, dtype)
    got = torch.ops.recompile.padded_softmax_attention(q, k, v, mask, 0.5, "cpu")
    want = padded_softmax_attention_reference(q.float(), k.float(), v.float(), mask.float(), 0.5)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_op_checks_and_bad_input():
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    mask = additive_mask(torch.tensor([4, 6]), 6, True, [], 1, torch.float32)
    # k as RecBole makes it: a permuted view
    k_view = torch.randn(2, 6, 2, 4).permute(0, 2, 1, 3).requires_grad_()
    for keys in (k, k_view):
        torch.library.opcheck(torch.ops.recompile.padded_softmax_attention.default, (q, keys, v, mask, 0.5, "cpu"))
    with pytest.raises(ValueError, match="padded_softmax_attention: the mask"):
        torch.ops.recompile.padded_softmax_attention(q, k, v, mask.bool(), 0.5, "cpu")
    with pytest.raises(ValueError, match="padded_softmax_attention: q, k and v"):
        torch.ops.recompile.padded_softmax_attention(q[0], k, v, mask, 0.5, "cpu")
