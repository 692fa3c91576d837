"""Checks the test files share: a compiled model's outputs and parameter gradients against eager's."""
import torch


def grads(model):
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def train_step(model, args):
    model.zero_grad()
    out = model(*args)
    out.float().pow(2).mean().backward()
    return out.detach(), grads(model)


def assert_compiled_equals_eager(model, args, options=None):
    compiled = torch.compile(model, backend="rec_ascend", options=options)
    out_c, grads_c = train_step(compiled, args)
    out_e, grads_e = train_step(model, args)
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-6)
    assert grads_c.keys() == grads_e.keys() and grads_e
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=name)
