"""The backend's name and its tracing settings, whichever way the name is registered: by the installed entry point,
or by ``import recompile`` from a source checkout (``recompile/__init__.py``'s lazy wrapper), and what the
settings cost a call (Dynamo enters a backend's context on every call: ``recompile.tracing.TracingCalls``, which sets
them only while Dynamo traces, and ``TracingConfig``, the settings themselves)."""
import subprocess
import sys
import textwrap

import torch

from recompile.tracing import TRACING_CONFIG, TracingConfig

# A source checkout without the installed entry point: the name comes from ``import recompile``; then an
# offsets -> repeat_interleave model (data-dependent output shape) must compile as one graph, which it does only
# under the backend's tracing settings.
LAZY_PATH = textwrap.dedent("""
    import importlib.metadata, sys
    real = importlib.metadata.entry_points
    def entry_points(**kwargs):
        found = real(**kwargs)
        if kwargs.get("group") == "torch_dynamo_backends":
            return importlib.metadata.EntryPoints(ep for ep in found if ep.name != "rec_ascend")
        return found
    importlib.metadata.entry_points = entry_points

    import torch
    import recompile
    assert "recompile.backend" not in sys.modules, "the lazy path imported the backend"
    from torch._dynamo.utils import counters

    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, values, offsets):
            lengths = offsets[1:] - offsets[:-1]
            pos = torch.arange(values.shape[0]) - torch.repeat_interleave(offsets[:-1], lengths)
            return self.lin(values) * pos.unsqueeze(1)

    model, values, offsets = Positions(), torch.randn(9, 4), torch.tensor([0, 2, 5, 9])
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend="rec_ascend", options={"autotune": False})(values, offsets)
        torch.testing.assert_close(out, model(values, offsets))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    assert "recompile.backend" in sys.modules
    assert not torch._dynamo.config.capture_dynamic_output_shape_ops  # only while rec_ascend traced
    print("ok")
""")


def test_lazy_registration_traces_under_the_backend_settings(tmp_path):
    env = {"RECOMPILE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", LAZY_PATH], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_tracing_config_sets_and_restores_the_settings_and_the_config_hash():
    config = torch._dynamo.config
    before, digest = config.get_config_copy(), config.get_hash()
    with TracingConfig():
        assert {key: getattr(config, key) for key in TRACING_CONFIG} == TRACING_CONFIG
        assert {key: config.get_config_copy()[key] for key in TRACING_CONFIG} == TRACING_CONFIG
        assert config.get_hash() != digest
        with TracingConfig():  # nests
            assert config.capture_scalar_outputs
        assert config.capture_scalar_outputs
    assert config.get_config_copy() == before and config.get_hash() == digest


def test_tracing_config_costs_a_call_a_fraction_of_config_patch():
    """Entered around every call: it was ``config.patch`` (a class built, six attributes set), 15-30 us a call.
    Counted in Python frames run (``sys.setprofile``), not timed; each entered once before (its imports)."""
    def calls(ctor) -> int:
        with ctor():
            pass
        made = []
        sys.setprofile(lambda frame, event, arg: made.append(frame) if event == "call" else None)
        try:
            with ctor():
                pass
        finally:
            sys.setprofile(None)
        return len(made)

    cheap, patch = calls(TracingConfig), calls(lambda: torch._dynamo.config.patch(TRACING_CONFIG))
    assert cheap < patch / 3, (cheap, patch)


def test_the_settings_hold_while_dynamo_traces_a_call_not_while_the_compiled_graph_runs():
    """rec_ascend's backend context (``TracingCalls``) sets no context variable on a call: one set per call cost
    the rest of the call 4-8 us (FM predict at batch 1); Dynamo's compile-start callback enters the settings for the
    compiles started inside its calls, also after ``torch._dynamo.reset()`` (which clears the callbacks)."""
    from recompile.backend import rec_ascend
    from recompile.tracing import TracingCalls

    assert rec_ascend.backend_ctx_ctor is TracingCalls
    traced, ran = [], []

    def probe(gm, inputs):
        traced.append(torch._dynamo.config.capture_scalar_outputs)

        def run(*args):
            ran.append(torch._dynamo.config.capture_scalar_outputs)
            return gm.forward(*args)
        return run

    probe.backend_ctx_ctor = TracingCalls
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: x + 1, backend=probe)
        for _ in range(3):
            torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 2.0))
    assert traced == [True, True] and ran == [False] * 6
    with TracingCalls():
        assert not torch._dynamo.config.capture_scalar_outputs
