"""No graph breaks on the jagged code users write: offsets -> (row, position) by repeat_interleave,
arange - repeat_interleave, nonzero, masked_select, bucketize and a max length read with .item() compile as one
graph under rec_ascend with no Dynamo flag set by the user (the backend's ``backend_ctx_ctor`` patches Dynamo's
config while it traces, and only then), and a break that remains is named with its place and its fix."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import recompile
from recompile.backend import TRACING_CONFIG, rec_ascend
from recompile.report import GraphBreak
from tests.test_jagged_pass_forms import C, H, N, batch_of, outputs_and_grads

# Numbers and compile counts, not which candidate is fastest: the race times one or two rounds (conftest).
pytestmark = pytest.mark.usefixtures("quick_race")


def positions_by_repeat_interleave(values, lengths):
    """The issue's spelling: each value's sequence start repeated over the sequence."""
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
    rows = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)
    return rows, torch.arange(values.shape[0]) - torch.repeat_interleave(offsets[:-1], lengths)


def positions_by_nonzero(values, lengths):
    return (torch.arange(N).view(1, N) < lengths.view(-1, 1)).nonzero(as_tuple=True)


def positions_by_masked_select(values, lengths):
    b = lengths.shape[0]
    valid = torch.arange(N).view(1, N) < lengths.view(-1, 1)
    return torch.arange(b).view(b, 1).expand(b, N).masked_select(valid), torch.arange(N).expand(b, N)[valid]


def positions_by_bucketize(values, lengths):
    offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
    ids = torch.arange(values.shape[0])
    rows = torch.bucketize(ids, offsets[1:], right=True)
    return rows, ids - offsets[rows]


POSITIONS = [positions_by_repeat_interleave, positions_by_nonzero, positions_by_masked_select, positions_by_bucketize]


class PaddedSequenceLayer(nn.Module):
    """A padded sequence layer: values written at (row, position), causal attention masked to the lengths, the
    same (row, position) gathered back."""

    def __init__(self, positions=positions_by_repeat_interleave):
        super().__init__()
        self.positions = positions
        self.qkv, self.out = nn.Linear(C, 3 * C), nn.Linear(C, C)

    def forward(self, values, lengths):
        b = lengths.shape[0]
        rows, positions = self.positions(values, lengths)
        x = values.new_zeros(b, N, C).index_put((rows, positions), values)
        q, k, v = (t.view(b, N, H, C // H).transpose(1, 2) for t in self.qkv(x).split(C, dim=-1))
        ids = torch.arange(N)
        mask = (ids.view(1, N, 1) >= ids.view(1, 1, N)) & (ids.view(1, 1, N) < lengths.view(-1, 1, 1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        return self.out(y.transpose(1, 2).reshape(b, N, C))[rows, positions]


class MaxLengthByItem(nn.Module):
    """Pads to the batch's longest sequence, read with .item()."""

    def forward(self, values, lengths):
        n = int(lengths.max().item())
        rows, positions = positions_by_repeat_interleave(values, lengths)
        x = values.new_zeros(lengths.shape[0], n, C).index_put((rows, positions), values)
        return torch.sigmoid(x)[rows, positions] * 2


def graphs_compiled(compiled, *inputs) -> int:
    counters.clear()
    compiled(*inputs)
    return counters["stats"]["unique_graphs"]


def test_importing_recompile_leaves_dynamo_config_unchanged():
    script = textwrap.dedent("""
        import torch
        before = torch._dynamo.config.get_config_copy()
        import recompile, recompile.passes.embedding
        assert torch._dynamo.config.get_config_copy() == before, "import changed torch._dynamo.config"
    """)
    subprocess.run([sys.executable, "-c", script], check=True)


def test_config_holds_only_while_rec_ascend_traces():
    seen = {}

    def probe(gm, inputs):
        seen.update({key: getattr(torch._dynamo.config, key) for key in TRACING_CONFIG})
        return gm.forward

    probe.backend_ctx_ctor = rec_ascend.backend_ctx_ctor
    before = torch._dynamo.config.get_config_copy()
    torch.compile(lambda x: x + 1, backend=probe)(torch.ones(2))
    assert seen == TRACING_CONFIG
    assert torch._dynamo.config.get_config_copy() == before
    assert all(getattr(torch._dynamo.config, key) != value for key, value in TRACING_CONFIG.items())


def test_other_backends_still_break_on_data_dependent_ops():
    """The patch is the backend's, not the process's: a backend without the seam traces under Dynamo's defaults."""
    counter = CompileCounter()
    model = PaddedSequenceLayer(positions_by_nonzero).eval()
    with torch.no_grad():
        torch.compile(model, backend=counter)(*batch_of([5, 0, 8, 1]))
    assert counter.frame_count > 1


