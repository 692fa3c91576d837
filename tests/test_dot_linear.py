"""A linear with one output column becomes a dot per row before Inductor (recompile.dot_linear): NARM's attention
compiles into one C++ kernel instead of two, and outputs and gradients equal eager's; other linears are left as
they are."""

import pytest
import torch

from recompile.dot_linear import LINEAR, linears_as_dots
from tests.checks import inductor_on_captured, train_step


def linears(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR]


def captured(model, args, rewrite: bool, training: bool = False):
    return inductor_on_captured(model, args, linears_as_dots if rewrite else (lambda gm: gm), training)


class Attention(torch.nn.Module):
    """RecBole NARM's attention over a GRU's outputs: ``v_t(mask * sigmoid(A1 h + A2 c))`` weighs each position."""

    def __init__(self, hidden: int = 16, bias: bool = False):
        super().__init__()
        self.a_1 = torch.nn.Linear(hidden, hidden, bias=False)
        self.a_2 = torch.nn.Linear(hidden, hidden, bias=False)
        self.v_t = torch.nn.Linear(hidden, 1, bias=bias)

    def forward(self, out, last, seq):
        mask = (seq > 0).unsqueeze(2).expand_as(out)
        q2 = self.a_2(last).unsqueeze(1).expand_as(out)
        alpha = self.v_t(mask * torch.sigmoid(self.a_1(out) + q2))
        return torch.sum(alpha.expand_as(out) * out, 1)


def inputs(batch=32, length=12, hidden=16):
    torch.manual_seed(0)
    seq = torch.randint(0, 5, (batch, length))
    return torch.randn(batch, length, hidden), torch.randn(batch, hidden), seq


def test_narm_attention_compiles_into_one_kernel():
    torch.manual_seed(0)
    model, args = Attention(), inputs()
    with torch.no_grad():
        want = model(*args)
    out, (graph,), kernels = captured(model, args, rewrite=True)
    plain, (before,), kernels_before = captured(model, args, rewrite=False)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-6)
    assert len(linears(before)) == 3 and len(linears(graph)) == 2
    assert len(kernels_before) == 2 and len(kernels) == 1


@pytest.mark.parametrize("bias", [False, True])
def test_gradients_through_the_dot(bias):
    torch.manual_seed(0)
    model, (out, last, seq) = Attention(bias=bias), inputs()
    args = (out.requires_grad_(), last, seq)
    (got, grads), (graph, *_), _ = captured(model, args, rewrite=True, training=True)
    want, want_grads = train_step(model, args)
    assert len(linears(graph)) == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and "v_t.weight" in want_grads
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("shape", [(2, 16), (1, 16)])
def test_left_as_it_is(shape):
    """Two output columns (a GEMM), or one applied to a vector (its output [1], not [.., 1])."""
    weight = torch.randn(shape)
    x = torch.randn(16) if shape[0] == 1 else torch.randn(4, 16)
    gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.linear(x, weight))
    for node in gm.graph.nodes:
        node.meta["example_value"] = x if node.op == "placeholder" else None
    linear = linears(gm)[0]
    linear.args[1].meta["example_value"] = weight
    linear.meta["example_value"] = torch.nn.functional.linear(x, weight)
    assert linears_as_dots(gm) is gm
