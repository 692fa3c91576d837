"""The C++ runner (runtime/cpp_runner): built against the installed torch's libtorch, it loads a zoo ranking
model's AOTInductor package (recompile.package: DLRM, its embedding bags and dot interaction as
torch.ops.recompile.* operators) with the operator library loaded, runs it on inputs saved from Python, and
its outputs equal eager's, on a batch size other than the one the package was exported with."""
import os
import subprocess

import pytest
import torch
import torch.utils._pytree as pytree
from torch.export import Dim

import recompile
from models.zoo import MODELS
from recompile.runtime.cpp_runner.build import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_cpp_runner_runs_a_packaged_ranking_model(tmp_path):
    work = MODELS["dlrm"]("small", seed=0, batch=8)
    model = work.model.eval()
    dense, indices, offsets = work.inputs
    batch = Dim("batch")
    dims = ({0: batch}, [{0: Dim(f"ids{t}")} for t in range(len(indices))], [{0: batch} for _ in offsets])
    path = recompile.package(model, work.inputs, str(tmp_path / "dlrm.pt2"), dynamic_shapes=dims)
    other = MODELS["dlrm"]("small", seed=1, batch=5).inputs  # another batch size
    torch.save(pytree.tree_flatten(other)[0], tmp_path / "inputs.pt")
    runner = build(str(tmp_path / "bin"))
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([runner, path, str(tmp_path / "inputs.pt"), str(tmp_path / "outputs.pt")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (got,) = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        torch.testing.assert_close(got, model(*other), rtol=1e-5, atol=1e-6)
