"""recompile::lstm (runtime/recurrent.py, csrc/lstm.h) against nn.LSTM, forward and every gradient, and the
recurrent pass: an LSTM sequential recommender compiled with rec_ascend traces as one graph, the LSTM one op,
equal to eager, compiled at most twice over batches whose size and sequence length both change."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import recompile
from recompile.runtime import recurrent
from recompile.runtime.kernels import KERNELS
from tests.test_gru import compiled_trains_as_eager

# the kernels that keep gates for a backward ("aten", inference only, has its own test)
IMPLS = [pytest.param(name, marks=[] if name == "reference" or recurrent.available() else
                      pytest.mark.skip(reason="native kernels not built")) for name in KERNELS["lstm"] if name != "aten"]


def lstm_case(batch, steps, layers, batch_first, bias, states, hidden=6, dtype=torch.float32, seed=0):
    """An nn.LSTM, an input and the initial states ``states`` names ("h", "c": the others are None)."""
    torch.manual_seed(seed)
    module = torch.nn.LSTM(5, hidden, num_layers=layers, bias=bias, batch_first=batch_first).to(dtype)
    x = torch.randn((batch, steps, 5) if batch_first else (steps, batch, 5), dtype=dtype, requires_grad=True)
    initial = [torch.randn(layers, batch, hidden, dtype=dtype, requires_grad=True) if name in states else None
               for name in "hc"]
    return module, x, initial


def op_call(module, x, initial, impl):
    return torch.ops.recompile.lstm(x, *initial, module._flat_weights, module.bias, module.num_layers,
                                    module.batch_first, True, impl)


def module_call(module, x, initial):
    """nn.LSTM's (output, h_n, c_n), a missing initial state given as zeros (it takes both or neither)."""
    if all(s is None for s in initial):
        out, (hn, cn) = module(x)
    else:
        like = next(s for s in initial if s is not None)
        out, (hn, cn) = module(x, tuple(s if s is not None else torch.zeros_like(like) for s in initial))
    return out, hn, cn


def assert_matches_module(module, x, initial, impl, tol):
    """Output, h_n, c_n and the gradients of the input, the initial states and every weight and bias equal
    nn.LSTM's."""
    want = module_call(module, x, initial)
    got = op_call(module, x, initial, impl)[:3]
    for name, g, w in zip(["output", "h_n", "c_n"], got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)
    given = [(name, s) for name, s in zip(["h0", "c0"], initial) if s is not None]
    names = ["input", *(name for name, _ in given), *module._flat_weights_names]
    leaves = [x, *(s for _, s in given), *module._flat_weights]
    grads = [torch.randn_like(w) for w in want]
    for name, g, w in zip(names, torch.autograd.grad(got, leaves, grads), torch.autograd.grad(want, leaves, grads)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(batch=st.integers(0, 5), steps=st.integers(1, 5), layers=st.integers(1, 2), batch_first=st.booleans(),
       bias=st.booleans(), states=st.sampled_from(["", "h", "c", "hc"]), hidden=st.sampled_from([1, 6, 8, 19]),
       seed=st.integers(0, 2**16))
def test_op_matches_nn_lstm(impl, batch, steps, layers, batch_first, bias, states, hidden, seed):
    """Batch 0 and 1, one step, hidden sizes below, at and past a vector's lanes (float32's vector path), with
    either initial state or both."""
    case = lstm_case(batch, steps, layers, batch_first, bias, states, hidden=hidden, seed=seed)
    assert_matches_module(*case, impl, 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 5e-2), (torch.float16, 5e-3)])
