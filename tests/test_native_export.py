"""Native C++ operators survive torch.export: the exported program holds torch.ops.recompile_native.* (dropout,
and the forward and backward of fm_second_order and sampled softmax) and runs in a fresh process that loads only the
built library (torch.ops.load_library), not this package."""
import os
import subprocess
import sys

import pytest
import torch

from hkv.native import library_path
from recompile.runtime import dropout

pytestmark = pytest.mark.skipif(not dropout.available(), reason="the native kernels are not built")
native = torch.ops.recompile_native


class Dropout(torch.nn.Module):
    def forward(self, x, seed):
        return native.dropout(x * 2, seed, 0.25) + 1


class FmSecondOrder(torch.nn.Module):
    def forward(self, v, grad):
        return native.fm_second_order_fwd(v * 2, True), native.fm_second_order_bwd(grad, v * 2, True)


class SampledSoftmax(torch.nn.Module):
    def forward(self, pos, neg, grad):
        loss, lse = native.sampled_softmax_fwd(pos, neg, None, None, None, 2.0)
        return (loss,) + native.sampled_softmax_bwd(grad, pos, neg, None, None, None, lse, 2.0)


CASES = {
    "dropout": (Dropout, lambda: (torch.randn(4, 33), torch.tensor([7, 11])), {"dropout"}),
    "fm_second_order": (FmSecondOrder, lambda: (torch.randn(4, 5, 6), torch.randn(4, 1)),
                        {"fm_second_order_fwd", "fm_second_order_bwd"}),
    "sampled_softmax": (SampledSoftmax, lambda: (torch.randn(4, 1), torch.randn(4, 9), torch.randn(4)),
                        {"sampled_softmax_fwd", "sampled_softmax_bwd"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_program_calls_the_native_op_without_the_package(tmp_path, case):
    module, inputs, ops = CASES[case]
    inputs = inputs()
    program = torch.export.export(module(), inputs)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {f"recompile_native.{op}.default" for op in ops} <= targets
    path = tmp_path / "program.pt2"
    torch.export.save(program, path)
    torch.save((inputs, module()(*inputs)), tmp_path / "io.pt")
    script = (f"import torch; torch.ops.load_library({library_path('recompile.runtime._C')!r}); "
              f"inputs, want = torch.load({str(tmp_path / 'io.pt')!r}); "
              f"got = torch.export.load({str(path)!r}).module()(*inputs); "
              "torch.testing.assert_close(got, want, rtol=0, atol=0); "
              "import sys; assert not any(m.split('.')[0] in ('runtime', 'hkv', 'recompile') for m in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, env=env)
