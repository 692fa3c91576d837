"""layout: sum(stack) -> an add chain, picks moved before a broadcast; same numbers and gradients, forms checked."""
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.passes.layout import layout
from recompile.passes.normalize import normalize
from recompile.pipeline import PassContext, copy_graph_module


def rewritten(fn, *args) -> fx.GraphModule:
    """The graph Dynamo captures for ``fn(*args)`` after normalize and layout, checked to compute what the
    captured one does (forward, and the gradient of every input that requires one)."""
    found = []

    def backend(gm, example_inputs):
        ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
        out = layout(normalize(copy_graph_module(gm), ctx), ctx)
        out.graph.lint()
        out.recompile()
        found.append(out)
        return out.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    leaves = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    got, want = compiled(*leaves), fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if any(a.requires_grad for a in args):
        seed = torch.randn_like(want)
        got_grads = torch.autograd.grad(got, [a for a in leaves if a.requires_grad], seed)
        want_grads = torch.autograd.grad(want, [a for a in args if a.requires_grad], seed)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    return found[0]


def calls(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


class FieldPairs(nn.Module):
    """FwFM's field-pair weighted interaction, as RecBole writes it (a weight broadcast over the batch, then
    picked per pair; the pair products stacked and summed)."""

    def __init__(self, fields: int):
        super().__init__()
        self.fields = fields
        self.weight = torch.randn(fields, fields, 1, requires_grad=True)

    def forward(self, x):
        weight = self.weight.expand(x.shape[0], -1, -1, -1)
        terms = [x[:, i] * x[:, j] * weight[:, i, j] for i in range(self.fields - 1) for j in range(i + 1, self.fields)]
        return torch.sum(torch.stack(terms, dim=1), dim=1).sum(dim=1, keepdim=True)


def test_field_pairs_lose_the_stack_and_pick_before_broadcasting():
    model = FieldPairs(4)
    gm = rewritten(model, torch.randn(5, 4, 3, requires_grad=True))
    assert torch.stack not in calls(gm)
    expands = [n for n in gm.graph.nodes if n.target == "expand"]
    assert len(expands) == 6 and all(n.args[0].target is operator.getitem for n in expands)
    assert all(n.args[0].args[0].op == "placeholder" for n in expands)  # picked from the weight itself


def test_weight_gradient_through_the_picks_equals_eager():
    torch.manual_seed(0)
    model = FieldPairs(5)
    x = torch.randn(7, 5, 4)
    compiled = torch.compile(model, backend=lambda gm, ex: _through_layout(gm, ex), fullgraph=True)
    torch._dynamo.reset()
    (got,) = torch.autograd.grad(compiled(x).sum(), model.weight)
    (want,) = torch.autograd.grad(model(x).sum(), model.weight)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _through_layout(gm, example_inputs):
    ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
    out = layout(normalize(copy_graph_module(gm), ctx), ctx)
    out.recompile()
    return out.forward


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 6), terms=st.integers(2, 5), dim=st.integers(0, 2),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_sum_of_stack_any_dim_and_dtype(rows, terms, dim, dtype):
    xs = [torch.randn(rows, 3, dtype=dtype, requires_grad=dtype != torch.bfloat16) for _ in range(terms)]

    def fn(*xs):
        return torch.stack(xs, dim=dim).sum(dim=dim)

    if dtype == torch.bfloat16:  # another summation order: bf16 rounds each partial sum
        gm = _graph_only(fn, *xs)
    else:
        gm = rewritten(fn, *xs)
    assert torch.stack not in calls(gm) and torch.add in calls(gm)


def _graph_only(fn, *args) -> fx.GraphModule:
    found = []

    def backend(gm, example_inputs):
        found.append(_through_layout(gm, example_inputs).__self__)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return found[0]


@pytest.mark.parametrize("case", ["keepdim", "other_dim", "integer", "stack_used_twice", "one_term"])
def test_sum_of_stack_left_alone(case):
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    fns = {
        "keepdim": lambda a, b: torch.stack([a, b], 1).sum(1, keepdim=True),
        "other_dim": lambda a, b: torch.stack([a, b], 1).sum(0),
        "integer": lambda a, b: torch.stack([a.long(), b.long()], 1).sum(1),
        "stack_used_twice": lambda a, b: (lambda s: s.sum(1) + s.mean(1))(torch.stack([a, b], 1)),
        "one_term": lambda a, b: torch.stack([a], 1).sum(1) + b,
    }
    gm = rewritten(fns[case], a, b)
    assert torch.stack in calls(gm) or case == "one_term"  # normalize makes a one-term stack an unsqueeze


def test_pick_with_a_slice_of_the_broadcast_dim_is_left_alone():
    w = torch.randn(3, 3, requires_grad=True)

    def fn(x):
        e = w.expand(x.shape[0], -1, -1)
        return x * e[:, 1, 2] + e[1:, 0, 0].sum()

    gm = rewritten(fn, torch.randn(4))
    assert any(n.target == "expand" and n.args[0].op != "call_function" for n in gm.graph.nodes)


def test_batch_size_changes_do_not_recompile():
    counts = [0]

    def backend(gm, example_inputs):
        counts[0] += 1
        return _through_layout(gm, example_inputs)

    torch._dynamo.reset()
    model = FieldPairs(4)
    compiled = torch.compile(model, backend=backend)
    for rows in (8, 12, 17):
        x = torch.randn(rows, 4, 3)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert counts[0] <= 2
