"""models.bench_triton (the accelerator check) runs every Triton kernel case here under the interpreter."""
import json

import torch

from models import bench_triton
from models.zoo import MODELS


def test_every_triton_case_matches_eager_under_interpreter(tmp_path):
    out = tmp_path / "triton.json"
    result = bench_triton.main(["--device", "cpu", "--check-only", "--json", str(out)])
    rows = result["kernels"]
    assert {row["op"] for row in rows} == set(bench_triton.CASES)
    assert all(row["ok"] for row in rows), [row for row in rows if not row["ok"]]
    assert json.loads(out.read_text())["kernels"] == rows


def test_a_wrong_kernel_is_reported(monkeypatch):
    def wrong(size, device, dtype, gen):
        x = torch.randn(4, 3, generator=gen, requires_grad=True)
        return bench_triton.Case("4x3", lambda: x * 2 + 1e-3, lambda: x * 2, [x])

    def broken(size, device, dtype, gen):
        raise RuntimeError("no kernel for these inputs")

    monkeypatch.setattr(bench_triton, "CASES", {"wrong": (wrong, (torch.float32,)), "broken": (broken, (torch.float32,))})
    rows = bench_triton.run_kernels(["wrong", "broken"], "tiny", torch.device("cpu"), 1, True, lambda line, rows: None)
    assert not rows[0]["ok"] and rows[0]["errors"]["forward"] > 1e-4
    assert not rows[1]["ok"] and "no kernel for these inputs" in rows[1]["error"]


def test_workload_moves_with_its_labels():
    workload = MODELS["dlrm"]("small").to("meta")
    assert all(t.device.type == "meta" for t in workload.inputs[1]) and workload.targets[0].device.type == "meta"
    assert next(workload.model.parameters()).device.type == "meta"
