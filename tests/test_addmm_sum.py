"""A sum of matrix products and other terms, read only by extern calls, as the other terms accumulated into the
products by addmm (recompile.addmm_sum, in rec_ascend's post-grad pass): NARM's GRU-output gradient is no C++ kernel
of its own, and a NARM-like training step's outputs and gradients equal eager's."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from recompile import addmm_sum
from tests.checks import inductor_compiles, train_step
from tests.test_gather_linear import NARMHead, inputs


class NARMLike(torch.nn.Module):
    """RecBole NARM's forward: item embeddings, a GRU, the attention head."""

    def __init__(self, items: int = 50, hidden: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(items, hidden, padding_idx=0)
        self.gru = torch.nn.GRU(hidden, hidden, batch_first=True)
        self.head = NARMHead(hidden)

    def forward(self, seq, lengths):
        out, _ = self.gru(self.emb(seq))
        return self.head(out, seq, lengths)


def compiled_step(model, args, dynamic=None):
    """rec_ascend's step without races (its pipeline, then Inductor), one thread as the corpus bench compiles:
    (outputs, grads), the C++ kernels' names, the output code."""
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with inductor_compiles():
            compiled = torch.compile(model, backend="rec_ascend", dynamic=dynamic, options={"autotune": False})
            result, codes = run_and_get_code(train_step, compiled, args)
    finally:
        torch.set_num_threads(threads)
    kernels = {k for code in codes for k in re.findall(r"^(cpp_fused\w*) = ", code, re.M)}
    return result, kernels, "\n".join(codes)


@pytest.mark.parametrize("batch, fewer, dynamic", [(1, 0, None), (9, 1, None), (9, 1, True)])
def test_gru_output_gradient_is_no_kernel_of_its_own(monkeypatch, batch, fewer, dynamic):
    """At batch 9 (and the corpus's 128) the rest fuses into the attention's backward kernel, and so it does with a
    symbolic batch (the graph compiled again at the next batch size); at batch 1 Inductor leaves it a kernel of its
    own, as the sum was."""
    torch.manual_seed(0)
    model = NARMLike()
    _, seq, lengths = inputs(batch=batch, seed=batch)
    (got, grads), kernels, code = compiled_step(model, (seq, lengths), dynamic)
    monkeypatch.setattr(addmm_sum, "sums_into_products", lambda graph, skip=None: None)
    _, kernels_before, _ = compiled_step(model, (seq, lengths), dynamic)
    want, want_grads = train_step(model, (seq, lengths))
    # the attention's two products of the GRU's output gradient add the rest of it
    assert code.count("extern_kernels.addmm(") == 2
    assert len(kernels) == len(kernels_before) - fewer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def sum_graph(consumer):
    def f(x, a, b, c):
        return consumer(torch.sigmoid(x) + a @ b, c)
    gen = torch.Generator().manual_seed(0)
    args = tuple(torch.randn(*size, generator=gen) for size in ((12, 5), (12, 6), (6, 5), (5, 2)))
    gm = make_fx(f, tracing_mode="fake")(*args)
    return gm, args


def test_sum_read_by_an_extern_call_is_an_addmm():
    gm, args = sum_graph(torch.mm)
    want = gm(*args)
    addmm_sum.sums_into_products(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.addmm.default in targets and torch.ops.aten.add.Tensor not in targets
    torch.testing.assert_close(gm(*args), want)


def test_sum_read_by_a_pointwise_op_is_left_as_it_is():
    """Inductor fuses the sum into its pointwise reader: no kernel to save."""
    gm, args = sum_graph(lambda s, c: torch.tanh(s))
    before = [n.target for n in gm.graph.nodes]
    addmm_sum.sums_into_products(gm.graph)
    assert [n.target for n in gm.graph.nodes] == before
