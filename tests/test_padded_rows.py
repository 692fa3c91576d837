"""Padded histories read at one row per sequence (``gather(h, 1, lengths - 1 ...)``, RecBole's gather_indexes):
the jagged pass proves the attentions' outputs reach nothing else (recompile.passes.jagged_rows) and gives
``recompile.padded_softmax_attention`` the read rows, so it computes only the query rows they depend on (checked
on the mask at run time). RecBole's SASRec unmodified and a hand-written layer whose query differs from its keys
(layer-normed, as Kang et al.'s SASRec): equal to eager forward and backward, at most two compilations over
batches of changing size and lengths; masks with holes and bidirectional masks widen the cut, exactly."""
import functools
import math
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.testing import CompileCounterWithBackend

import recompile
from recompile.backend import rec_ascend
from recompile.runtime.padded_attention import padded_softmax_attention_reference, query_cuts
from tests.test_padded_sequence import additive_mask, build, histories, inputs_of, outputs_and_grads
from tests.test_repeated_layers import inductor_graphs, layer_calls  # noqa: F401  (a fixture)

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")

N_ITEMS, N, C, H = 40, 12, 16, 2


class QueryNormed(nn.Module):
    """Two blocks: q from LayerNorm(x), k and v from x; one additive mask from ``seq != 0`` (causal or not);
    the output read at ``lengths - 1``."""

    def __init__(self, causal=True, read_all=False):
        super().__init__()
        torch.manual_seed(0)
        self.causal, self.read_all = causal, read_all
        self.emb, self.pos = nn.Embedding(N_ITEMS, C, padding_idx=0), nn.Embedding(N, C)
        self.blocks = nn.ModuleList(nn.ModuleDict({"norm": nn.LayerNorm(C), "q": nn.Linear(C, C), "k": nn.Linear(C, C),
                                                   "v": nn.Linear(C, C), "out": nn.Linear(C, C)}) for _ in range(2))

    def forward(self, seq, lengths):
        b, n = seq.shape
        x = self.emb(seq) + self.pos(torch.arange(n))
        keep = (seq != 0)[:, None, None, :].expand(-1, -1, n, -1)
        mask = torch.where(keep.tril() if self.causal else keep, 0.0, -10000.0)
        for block in self.blocks:
            qx = block["norm"](x)
            q, k, v = (lin(y).view(b, n, H, C // H).transpose(1, 2)
                       for lin, y in ((block["q"], qx), (block["k"], x), (block["v"], x)))
            w = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(C // H) + mask, -1)
            x = qx + torch.relu(block["out"](torch.matmul(w, v).transpose(1, 2).reshape(b, n, C)))
        if self.read_all:
            return x
        return x.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, -1, C)).squeeze(1)


def fused_calls(model, *inputs):
    torch._dynamo.reset()
    report = recompile.explain(model, *inputs).to_dict()
    # nothing but a padding_idx item lookup left out of the grouped lookups
    assert [f for f in report["fallbacks"] if "padding_idx" not in f["reason"]] == []
    code = report["stages"][-1]["code"]
    return [line for line in code.splitlines() if "padded_softmax_attention.default(" in line]


def takes_rows(call: str) -> bool:
    return re.search(r"\brows ?= ?\w", call.split(";")[0]) is not None


def batch(lengths, holes=()):
    seq, lengths = histories(lengths, N, holes)
    return seq.clamp(max=N_ITEMS - 1), lengths


@pytest.mark.parametrize("causal", [True, False])
def test_read_rows_reach_the_op(causal):
    calls = fused_calls(QueryNormed(causal).eval(), *batch([3, 12, 1, 6]))
    assert len(calls) == 2 and all(map(takes_rows, calls))


def test_outputs_read_at_every_row_keep_every_row():
    calls = fused_calls(QueryNormed(read_all=True).eval(), *batch([3, 12, 1, 6]))
    assert len(calls) == 2 and not any(map(takes_rows, calls))


