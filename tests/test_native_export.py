"""A native C++ operator survives torch.export: the exported program holds torch.ops.recompile_native.dropout and
runs in a fresh process that loads only the built library (torch.ops.load_library), not this package."""
import os
import subprocess
import sys

import pytest
import torch

from hkv.native import library_path
from recompile.runtime import dropout

pytestmark = pytest.mark.skipif(not dropout.available(), reason="the native kernels are not built")


class Dropout(torch.nn.Module):
    def forward(self, x, seed):
        return torch.ops.recompile_native.dropout(x * 2, seed, 0.25) + 1


def test_exported_program_calls_the_native_op_without_the_package(tmp_path):
    x, seed = torch.randn(4, 33), torch.tensor([7, 11])
    program = torch.export.export(Dropout(), (x, seed))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "recompile_native.dropout.default" in targets
    path = tmp_path / "dropout.pt2"
    torch.export.save(program, path)
    torch.save((x, seed, Dropout()(x, seed)), tmp_path / "io.pt")
    script = (f"import torch; torch.ops.load_library({library_path('recompile.runtime._C')!r}); "
              f"x, seed, want = torch.load({str(tmp_path / 'io.pt')!r}); "
              f"got = torch.export.load({str(path)!r}).module()(x, seed); "
              "assert torch.equal(got, want), (got - want).abs().max(); "
              "import sys; assert not any(m.split('.')[0] in ('runtime', 'hkv', 'recompile') for m in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=env)
