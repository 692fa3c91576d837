"""rec_ascend compiles Inductor's graphs without its per-call size and stride asserts (``backend.CALL_CONFIG``): what
they checked, Dynamo's guards hold, so inputs of other strides or sizes recompile and give eager's numbers."""
import collections
import sys

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.usefixtures("quick_race")


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.linear(x * 2 + 1)).sum(1)


def _layouts(batch):
    """The same [batch, 4] values contiguous, transposed and strided."""
    x = torch.randn(batch, 4)
    return x, x.t().contiguous().t(), torch.stack([x, x], 2)[:, :, 0]


@pytest.mark.parametrize("options", [{"autotune": False}, None], ids=["inductor", "raced"])
def test_inputs_of_other_strides_recompile_and_equal_eager(options):
    model = Dense()
    compiled = torch.compile(model, backend="rec_ascend", options=options)
    for batch in (8, 13):
        for x in _layouts(batch):
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    x = _layouts(13)[1].requires_grad_()
    compiled(x).sum().backward()
    want = x.detach().clone().requires_grad_()
    model(want).sum().backward()
    torch.testing.assert_close(x.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_compiled_graph_has_no_size_asserts(monkeypatch):
    from torch._inductor import compile_fx as inductor

    from recompile import backend

    seen = []
    real = inductor.compile_fx

    def recording(gm, inputs, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(backend, "compile_fx", recording)
    with torch.no_grad():
        torch.compile(Dense(), backend="rec_ascend", options={"autotune": False})(torch.randn(5, 4))
    assert seen and all(patches.get("size_asserts") is False for patches in seen)


def _frames(call) -> collections.Counter:
    """The Python functions ``call()`` runs, by file and name, counted (the file of a compiled graph's code, which
    Inductor names by its hash, as ``<generated>``)."""
    seen = collections.Counter()
    generated = torch._inductor.codecache.cache_dir()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            seen["<generated>" if path.startswith(generated) else path, frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_settled_inductor_choice_is_called_as_plain_inductors_graph(tmp_path, monkeypatch, training):
    """Once the race keeps Inductor and its check in place is over, a call (for training: the loss and its
    backward) runs the Python frames of plain Inductor's call plus rec_ascend's own (its backend context's count of
    calls in progress, the CompiledGraph's dispatch) and nothing else: no second ``torch._dynamo.disable`` wrapper
    around the compiled graph (AOT autograd's, inside Dynamo's around the CompiledGraph), no check or wrapper of
    the training call path (autograd runs AOT's compiled backward as plain Inductor's)."""
    from recompile import autotune
    from recompile import backend as rec_backend

    monkeypatch.setenv("RECOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "fastest", lambda samples, incumbents=(), margin=0.0: (
        "inductor-captured" if "inductor-captured" in samples else next(iter(samples))))
    returned = []

    def backend(gm, example_inputs):
        returned.append(rec_backend.rec_ascend(gm, example_inputs))
        return returned[-1]

    backend.backend_ctx_ctor = rec_backend.rec_ascend.backend_ctx_ctor
    model, x = Dense(), torch.randn(8, 4)
    compiled = {"inductor": torch.compile(model, backend="inductor"), "rec_ascend": torch.compile(model, backend=backend)}

    def step(fn):
        if not training:
            with torch.no_grad():
                return fn(x)
        model.zero_grad(set_to_none=True)
        out = fn(x)
        out.sum().backward()
        return out.detach(), model.linear.weight.grad

    for fn in compiled.values():
        for _ in range(4 * autotune.SHORT_CHECK_CALLS):  # past the check in place
            torch.testing.assert_close(step(fn), step(model), rtol=1e-5, atol=1e-6)
    [graph] = returned
    chooser = graph.chooser
    assert chooser.decision.mode == ("training" if training else "inference")
    assert chooser.decision.choice == "inductor-captured" and chooser.run is chooser.candidates["inductor-captured"]
    assert not hasattr(chooser.run, "_torchdynamo_orig_callable")  # the compile itself, not a disable wrapper
    frames = {name: _frames(lambda fn=fn: step(fn)) for name, fn in compiled.items()}
    assert not training or any(name == "backward" for _, name in frames["rec_ascend"])  # AOT's compiled backward
    added = frames["rec_ascend"] - frames["inductor"]
    own = {key for key in added if "/recompile/" in key[0] or key[1] == "call_backend_ctx"}
    assert own and set(added) == own, added
    assert sum(added.values()) <= 4, added  # call_backend_ctx, TracingCalls' enter and exit, CompiledGraph.__call__
