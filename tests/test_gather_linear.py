"""A linear of one gathered position per sequence becomes the gather of the linear at every position before
Inductor (recompile.gather_linear): NARM's attention after its GRU compiles into fewer C++ kernels, forward and
backward, and outputs and gradients equal eager's; a narrow product read only by products is not copied back
(recompile.narrow_gemm)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from recompile import narrow_gemm
from recompile.dot_linear import LINEAR, linears_as_dots
from recompile.gather_linear import _gathered_row, gathers_after_linears
from tests.checks import inductor_on_captured, train_step


def rewrite(gm):
    return linears_as_dots(gathers_after_linears(gm))


def gathered_linears(gm):
    """The linears whose input is one gathered row per sequence."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR and _gathered_row(n.args[0])]


class NARMHead(torch.nn.Module):
    """RecBole NARM's forward after its GRU: the last position's output (``gather_indexes``) and the attention over
    every position, concatenated and projected."""

    def __init__(self, hidden: int = 16, out: int = 8):
        super().__init__()
        self.a_1 = torch.nn.Linear(hidden, hidden, bias=False)
        self.a_2 = torch.nn.Linear(hidden, hidden, bias=False)
        self.v_t = torch.nn.Linear(hidden, 1, bias=False)
        self.b = torch.nn.Linear(2 * hidden, out, bias=False)

    def forward(self, gru_out, seq, lengths):
        index = (lengths - 1).view(-1, 1, 1).expand(-1, -1, gru_out.shape[-1])
        c_global = ht = gru_out.gather(dim=1, index=index).squeeze(1)
        mask = seq.gt(0).unsqueeze(2).expand_as(gru_out)
        q1 = self.a_1(gru_out)
        q2 = self.a_2(ht).unsqueeze(1).expand_as(q1)
        alpha = self.v_t(mask * torch.sigmoid(q1 + q2))
        c_local = torch.sum(alpha.expand_as(gru_out) * gru_out, 1)
        return self.b(torch.cat([c_local, c_global], 1))


def inputs(batch=32, length=12, hidden=16, dtype=torch.int64, seed=0):
    """Random GRU outputs and item ids; lengths 1..length, the full length and 1 among them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    lengths[-1] = 1
    seq = torch.randint(1, 50, (batch, length), generator=gen)
    seq[torch.arange(length) >= lengths.unsqueeze(1)] = 0
    return torch.randn(batch, length, hidden, generator=gen), seq, lengths.to(dtype)


def test_full_sort_attention_compiles_into_one_kernel():
    torch.manual_seed(0)
    model, args = NARMHead(), inputs()
    with torch.no_grad():
        want = model(*args)
    out, (graph,), kernels = inductor_on_captured(model, args, rewrite)
    plain, (before,), kernels_before = inductor_on_captured(model, args, linears_as_dots)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-6)
    assert len(gathered_linears(before)) == 1 and not gathered_linears(graph)
    # the gathered rows were a kernel before a_2's GEMM; now an indexed load in the attention's kernel
    assert len(kernels_before) == 2 and len(kernels) == 1


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_gradients_equal_eager(batch, dtype):
    torch.manual_seed(0)
    model = NARMHead()
    out, seq, lengths = inputs(batch=batch, dtype=dtype, seed=batch)
    args = (out.requires_grad_(), seq, lengths)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=narrow_gemm.NarrowGemm()):  # as rec_ascend compiles
        (got, grads), (graph, *_), _ = inductor_on_captured(model, args, rewrite, training=True)
    want, want_grads = train_step(model, args)
    # a_1's and a_2's products of the GRU's outputs side by side in the training graph, each padded to both's width
    linears = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is LINEAR]
    pads = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is torch.nn.functional.pad]
    assert not gathered_linears(graph) and len(linears) == 3 and {p.args[0] for p in pads} < set(linears)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() == {"a_1.weight", "a_2.weight", "v_t.weight", "b.weight"}
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture
def one_thread():
    """One torch thread, as the corpus bench compiles and runs (Inductor's fusion choices depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_step_builds_fewer_kernels(one_thread):
    """Forward: the attention (three before: the gathered rows, the attention and the gathered rows' gradient
    scattered); backward: the attention's gradient and the GRU outputs' (three before); under rec_ascend's post-grad
    pass (``narrow_gemm.NarrowGemm``), as rec_ascend compiles."""
    torch.manual_seed(0)
    model, (out, seq, lengths) = NARMHead(), inputs()
    args = (out.requires_grad_(), seq, lengths)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=narrow_gemm.NarrowGemm()):
        *_, kernels = inductor_on_captured(model, args, rewrite, training=True)
        *_, kernels_before = inductor_on_captured(model, args, linears_as_dots, training=True)
    assert len(kernels_before) == 5 and len(kernels) == 3


