"""A stack of identical layers is compiled once (recompile.repeated_layers): outputs and gradients equal eager's, the
graph Inductor gets calls one shared subgraph per layer, Inductor generates the layer's code once, batch sizes
changing compile twice at most, and layers that differ are left inline."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch._inductor.utils import run_and_get_code

import recompile.backend
from recompile.repeated_layers import outline_repeated_layers
from tests.checks import inductor_compiles, replace_step_before_inductor, train_step

DIM = 16


class Block(nn.Module):
    def __init__(self, hidden: int = 2 * DIM):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)  # so that the first block's input requires grad as the others' do
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


@pytest.fixture
def inductor_graphs(monkeypatch):
    """The graphs rec_ascend hands to Inductor and Inductor compiled (a graph it fails on is run eagerly, so the
    numbers alone would not tell), as a list filled while the test compiles."""
    graphs = []
    compile_fx = recompile.backend.compile_fx

    def spy(gm, *args, **kwargs):
        compiled = compile_fx(gm, *args, **kwargs)
        graphs.append(gm)
        return compiled

    monkeypatch.setattr(recompile.backend, "compile_fx", spy)
    return graphs


def layer_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is invoke_subgraph]


def test_identical_layers_call_one_subgraph(inductor_graphs):
    """Three identical blocks at inference: one subgraph, called three times with each block's own parameters;
    outputs equal eager's over changing batch sizes, which compile twice (static, then dynamic)."""
    counters.clear()
    model = Stack([Block() for _ in range(3)]).eval()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    with torch.no_grad():
        for batch in (8, 13, 21, 5):
            x = torch.randn(batch, DIM)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert inductor_graphs
    for gm in inductor_graphs:
        calls = layer_calls(gm)
        assert len(calls) == 3 and len({c.args[0].target for c in calls}) == 1, gm.code
        # each call passes its own block's parameters (6 each) beside the layer's input
        assert len({frozenset(map(str, c.args[2:])) for c in calls}) == 3


def test_training_layers_call_one_subgraph_and_train_as_eager(inductor_graphs):
    """Three identical blocks in training: one subgraph called three times, compiled with Inductor's buffer reuse
    off (``BUFFER_REUSE_OFF``); outputs and every gradient equal eager's."""
    model = Stack([Block() for _ in range(3)])
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    for batch in (8, 13):
        x = torch.randn(batch, DIM)
        (out_c, grads_c), (out_e, grads_e) = train_step(compiled, (x,)), train_step(model, (x,))
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
        assert grads_c.keys() == grads_e.keys() and len(grads_e) == 3 * 6 + 4
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
    assert inductor_graphs and all(len(layer_calls(gm)) == 3 for gm in inductor_graphs)


# The same model, batches and checks, and a third batch: test_padded_rows.py's query-normed layer in make test.
@pytest.mark.slow
def test_saved_values_of_a_layer_are_not_overwritten(inductor_graphs):
    """Two pre-norm attention blocks whose layer returns its LayerNorm output (the residual add is outside the
    block's modules), which its backward also saves (as ``qx.t()`` for the query weight's gradient): Inductor wrote
    the residual add into that buffer in place, and the first block's query weight got a wrong gradient (outputs
    right). Training, changing batch sizes and lengths, gradients against eager."""
    from tests.test_padded_rows import QueryNormed, batch

    model = QueryNormed().train()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    for lengths in ([3, 12, 1, 6], [5, 2, 7, 8, 4]):
        inputs = batch(lengths)
        (out_c, grads_c), (out_e, grads_e) = train_step(compiled, inputs), train_step(model, inputs)
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5, msg=name)
    assert inductor_graphs and all(len(layer_calls(gm)) == 2 for gm in inductor_graphs)


def count_layer_code(model, x):
    """Inductor's output code for the compiled model's first forward: (C++ kernels defined, matmuls called)."""
    with inductor_compiles():
        _, codes = run_and_get_code(torch.compile(model, backend="rec_ascend", options={"autotune": False}), x)
    code = "\n".join(codes)
    return code.count("async_compile.cpp_pybinding("), code.count("extern_kernels.addmm(")


