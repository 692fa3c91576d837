"""The C++ autograd of recompile::grouped_embedding_bag, fm_second_order, vector_cross, cross_stack, cross_mixture and
sampled_softmax_loss (csrc/ops.cpp, the AutogradCPU key): no Python runs per call, forward or backward
(cross_mixture's training forward and backward are Python); the gradients match the references (gradcheck in
double, hypothesis edge cases: a single row, an empty batch, fp16/bf16 where the kernel takes them, a clear error
naming the op and dtype where not); double backward raises naming the op; the zoo's DeepFM and HSTU (sampled
softmax retrieval) train compiled as in eager."""
import os
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

from recompile.runtime import interaction_native, sampled_softmax
from recompile.runtime.interaction import fm_second_order_reference
from recompile.runtime.kernels import UnsupportedInputs

pytestmark = pytest.mark.skipif(not interaction_native.available(), reason="the native kernels are not built")

ops = torch.ops.recompile
RUNTIME = os.path.dirname(sampled_softmax.__file__)
LIBRARY = os.path.join(os.path.dirname(torch.__file__), "_library")
AUTOGRAD_FUNCTION = os.path.join(os.path.dirname(torch.__file__), "autograd", "function.py")


def fm(v, impl="native", reduce=True):
    return ops.fm_second_order(v, reduce, impl)


def softmax(pos, neg, neg_ids=None, target_ids=None, impl="native", scale=2.0):
    return ops.sampled_softmax_loss(pos, neg, neg_ids, target_ids, scale, impl)[0]


