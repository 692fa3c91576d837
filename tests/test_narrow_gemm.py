"""recompile.narrow_gemm: CPU matrix products with a few output columns computed transposed, in every graph
rec_ascend hands Inductor (forward and backward), with eager's numbers."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from torch.fx.experimental.proxy_tensor import make_fx

from recompile import narrow_gemm
from tests.checks import inductor_compiles

aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("quick_race")


def _products(graph):
    """(target, output shape) of each mm / addmm."""
    return [(str(n.target), tuple(n.meta["val"].shape)) for n in graph.nodes
            if n.op == "call_function" and n.target in (aten.mm.default, aten.addmm.default)]


def _fn(a, at, b, bias, bias2, column, wide):
    return a @ b, at.t() @ b, torch.addmm(bias, a, b), torch.addmm(bias2, a, b), a @ column, a @ wide


@pytest.mark.parametrize("seed", [0, 1])
def test_narrow_products_are_computed_transposed_with_the_same_numbers(seed):
    torch.manual_seed(seed)
    args = (torch.randn(600, 512), torch.randn(512, 600), torch.randn(512, 8), torch.randn(8), torch.randn(600, 8),
            torch.randn(512, 1), torch.randn(512, 32))
    gm = make_fx(_fn, tracing_mode="fake")(*args)
    assert ("aten.mm.default", (600, 8)) in _products(gm.graph)
    want = gm(*args)
    narrow_gemm.transpose_narrow_products(gm.graph)
    gm.recompile()
    # the four narrow products now write [8, 600]; a single column and 32 columns stay as they were
    assert sorted(_products(gm.graph)) == sorted(
        [("aten.mm.default", (8, 600))] * 2 + [("aten.addmm.default", (8, 600))] * 2
        + [("aten.mm.default", (600, 1)), ("aten.mm.default", (600, 32))])
    for got, ref in zip(gm(*args), want):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


def test_small_static_products_stay():
    """Below ``MIN_WORK`` (rows x inner size) the copy back would cost what the transposed product saves."""
    args = (torch.randn(40, 4), torch.randn(4, 8))
    gm = make_fx(torch.mm, tracing_mode="fake")(*args)
    narrow_gemm.transpose_narrow_products(gm.graph)
    assert _products(gm.graph) == [("aten.mm.default", (40, 8))]


def _product_graph(a: tuple, b: tuple, batch_dim: tuple) -> fx.Graph:
    """A graph of one ``mm`` of an [a] and a [b] operand whose ``batch_dim`` (operand, dim) is symbolic."""
    mode, graph = FakeTensorMode(shape_env=ShapeEnv()), fx.Graph()
    values = []
    for i, shape in enumerate((a, b)):
        dims = [DimDynamic.DYNAMIC if (i, d) == batch_dim else DimDynamic.STATIC for d in range(2)]
        values.append(mode.from_tensor(torch.randn(shape),
                                       symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims)))
        graph.placeholder(f"x{i}").meta["val"] = values[-1]
    node = graph.call_function(aten.mm.default, tuple(graph.nodes))
    node.meta["val"] = aten.mm.default(*values)
    graph.output(node)
    return graph


def test_short_inner_and_square_products_stay_with_symbolic_sizes():
    """With a symbolic batch: an inner size below ``MIN_INNER`` (bound by the output's bytes: RecBole AFM's pair
    projection) and an output no taller than wide (its backward's ``[8, B] x [B, 8]``) stay as they are; a longer
    inner size is transposed."""
    cases = {((300, 8), (8, 8), (0, 0)): False, ((8, 300), (300, 8), (0, 1)): False,
             ((300, 16), (16, 8), (0, 0)): True}
    for (a, b, batch_dim), transposed in cases.items():
        graph = _product_graph(a, b, batch_dim)
        before = _products(graph)
        narrow_gemm.transpose_narrow_products(graph)
        assert (_products(graph) != before) == transposed, (a, b)


class FullSoftmax(nn.Module):
    """A sequence-model loss shape: a narrow projection, then logits over all items and cross entropy."""

    def __init__(self, items=3000, dim=8):
        super().__init__()
        self.items, self.dense = nn.Embedding(items, dim), nn.Linear(16, dim)

    def forward(self, x, target):
        logits = self.dense(x) @ self.items.weight.t()
        return F.cross_entropy(logits, target)


def test_training_graph_is_rewritten_forward_and_backward_and_equals_eager(monkeypatch):
    """Batches of changing size (the second compiles a graph dynamic in the batch, the third reuses it): the
    forward's narrow product, saved for the backward, keeps the layout the backward was traced with."""
    rewritten = []
    real = narrow_gemm.transpose_narrow_products

    def counting(graph):
        before = _products(graph)
        real(graph)
        rewritten.append(sum(shape != old for (_, shape), (_, old) in zip(_products(graph), before)))

    monkeypatch.setattr(narrow_gemm, "transpose_narrow_products", counting)
    torch.manual_seed(0)
    model, twin = FullSoftmax(), FullSoftmax()
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(twin, backend="rec_ascend", options={"autotune": False})
    with inductor_compiles():
        for batch in (128, 96, 37):
            x, target = torch.randn(batch, 16), torch.randint(0, 3000, (batch,))
            model.zero_grad(), twin.zero_grad()
            got, want = compiled(x, target), model(x, target)
            got.backward(), want.backward()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for (name, p), q in zip(twin.named_parameters(), model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # static graph: the item table's and the dense output's gradients ([3000, 128] x [128, 8], [128, 3000] x
    # [3000, 8]) in the backward, not the dense layer's forward ([128, 16] x [16, 8]: below MIN_WORK); dynamic
    # graph (symbolic batch): that too
    assert rewritten == [0, 2, 1, 2]


class Counting(CustomGraphPass):
    """A user's own post-grad pass."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph):
        self.graphs += 1

    def uuid(self):
        return "counting"


def test_the_users_own_post_grad_pass_still_runs():
    """rec_ascend sets Inductor's ``post_grad_custom_pre_pass`` for its compiles: a pass the user set there runs
    after ours instead of being dropped, and keys the cache with ours."""
    theirs = Counting()
    model = nn.Linear(16, 8)
    x = torch.randn(600, 16)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=theirs), inductor_compiles(), torch.no_grad():
        compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert theirs.graphs == 1
    assert narrow_gemm.NarrowGemm(theirs).uuid()[1] == "counting"
    assert narrow_gemm.NarrowGemm(lambda graph: None).uuid() is None  # a plain callable: Inductor cannot cache