def test_recbole_sasrec_gets_its_read_rows():
    calls = fused_calls(build("SASRec").eval(), *inputs_of("SASRec", *histories([3, 12, 1, 6])))
    assert len(calls) == 2 and all(map(takes_rows, calls))


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_query_normed_layer_equals_eager_and_compiles_at_most_twice(causal, inductor_graphs):
    """Training mode, forward and backward; changing batch size and lengths; a 0 inside a history (not a
    prefix mask) in the last batch. The two blocks are one outlined layer called twice in every graph Inductor
    compiles (recompile.repeated_layers), whose saved values, read by the backward, must not be overwritten: the
    first block's query weight got a wrong gradient (test_repeated_layers.py)."""
    model = QueryNormed(causal).train()
    counter = CompileCounterWithBackend(functools.partial(rec_ascend, options={"autotune": False}))
    compiled = torch.compile(model, backend=counter)
    for lengths, holes in (([3, 12, 1, 6], ()), ([5, 2, 7, 8, 4], ()), ([2, 9, 4], [(1, 3)])):
        inputs = batch(lengths, holes)
        got, want = outputs_and_grads(compiled, *inputs), outputs_and_grads(model, *inputs)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        for a, b in zip(got[1:], want[1:]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.frame_count <= 2
    assert inductor_graphs and all(len(layer_calls(gm)) == 2 for gm in inductor_graphs)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    n=st.integers(9, 12),
    causal=st.booleans(),
    holes=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 11)), max_size=2),
    read=st.lists(st.integers(0, 8), min_size=5, max_size=5),
)
def test_read_rows_equal_the_padded_formula_and_kernels_agree(lengths, n, causal, holes, read):
    """On the read rows and every row they depend on, forward and backward; the other rows 0 in every kernel."""
    lengths = torch.tensor(lengths)
    b = len(lengths)
    rows = torch.tensor(read[:b])
    q, k, v = (torch.randn(b, 2, n, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = additive_mask(lengths, n, causal, holes, 1, torch.float64)
    cuts = query_cuts(mask, rows, n)
    assert (cuts > rows).all()
    computed = (torch.arange(n) < cuts.view(-1, 1)).view(b, 1, n, 1)
    full = padded_softmax_attention_reference(q, k, v, mask, 0.5)
    grad = torch.randn_like(full) * (torch.arange(n) <= rows.view(-1, 1)).view(b, 1, n, 1)  # read rows only
    want = torch.autograd.grad(full, (q, k, v), grad)
    outs = {}
    for impl in ("reference", "cpu"):
        got = torch.ops.recompile.padded_softmax_attention(q, k, v, mask, 0.5, impl, rows)
        torch.testing.assert_close(got, full * computed)
        for a, w in zip(torch.autograd.grad(got, (q, k, v), grad), want):
            torch.testing.assert_close(a, w)
        outs[impl] = got
    torch.testing.assert_close(outs["cpu"], outs["reference"])


def test_rows_checked():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    mask = additive_mask(torch.tensor([4, 6]), 6, True, [], 1, torch.float32)
    torch.library.opcheck(torch.ops.recompile.padded_softmax_attention.default,
                          (q, k, v, mask, 0.5, "cpu", torch.tensor([3, 5])))
    with pytest.raises(ValueError, match="padded_softmax_attention: rows must be integer"):
        torch.ops.recompile.padded_softmax_attention(q, k, v, mask, 0.5, "cpu", torch.tensor([3.0, 5.0]))


def test_rows_survive_the_autotune_race():
    """The race rewrites each op's last argument (its kernel): rows is passed by keyword."""
    model = QueryNormed().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rec_ascend")
    with torch.no_grad():
        for lengths in ([3, 12, 1, 6], [5, 2, 7, 8, 4]):
            inputs = batch(lengths)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths", [[12, 12, 11, 12], [12, 1, 2, 1, 1, 2]], ids=["one bucket", "buckets"])
def test_cpu_kernel_one_bucket_and_buckets_equal_the_formula(lengths):
    """Nearly full histories run all at once on the longest cut (no gathers); one long history among short ones
    runs in buckets (``SPLIT_SAVING``): both are the padded formula on the computed rows, forward and backward."""
    from recompile.runtime.padded_attention import BUCKET, _buckets

    lengths = torch.tensor(lengths)
    b, rows = len(lengths), lengths - 1
    mask = additive_mask(lengths, N, True, [], 1, torch.float32)
    _, buckets = _buckets(mask, rows, N)
    assert (len(buckets) == 1) == (lengths.min() > BUCKET)
    q, k, v = (torch.randn(b, H, N, 8, requires_grad=True) for _ in range(3))
    computed = (torch.arange(N) < lengths.view(-1, 1)).view(b, 1, N, 1)
    full = padded_softmax_attention_reference(q, k, v, mask, 0.5)
    grad = torch.randn_like(full) * computed
    got = torch.ops.recompile.padded_softmax_attention(q, k, v, mask, 0.5, "cpu", rows)
    torch.testing.assert_close(got, full * computed, rtol=1e-5, atol=1e-6)
    for a, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(full, (q, k, v), grad)):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keys", [1, 12, 15, 16, 40])
def test_written_out_softmax_equals_torch_softmax(keys):
    """Short rows (written out, the exponent clamped) and long ones (ATen's), with masked keys and a row that
    attends to no key."""
    from recompile.runtime.padded_attention import softmax_

    scores = torch.randn(3, 2, 5, keys) * 30 + torch.where(torch.rand(3, 1, 5, keys) < 0.4, -10000.0, 0.0)
    scores[0, :, 1] = -10000.0
    torch.testing.assert_close(softmax_(scores.clone()), torch.softmax(scores, -1), rtol=1e-6, atol=1e-7)
