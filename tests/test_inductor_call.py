"""rec_ascend compiles Inductor's graphs without its per-call size and stride asserts (``backend.CALL_CONFIG``): what
they checked, Dynamo's guards hold, so inputs of other strides or sizes recompile and give eager's numbers."""
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