def test_dtypes(impl, dtype, tol):
    assert_matches_module(*lstm_case(3, 4, 2, True, True, "hc", hidden=9, dtype=dtype), impl, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers, batch_first, states", [(1, True, ""), (2, False, "hc"), (2, True, "c")])
def test_aten_kernel_for_inference(layers, batch_first, states, dtype):
    """The "aten" kernel (ATen's oneDNN LSTM below autograd) equals nn.LSTM on inference calls; it refuses to
    save gates, so training calls lower to the native kernel (test_compiled_model_...)."""
    module, x, initial = lstm_case(3, 4, layers, batch_first, True, states, hidden=9, dtype=dtype)
    with torch.no_grad():
        got = torch.ops.recompile.lstm(x, *initial, module._flat_weights, True, layers, batch_first, False, "aten")
        for g, w in zip(got[:3], module_call(module, x, initial)):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert g.is_contiguous()  # as the fake says
    assert "save" in recurrent.aten_reads(x, weights=module._flat_weights, save=True)


@pytest.mark.parametrize("read", ["output", "h_n", "c_n"])
def test_only_what_is_asked_for_is_differentiated(read):
    """One result read: the others' gradients are None; no initial state means no gradient for it."""
    module, x, initial = lstm_case(2, 3, 2, False, True, "")
    index = ["output", "h_n", "c_n"].index(read)
    got = op_call(module, x, initial, "native" if recurrent.available() else "reference")[index]
    want = module_call(module, x, initial)[index]
    leaves = [x, *module._flat_weights]
    for g, w in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    """A wrong dtype or state shape names the op and argument; no steps is refused as torch.lstm refuses it
    (``Expected sequence length to be larger than 0 in RNN``)."""
    module, x, (h0, c0) = lstm_case(2, 3, 1, True, True, "hc")
    with pytest.raises(TypeError, match="recompile.lstm: input has dtype torch.int64"):
        op_call(module, x.detach().long(), [None, None], "reference")
    with pytest.raises(ValueError, match=r"recompile.lstm: cx must be \(1, 2, 6\)"):
        op_call(module, x, [h0, c0[:, :1]], "reference")
    with pytest.raises(RuntimeError, match="sequence length to be larger than 0"):
        module(x[:, :0])
    with pytest.raises(ValueError, match="recompile.lstm: input has no steps"):
        op_call(module, x[:, :0], [None, None], "reference")


class LSTM4Rec(torch.nn.Module):
    """A sequential recommender: item ids -> embeddings -> LSTM -> the last state -> scores over the items."""

    def __init__(self, items=50, dim=8, hidden=16, layers=1, **lstm):
        super().__init__()
        self.emb = torch.nn.Embedding(items, dim)
        self.lstm = torch.nn.LSTM(dim, hidden, num_layers=layers, batch_first=True, **lstm)
        self.out = torch.nn.Linear(hidden * (1 + self.lstm.bidirectional), dim)

    def forward(self, ids, state=None):
        out, (h, c) = self.lstm(self.emb(ids), state)
        return self.out(out[:, -1]) @ self.emb.weight.T + h.sum(0).sum(-1, keepdim=True) * c.sum(0).sum(-1, keepdim=True)


def train_step(model, *inputs):
    model.zero_grad()
    out = model(*inputs)
    torch.nn.functional.cross_entropy(out, inputs[0][:, 0]).backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def test_compiled_model_equals_eager_one_graph_two_compiles():
    """Batch size and sequence length change every batch: outputs and gradients equal eager's, Dynamo breaks
    nowhere, the graph compiles at most twice (static, then dynamic in both), its LSTM one recompile::lstm."""
    torch.manual_seed(0)
    regions = compiled_trains_as_eager(LSTM4Rec(layers=2), train_step, [(4, 5), (7, 8), (3, 6)], rtol=1e-4)
    assert regions == [("recurrent", "recompile::lstm", "native" if recurrent.available() else "reference")]


def test_initial_states_are_the_ops():
    """(h0, c0) given by the caller reach the op (not dropped as the modules' zeros), inference equal to eager."""
    torch.manual_seed(0)
    model = LSTM4Rec().eval()
    ids, state = torch.randint(0, 50, (3, 4)), (torch.randn(1, 3, 16), torch.randn(1, 3, 16))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, state), model(ids, state), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        report = recompile.explain(model, ids, state)
    assert [(r.kind, r.op, r.impl.impl) for _, r in report.regions()] == [("recurrent", "recompile::lstm", "aten")]


@pytest.mark.parametrize("lstm", [{"bidirectional": True}, {"dropout": 0.5, "layers": 2}, {"proj_size": 4}],
                         ids=["bidirectional", "dropout", "projections"])
def test_what_the_op_does_not_compute_stays_aten(lstm):
    """A bidirectional LSTM, dropout between layers while training, and projections are left to ATen."""
    torch.manual_seed(0)
    model = LSTM4Rec(**{"hidden": 4 if "proj_size" not in lstm else 8, **lstm})
    if "proj_size" in lstm:
        model.out = torch.nn.Linear(4, 8)
    report = recompile.explain(model, torch.randint(0, 50, (4, 5)))
    assert not [r for _, r in report.regions() if r.kind == "recurrent"]


@pytest.mark.skipif(not recurrent.available(), reason="native kernels not built")
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_autograd_is_cpp_and_a_call_runs_no_python(kind):
    """recompile::gru / lstm have their autograd in C++ (csrc/ops.cpp, the AutogradCPU key, as the house's other
    CPU ops): a call, its backward and an inference call run no Python; differentiating a call that saved nothing
    raises naming the op."""
    from tests.test_native_autograd import _python_calls

    for name in (f"recompile::{kind}", f"recompile::{kind}_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU"), name
    module = (torch.nn.GRU if kind == "gru" else torch.nn.LSTM)(5, 6, num_layers=2)
    x = torch.randn(4, 3, 5, requires_grad=True)
    op, states = getattr(torch.ops.recompile, kind), [None] * (1 + (kind == "lstm"))

    def call(save=True):
        return op(x, *states, module._flat_weights, True, 2, False, save, "native")

    call()  # the backward op's handle is looked up once
    out = []
    assert _python_calls(lambda: out.append(call())) == []
    assert "Recurrent" in out[0][0].grad_fn.name() and not any(t.requires_grad for t in out[0][-1])
    assert _python_calls(lambda: out[0][1].sum().backward()) == []
    with torch.no_grad():
        assert _python_calls(lambda: call(save=False)) == []
    with pytest.raises(RuntimeError, match=f"recompile.{kind}: differentiated after a forward that saved nothing"):
        call(save=False)[0].sum().backward()