class PerColumn(torch.nn.Module):
    """A gather whose position differs per column: not one row per sequence, left as it is."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 4)

    def forward(self, x, index):
        return self.a(x.gather(1, index).squeeze(1))


class WideScores(torch.nn.Module):
    """GRU4Rec's scores of its last position over every item: at every position, T times the GEMM."""

    def __init__(self):
        super().__init__()
        self.items = torch.nn.Linear(8, 300, bias=False)

    def forward(self, x, lengths):
        return self.items(x.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, -1, 8)).squeeze(1))


def test_a_wider_linear_is_left_as_it_is():
    model, x, lengths = WideScores(), torch.randn(5, 12, 8), torch.randint(1, 13, (5,))
    _, (graph,), _ = inductor_on_captured(model, (x, lengths), gathers_after_linears)
    narrow = NARMHead()
    _, (narm,), _ = inductor_on_captured(narrow, inputs(), gathers_after_linears)
    assert len(gathered_linears(graph)) == 1 and not gathered_linears(narm)


def test_left_as_it_is():
    x, index = torch.randn(5, 12, 16), torch.randint(0, 12, (5, 1, 16))
    gm = torch.fx.symbolic_trace(PerColumn())
    values = {"x": x, "index": index}
    for node in gm.graph.nodes:
        node.meta["example_value"] = values.get(node.name)
    assert gathers_after_linears(gm) is gm


def test_narrow_product_read_by_products_is_not_copied_back():
    """NARM's sequence-output gradient [B, 8] is read only by the two products of its linear's backward."""
    args = (torch.randn(600, 512), torch.randn(512, 8), torch.randn(8, 32), torch.randn(600, 8))

    def fn(a, b, w, c):
        narrow = a @ b
        return narrow @ w, narrow.t() @ a, (a @ b) * c  # the last is read by a multiplication: copied back

    gm = make_fx(fn, tracing_mode="fake")(*args)
    want = gm(*args)
    narrow_gemm.transpose_narrow_products(gm.graph)
    gm.recompile()
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
    mul = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    assert len(clones) == 1 and clones[0].users.keys() == {mul}
    for got, ref in zip(gm(*args), want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)  # sums of 512 products, in another order


def test_crops_are_slices():
    """A padding that only crops (AOT autograd's backward of a padding) is a view of its input: a GEMM reads it as
    it is (recompile.crop_pad); one that pads is left as it is."""
    from recompile.crop_pad import crops_as_slices

    def fn(x, w):
        return torch.constant_pad_nd(x, (-3, 0, 0, -1)) @ w, torch.constant_pad_nd(x, (0, -2)).sum(), \
            torch.constant_pad_nd(x, (1, -1))

    args = (torch.randn(6, 8), torch.randn(5, 4))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    want = gm(*args)
    crops_as_slices(gm.graph)
    gm.recompile()
    pads = [n for n in gm.graph.nodes if n.target == torch.ops.aten.constant_pad_nd.default]
    assert len(pads) == 1 and pads[0].args[1] == [1, -1]
    for got, ref in zip(gm(*args), want):
        torch.testing.assert_close(got, ref)