def test_the_layer_code_is_generated_once(monkeypatch):
    """Inductor generates and compiles the block's kernels once for three blocks: as many matmuls in the output code
    as one block has, and fewer C++ kernels than the same graph with its blocks inline."""
    model = Stack([Block() for _ in range(3)]).eval()
    x = torch.randn(8, DIM)
    with torch.no_grad():
        kernels, matmuls = count_layer_code(model, x)
        torch._dynamo.reset()
        replace_step_before_inductor(monkeypatch, outline_repeated_layers, lambda gm: gm)
        kernels_inline, matmuls_inline = count_layer_code(model, x)
    # the blocks' two linears and embed's (the head's one column is a dot, recompile.dot_linear)
    assert (matmuls, matmuls_inline) == (2 + 1, 3 * 2 + 1)
    assert kernels_inline > kernels, (kernels, kernels_inline)


def test_layers_that_differ_stay_inline(inductor_graphs):
    """Blocks of different widths compute different functions: no subgraph, and the numbers are eager's."""
    model = Stack([Block(2 * DIM), Block(3 * DIM)])
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    x = torch.randn(8, DIM)
    (out_c, grads_c), (out_e, grads_e) = train_step(compiled, (x,)), train_step(model, (x,))
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
    assert inductor_graphs and not any(layer_calls(gm) for gm in inductor_graphs)


def test_hstu_layers_keep_their_regions(inductor_graphs):
    """The generative-recommenders HSTU (corpus): the rec passes run first on the whole graph, so each layer's jagged
    attention region is found as before, and the two rewritten layers call one subgraph holding the region's op;
    with symbolic sizes too (the second batch size), where the offsets' size ``s + 1`` is the layer's input and the
    symbol ``s`` an operand of its own."""
    from models.corpus import gr_hstu

    counters.clear()
    model = gr_hstu.build()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    with torch.no_grad():
        for batch in (16, 23):
            seq, lengths, _ = gr_hstu.batch(batch)
            torch.testing.assert_close(compiled(seq, lengths), model(seq, lengths), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 2 and len(inductor_graphs) == 2
    for gm in inductor_graphs:
        calls = layer_calls(gm)
        assert len(calls) == gr_hstu.LAYERS and len({c.args[0].target for c in calls}) == 1
        layer = getattr(gm, calls[0].args[0].target)
        assert [n.target for n in layer.graph.nodes].count(torch.ops.recompile.hstu_attention.default) == 1


def test_hstu_trains_through_its_layer_subgraph(inductor_graphs):
    """The corpus HSTU in training: its two layers call one subgraph (jagged attention region inside), and every
    gradient equals eager's, static then symbolic batch size."""
    from models.corpus import gr_hstu

    model = gr_hstu.build()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    for batch in (16, 23):
        seq, lengths, _ = gr_hstu.batch(batch)
        (out_c, grads_c), (out_e, grads_e) = train_step(compiled, (seq, lengths)), train_step(model, (seq, lengths))
        torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
        assert grads_c.keys() == grads_e.keys() and grads_e
        for name in grads_e:
            torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(inductor_graphs) == 2 and all(len(layer_calls(gm)) == gr_hstu.LAYERS for gm in inductor_graphs)


def test_layers_creating_a_size_stay_inline_in_training():
    """HSTU's captured graph without the rec passes: ``fbgemm.dense_to_jagged`` in each layer creates a
    data-dependent size. Outlined at inference; left inline in training, where Inductor's backward of such a
    subgraph fails (torch 2.13: ``u19 not in dict_keys([u0])``); gradients equal eager's."""
    from models.corpus import gr_hstu
    from recompile.repeated_layers import layer_config_patches

    outlined = []

    def backend(gm, inputs):
        graph = outline_repeated_layers(gm)
        outlined.append(len(layer_calls(graph)))
        return recompile.backend.compile_fx(graph, inputs, config_patches=layer_config_patches(graph))

    model = gr_hstu.build()
    seq, lengths, _ = gr_hstu.batch(16)
    with torch._dynamo.config.patch(recompile.backend.TRACING_CONFIG):
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(model, backend=backend)(seq, lengths), model(seq, lengths))
        assert outlined == [gr_hstu.LAYERS]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        (out_c, grads_c), (out_e, grads_e) = train_step(compiled, (seq, lengths)), train_step(model, (seq, lengths))
    assert outlined[1:] == [0]
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
