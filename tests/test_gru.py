"""recompile::gru (runtime/recurrent.py, csrc/gru.h) against nn.GRU, forward and every gradient, and the recurrent
pass: a model with an nn.GRU compiled with rec_ascend traces as one graph, the GRU one op, equal to eager."""
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.runtime import recurrent
from recompile.runtime.kernels import KERNELS

IMPLS = [pytest.param(name, marks=[] if name == "reference" or recurrent.available() else
                      pytest.mark.skip(reason="native kernels not built")) for name in KERNELS["gru"]]


def gru_case(batch, steps, layers, batch_first, bias, with_h0, hidden=6, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    module = torch.nn.GRU(5, hidden, num_layers=layers, bias=bias, batch_first=batch_first).to(dtype)
    x = torch.randn((batch, steps, 5) if batch_first else (steps, batch, 5), dtype=dtype, requires_grad=True)
    h0 = torch.randn(layers, batch, hidden, dtype=dtype, requires_grad=True) if with_h0 else None
    return module, x, h0


def op_call(module, x, h0, impl):
    return torch.ops.recompile.gru(x, h0, module._flat_weights, module.bias, module.num_layers, module.batch_first,
                                   True, impl)


def assert_matches_module(module, x, h0, impl, tol):
    """Output, h_n and the gradients of the input, h0 and every weight and bias equal nn.GRU's."""
    want_out, want_hn = module(x, h0)
    got_out, got_hn, _ = op_call(module, x, h0, impl)
    torch.testing.assert_close(got_out, want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(got_hn, want_hn, rtol=tol, atol=tol)
    leaves = [x, *([h0] if h0 is not None else []), *module._flat_weights]
    grads = torch.randn_like(want_out), torch.randn_like(want_hn)
    want = torch.autograd.grad((want_out, want_hn), leaves, grads)
    got = torch.autograd.grad((got_out, got_hn), leaves, grads)
    for name, g, w in zip(["input", "h0"][:len(leaves) - len(module._flat_weights)] + module._flat_weights_names,
                          got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(batch=st.integers(0, 5), steps=st.integers(1, 5), layers=st.integers(1, 2), batch_first=st.booleans(),
       bias=st.booleans(), with_h0=st.booleans(), hidden=st.sampled_from([1, 6, 8, 19]), seed=st.integers(0, 2**16))
def test_op_matches_nn_gru(impl, batch, steps, layers, batch_first, bias, with_h0, hidden, seed):
    """Batch 0 and 1, one step, hidden sizes below, at and past a vector's lanes (float32's vector path)."""
    case = gru_case(batch, steps, layers, batch_first, bias, with_h0, hidden=hidden, seed=seed)
    assert_matches_module(*case, impl, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 5e-2), (torch.float16, 5e-3)])
def test_dtypes(impl, dtype, tol):
    assert_matches_module(*gru_case(3, 4, 2, True, True, True, dtype=dtype), impl, tol)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-4), (torch.float64, 1e-10)])
def test_batch_in_chunks(impl, batch_first, dtype, tol):
    """A batch of more rows than the native kernels run at a time (csrc/gru.h's chunk_rows: 64 rows at hidden 96
    and 10 steps): three chunks, the last one short, each through both layers, with h0 and both outputs' gradients.
    The weights' gradients sum 1500 rows' (up to 100 in size): float32 differs from nn.GRU's by up to 7e-5, the
    reference's as the native kernel's."""
    case = gru_case(150, 10, 2, batch_first, True, True, hidden=96, dtype=dtype, seed=1)
    assert_matches_module(*case, impl, tol)


def test_only_what_is_asked_for_is_differentiated():
    """Only h_n read (or only the output): the other's gradient is None, and no h0 means no h0 gradient."""
    module, x, _ = gru_case(2, 3, 2, False, True, False)
    _, hn, _ = op_call(module, x, None, "native" if recurrent.available() else "reference")
    got = torch.autograd.grad(hn.sum(), [x, *module._flat_weights])
    want = torch.autograd.grad(module(x)[1].sum(), [x, *module._flat_weights])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    module, x, h0 = gru_case(2, 3, 1, True, True, True)
    with pytest.raises(TypeError, match="recompile.gru: input has dtype torch.int64"):
        op_call(module, x.detach().long(), None, "reference")
    with pytest.raises(ValueError, match=r"recompile.gru: hx must be \(1, 2, 6\)"):
        op_call(module, x, h0[:, :1], "reference")
    with pytest.raises(ValueError, match="sequence length 0"):
        op_call(module, x[:, :0], None, "reference")