def _leaves(*shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(sum(map(sum, shapes)))
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


def _python_calls(step) -> list[str]:
    """The Python functions of the runtime, torch.library's custom-op layer and torch.autograd.Function that run
    in ``step``."""
    calls = []

    def profile(frame, event, _):
        name = frame.f_code.co_filename
        if event == "call" and (name.startswith((RUNTIME, LIBRARY)) or name == AUTOGRAD_FUNCTION):
            calls.append(f"{name}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def vector_cross(x0, x, w0, w1, b0, b1, impl="native"):
    return ops.vector_cross(x0, x, [w0, w1], [b0, b1], impl)


def cross_stack(x0, x, w0, w1, b0, b1, v0, v1, impl="native", save=True):
    return ops.cross_stack(x0, x, [w0, w1], [b0, b1], [v0, v1], save, impl)


def fields(w0, w1, ids=torch.tensor([[3], [0], [9], [3], [4]])):
    """A field lookup's call (the embedding pass's grouping of RecBole's FM tables): bags of one id, two tables."""
    return ops.grouped_embedding_bag([w0, w1], [ids, ids.int()], [None, None], [torch.empty(0)] * 2, [0, 0], [-1, -1],
                                     [False, False], [False, False], "concat", "v,first_order", "fatal", "native")


STACK_SHAPES = ((5, 8), (5, 8), (8, 3), (8, 3), (8,), (8,), (3, 8), (3, 8))
CASES = {
    "grouped_embedding_bag": (fields, ((10, 8), (10, 1))),
    "fm_second_order": (fm, ((4, 3, 8),)),
    "vector_cross": (vector_cross, ((5, 8), (5, 8), (8,), (8,), (8,), (8,))),
    "sampled_softmax_loss": (softmax, ((4, 1), (4, 6))),
    "sampled_softmax_loss with ids": (lambda p, n: softmax(p, n, torch.tensor([1, 2, 3, 2, 5, 6]),
                                                          torch.tensor([2, 0, 6, 1])), ((4, 1), (4, 6))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_autograd_is_cpp_and_a_call_runs_no_python(case):
    fn, shapes = CASES[case]
    op = f"recompile::{case.split()[0]}"
    for name in (op, op + "_backward"):  # a C++ kernel for the key (the Python formula is for the Autograd alias)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU"), name
    leaves = _leaves(*shapes)
    fn(*leaves)  # the backward op's handle is looked up once
    out = []
    assert _python_calls(lambda: out.append(fn(*leaves))) == []
    assert "CppNode" in out[0].grad_fn.name() and not isinstance(out[0].grad_fn, torch.autograd.function.BackwardCFunction)
    assert _python_calls(lambda: out[0].sum().backward()) == []
    with torch.no_grad():
        assert _python_calls(lambda: fn(*leaves)) == []


def test_cross_stack_runs_no_python_forward_or_backward():
    for name in ("recompile::cross_stack", "recompile::cross_stack_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutogradCPU"), name
    leaves = _leaves(*STACK_SHAPES)
    cross_stack(*leaves)
    out = []
    assert _python_calls(lambda: out.append(cross_stack(*leaves))) == []
    (x_l, saved) = out[0]
    assert "CrossStack" in x_l.grad_fn.name() and len(saved) == 3 and not any(t.requires_grad for t in saved)
    assert _python_calls(lambda: x_l.sum().backward()) == []
    with torch.no_grad():
        assert _python_calls(lambda: cross_stack(*leaves, save=False)) == []


def test_cross_mixture_forward_runs_no_python_and_its_node_calls_the_backward_op():
    """The node is C++ (a training call's forward is the registry's torch kernel, in Python); an inference call
    (the fused kernel) runs no Python."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("recompile::cross_mixture", "AutogradCPU")
    x0, x, gate, *p = _leaves((5, 8), (5, 8), (2, 8), (3, 8), (3, 8), (3, 3), (3, 3), (8, 3), (8, 3), (8,), (8,))

    def mixture(save=True):
        return ops.cross_mixture(x0, x, gate, p[0:2], p[2:4], p[4:6], p[6:8], "relu", save, "native")

    out, saved = mixture()
    assert "CrossMixture" in out.grad_fn.name() and len(saved) == 4 and not any(t.requires_grad for t in saved)
    assert any("cross_mixture_backward" in c for c in _python_calls(lambda: out.sum().backward()))
    with torch.no_grad():
        assert _python_calls(lambda: mixture(save=False)) == []


@pytest.mark.parametrize("impl", ["native", "cpu", "reference"])
def test_cross_stack_cpp_autograd_matches_the_reference(impl):
    """Every kernel through the C++ node: gradients of all inputs as autograd of the reference."""
    from recompile.runtime.interaction import cross_stack_reference

    leaves = _leaves(*STACK_SHAPES)
    wants = [t.detach().clone().requires_grad_() for t in leaves]
    got = torch.autograd.grad(cross_stack(*leaves, impl=impl)[0].square().sum(), leaves)
    want = torch.autograd.grad(cross_stack_reference(*wants[:2], wants[2:4], wants[4:6], wants[6:]).square().sum(), wants)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_other_kernels_go_through_the_cpp_autograd_to_the_python_op():
    """impl "cpu" / "reference": the same C++ node, the kernels from the registry (forward and backward)."""
    (v,) = _leaves((3, 4, 5))
    out = fm(v, "cpu", reduce=False)
    assert "FmSecondOrder" in out.grad_fn.name()
    assert any("fm_second_order_backward" in c for c in _python_calls(lambda: out.sum().backward()))


@pytest.mark.parametrize("reduce", [False, True])
def test_gradcheck_in_double(reduce):
    """float64: the native kernels do not take it, the C++ autograd does (the torch kernels below it)."""
    v = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda v: fm(v, "cpu", reduce), (v,))
    pos, neg = torch.randn(3, 1, dtype=torch.float64, requires_grad=True), torch.randn(3, 7, dtype=torch.float64,
                                                                                        requires_grad=True)
    ids, targets = torch.tensor([0, 1, 2, 1, 4, 5, 6]), torch.tensor([1, 3, 4])
    assert gradcheck(lambda p, n: softmax(p, n, ids, targets, "reference", 1.5), (pos, neg))


@settings(max_examples=30, deadline=None)
@given(b=st.sampled_from([0, 1, 2, 9]), f=st.integers(1, 6), d=st.integers(1, 40), reduce=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_fm_forward_and_backward_match_the_reference(b, f, d, reduce, dtype):
    (v,) = _leaves((b, f, d), dtype=dtype)
    want_v = v.detach().float().requires_grad_()
    out, want = fm(v, "native", reduce), fm_second_order_reference(want_v, reduce)
    grad = torch.randn(want.shape)
    (got_grad,) = torch.autograd.grad(out, v, grad.to(dtype))
    (want_grad,) = torch.autograd.grad(want, want_v, grad)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype] * f
    assert out.dtype == got_grad.dtype == dtype
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_grad.float(), want_grad, rtol=tolerance, atol=tolerance)


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from([0, 1, 2, 7]), k=st.sampled_from([0, 1, 5, 33]), ids=st.booleans(),
       needs=st.sampled_from(["both", "pos", "neg"]))
def test_sampled_softmax_forward_and_backward_match_the_reference(n, k, ids, needs):
    pos, neg = _leaves((n, 1), (n, k))
    pos.requires_grad_(needs != "neg"), neg.requires_grad_(needs != "pos")
    neg_ids, targets = (torch.randint(0, 4, (k,)), torch.randint(0, 4, (n,))) if ids else (None, None)
    wants = [t.detach().clone().requires_grad_(t.requires_grad) for t in (pos, neg)]
    leaves = [t for t in (pos, neg) if t.requires_grad]
    out, want = softmax(pos, neg, neg_ids, targets, "native"), softmax(*wants, neg_ids, targets, "reference")
    grad = torch.rand(n)
    got = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(want, [t for t in wants if t.requires_grad], grad)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sampled_softmax_native_refuses_half_types_naming_the_op_and_dtype(dtype):
    pos, neg = _leaves((3, 1), (3, 4), dtype=dtype)
    with pytest.raises(UnsupportedInputs, match=f"recompile::sampled_softmax_loss: kernel 'native'.*{str(dtype)[6:]}"):
        softmax(pos, neg)
    with pytest.raises(UnsupportedInputs, match=f"sampled_softmax_loss_backward: kernel 'native'.*{str(dtype)[6:]}"):
        ops.sampled_softmax_loss_backward(torch.ones(3, dtype=dtype), pos, neg, None, None, torch.ones(3, dtype=dtype),
                                          1.0, "native")


@pytest.mark.parametrize("case", ["fm_second_order", "sampled_softmax_loss", "vector_cross", "grouped_embedding_bag"])
def test_double_backward_raises_naming_the_backward_op(case):
    fn, shapes = CASES[case]
    leaves = _leaves(*shapes)
    (grad,) = torch.autograd.grad(fn(*leaves).sum(), leaves[-1], create_graph=True)
    with pytest.raises(RuntimeError, match=f"recompile::{case}_backward"):
        grad.sum().backward()


def test_a_backward_grad_of_the_wrong_shape_is_refused_naming_the_op():
    v = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"fm_second_order_bwd: v must be \[B, F, D\] and grad \[B, 1\]"):
        torch.ops.recompile_native.fm_second_order_bwd(torch.randn(2, 4), v, True)


def _sgd_losses(model, workload, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = workload.loss(model(*workload.inputs))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


# The HSTU's is long (its training graph's compile, about a minute under load): test_models.py's zoo[hstu] (compiled
# forward and gradients against eager) and this file's other tests keep its path in `make test`.
@pytest.mark.parametrize("name, op", [("deepfm", "recompile::fm_second_order"),
                                      pytest.param("hstu", "recompile::sampled_softmax_loss", marks=pytest.mark.slow)])
def test_zoo_model_trains_compiled_as_in_eager(name, op):
    """Three SGD steps: the same losses and parameters; the op and its backward op run in the compiled step."""
    import copy

    from models.zoo import MODELS

    workload = MODELS[name]("small")
    model = workload.model.eval()  # dropout off: eager and compiled draw different random numbers
    eager = copy.deepcopy(model)
    # no race: the step runs the op (the race may keep the unfused graph where it is as fast)
    compiled = torch.compile(model, backend="rec_ascend", options={"autotune": False})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        losses = _sgd_losses(compiled, workload)
    ran = {event.key for event in profile.key_averages()}
    assert {op, op + "_backward"} <= ran
    torch.testing.assert_close(losses, _sgd_losses(eager, workload), rtol=1e-5, atol=1e-5)
    for (param, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=param)


def test_export_of_a_compiled_region_graph_keeps_the_op():
    """recompile.export: the FM regions become recompile.fm_second_order, the program equals eager on other batches
    (the C++ operators it calls are exported standalone by tests/test_native_export.py)."""
    import recompile
    from torch.export import Dim

    from test_interaction_pass import FM

    model = FM()
    batch = Dim("batch")
    program = recompile.export(model, (torch.randn(5, 4, 6), torch.randn(5, 10)),
                               dynamic_shapes=({0: batch}, {0: batch}))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "recompile.fm_second_order.default" in targets
    for size in (1, 7):
        inputs = (torch.randn(size, 4, 6), torch.randn(size, 10))
        torch.testing.assert_close(program.module()(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