def test_issue_padded_sequence_layer_is_one_graph_with_a_jagged_region():
    model = PaddedSequenceLayer().eval()
    values, lengths = batch_of([5, 0, 8, 1])
    report = recompile.explain(model, values, lengths).to_dict()
    assert len(report["graphs"]) == 1 and report["fallbacks"] == []
    found = {(r["kind"], r["op"]) for r in report["regions"]}
    assert {("jagged", "recompile::jagged_within"), ("attention", "recompile::jagged_softmax_attention")} <= found
    assert "index_put" not in report["stages"][-1]["code"]
    # Autotune off: the test counts the graphs of the rewrite, not the race's candidates.
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    batches = ([5, 0, 8, 1], [3, 8, 2], [1, 7, 4, 6, 2, 2])
    total = 0
    for lengths in batches:
        counters.clear()
        values, lengths = batch_of(lengths)
        got = outputs_and_grads(compiled, values, lengths)
        total += counters["stats"]["unique_graphs"]
        for a, b in zip(got, outputs_and_grads(model, values, lengths)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert total <= 2


@pytest.mark.parametrize("positions", POSITIONS[1:], ids=lambda f: f.__name__)
def test_positions_form_is_one_graph_with_a_jagged_region(positions):
    model = PaddedSequenceLayer(positions).eval()
    values, lengths = batch_of([5, 0, 8, 1])
    report = recompile.explain(model, values, lengths).to_dict()
    assert len(report["graphs"]) == 1 and report["fallbacks"] == []
    assert ("attention", "recompile::jagged_softmax_attention") in {(r["kind"], r["op"]) for r in report["regions"]}
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    with torch.no_grad():
        assert graphs_compiled(compiled, values, lengths) == 1
        torch.testing.assert_close(compiled(values, lengths), model(values, lengths), rtol=1e-5, atol=1e-5)


def test_max_length_by_item_is_one_graph():
    """A data-dependent N stays padded (the reason says so), in one graph, equal to eager."""
    model = MaxLengthByItem()
    values, lengths = batch_of([5, 0, 8, 1])
    report = recompile.explain(model, values, lengths).to_dict()
    assert len(report["graphs"]) == 1
    assert any("static N" in f["reason"] for f in report["fallbacks"])
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    assert graphs_compiled(compiled, values, lengths) == 1
    torch.testing.assert_close(compiled(values, lengths), model(values, lengths))


def test_a_remaining_break_is_named_with_its_place_and_fix():
    def branchy(x, lengths):
        y = x * 2
        if lengths.max() > 4:  # a Python branch on data: Dynamo must break here
            y = y + 1
        return y

    report = recompile.explain(branchy, torch.randn(4, C), torch.tensor([3, 5]))
    d = report.to_dict()
    [brk] = d["breaks"]  # named once: Dynamo's log and the graph it ended are the same break
    assert [g["break"] for g in d["graphs"]] == [0, None]
    assert "test_graph_breaks.py" in brk["at"] and "if lengths.max() > 4" in brk["at"]
    assert "torch.where" in brk["remedy"]
    text = report.to_text()
    assert "ended by graph break #0" in text and f"at: {brk['at']}" in text and f"fix: {brk['remedy']}" in text


@pytest.mark.parametrize("reason, fix", [
    ("Dynamic shape operator\n  Explanation: Operator `aten.nonzero.default`'s output shape",
     "capture_dynamic_output_shape_ops"),
    ("Unsupported Tensor.item() call with capture_scalar_outputs=False", "capture_scalar_outputs"),
    ("Could not guard on data-dependent expression Eq(u0, 0)", "torch._check"),
    ("Failed to trace builtin operator\n  Explanation: Dynamo does not know how to trace builtin operator `print`",
     "reorderable_logging_functions"),
    ("Attempted to wrap RNN, GRU, or LSTM\n  Explanation: Dynamo does not support RNN, GRU, or LSTM.", "allow_rnn"),
])
def test_break_reasons_map_to_the_setting_or_rewrite_that_removes_them(reason, fix):
    assert fix in GraphBreak(reason).remedy
    assert GraphBreak("an unheard-of reason").remedy is None


def session_graph(seq, weight):
    """GCSAN / SRGNN's spelling: a session's distinct items as a Python list (``torch.unique(seq).tolist()``)."""
    items = torch.unique(seq).tolist()
    return weight[torch.tensor(items)].sum(0) * (len(items) + seq.float().mean())


def test_tolist_of_a_data_dependent_length_breaks_the_graph_and_does_not_fail():
    """``unique`` is captured under the backend's settings, so its length is data-dependent; Dynamo's ``tolist``
    of it raised GuardOnDataDependentSymNode (a hard error) and now breaks the graph, named as such."""
    torch._dynamo.reset()
    counters.clear()
    weight = torch.randn(50, 4)
    compiled = torch.compile(session_graph, backend="rec_ascend")
    for n in (7, 11, 13):
        seq = torch.randint(0, 50, (n,))
        torch.testing.assert_close(compiled(seq, weight), session_graph(seq, weight))
    assert any("tolist() of a data-dependent length" in reason for reason in counters["graph_break"])


def reversed_prefixes(seq, lengths):
    """HRM's spelling: each row's first ``length`` items moved to its end, as Python lists, in a loop over rows."""
    rows = []
    for items, length in zip(seq, lengths):
        rows.append(list(items[length:]) + list(items[:length]))
    return torch.tensor(rows)


class LoopedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(30, C)

    def forward(self, seq, lengths):
        return self.embedding(reversed_prefixes(seq, lengths)).sum(1)


def test_a_break_that_ends_no_captured_graph_is_named():
    """A slice by a tensor length inside a loop: Dynamo breaks before any op of the frame (no graph ends there) and
    then runs the whole loop's function eagerly; ``explain`` names both breaks from Dynamo's log, with place and fix,
    and leaves the log's settings as they were (nothing printed)."""
    log = torch._dynamo.symbolic_convert.graph_break_log
    settings = (log.level, log.propagate, list(log.handlers))
    seq, lengths = torch.randint(1, 30, (4, 6)), torch.tensor([2, 6, 1, 4])
    report = recompile.explain(LoopedModel(), seq, lengths)
    breaks = report.to_dict()["breaks"]
    assert all(g["break"] is None for g in report.to_dict()["graphs"])  # no captured graph ends at them
    assert [b["summary"] for b in breaks][-1] == "graph break in loop"
    assert all("test_graph_breaks.py" in b["at"] for b in breaks) and all(b["remedy"] for b in breaks)
    text = report.to_text()
    assert f"graph breaks Dynamo made: {len(breaks)}" in text and "fix: a break inside a for/while loop" in text
    assert (log.level, log.propagate, list(log.handlers)) == settings
