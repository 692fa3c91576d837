"""normalize: every spelling of one computation leaves the same graph, and that graph computes the same numbers."""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from recompile.lowering import detect_target
from recompile.options import RecompileOptions
from recompile.passes.normalize import normalize
from recompile.pipeline import PassContext, copy_graph_module

LINEAR = torch._C._nn.linear


def normalized(fn, *args) -> fx.GraphModule:
    """The graph Dynamo captures for ``fn(*args)`` after normalize, checked to compute what the captured one does."""
    found = []

    def backend(gm, example_inputs):
        ctx = PassContext(RecompileOptions(), detect_target("cpu"), example_inputs)
        out = normalize(copy_graph_module(gm), ctx)
        out.graph.lint()
        out.recompile()
        torch.testing.assert_close(out(*example_inputs), gm(*example_inputs), rtol=1e-5, atol=1e-5)
        found.append(out)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    [gm] = found
    return gm


def form(gm: fx.GraphModule) -> list[tuple]:
    """The calls of a graph with their arguments, nodes named by their position: equal forms, equal graphs."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    where = lambda a: fx.node.map_arg(a, lambda n: ("node", position[n]))  # noqa: E731
    return [(n.target, where(n.args), where(n.kwargs)) for n in gm.graph.nodes if n.op == "call_function"]


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


class Holder(nn.Module):
    """A [in, out] weight held as a Parameter, a buffer or a ParameterList item."""

    def __init__(self, how: str):
        super().__init__()
        weight, bias = torch.randn(6, 5), torch.randn(5)
        if how == "parameter":
            self.w, self.b = nn.Parameter(weight), nn.Parameter(bias)
        elif how == "buffer":
            self.register_buffer("w", weight)
            self.register_buffer("b", bias)
        else:
            self.ws, self.bs = nn.ParameterList([weight]), nn.ParameterList([bias])

    def weights(self):
        return (self.w, self.b) if hasattr(self, "w") else (self.ws[0], self.bs[0])


MATMULS = {
    "at": lambda x, w, b: x @ w + b,
    "matmul": lambda x, w, b: torch.matmul(x, w) + b,
    "mm": lambda x, w, b: b + torch.mm(x, w),
    "addmm": lambda x, w, b: torch.addmm(b, x, w),
    "einsum": lambda x, w, b: torch.einsum("bi,ij->bj", x, w) + b,
    "linear_of_t": lambda x, w, b: F.linear(x, w.t(), b),
    "linear_of_T": lambda x, w, b: F.linear(x, w.T) + b,
    "linear_of_transpose": lambda x, w, b: torch.nn.functional.linear(x, w.transpose(1, 0), bias=b),
}


@pytest.mark.parametrize("how", ["parameter", "buffer", "parameter_list"])
@pytest.mark.parametrize("spelling", list(MATMULS))
def test_matmul_spellings_become_one_linear(spelling, how):
    holder, x = Holder(how), torch.randn(4, 6)

    def fn(x):
        return MATMULS[spelling](x, *holder.weights())

    gm = normalized(fn, x)
    assert targets(gm) == [torch.transpose, LINEAR]  # linear(x, W^T, b): W written [in, out]
    [linear] = [n for n in gm.graph.nodes if n.target is LINEAR]
    assert linear.args[2] is not None and linear.args[1].args[1:] == (0, 1)


def test_linear_module_and_column_form_are_linear():
    lin = nn.Linear(6, 5)
    W, b = nn.Parameter(torch.randn(5, 6)), nn.Parameter(torch.randn(5, 1))

    def column(x):  # W @ x over a column batch [B, N, 1], as TorchRec's and RecBole's cross nets write it
        return (torch.matmul(W, x.unsqueeze(2)) + b).squeeze(2)

    x = torch.randn(4, 6)
    assert targets(normalized(lin, x)) == [LINEAR]
    assert targets(normalized(column, x)) == [torch.squeeze, LINEAR]  # linear(x, W, squeeze(b, 1))


def test_linear_einsum_with_out_in_weight():
    W = torch.randn(5, 6)
    gm = normalized(lambda x: torch.einsum("...i,ji->...j", x, W), torch.randn(2, 3, 6))
    assert targets(gm) == [LINEAR]


def test_batched_products_stay_matmul():
    """Two activations (attention scores, T T^T): one ``matmul`` whatever the spelling, never a linear."""
    a = torch.randn(3, 4, 5)
    forms = {repr(form(normalized(fn, a))) for fn in (
        lambda t: torch.bmm(t, t.transpose(1, 2)),
        lambda t: t @ t.transpose(-1, -2),
        lambda t: torch.matmul(t, t.permute(0, 2, 1)),
    )}
    assert len(forms) == 1


@pytest.mark.parametrize("family,spellings", [
    ("sum", [lambda x: x.sum(-1, keepdim=True), lambda x: torch.sum(x, dim=2, keepdim=True),
             lambda x: torch.sum(x, 2, True)]),
    ("half", [lambda x: 0.5 * x, lambda x: x * 0.5, lambda x: x / 2, lambda x: torch.div(x, 2.0)]),
    ("square", [lambda x: x * x, lambda x: x ** 2, lambda x: x.pow(2), lambda x: torch.square(x)]),
    ("cat", [lambda x: torch.cat([x, x], -1), lambda x: torch.concat([x, x], dim=2),
             lambda x: torch.cat(tensors=[x, x], dim=2)]),
    ("softmax", [lambda x: F.softmax(x, dim=-1), lambda x: x.softmax(2), lambda x: torch.softmax(x, -1),
                 lambda x: F.softmax(x, 2, 3)]),
    ("transpose", [lambda x: x.transpose(2, 1), lambda x: torch.transpose(x, -2, -1), lambda x: x.permute(0, 2, 1)]),
    ("reshape", [lambda x: x.view(3, -1), lambda x: x.reshape(3, -1), lambda x: x.reshape((3, -1))]),
    ("relu", [lambda x: F.relu(x), lambda x: torch.relu(x), lambda x: x.relu(), lambda x: F.relu(x, False)]),
])
def test_spellings_of_one_call_leave_one_graph(family, spellings):
    x = torch.randn(3, 4, 5)
    assert len({repr(form(normalized(fn, x))) for fn in spellings}) == 1


def test_commutative_operands_in_one_order():
    """Tensors before numbers, then the operand defined first."""
    def written(a, b):
        h, g = a.relu(), b.relu()
        p, q = h * g, 0.5 * h
        return p + q

    def swapped(a, b):
        h, g = a.relu(), b.relu()
        p, q = g * h, h * 0.5
        return q + p

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert form(normalized(written, x, y)) == form(normalized(swapped, x, y))


def test_division_by_other_numbers_is_kept():
    gm = normalized(lambda x: x / 3, torch.randn(3, 4))
    assert targets(gm) == [torch.div]


F_ = 5


class Pairs(nn.Module):
    """The upper-triangle pairs of ``T T^T``, picked in the ways users write it."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        rows, cols = torch.triu_indices(F_, F_, 1)
        self.register_buffer("rows", rows)
        self.register_buffer("cols", cols)
        self.register_buffer("flat", rows * F_ + cols)

    def forward(self, t):
        dots = torch.bmm(t, t.transpose(1, 2))
        if self.spelling == "computed_indices":
            rows, cols = torch.triu_indices(F_, F_, offset=1)
            return dots[:, rows, cols]
        if self.spelling == "buffer_indices":
            return dots[:, self.rows, self.cols]
        if self.spelling == "python_lists":
            rows = [i for i in range(F_) for j in range(i + 1, F_)]
            cols = [j for i in range(F_) for j in range(i + 1, F_)]
            return dots[:, rows, cols]
        if self.spelling == "flat_index":
            return dots.flatten(1)[:, self.flat]
        if self.spelling == "gather":
            return torch.gather(dots.flatten(1), 1, self.flat.expand(t.shape[0], -1))
        if self.spelling == "index_select":
            return dots.reshape(t.shape[0], -1).index_select(1, self.flat)
        raise ValueError(self.spelling)


