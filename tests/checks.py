"""Checks the test files share: a compiled model's outputs and parameter gradients against eager's; a kernel of
an op against its reference, forward and backward."""
import contextlib

import torch


def grads(model):
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train_step(model, args):
    model.zero_grad()
    out = model(*args)
    out.float().pow(2).mean().backward()
    return out.detach(), grads(model)


@contextlib.contextmanager
def inductor_compiles():
    """Inductor compiles every graph it is handed, its passes run and its output code is generated: its FX graph
    and AOT autograd caches are off (a cache hit skips all three). Its C++ kernels are still found by their source
    in its kernel cache (a kernel built earlier in the process is the same binary), where ``fresh_cache()`` emptied
    that cache too and built each again."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def inductor_on_captured(model, args, before_inductor, training: bool = False):
    """``model`` compiled by Inductor on its captured graph (rec_ascend's tracing settings), each graph passed through
    ``before_inductor`` first: (outputs or (outputs, grads), the graphs handed to Inductor, the names of the C++
    kernels Inductor generated)."""
    import re

    from torch._inductor.utils import run_and_get_code

    import recompile.backend

    graphs = []

    def backend(gm, inputs):
        graphs.append(before_inductor(gm))
        return recompile.backend.compile_fx(graphs[-1], inputs)

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile.backend.TRACING_CONFIG), inductor_compiles():
        compiled = torch.compile(model, backend=backend)
        if training:
            result, codes = run_and_get_code(train_step, compiled, args)
        else:
            with torch.no_grad():
                result, codes = run_and_get_code(compiled, *args)
    kernels = {k for code in codes for k in re.findall(r"^(cpp_fused\w*) = ", code, re.M)}
    return result, graphs, kernels


def assert_compiled_equals_eager(model, args, options=None):
    compiled = torch.compile(model, backend="rec_ascend", options=options)
    out_c, grads_c = train_step(compiled, args)
    out_e, grads_e = train_step(model, args)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)


def assert_kernel_matches_reference(op, args, impl, gen, tol):
    """``op(*args, impl)`` equals ``op(*args, "reference")`` within ``tol``, and so do the gradients of the
    arguments that require them for one random output gradient (drawn from ``gen``)."""
    got, want = op(*args, impl), op(*args, "reference")
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    leaves = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
    grad = torch.randn(want.shape, generator=gen)
    for g, w in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def replace_step_before_inductor(monkeypatch, step, replacement):
    """``recompile.backend.BEFORE_INDUCTOR`` with ``replacement`` in ``step``'s place, for this test."""
    import recompile.backend

    steps = recompile.backend.BEFORE_INDUCTOR
    assert step in steps, step
    monkeypatch.setattr(recompile.backend, "BEFORE_INDUCTOR", tuple(replacement if s is step else s for s in steps))