class SequenceModel(torch.nn.Module):
    """GRU4Rec's shape: ids -> embeddings -> GRU -> the last step and h_n into a linear head."""

    def __init__(self, layers=2, **gru):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.gru = torch.nn.GRU(8, 16, num_layers=layers, batch_first=True, **gru)
        self.head = torch.nn.Linear(16 * (1 + self.gru.bidirectional), 4)

    def forward(self, ids):
        out, h = self.gru(self.emb(ids))
        return self.head(out[:, -1]) + h.sum(0).sum(-1, keepdim=True)


def train_step(model, ids):
    model.zero_grad()
    out = model(ids)
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def assert_steps_equal(got, want, rtol=1e-5):
    """Two ``train_step`` results (outputs, gradients) equal."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=1e-5)


def compiled_trains_as_eager(model, train_step, batches, rtol=1e-5):
    """``model`` compiled with rec_ascend over ``batches`` ((batch, steps): ids of 50 items) equals eager, outputs
    and gradients; Dynamo breaks nowhere and compiles at most twice (static, then dynamic in the batch size and the
    sequence length). Returns the regions ``explain`` finds: (kind, op, kernel)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    for batch, steps in batches:
        ids = torch.randint(0, 50, (batch, steps))
        assert_steps_equal(train_step(compiled, ids), train_step(model, ids), rtol)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    report = recompile.explain(model, torch.randint(0, 50, (4, 5)))
    return [(r.kind, r.op, r.impl.impl) for _, r in report.regions()]


def test_compiled_model_equals_eager_one_graph_two_compiles():
    """Batch size and sequence length change every batch (padded to each batch's longest history): equal to eager,
    one graph, at most two compiles (``recompile.runtime.recurrent.symbolic_steps`` keeps the length symbolic
    where ATen's decomposition of torch.gru loops over the steps), its GRU one recompile::gru forward and
    backward."""
    torch.manual_seed(0)
    regions = compiled_trains_as_eager(SequenceModel(), train_step, [(4, 5), (7, 8), (9, 3), (3, 6)])
    assert [region[:2] for region in regions] == [("recurrent", "recompile::gru")]


def test_dynamic_true_compiles_through_inductor():
    """Under ``dynamic=True`` the GRU op's float arguments are symbolic, and AOT autograd asks Dynamo to trace the
    frame again with them specialized (``TensorifyScalarRestartAnalysis``): rec_ascend lets that signal through, where
    it took it for Inductor failing and ran the graph eagerly."""
    torch.manual_seed(0)
    model, ids = SequenceModel(), torch.randint(0, 50, (4, 5))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = train_step(torch.compile(model, backend="rec_ascend", dynamic=True, options={"autotune": False}), ids)
    assert not [str(w.message) for w in caught if str(w.message).startswith("recompile:")]
    assert_steps_equal(got, train_step(model, ids))


@pytest.mark.parametrize("gru", [{"bidirectional": True}, {"dropout": 0.5}], ids=["bidirectional", "dropout"])
def test_what_the_op_does_not_compute_stays_aten(gru):
    """A bidirectional GRU, and dropout between layers while training, are left to ATen: no region."""
    torch.manual_seed(0)
    model = SequenceModel(**gru)
    report = recompile.explain(model, torch.randint(0, 50, (4, 5)))
    assert not [r for _, r in report.regions() if r.kind == "recurrent"]


def test_symbolic_steps_restores_aten():
    """``symbolic_steps`` (held while rec_ascend traces) swaps ATen's GRU / LSTM Python kernels for the ops' and
    puts them back on exit, nested too; outside it, ATen's own decomposition runs."""
    before = {kind: dict(op.py_kernels) for kind, op in recurrent.ATEN.items()}
    with recurrent.symbolic_steps():
        with recurrent.symbolic_steps():
            pass
        assert all(op.py_kernels[key] is not before[kind][key] for kind, op in recurrent.ATEN.items()
                   for key in recurrent.KEYS)
    assert {kind: dict(op.py_kernels) for kind, op in recurrent.ATEN.items()} == before