PAIR_SPELLINGS = ["computed_indices", "buffer_indices", "python_lists", "flat_index", "gather", "index_select"]


@pytest.mark.parametrize("spelling", PAIR_SPELLINGS)
def test_upper_triangle_pairs_have_one_form(spelling):
    gm = normalized(Pairs(spelling), torch.randn(3, F_, 4))
    selects = [n for n in gm.graph.nodes if n.target is torch.index_select]
    assert len(selects) == 1 and selects[0].meta["pairs"] == (F_, True, False)
    assert selects[0].args[0].target is torch.flatten and selects[0].args[0].args[1:] == (1, 2)
    assert targets(gm)[-3:] == [torch.matmul, torch.flatten, torch.index_select]


def test_masked_select_with_a_triangle_mask_is_the_pairs_form_flattened():
    mask = torch.ones(F_, F_).tril(-1).bool()
    gm = normalized(lambda t: torch.bmm(t, t.transpose(1, 2)).masked_select(mask).reshape(3, -1),
                    torch.randn(3, F_, 4))
    [select] = [n for n in gm.graph.nodes if n.target is torch.index_select]
    assert select.meta["pairs"] == (F_, False, False)


def test_a_selection_that_is_no_triangle_is_left_as_written():
    idx = torch.tensor([0, 2, 3])
    gm = normalized(lambda t: torch.bmm(t, t.transpose(1, 2))[:, idx, idx], torch.randn(3, F_, 4))
    assert not any("pairs" in n.meta for n in gm.graph.nodes)
