"""The recompile CLI: inspect (text, JSON, plan, profile), dump, target resolution and bad targets."""
import importlib.machinery
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import recompile
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile import cli, loader
from recompile.frontends import tensorflow as tf_frontend
from recompile.lowering import Impl, choose, detect_target
from recompile.pipeline import PASS_ORDER, Region
from recompile.report import runs_as

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
SMALL = DLRMConfig(table_rows=[50, 80, 120], dim=8, bottom=[16, 8], top=[16, 1])


class TinyHSTU(nn.Module):
    """HSTU-like over jagged sequences: offsets from lengths, SiLU uvqk projection, last item of each sequence."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, values, lengths):
        offsets = F.pad(torch.cumsum(lengths, 0), (1, 0))
        u, v, q, k = F.silu(self.uvqk(values)).chunk(4, dim=1)
        x = self.out(u * v * (q * k).sum(-1, keepdim=True))
        return x[offsets[1:] - 1]


def hstu_model():
    lengths = torch.tensor([3, 1, 4, 2])
    return TinyHSTU(), (torch.randn(int(lengths.sum()), 8), lengths)


def dlrm_model():
    return DLRM(SMALL), synthetic_batch(SMALL, 4)


def ebc_model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    class EBCModel(nn.Module):
        def __init__(self):
            super().__init__()
            tables = [
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=40, feature_names=[f"f{i}"])
                for i in range(2)
            ]
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
            self.top = nn.Linear(16, 1)

        def forward(self, kjt):
            return self.top(self.ebc(kjt).values())

    lengths = torch.tensor([1, 2, 0, 3, 2, 1, 1, 2])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.randint(0, 40, (int(lengths.sum()),)), lengths=lengths
    )
    return EBCModel(), (kjt,)


def with_graph_break():
    def f(x):
        y = torch.relu(x)
        torch._dynamo.graph_break()
        return y * 2

    return f, (torch.randn(3),)


def raising_factory():
    raise RuntimeError("no weights here\nsecond line")


def model_only():
    return nn.Linear(2, 2)


def not_callable_model():
    return 3, (torch.randn(2),)


def inspect_json(tmp_path, target, *extra):
    out = tmp_path / "report.json"
    assert cli.main(["inspect", target, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def check_regions_consistent(data):
    """Every region's replaced nodes are in the stage its pass started from, its fused nodes in the pass's stage."""
    stages = {(s["graph"], s["name"]): {n["name"] for n in s["nodes"]} for s in data["stages"]}
    for r in data["regions"]:
        assert set(r["replaced"]) <= stages[r["graph"], r["stage_before"]]
        assert r["fused"] and set(r["fused"]) <= stages[r["graph"], r["stage_after"]]


def test_inspect_hstu_npu_plan(tmp_path, capsys):
    data = inspect_json(tmp_path, f"{HERE}:hstu_model", "--target", "npu")
    text = capsys.readouterr().out
    npu = detect_target("npu")
    impl = choose("recompile::complete_cumsum", npu)
    assert data["executed"] is False and data["target"]["name"] == "npu"
    [region] = data["regions"]
    assert region["kind"] == "jagged" and region["op"] == "recompile::complete_cumsum"
    assert region["replaced"] == ["cumsum", "offsets"] and region["kernel"] == impl.describe
    assert region["runs_as"] == "fbgemm-ascend op"  # asynchronous_complete_cumsum is in the A3 table
    assert any("F.pad(torch.cumsum(lengths, 0), (1, 0))" in s for s in region["source"])
    check_regions_consistent(data)
    assert [p["pass"] for p in data["passes"]] == PASS_ORDER
    jagged = data["passes"][PASS_ORDER.index("jagged")]
    assert jagged["num_nodes_after"] == jagged["num_nodes_before"] - 1 and jagged["regions"] == 1
    assert data["plan"]["fbgemm-ascend op"] == [f"#0 recompile::complete_cumsum via {impl.describe}"]
    assert data["plan"]["Triton kernel (triton-ascend)"] == [] and data["plan"]["HKV call"] == []
    for line in ("plan only", "NOT executed", "graphs captured: 1", "regions: 1", "fbgemm-ascend op: 1",
                 "Inductor (compile_fx)", "fallbacks: 0", "replaced: cumsum", "graph 0 jagged:"):
        assert line in text


def test_inspect_profile_measures_regions(tmp_path, capsys):
    data = inspect_json(tmp_path, f"{HERE}:hstu_model", "--target", "cpu", "--profile")
    assert data["executed"] is True
    [region] = data["regions"]
    assert region["profile"]["eager_ms"] > 0 and region["profile"]["fused_ms"] > 0
    assert "measured: eager" in capsys.readouterr().out
    planned = inspect_json(tmp_path, f"{HERE}:hstu_model", "--target", "npu", "--profile")
    assert planned["regions"][0]["profile"] is None and "not present" in planned["profile_note"]


def test_regions_sharing_a_user_get_their_own_fused_node():
    def two_offsets(a, b):
        return torch.cat([F.pad(torch.cumsum(a, 0), (1, 0)), F.pad(torch.cumsum(b, 0), (1, 0))])

    data = recompile.explain(two_offsets, torch.tensor([2, 1]), torch.tensor([3, 0, 1])).to_dict()
    check_regions_consistent(data)
    fused = [r["fused"] for r in data["regions"]]
    assert len(fused) == 2 and all(len(f) == 1 for f in fused) and fused[0] != fused[1]
    after = next(s for s in data["stages"] if s["name"] == "jagged")
    inputs = {n["name"]: n["args"][0]["node"] for n in after["nodes"] if n["name"] in fused[0] + fused[1]}
    assert [inputs[f[0]] for f in fused] == ["l_a_", "l_b_"]  # each op reads its own region's lengths


@pytest.mark.parametrize(
    "op, kind, describe, target, expected",
    [
        ("recompile::x", "library", "torch.ops.fbgemm.jagged_to_padded_dense", "npu", "fbgemm-ascend op"),
        ("recompile::x", "library", "torch.ops.fbgemm.jagged_to_padded_dense", "cpu", "fbgemm-gpu-cpu op"),
        ("recompile::x", "triton", "recompile.runtime.triton_kernels.x", "npu", "Triton kernel (triton-ascend)"),
        ("hkv::find_or_insert", "reference", "hkv.table.find_or_insert", "npu", "HKV call"),
        ("recompile::x", "library", "torch.ops.hkv.gather", "cuda", "HKV call"),
        ("recompile::x", "reference", "recompile.runtime.x_reference", "npu", "reference (plain torch), fused by Inductor"),
    ],
)
def test_runs_as_names_where_a_region_runs(op, kind, describe, target, expected):
    region = Region("jagged", "jagged", ["a"], op, target, Impl("k", kind, lambda t: True, describe))
    assert runs_as(region, detect_target(target)) == expected


def test_graph_breaks_are_reported(tmp_path, capsys):
    data = inspect_json(tmp_path, f"{HERE}:with_graph_break")
    assert len(data["graphs"]) == 2 and data["graphs"][0]["break"] == 0 and data["graphs"][1]["break"] is None
    assert {s["graph"] for s in data["stages"]} == {0, 1}
    text = capsys.readouterr().out
    summary = data["breaks"][0]["summary"]
    assert "graphs captured: 2" in text and "nodes; ended by graph break #0" in text and f"  #0 {summary}" in text


def test_zoo_name_resolves_through_registry(tmp_path, monkeypatch, capsys):
    zoo = types.ModuleType("models.zoo")
    zoo.__spec__ = importlib.machinery.ModuleSpec("models.zoo", None)
    zoo.MODELS = {"dlrm": dlrm_model}
    monkeypatch.setitem(sys.modules, "models.zoo", zoo)
    data = inspect_json(tmp_path, "dlrm")
    assert capsys.readouterr().out.startswith("model: models.zoo.MODELS['dlrm']")
    [graph] = data["graphs"]
    captured = next(s for s in data["stages"] if s["name"] == "captured")
    assert sum("embedding_bag" in n["target"] for n in captured["nodes"]) == len(SMALL.table_rows)
    assert graph["num_nodes_before"] == len(captured["nodes"])
    check_regions_consistent(data)
    assert cli.main(["inspect", "dcn"]) == 2
    assert "unknown model 'dcn'; the zoo has: dlrm" in capsys.readouterr().err


def test_inspect_torchrec_ebc(tmp_path):
    data = inspect_json(tmp_path, f"{HERE}:ebc_model")
    assert data["graphs"] and all(g["num_nodes_after"] > 0 for g in data["graphs"])
    nodes = [n for s in data["stages"] if s["name"] == "captured" for n in s["nodes"]]
    assert any("embedding_bag" in n["target"] for n in nodes)
    check_regions_consistent(data)


def test_tf_graph_target_uses_frontend(tmp_path, monkeypatch):
    def import_graph(path):
        assert path.endswith(".pb")
        gm = fx.symbolic_trace(TinyHSTU())
        example = {"values": torch.empty(10, 8), "lengths": torch.empty(4, dtype=torch.int64)}
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                node.meta["example_value"] = example[node.name]
        return gm

    monkeypatch.setattr(tf_frontend, "import_graph", import_graph)
    pb = tmp_path / "model.pb"
    pb.write_bytes(b"\x0a\x00")
    data = inspect_json(tmp_path, str(pb))
    assert [r["op"] for r in data["regions"]] == ["recompile::complete_cumsum"]


def test_tf_graph_without_frontend_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loader, "TF_FRONTEND", "recompile.no_such_frontends.tensorflow")
    pb = tmp_path / "model.pb"
    pb.write_bytes(b"\x0a\x00")
    assert cli.main(["inspect", str(pb)]) == 2
    assert "need the front end recompile.no_such_frontends.tensorflow" in capsys.readouterr().err


def test_dump_writes_every_stage(tmp_path, capsys):
    out = tmp_path / "dump"
    assert cli.main(["dump", f"{HERE}:hstu_model", str(out)]) == 0
    assert f"{len(PASS_ORDER) + 1} stage(s) written" in capsys.readouterr().out
    for i, name in enumerate(["captured", *PASS_ORDER]):
        code = (out / f"graph0_{i:02d}_{name}.py").read_text()
        compile(code, name, "exec")
        assert "def forward" in code
        graph = json.loads((out / f"graph0_{i:02d}_{name}.json").read_text())
        assert graph["nodes"][0]["op"] == "placeholder"
    jagged = 1 + PASS_ORDER.index("jagged")
    assert "recompile.complete_cumsum" in (out / f"graph0_{jagged:02d}_jagged.py").read_text()
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["captured", *PASS_ORDER]
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "target, message",
    [
        ("no/such/file.py:make", "no/such/file.py: no such file"),
        ("no_such_pkg.mod:make", "no_such_pkg.mod: no such module"),
        (f"{HERE}:nope", "has no attribute 'nope'"),
        (f"{HERE}:raising_factory", "raising_factory() raised RuntimeError: no weights here"),
        (f"{HERE}:model_only", "returned Linear; expected a tuple (model, example_inputs)"),
        (f"{HERE}:not_callable_model", "returned a model of type int, which is not callable"),
        (f"{HERE}:SMALL", "is not callable"),
        (HERE, "name the factory too"),
        ("missing.pb", "missing.pb: no such file"),
    ],
)
def test_bad_targets_one_line_exit_2(target, message, capsys):
    assert cli.main(["inspect", target]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recompile inspect: error: ") and message in lines[0]
    assert captured.out == ""


def test_bad_target_in_a_fresh_process(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(2, 2), torch.randn(2)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "recompile", "dump", f"{bad}:make", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"recompile dump: error: {bad}:make() returned example_inputs of type Tensor; expected a tuple or list"
    ]
    assert not (tmp_path / "out").exists()


def test_unwritable_output_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["inspect", f"{HERE}:hstu_model", "--json", str(blocker / "r.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_subcommand_registry_hook(monkeypatch, capsys):
    plugin = types.ModuleType("plugin_commands")

    def register(subparsers):
        parser = subparsers.add_parser("hello")
        parser.add_argument("name")
        parser.set_defaults(run=lambda args: print(f"hello {args.name}") or 0)

    plugin.register = register
    monkeypatch.setitem(sys.modules, "plugin_commands", plugin)
    monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "plugin_commands"])
    assert cli.main(["hello", "tf"]) == 0
    assert capsys.readouterr().out == "hello tf\n"
    with pytest.raises(SystemExit) as exc:
        cli.main(["inspect"])  # argparse: missing TARGET
    assert exc.value.code == 2
